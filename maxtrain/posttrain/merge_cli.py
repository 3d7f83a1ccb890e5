"""Folds a LoRA run's adapters into its base: a plain checkpoint every tool reads as any model.

    python tools/merge_lora.py RUN_OR_STEP OUTPUT [key=value ...]

RUN_OR_STEP: a LoRA run's checkpoint (a step, tier or run directory, as
checkpoint.load_parameters_path takes). Its saved config names the base
(checkpoint.load_parameters_path) and how the run kept it (lora.base_quantization: a QLoRA
base is quantized as the run quantized it, and the merge uses it dequantized, the weights the
adapters were trained on). OUTPUT: a new parameters-only checkpoint of the merged model, with
its model file and the tokenizer files found beside the run or the base. Its saved config is the
run's with lora.rank 0, so tools/convert_hf.py export, maxtrain.generate,
maxtrain.evaluate and
checkpoint.load_parameters_path read it as any model. key=value: overrides of the run's saved
config (mesh.*, or checkpoint.load_parameters_path=... for a base that has moved). Mistakes
print one line and exit 2, with nothing written (maxtrain/posttrain/merging.py does the work).
"""

from __future__ import annotations

from maxtrain.common.errors import ArgumentParser, UserError, refuse


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="merge_lora", description=__doc__.splitlines()[0])
    parser.add_argument("run", help="a LoRA run's checkpoint: a step, tier or run directory")
    parser.add_argument("output", help="directory to create for the merged checkpoint")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the run's config")
    args = parser.parse_args(argv)
    try:
        from maxtrain.posttrain.merging import (
            merge_checkpoint,  # Qwix: after the arguments parse
        )

        step_dir, _ = merge_checkpoint(args.run, args.output, args.overrides)
    except UserError as e:
        return refuse("merge_lora", e)
    print(
        f"merge_lora: wrote {step_dir}, the adapters of {args.run} merged into their base. "
        "Export: python tools/convert_hf.py export --checkpoint "
        f"{args.output} --output HF_DIR"
    )
    return 0
