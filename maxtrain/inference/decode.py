"""Batched generation: a jitted prefill of the prompts, then a jitted one-token decode step.

Prompts of different lengths share a batch right-padded to the longest: the prefill runs every
row over the padded length, the padding at position -1, writes what attention keeps into the
cache (keys and values, or multi-head latent attention's latents: layers/kv_cache.py; a local
layer's ring keeps a window's and no padding; a linear-attention layer's state advances past
each row's last prompt token, not its padding), and takes each row's next token from the logits
at its own last prompt token. Each decode step then feeds one token per row at that row's next
position, overwriting the padding's entries of a full-length cache before any query could see
them. The batch is padded to a multiple of the mesh's data-parallel degree with rows whose
output is dropped.

Both functions are compiled ahead of the timed work, so the printed tokens/s are of running,
not of compiling.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from tqdm import tqdm

from maxtrain.common.errors import UserError
from maxtrain.config import ModelConfig
from maxtrain.inference.loading import LoadedModel
from maxtrain.inference.sampling import Sampling, next_tokens
from maxtrain.layers.attention_pattern import kind_per_layer, model_kinds
from maxtrain.layers.kv_cache import cache_kind, cache_shardings, init_cache
from maxtrain.models import compute_dtype
from maxtrain.models.stacks import STACKS, layer_kinds
from maxtrain.parallel.mesh import batch_degree, logical_to_spec, sharding_rules

GREEDY = Sampling()
# row, its new tokens so far -> whether it is done (a stop string appeared)
type StopCheck = Callable[[int, list[int]], bool]


@dataclass
class Generation:
    new_tokens: list[list[int]]  # per prompt, a stop token included
    finish: list[str]  # per prompt: "eos", "stop" (a stop string) or "length"
    prompt_tokens: int  # over the batch's real rows
    compile_seconds: float
    prefill_seconds: float
    decode_seconds: float
    decode_steps: int
    logprobs: list[list[float]]  # per prompt, each new token's under the sampling temperature

    @property
    def generated_tokens(self) -> int:
        return sum(len(t) for t in self.new_tokens)

    def throughput_line(self) -> str:
        decoded = self.generated_tokens - len(self.new_tokens)  # the first token is prefill's
        return (
            f"prefill {self.prompt_tokens} tokens in {self.prefill_seconds:.3f} s "
            f"({self.prompt_tokens / max(self.prefill_seconds, 1e-9):,.0f} tokens/s); decode "
            f"{decoded} tokens in {self.decode_steps} steps, {self.decode_seconds:.3f} s "
            f"({decoded / max(self.decode_seconds, 1e-9):,.0f} tokens/s); compile "
            f"{self.compile_seconds:.1f} s"
        )


def cache_stacks(model_cfg: ModelConfig) -> dict[str, dict[str, int]]:
    """{params key of a layer stack: {cache kind: its layers of that kind}} for the stacks
    and kinds the model has: the decode cache's arrays (layers/kv_cache.py; a linear stack's
    layers keep their states under one kind)."""
    stacks: dict[str, dict[str, int]] = {}
    names = model_kinds(model_cfg)
    for layer_kind, kind in zip(layer_kinds(model_cfg), kind_per_layer(model_cfg), strict=True):
        per_kind = stacks.setdefault(STACKS[layer_kind], {})
        name = cache_kind(layer_kind.mixer, names[kind])
        per_kind[name] = per_kind.get(name, 0) + 1
    return stacks


def _padded_batch(prompts: Sequence[Sequence[int]], degree: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [B, W] right-padded with 0, lengths [B]): B a multiple of the data-parallel
    degree, the padding rows repeating the first prompt; W the longest prompt."""
    rows = [*prompts, *[prompts[0]] * (-len(prompts) % degree)]
    lengths = np.array([len(p) for p in rows], np.int32)
    tokens = np.zeros((len(rows), int(lengths.max())), np.int32)
    for row, prompt in enumerate(rows):
        tokens[row, : len(prompt)] = prompt
    return tokens, lengths


