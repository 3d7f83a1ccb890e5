"""A trained or imported model ready to run: its config, parameters on a mesh, its tokenizer.

    model = load_model("runs/base", ["mesh.fsdp=4", "mesh.tensor=2"])

The path is anything `checkpoint.load_parameters_path` takes (a step, a tier or a run
directory: the newest complete step), an imported checkpoint (tools/convert_hf.py) or a
post-training-quantized one (tools/quantize.py: its kernels dequantized as they are read).
Which model it holds is the config saved with the step: a training run's resolved config, or an
import's model section on top of configs/base.yml's defaults. Overrides (`mesh.*`, ...) apply
on top. Generation and evaluation load through here, so both read a checkpoint the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from maxtrain.checkpointing.checkpointer import resolve_step_dir
from maxtrain.checkpointing.common import absolute
from maxtrain.checkpointing.saved_config import TOKENIZER_SEARCH_DEPTH, saved_config
from maxtrain.config import MESH_AXES, Config, ConfigError
from maxtrain.data.grain_pipeline import EMBEDDED_PREFIX
from maxtrain.data.shards import read_metadata
from maxtrain.models import ModelDef, build
from maxtrain.parallel.mesh import build_mesh, sharding_rules
from maxtrain.posttrain import parameter_split
from maxtrain.surgery.initialize import initial_params
from maxtrain.tokenizers import DEFAULT_TOKENIZER, TOKENIZER_MODELS, Tokenizer, load_tokenizer
from maxtrain.training.run_model import model_def, model_spec
from maxtrain.training.state import param_shardings


@dataclass(frozen=True)
class LoadedModel:
    cfg: Config
    mdef: ModelDef  # the model in layer order (no pipeline stages)
    params: Any  # sharded over `mesh` by the config's rules
    mesh: Mesh
    step_dir: Path
    step: int  # the training step the parameters are from (0 for an import)
    initial: bool = False  # the parameters the run started from (load_model initial=True)

    def source(self) -> str:
        """Where the parameters come from, for a command's first line: a training step; a
        parameters-only checkpoint (an import, a merge, a quantized export), which has none;
        or a run's start."""
        if self.initial:
            return f"the initial parameters of the run of {self.step_dir}"
        if self.step == 0:
            return f"{self.step_dir} (parameters only: no training step)"
        return f"step {self.step} of {self.step_dir}"


def load_model(
    path: str | Path,
    overrides: Sequence[str] = (),
    devices: list[jax.Device] | None = None,
    initial: bool = False,
) -> LoadedModel:
    """The parameters of the newest complete step under `path`, on a mesh of `devices`
    (default all); CheckpointError/ConfigError (one line) for a bad path or override.
    initial: the parameters the run started from instead (as the train state held them at
    step 0: _initial): the baseline an evaluation compares with, and DPO's reference.
    A step of a run whose split adds parameters (adapters: training/split.py) loads as the
    plain model they merge into (posttrain/merging.py); its initial parameters are its base,
    as the run kept it (zero adapters)."""
    step_dir = Path(resolve_step_dir(absolute(path)))
    cfg, mesh = _config_and_mesh(step_dir, overrides, devices)
    step = 0 if initial or not step_dir.name.isdigit() else int(step_dir.name)
    if parameter_split(cfg).adds_parameters:  # folded into their base (Qwix: only when asked)
        from maxtrain.posttrain import merging

        params = merging.merged_params(cfg, None if initial else step_dir, mesh)
        cfg = merging.plain_config(cfg)
        with sharding_rules(mesh, cfg.mesh.rules):
            mdef = model_def(cfg, pipelined=False)
        return LoadedModel(cfg, mdef, params, mesh, step_dir, step, initial)
    with sharding_rules(mesh, cfg.mesh.rules):
        mdef = model_def(cfg, pipelined=False)
        shardings = param_shardings(mdef, cfg, mesh)
    abstract = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        _abstract_params(mdef),
        shardings,
    )
    if initial:
        return LoadedModel(cfg, mdef, _initial(cfg, abstract), mesh, step_dir, 0, initial=True)
    # float, or tools/quantize.py's (the package imports Qwix: only when a model is loaded)
    from maxtrain.quantization.ptq import load_parameters_dequantized

    params = load_parameters_dequantized(step_dir, abstract)
    return LoadedModel(cfg, mdef, params, mesh, step_dir, step)


