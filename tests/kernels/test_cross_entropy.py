"""The custom-VJP cross-entropy equals plain autodiff of the float32 formula."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtrain.kernels.cross_entropy import cross_entropy, reference_cross_entropy


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_values_and_gradients_match_reference(dtype):
    k_logits, k_targets, k_w = jax.random.split(jax.random.key(0), 3)
    logits = (4.0 * jax.random.normal(k_logits, (3, 7, 101))).astype(dtype)
    targets = jax.random.randint(k_targets, (3, 7), 0, 101)
    weights = jax.random.normal(k_w, (3, 7))

    def objective(fn, x):  # uses both outputs, as the loss with z-loss does
        nll, log_z = fn(x, targets)
        return jnp.sum(nll * weights) + 0.3 * jnp.sum(log_z**2)

    nll, log_z = cross_entropy(logits, targets)
    ref_nll, ref_log_z = reference_cross_entropy(logits, targets)
    np.testing.assert_allclose(nll, ref_nll, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(log_z, ref_log_z, rtol=1e-5, atol=1e-5)
    grad = jax.grad(lambda x: objective(cross_entropy, x))(logits)
    ref_grad = jax.grad(lambda x: objective(reference_cross_entropy, x))(logits)
    assert grad.dtype == logits.dtype  # the gradient is written once, in the logits' dtype
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(
        np.asarray(grad, np.float32), np.asarray(ref_grad, np.float32), rtol=tol, atol=tol
    )


def test_matches_a_numpy_log_softmax():
    logits = np.random.default_rng(0).normal(size=(2, 3, 11)).astype(np.float32)
    targets = np.array([[0, 5, 10], [3, 3, 7]])
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    expected = -np.take_along_axis(log_probs, targets[..., None], -1)[..., 0]
    nll, _ = cross_entropy(jnp.asarray(logits), jnp.asarray(targets))
    np.testing.assert_allclose(nll, expected, rtol=1e-5)