def generate(
    model: LoadedModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    sampling: Sampling = GREEDY,
    seed: int = 0,
    stop_ids: Sequence[int] = (),
    stop_check: StopCheck | None = None,
    progress: bool = False,
    programs: dict | None = None,
) -> Generation:
    """Up to max_new_tokens new tokens per prompt (token ids). A row stops at a token in
    stop_ids (kept in its output) or when stop_check says so; the batch stops when every row
    has. progress: a progress bar of the decode steps on a terminal (the command line's).
    programs: a dict the caller keeps, holding the compiled programs by batch shape between
    calls."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise UserError("every prompt needs at least one token")
    if max_new_tokens < 1:
        raise UserError(f"max_new_tokens must be at least 1 (got {max_new_tokens})")
    tokens, lengths = _padded_batch(prompts, batch_degree(model.cfg.mesh.rules, model.mesh))
    start = time.perf_counter()
    batch = _Batch.place(model, tokens, lengths, max_new_tokens)
    rng, prefill_rng = jax.random.split(jax.random.key(seed))
    prefill_fn, step_fn = _compiled_pair(model, batch, sampling, rng, programs)
    compile_seconds = time.perf_counter() - start

    start = time.perf_counter()
    token, logp, cache = prefill_fn(
        model.params, batch.tokens, batch.lengths, batch.cache, prefill_rng
    )
    token, logp = np.asarray(token), np.asarray(logp)
    prefill_seconds = time.perf_counter() - start

    out = _Outputs(len(prompts), max_new_tokens, set(stop_ids), stop_check)
    steps = 0
    bar = tqdm(
        total=max_new_tokens - 1, desc="decode", unit=" step", file=sys.stderr,
        disable=None if progress else True, leave=False,
    )  # fmt: skip
    start = time.perf_counter()
    while not out.record(token, logp):
        positions = lengths + steps
        rng, step_rng = jax.random.split(rng)
        token, logp, cache = step_fn(
            model.params,
            jax.device_put(token, batch.rows_sharding),
            jax.device_put(positions, batch.rows_sharding),
            cache,
            step_rng,
        )
        token, logp = np.asarray(token), np.asarray(logp)
        steps += 1
        bar.update()
    decode_seconds = time.perf_counter() - start
    bar.close()
    prompt_tokens = int(lengths[: len(prompts)].sum())
    timings = (compile_seconds, prefill_seconds, decode_seconds, steps)
    return Generation(out.new_tokens, out.finish, prompt_tokens, *timings, out.logprobs)


@dataclass
class _Batch:
    """A padded batch on the mesh, with the empty decode cache it fills."""

    tokens: jax.Array  # [B, W]
    lengths: jax.Array  # [B]
    cache: Any
    rows_sharding: NamedSharding
    cache_sharding: Any
    cache_length: int  # W + max_new_tokens: the positions the cache holds

    @classmethod
    def place(
        cls, model: LoadedModel, tokens: np.ndarray, lengths: np.ndarray, max_new_tokens: int
    ) -> _Batch:
        cfg, mesh, rules = model.cfg, model.mesh, model.cfg.mesh.rules
        cache_length = tokens.shape[1] + max_new_tokens
        if cache_length > cfg.model.max_seq_len:
            raise UserError(
                f"the longest prompt ({tokens.shape[1]} tokens) plus max_new_tokens "
                f"({max_new_tokens}) needs {cache_length} positions; the model's max_seq_len is "
                f"{cfg.model.max_seq_len}"
            )
        rows_sharding = NamedSharding(mesh, logical_to_spec(("batch",), rules, mesh, lengths.shape))
        tokens_sharding = NamedSharding(mesh, logical_to_spec(("batch", None), rules, mesh))
        make_cache = functools.partial(
            init_cache,
            cfg.model,
            cache_stacks(cfg.model),
            len(lengths),
            cache_length,
            compute_dtype(cfg.compute),
        )
        cache_sharding = cache_shardings(jax.eval_shape(make_cache), mesh, rules)
        return cls(
            jax.device_put(tokens, tokens_sharding),
            jax.device_put(lengths, rows_sharding),
            jax.jit(make_cache, out_shardings=cache_sharding)(),
            rows_sharding,
            cache_sharding,
            cache_length,
        )


def _compiled_pair(
    model: LoadedModel, batch: _Batch, sampling: Sampling, rng: jax.Array, programs: dict | None
) -> tuple[Any, Any]:
    """(prefill, one decode step) compiled for the batch's shape, kept in `programs` (when
    given) for the next batch of this shape: a caller that generates every step (GRPO's
    rollouts) compiles once."""
    key = (batch.tokens.shape, batch.cache_length, sampling)
    if programs is not None and key in programs:
        return programs[key]
    mesh, rules = model.mesh, model.cfg.mesh.rules
    out_shardings = (batch.rows_sharding, batch.rows_sharding, batch.cache_sharding)

    def compiled(fn, *example_args):
        def traced(*args):
            with sharding_rules(mesh, rules):
                return fn(*args, decode=model.mdef.decode, sampling=sampling)

        jitted = jax.jit(traced, out_shardings=out_shardings, donate_argnums=3)
        return jitted.lower(*example_args).compile()

    example = (model.params, batch.tokens, batch.lengths, batch.cache, rng)
    pair = (
        compiled(_prefill, *example),
        compiled(_step, model.params, batch.lengths, batch.lengths, batch.cache, rng),
    )
    if programs is not None:
        programs[key] = pair
    return pair


def _chosen(logits, rng, sampling: Sampling):
    """The next token and its log-probability under the sampled distribution's temperature
    (top-p's cut aside: GRPO's old log-probabilities, posttrain/rollout.py)."""
    token = next_tokens(logits, rng, sampling)
    scaled = logits.astype(jnp.float32)
    if not sampling.greedy:
        scaled = scaled / sampling.temperature
    logp = jax.nn.log_softmax(scaled, axis=-1)
    return token, jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0]


def _prefill(params, tokens, lengths, cache, rng, *, decode, sampling: Sampling):
    """Every row over the padded width (the padding at position -1), the next token taken from
    the logits at each row's own last prompt token."""
    positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
    positions = jnp.where(positions < lengths[:, None], positions, -1)  # -1: padding
    logits, cache = decode(params, tokens, positions, cache)
    last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
    return *_chosen(last, rng, sampling), cache


