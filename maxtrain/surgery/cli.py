"""The command line shared by tools/upcycle.py and tools/depth_upscale.py.

    python tools/<mode>.py CONFIG.yml [key=value ...] --source CKPT --output DIR

CONFIG (plus overrides) describes the new model and its `init:` section, exactly as a train run
starting from CKPT would (`init.mode` is set by the tool, `checkpoint.load_parameters_path` by
--source). The result is written to DIR as a parameters-only checkpoint that
`checkpoint.load_parameters_path=DIR` starts a run from, with the new model's file
DIR/model.yml (`model_name=DIR/model.yml` names it). User mistakes (config, layer map,
shapes, a missing or mismatching checkpoint, an existing DIR) print one line and exit 2, with
nothing written.
"""

from __future__ import annotations

from maxtrain import config as config_lib
from maxtrain import models as model_lib
from maxtrain.checkpointing.export import save_parameters
from maxtrain.common.errors import ArgumentParser, UserError, refuse
from maxtrain.hf.convert import MODEL_YAML, model_yaml
from maxtrain.parallel.mesh import build_mesh
from maxtrain.surgery.initialize import abstract_params, initial_params


def main(mode: str, argv: list[str], description: str) -> int:
    parser = ArgumentParser(prog=mode, description=description)
    parser.add_argument("config", help="config of the new model, with its init: section")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    parser.add_argument(
        "--source", required=True, help="checkpoint to read: a step, tier or run directory"
    )
    parser.add_argument("--output", required=True, help="directory to create for the result")
    args = parser.parse_args(argv)
    try:
        source = f"checkpoint.load_parameters_path={args.source}"
        cfg = config_lib.load(args.config, [*args.overrides, f"init.mode={mode}", source])
        mesh = build_mesh(cfg.mesh)
        params = initial_params(cfg, abstract_params(cfg, mesh))
        comment = f"Made by tools/{mode}.py from {cfg.init.source_model} at {args.source}."
        step_dir = save_parameters(
            args.output,
            params,
            config_yaml=config_lib.to_yaml(cfg),
            meta={"init": {**cfg.init.model_dump(), "source": args.source}},
            files={MODEL_YAML: model_yaml(cfg.model, comment)},
        )
    except UserError as e:
        return refuse(mode, e)
    moe = cfg.model.moe
    kind = f"MoE, {moe.num_experts} experts, top-{moe.top_k}" if moe else "dense"
    print(
        f"{mode}: wrote {step_dir} and its model file {args.output}/{MODEL_YAML}: "
        f"{cfg.model.num_layers} layers, {kind}, {model_lib.param_count(cfg.model):,} parameters "
        f"({model_lib.active_param_count(cfg.model):,} active), from {cfg.init.source_model} at "
        f"{args.source}. To train from it: model_name={args.output}/{MODEL_YAML} "
        f"checkpoint.load_parameters_path={args.output}"
    )
    return 0
