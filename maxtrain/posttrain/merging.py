"""A LoRA run's checkpoint as a plain model: its adapters folded into the base they were
trained on, for export, generation, evaluation and further training.

A LoRA run's checkpoint holds only the adapters; the config saved with it names the base
(checkpoint.load_parameters_path, read per init.mode as the run read it) and how the run kept
it (lora.base_quantization). `merged_params` rebuilds that base exactly as the run held it (a
QLoRA base quantized by the same function, so the merge computes what the adapters were trained
with: the dequantized base) and folds the adapters in (lora.merge: W + alpha / rank * A B).
`merge_checkpoint` writes the result as a parameters-only checkpoint whose saved config is the
run's without adapters, which every tool reads as any model; inference/loading.py load_model
merges on the fly instead, so a LoRA run's checkpoint can be generated from or evaluated
directly.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from maxtrain import config as config_lib
from maxtrain.checkpointing import CheckpointError, load_parameters
from maxtrain.checkpointing.checkpointer import resolve_step_dir
from maxtrain.checkpointing.common import absolute
from maxtrain.checkpointing.export import save_parameters
from maxtrain.checkpointing.saved_config import TOKENIZER_SEARCH_DEPTH, saved_config
from maxtrain.common.files import atomic_directory
from maxtrain.config import Config
from maxtrain.hf.convert import MODEL_YAML, model_yaml
from maxtrain.parallel.mesh import build_mesh, sharding_rules
from maxtrain.posttrain import lora, parameter_split
from maxtrain.surgery.initialize import initial_params
from maxtrain.tokenizers import copy_tokenizer_files
from maxtrain.training.run_model import model_def
from maxtrain.training.state import abstract_frozen, param_shardings


def merged_params(cfg: Config, step_dir: str | os.PathLike | None, mesh: Mesh) -> dict:
    """The plain model's parameters, sharded over `mesh` per cfg's rules: the base of the LoRA
    run `cfg` (its checkpoint.load_parameters_path, quantized under lora.base_quantization as
    the run kept it) with the adapters saved at `step_dir` folded in. step_dir None: zero
    adapters, i.e. the model the run started from. CheckpointError (one line) for a missing
    base or adapters that do not fit the run's model."""
    with sharding_rules(mesh, cfg.mesh.rules):
        mdef = model_def(cfg, pipelined=False)  # checkpoints hold layers in model order
        adapter_shardings, base_shardings = lora.split(param_shardings(mdef, cfg, mesh))
    try:
        base = initial_params(cfg, abstract_frozen(mdef, cfg, mesh))
    except CheckpointError as e:
        raise CheckpointError(
            f"the base model of the LoRA run (checkpoint.load_parameters_path="
            f"{cfg.checkpoint.load_parameters_path} in its saved config): {e}"
        ) from None
    shapes = lora.split(nnx.to_pure_dict(mdef.abstract_state))[0]
    abstract = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, adapter_shardings
    )
    if step_dir is None:
        zeros = lambda: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), abstract)  # noqa: E731
        adapters = jax.jit(zeros, out_shardings=adapter_shardings)()
    else:
        adapters = load_parameters(step_dir, abstract)
    stored = functools.partial(parameter_split(cfg).stored, abstract_state=mdef.abstract_state)
    base = jax.jit(stored)(base)  # QLoRA's quantized, as trained

    def fold(base: Any, adapters: dict) -> dict:
        return lora.merge(lora.combine(base, adapters), cfg.lora, mdef.abstract_state)

    return jax.jit(fold, out_shardings=base_shardings)(base, adapters)


def plain_config(cfg: Config, start: str | None = None) -> Config:
    """The merged model's config: the LoRA run's without adapters. start: the checkpoint a run
    of this config starts from (checkpoint.load_parameters_path, read as it is: init.mode
    none); None keeps the run's own."""
    changes: dict[str, Any] = {"lora": {"rank": 0}}
    if start is not None:
        changes |= {"checkpoint": {"load_parameters_path": start}, "init": {"mode": "none"}}
    return config_lib.validate(config_lib.deep_merge(cfg.model_dump(mode="json"), changes))


def lora_run_config(step_dir: Path, overrides: Sequence[str] = ()) -> Config:
    """The saved config of a LoRA run's step (with overrides); CheckpointError if the step is
    not a LoRA run's."""
    cfg = saved_config(step_dir, overrides, dropless=False)
    if not cfg.lora.enabled:
        raise CheckpointError(
            f"{step_dir} is not a LoRA run's checkpoint: its saved config has lora.rank=0 "
            "(expected a run trained with lora.rank > 0)"
        )
    return cfg


def merge_checkpoint(
    run: str | os.PathLike, output: str | os.PathLike, overrides: Sequence[str] = ()
) -> tuple[Path, Config]:
    """Writes the merged model of the LoRA run checkpoint `run` (a step, tier or run directory)
    as a parameters-only checkpoint in the new directory `output`, with its model file
    (output/model.yml) and the tokenizer files found beside the run's or the base's checkpoint.
    Its saved config is the run's with lora.rank 0, starting from `output` itself.
    overrides: on the run's saved config (mesh.*, or a moved base's
    checkpoint.load_parameters_path). Returns (the step directory written, that config).
    Nothing is written on a refusal."""
    output = Path(output)
    if output.exists():
        raise CheckpointError(f"{output} already exists; name a new output directory")
    step_dir = Path(resolve_step_dir(absolute(run)))
    cfg = lora_run_config(step_dir, overrides)
    params = merged_params(cfg, step_dir, build_mesh(cfg.mesh))
    merged = plain_config(cfg, start=str(absolute(output)))
    base_dir = Path(resolve_step_dir(absolute(cfg.checkpoint.load_parameters_path)))
    comment = f"The model of LoRA run {step_dir} merged into its base by tools/merge_lora.py."
    with atomic_directory(output) as staging:
        save_parameters(
            staging,
            params,
            config_yaml=config_lib.to_yaml(merged),
            meta={"lora_merge": {"run": str(step_dir), "base": str(base_dir)}},
        )
        (staging / MODEL_YAML).write_text(model_yaml(cfg.model, comment))
        for directory in (*_nearby(step_dir), *_nearby(base_dir)):
            if copy_tokenizer_files(directory, staging):
                break
    return output / "0", merged


def _nearby(step_dir: Path) -> list[Path]:
    """Where a checkpoint's tokenizer files may be kept: beside its step (an import's), or
    beside its tier or run directory (loading.py find_tokenizer searches the same)."""
    return [step_dir, *step_dir.parents][:TOKENIZER_SEARCH_DEPTH]
