"""The token embedding's lookup (maxtrain/layers/embedding.py): its gradient equals
autodiff's,
and computing it moves no table-sized buffer between FSDP's devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtrain import config as config_lib
from maxtrain.analysis.collectives import collective_bytes_per_axis
from maxtrain.config import MeshConfig
from maxtrain.layers.embedding import lookup
from maxtrain.parallel.mesh import build_mesh, constrain, logical_to_spec, sharding_rules

V, D, B, T = 4096, 64, 8, 16  # a table far larger than the batch's activations
RULES = config_lib.load(config_lib.CONFIGS_DIR / "base.yml").mesh.rules


def _grad_fn(mesh, embed):
    """jit(grad) of sum(embed(table, tokens) * cotangent) over the table, on the mesh."""
    table_spec = jax.sharding.NamedSharding(mesh, logical_to_spec(("vocab", "embed"), RULES, mesh))

    def loss(table, tokens, cotangent):
        with sharding_rules(mesh, RULES):
            rows = constrain(embed(table, tokens), ("batch", "length", "act_embed"))
            return jnp.sum(rows * cotangent)

    return jax.jit(jax.grad(loss), in_shardings=(table_spec, None, None), out_shardings=table_spec)


def _plain(table, tokens):
    """The same forward (rows of the table gathered whole), left to autodiff."""
    return jnp.take(constrain(table, (None, None)), tokens, axis=0)


@pytest.mark.parametrize("degrees", [dict(fsdp=8), dict(data=2, fsdp=4), dict(fsdp=2, context=4)])
def test_gradient_equals_autodiff(degrees):
    mesh = build_mesh(MeshConfig(**{"fsdp": 1, **degrees}))
    kt, kk, kc = jax.random.split(jax.random.key(0), 3)
    table = jax.random.normal(kt, (V, D), jnp.float32)
    tokens = jax.random.randint(kk, (B, T), 0, 64)  # repeats: several tokens add into a row
    cotangent = jax.random.normal(kc, (B, T, D), jnp.float32)
    got = _grad_fn(mesh, lambda t, x: lookup(t, x, jnp.float32))(table, tokens, cotangent)
    want = _grad_fn(mesh, _plain)(table, tokens, cotangent)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_gradient_moves_no_table_between_fsdp_devices():
    """Autodiff scatters into a whole table on every device and all-reduces it over FSDP; the
    lookup's gradient re-splits the tokens' cotangents instead, far less than one table."""
    mesh = build_mesh(MeshConfig(fsdp=8))
    args = (
        jax.ShapeDtypeStruct((V, D), jnp.float32),
        jax.ShapeDtypeStruct((B, T), jnp.int32),
        jax.ShapeDtypeStruct((B, T, D), jnp.float32),
    )
    table_bytes = V * D * 4

    def fsdp_bytes(embed):
        hlo = _grad_fn(mesh, embed).lower(*args).compile().as_text()
        moved = collective_bytes_per_axis(hlo, dict(mesh.shape))["ici"]
        return sum(b for kind, b in moved.items() if kind.endswith("fsdp"))

    assert fsdp_bytes(_plain) >= table_bytes  # what the custom backward avoids
    assert fsdp_bytes(lambda t, x: lookup(t, x, jnp.float32)) < table_bytes / 8
