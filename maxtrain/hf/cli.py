"""The command line of tools/convert_hf.py.

    python tools/convert_hf.py import --hf-dir DIR --output CKPT [--param-dtype bfloat16]
    python tools/convert_hf.py export --checkpoint CKPT --output DIR [--dtype bfloat16]
                                      [--max-shard-gb 5]

Bad or unsupported input (a missing config.json or tensor, a shape the config does not imply,
an unknown model_type or option, an existing output) prints one line and exits with status 2,
leaving no output directory behind.
"""

from __future__ import annotations

from maxtrain import models as model_lib
from maxtrain.common.errors import ArgumentParser, UserError, positive_float, refuse
from maxtrain.hf.convert import DTYPES, MODEL_YAML, export_checkpoint, import_checkpoint

PROG = "convert_hf"


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "import":
            cfg = import_checkpoint(args.hf_dir, args.output, args.param_dtype)
            print(
                f"{PROG}: wrote {args.output} ({model_lib.param_count(cfg):,} parameters, "
                f"{args.param_dtype}) and its model file {args.output}/{MODEL_YAML}. To train "
                f"from it: model_name={args.output}/{MODEL_YAML} "
                f"checkpoint.load_parameters_path={args.output}"
            )
        else:
            cfg, family, step_dir, tokenizer, dtype = export_checkpoint(
                args.checkpoint,
                args.output,
                args.dtype,
                int(args.max_shard_gb * 2**30),
                args.tokenizer,
            )
            print(
                f"{PROG}: wrote {args.output} from step {step_dir.name} ({step_dir}): "
                f"{family.architecture}, {model_lib.param_count(cfg):,} parameters, "
                f"{dtype}, "
                + (
                    f"tokenizer {tokenizer} with generation_config.json"
                    if tokenizer
                    else "no tokenizer (the run's is not known: pass --tokenizer)"
                )
            )
    except UserError as e:
        return refuse(PROG, e)
    return 0


def _parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog=PROG, description="Hugging Face checkpoints in and out of maxtrain."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="Hugging Face model directory -> maxtrain checkpoint")
    imp.add_argument("--hf-dir", required=True, help="config.json + safetensors (sharded or not)")
    imp.add_argument("--output", required=True, help="checkpoint directory to create")
    imp.add_argument(
        "--param-dtype",
        choices=DTYPES,
        default="float32",
        help="dtype the parameters are stored in (default float32, the training default)",
    )
    exp = sub.add_parser("export", help="maxtrain checkpoint -> Hugging Face model directory")
    exp.add_argument("--checkpoint", required=True, help="a step, tier or run directory")
    exp.add_argument("--output", required=True, help="model directory to create")
    exp.add_argument(
        "--tokenizer",
        default=None,
        help="sentencepiece model to include (default: the run's, from its saved config)",
    )
    exp.add_argument(
        "--dtype", choices=DTYPES, default=None, help="weight dtype (default: the checkpoint's)"
    )
    exp.add_argument(
        "--max-shard-gb", type=positive_float, default=5.0, help="largest safetensors file (GiB)"
    )
    return parser
