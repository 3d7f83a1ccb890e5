"""Import a Hugging Face model into a maxtrain checkpoint, and export one back.

    cfg, params = read_hf_model(hf_dir)                    # host arrays in our layout
    import_checkpoint(hf_dir, output)                      # + checkpoint and model.yml
    write_hf_model(cfg, params, output)                    # config.json + safetensors
    export_checkpoint(checkpoint, output)                  # from any maxtrain checkpoint

Memory: import allocates the output parameters once (host numpy arrays in our stacked layout),
writes each tensor into them in place as it is read, then moves them onto the CPU device one
array at a time, so it holds the output plus the tensor being converted; export holds the
restored parameters plus the tensor being written. Neither holds the model twice while
converting. (Orbax's asynchronous save of the imported checkpoint takes its own host copy of
part of the state on top: see the README's numbers.)

Outputs appear whole or not at all (maxtrain/common/files.py atomic_directory): each is written as
the sibling `<output>.partial-<pid>` and renamed when complete; on any failure the partial directory
is removed. All input checks (config, tensor names, shapes, dtypes) run before anything is
written.
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
import yaml
from flax import nnx
from jax.sharding import SingleDeviceSharding

from maxtrain import models as model_lib
from maxtrain.checkpointing import CheckpointError, load_parameters, read_saved_config
from maxtrain.checkpointing.checkpointer import resolve_step_dir
from maxtrain.checkpointing.common import absolute
from maxtrain.checkpointing.export import save_parameters
from maxtrain.common.files import atomic_directory
from maxtrain.config import (
    ComputeConfig,
    ConfigError,
    InitConfig,
    ModelConfig,
    migration,
    validate_model,
)
from maxtrain.hf.config_map import CONFIG_JSON, hf_config, init_std, model_config, read_config_json
from maxtrain.hf.errors import ConversionError
from maxtrain.hf.families import family_for
from maxtrain.hf.family import Family
from maxtrain.hf.layout import Slot, hf_tensor, slots
from maxtrain.hf.safetensors_io import OutputTensor, TensorReader, write_safetensors
from maxtrain.hf.tokenizer_files import run_tokenizer, special_ids, tokenizer_files
from maxtrain.posttrain import partial_checkpoint
from maxtrain.tokenizers import TOKENIZER_MODELS, copy_tokenizer_files, load_tokenizer

MODEL_YAML = "model.yml"  # written beside the imported checkpoint's step directory
DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
# Tensors some checkpoints carry that the model derives: old Llama exports saved RoPE's
# inverse frequencies as buffers.
_DERIVED = re.compile(r"\.rotary_emb\.inv_freq$")
# Layers past num_hidden_layers: DeepSeek-V3's multi-token prediction module (its layer 61),
# which transformers skips as well.
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def read_hf_model(
    hf_dir: str | os.PathLike, param_dtype: str = "float32"
) -> tuple[ModelConfig, dict[str, Any]]:
    """The ModelConfig and parameters (nested dict of host jax arrays in our layout and
    param_dtype) of a Hugging Face model directory. Raises ConversionError for bad or
    unsupported input."""
    hf_dir = Path(hf_dir)
    hf, family = read_config_json(hf_dir)
    cfg = model_config(hf, family, where=str(hf_dir / CONFIG_JSON))
    params = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), _abstract_params(cfg, param_dtype))
    why = f"{CONFIG_JSON} ({family.model_type})"
    layout = slots(cfg, family)
    with TensorReader(hf_dir) as reader:
        _check_names(reader, layout, cfg, family, why)
        for slot in layout:
            node, leaf = _at(params, slot.path[:-1]), slot.path[-1]
            block_shape = node[leaf].shape[len(slot.index) :]
            tensor = reader.read(slot.hf_name, slot.hf_shape(block_shape), why)
            node[leaf][slot.index] = slot.to_ours(tensor, block_shape)  # cast to its dtype
    return cfg, _onto_device(params, jax.devices("cpu")[0])


def _onto_device(tree: dict[str, Any], device: jax.Device) -> dict[str, Any]:
    """The nested dict of numpy arrays as jax arrays on device, each host array dropped as
    soon as it is moved, so the model is never held twice. Filling numpy arrays in place and
    moving them once compiles nothing (a jitted in-place write compiled a program per shape of
    parameter and block, dozens for one model)."""
    for key, value in tree.items():
        moved = _onto_device if isinstance(value, dict) else jax.device_put
        tree[key] = moved(value, device)
    return tree


def import_checkpoint(
    hf_dir: str | os.PathLike, output: str | os.PathLike, param_dtype: str = "float32"
) -> ModelConfig:
    """Writes the Hugging Face model at hf_dir as a parameters-only checkpoint in the new
    directory `output` (step 0, what checkpoint.load_parameters_path reads), with the model's
    config file `output/model.yml` (the format of configs/models/*.yml) and the model's
    tokenizer files (maxtrain.tokenizers.TOKENIZER_FILES), so every tool finds its tokenizer."""
    output = Path(output)
    _refuse_existing(output)
    if any((Path(hf_dir) / name).is_file() for name in TOKENIZER_MODELS):
        load_tokenizer(hf_dir)  # a broken tokenizer is refused before anything is written
    cfg, params = read_hf_model(hf_dir, param_dtype)
    std = init_std(*read_config_json(Path(hf_dir)))
    source = f"Imported from {Path(hf_dir).resolve()} by tools/convert_hf.py."
    meta = {"source": {"hugging_face": str(Path(hf_dir).resolve())}}
    saved = model_config_yaml(cfg, output.name, param_dtype, std)
    with atomic_directory(output) as staging:
        save_parameters(staging, params, config_yaml=saved, meta=meta)
        (staging / MODEL_YAML).write_text(model_yaml(cfg, source))
        copy_tokenizer_files(hf_dir, staging)
    return cfg


def write_hf_model(
    cfg: ModelConfig,
    params: dict[str, Any],
    output: str | os.PathLike,
    dtype: str | None = None,
    max_shard_bytes: int = 5 * 2**30,
    extra_config: dict[str, Any] | None = None,
    files: dict[str, str | bytes] | None = None,
    std: float = InitConfig().std,
) -> Family:
    """Writes params (numpy or CPU jax arrays, our layout) as a Hugging Face model directory
    `output` (config.json + safetensors) with weights in dtype (default: the params' own).
    extra_config: more config.json keys (the special token ids); files: {name: content} written
    beside (the tokenizer's); std: the initialisation's (initializer_range). Returns the family
    it was written as."""
    output = Path(output)
    _refuse_existing(output)
    family = family_for(cfg)
    dtype = dtype or _dtype_name(params)
    config_json = {**hf_config(cfg, family, dtype, std), **(extra_config or {})}
    arrays = jax.tree.map(np.asarray, params)  # no copy for arrays already on the host

    def produce(parts: list[Slot]) -> np.ndarray:
        """One tensor from the slots that share it (several: its Parts along the last axis)."""
        return hf_tensor(parts, [_at(arrays, slot.path)[slot.index] for slot in parts])

    by_name: dict[str, list[Slot]] = {}
    for slot in slots(cfg, family):
        by_name.setdefault(slot.hf_name, []).append(slot)
    tensors = [
        OutputTensor(
            name,
            parts[0].hf_shape(_at(arrays, parts[0].path).shape[len(parts[0].index) :]),
            DTYPES[dtype],
            functools.partial(produce, parts),
        )
        for name, parts in by_name.items()
    ]
    with atomic_directory(output) as staging:
        staging.mkdir(parents=True)
        (staging / CONFIG_JSON).write_text(json.dumps(config_json, indent=2) + "\n")
        write_safetensors(staging, tensors, max_shard_bytes)
        for name, content in (files or {}).items():
            path = staging / name
            path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
    return family


def export_checkpoint(
    checkpoint: str | os.PathLike,
    output: str | os.PathLike,
    dtype: str | None = None,
    max_shard_bytes: int = 5 * 2**30,
    tokenizer: str | os.PathLike | None = None,
) -> tuple[ModelConfig, Family, Path, Path | None, str]:
    """Writes the parameters of a maxtrain checkpoint (a step, tier or run directory; the model
    is the config saved with it) as a Hugging Face model directory `output`, with the run's
    tokenizer files, special ids and generation_config.json (tokenizer_files.py) where the
    tokenizer is known or given. Returns (model, family, the step directory read, the
    tokenizer written or None, the weights' dtype: `dtype`, else the checkpoint's own)."""
    _refuse_existing(Path(output))  # before reading gigabytes
    step_dir = resolve_step_dir(absolute(checkpoint))
    from maxtrain.quantization.ptq import quantized_kind  # qwix: only when exporting

    if qtype := quantized_kind(step_dir):
        raise ConversionError(
            f"checkpoint {step_dir} holds {qtype} post-training-quantized weights "
            "(tools/quantize.py), which export does not write; export the float checkpoint "
            "it was quantized from"
        )
    cfg, param_dtype, std = checkpoint_model(step_dir)
    if why := partial_checkpoint(step_dir, yaml.safe_load(read_saved_config(step_dir)) or {}):
        raise ConversionError(why)
    dtype = dtype or param_dtype
    hf_config(cfg, family_for(cfg), dtype, std)  # unsupported: fail before reading
    device = SingleDeviceSharding(jax.devices("cpu")[0])
    abstract = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device),
        _abstract_params(cfg, param_dtype),
    )
    if tokenizer is None:
        tokenizer = run_tokenizer(read_saved_config(step_dir))
    extra, files = {}, {}
    if tokenizer is not None:
        tokenizer = Path(tokenizer)
        extra, files = special_ids(tokenizer), tokenizer_files(tokenizer, cfg.max_seq_len)
    params = load_parameters(step_dir, abstract)
    family = write_hf_model(cfg, params, output, dtype, max_shard_bytes, extra, files, std)
    return cfg, family, step_dir, tokenizer, dtype


def checkpoint_model(step_dir: Path) -> tuple[ModelConfig, str, float]:
    """The model of a checkpoint step, the dtype its parameters are stored in and the std they
    were initialised with, from the config saved with it (either layout:
    checkpointing.read_saved_config; an older maxtrain's keys migrated)."""
    try:
        saved = yaml.safe_load(read_saved_config(step_dir)) or {}
    except CheckpointError as e:
        raise ConversionError(f"{e}; cannot tell the model") from None
    saved = migration.migrate(saved, str(step_dir))
    try:
        cfg = validate_model(saved.get("model"))
    except ConfigError as e:
        raise ConversionError(
            f"{step_dir}: the model section of its saved config is not a valid model ({e})"
        ) from None
    compute, init = saved.get("compute") or {}, saved.get("init") or {}
    return (
        cfg,
        compute.get("param_dtype", ComputeConfig().param_dtype),
        init.get("std", InitConfig().std),
    )


def model_yaml(cfg: ModelConfig, comment: str) -> str:
    """cfg as a model file (configs/models/<name>.yml): the architecture, none of the keys
    (dtypes, remat, attention kernel, init) that a run sets."""
    return f"# {comment}\n" + yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def model_config_yaml(cfg: ModelConfig, model_name: str, param_dtype: str, std: float) -> str:
    """The config saved with an imported checkpoint: its model, the dtype of its parameters
    and their initialiser's std (what export reads back). No other run settings: importing
    must not depend on them (a model whose max_seq_len is below the default train.seq_len
    imports all the same)."""
    saved = {
        "model_name": model_name,
        "model": cfg.model_dump(mode="json"),
        "compute": {"param_dtype": param_dtype},
        "init": {"std": std},
    }
    return yaml.safe_dump(saved, sort_keys=False)


def _abstract_params(cfg: ModelConfig, param_dtype: str = "float32") -> dict[str, Any]:
    spec = model_lib.ModelSpec(cfg, ComputeConfig(param_dtype=param_dtype))
    return nnx.to_pure_dict(nnx.state(model_lib.abstract(spec), nnx.Param))


def _dtype_name(params: dict[str, Any]) -> str:
    """The name in DTYPES of the parameters' dtype (float32 or bfloat16)."""
    dtype = np.dtype(jax.tree.leaves(params)[0].dtype)
    return next(name for name, known in DTYPES.items() if known == dtype)


def _at(tree: dict[str, Any], path: tuple[str, ...]) -> Any:
    return functools.reduce(dict.__getitem__, path, tree)


def _check_names(
    reader: TensorReader, layout: list[Slot], cfg: ModelConfig, family: Family, why: str
) -> None:
    """Before reading a byte: every tensor the config implies is listed, and every listed one
    is used. A tensor the config does not explain means an option we would silently drop
    (biases, extra norms); derived buffers and a tied model's head are skipped, as transformers
    skips them."""
    missing = [s.hf_name for s in layout if s.hf_name not in reader.files]
    if missing:
        raise ConversionError(f"{reader.listing}: no tensor {missing[0]!r} ({why} needs it)")
    used = {s.hf_name for s in layout}
    for name in sorted(reader.files):
        tied_head = cfg.tie_embeddings and name == "lm_head.weight"
        layer = _LAYER.match(name)
        beyond = layer is not None and int(layer.group(1)) >= cfg.num_layers
        if name not in used and not tied_head and not beyond and not _DERIVED.search(name):
            raise ConversionError(
                f"{reader.files[name]}: tensor {name!r} has no place in a {family.model_type} "
                f"model as {CONFIG_JSON} describes it (an unsupported option?)"
            )


def _refuse_existing(output: Path) -> None:
    if output.exists():
        raise ConversionError(f"{output} already exists; name a new output directory")