def _step(params, tokens, positions, cache, rng, *, decode, sampling: Sampling):
    """One token per row at that row's next position."""
    logits, cache = decode(params, tokens[:, None], positions[:, None], cache)
    return *_chosen(logits[:, 0], rng, sampling), cache


class _Outputs:
    """Each real row's new tokens and their log-probabilities so far, and why it finished
    ("length" while it runs)."""

    def __init__(self, rows: int, max_new_tokens: int, stop_ids: set, stop_check):
        self.rows, self.max_new_tokens = rows, max_new_tokens
        self.stop_ids, self.stop_check = stop_ids, stop_check
        self.new_tokens: list[list[int]] = [[] for _ in range(rows)]
        self.logprobs: list[list[float]] = [[] for _ in range(rows)]
        self.finish = ["length"] * rows

    def record(self, token: np.ndarray, logp: np.ndarray) -> bool:
        """Appends each running row's token; whether every row is done."""
        for row in range(self.rows):
            if self.finish[row] != "length" or len(self.new_tokens[row]) == self.max_new_tokens:
                continue
            self.new_tokens[row].append(int(token[row]))
            self.logprobs[row].append(float(logp[row]))
            if int(token[row]) in self.stop_ids:
                self.finish[row] = "eos"
            elif self.stop_check is not None and self.stop_check(row, self.new_tokens[row]):
                self.finish[row] = "stop"
        running = [r for r in range(self.rows) if self.finish[r] == "length"]
        return all(len(self.new_tokens[r]) == self.max_new_tokens for r in running)