def _initial(cfg: Config, abstract: Any) -> Any:
    """The parameters a run started from, as its train state held them at step 0: those read
    from checkpoint.load_parameters_path (transformed per init.mode), else its model
    initialised with run.seed."""
    if cfg.checkpoint.load_parameters_path:
        return initial_params(cfg, abstract)
    spec = model_spec(cfg)
    init = lambda: nnx.to_pure_dict(nnx.state(build(spec, seed=cfg.run.seed), nnx.Param))
    shardings = jax.tree.map(lambda a: a.sharding, abstract)
    return jax.jit(init, out_shardings=shardings)()


# Every device on fsdp, one slice: a mesh any device count fits, for any model.
ALL_ON_FSDP = (
    *(f"mesh.{axis}={-1 if axis == 'fsdp' else 1}" for axis in MESH_AXES),
    "mesh.num_slices=1",
    *(f"mesh.dcn.{axis}=1" for axis in MESH_AXES),
)


def _config_and_mesh(
    step_dir: Path, overrides: Sequence[str], devices: list[jax.Device] | None
) -> tuple[Config, Mesh]:
    """The saved config with the overrides, and its mesh over `devices`.

    A run trained on 8 devices is sampled on 1: when the saved mesh does not fit the devices
    and no override names a mesh key, every device goes on fsdp instead (which changes where
    the weights sit, not what the model computes), and a line says so. A mesh the user gave
    that does not fit is refused as it is."""
    cfg = saved_config(step_dir, overrides)
    try:
        return cfg, build_mesh(cfg.mesh, devices)
    except ConfigError:
        if any(text.startswith("mesh.") for text in overrides):
            raise
    fitted = saved_config(step_dir, [*overrides, *ALL_ON_FSDP])
    mesh = build_mesh(fitted.mesh, devices)
    saved = " x ".join(
        f"{a}={getattr(cfg.mesh, a)}" for a in MESH_AXES if getattr(cfg.mesh, a) != 1
    )
    print(
        f"the saved mesh ({saved or 'all 1'}, {cfg.mesh.num_slices} slice(s)) does not fit "
        f"{mesh.size} device(s): loading with mesh.fsdp={mesh.size} (mesh.* overrides choose)",
        flush=True,
    )
    return fitted, mesh


def find_tokenizer(
    model: LoadedModel, explicit: str | Path | None = None
) -> tuple[Tokenizer | None, bool]:
    """The tokenizer of a loaded model, and whether a prompt gets its special tokens.

    `explicit` if given; else one kept beside the checkpoint (an import copies the Hugging Face
    model's, and prompts get its special tokens as transformers adds them: Llama's BOS); else
    the one the run's data was prepared with (the default tokenizer for the embedded corpus, a
    prepared source's metadata.json: documents start without BOS, so prompts do too). None if
    there is none (synthetic data): prompts must then be token ids.
    """
    if explicit is not None:
        return load_tokenizer(explicit), False
    for directory in [model.step_dir, *model.step_dir.parents][:TOKENIZER_SEARCH_DEPTH]:
        if any((directory / name).is_file() for name in TOKENIZER_MODELS):
            return load_tokenizer(directory), True
    path = data_tokenizer_path(model.cfg)
    return (load_tokenizer(path) if path is not None else None), False


def data_tokenizer_path(cfg: Config) -> str | None:
    """The tokenizer the run's first data source was made with, or None."""
    if cfg.data.kind != "grain":
        return None
    if cfg.data.sources[0].format != "tokens":  # chat or preference text, tokenized as read
        return cfg.data.tokenizer or str(DEFAULT_TOKENIZER)
    source = cfg.data.sources[0].path
    if source.startswith(EMBEDDED_PREFIX):
        return str(DEFAULT_TOKENIZER)
    directory = Path(source) if Path(source).is_dir() else Path(source).parent
    return read_metadata(directory)["tokenizer"]


def _abstract_params(mdef: ModelDef) -> Any:
    return nnx.to_pure_dict(mdef.abstract_state)
