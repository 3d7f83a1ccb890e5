"""Post-training quantization of a checkpoint: int8 or int4 weights plus per-channel scales.

    python tools/quantize.py CONFIG.yml [key=value ...] --source CKPT --output DIR \
        [--qtype int8|int4] [--eval-batches N]

CONFIG (plus overrides) names the model the checkpoint holds and the held-out data to score it
on. Every matmul kernel (attention, MLP, experts, lm_head; not the router, embedding or norms)
is stored as {qvalue: int8/int4, scale: float32}, one scale per output channel, layer and
expert (maxtrain/quantization/ptq.py quantize_params). DIR is a parameters-only checkpoint
(`save_parameters`), plus DIR/report.json: the relative L2 error of every kernel per layer, the
held-out loss before and after (the float model run on the weights read back from DIR and
dequantized: quantization.load_parameters_dequantized, as evaluation loads them), the bytes of
the parameters before and after, and the bytes DIR takes on disk. Mistakes print one line and
exit 2.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np

from maxtrain import config as config_lib
from maxtrain import quantization
from maxtrain.checkpointing import abstract_like, load_parameters
from maxtrain.checkpointing.export import save_parameters
from maxtrain.common.errors import ArgumentParser, UserError, positive_int, refuse
from maxtrain.data.streams import data_streams
from maxtrain.training.loop import evaluate
from maxtrain.training.trainer import build_trainer


def _nbytes(tree) -> int:
    """Bytes the arrays take, int4 counted as half a byte (its packed size)."""
    return int(
        sum(
            x.size * (0.5 if x.dtype.name == "int4" else x.dtype.itemsize)
            for x in jax.tree.leaves(tree)
        )
    )


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="quantize", description=__doc__.split("\n")[0])
    parser.add_argument("config", help="config of the checkpoint's model and the eval data")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    parser.add_argument("--source", required=True, help="checkpoint: a step, tier or run dir")
    parser.add_argument("--output", required=True, help="directory to create for the result")
    parser.add_argument("--qtype", choices=("int8", "int4"), default="int8")
    parser.add_argument(
        "--eval-batches", type=positive_int, default=4, help="held-out batches per source"
    )
    args = parser.parse_args(argv)
    try:
        # Scored on the float model: a quantized-training run's config would otherwise
        # quantize the matmuls again on top of the stored weights.
        fixed = ["quantization.preset=none", "quantization.rules=[]"]
        cfg = config_lib.load(
            args.config, [*args.overrides, *fixed, f"train.eval_steps={args.eval_batches}"]
        )
        _, eval_streams = data_streams(cfg)  # data mistakes first: they need no compiling
        trainer = build_trainer(cfg)
        params = load_parameters(args.source, abstract_like(trainer.state.params))
        kernels = quantization.quantizable_kernels(trainer.mdef.abstract_state)
        qparams, errors = quantization.quantize_params(params, kernels, args.qtype)
        trainer.state = trainer.state.replace(params=params)
        before = evaluate(trainer, eval_streams)
        step_dir = save_parameters(
            args.output,
            qparams,
            config_yaml=config_lib.to_yaml(cfg),
            meta={"quantization": {"qtype": args.qtype, "source": args.source}},
        )
        # Scored as evaluation will load it: read back from disk and dequantized on the fly.
        reloaded = quantization.load_parameters_dequantized(
            step_dir, abstract_like(trainer.state.params)
        )
        trainer.state = trainer.state.replace(params=reloaded)
        after = evaluate(trainer, eval_streams)
        report = {
            "qtype": args.qtype,
            "source": args.source,
            "eval_before": before,
            "eval_after": after,
            "bytes_before": _nbytes(params),
            "bytes_after": _nbytes(qparams),
            "relative_error": errors,
        }
    except UserError as e:
        return refuse("quantize", e)
    report["disk_bytes"] = sum(f.stat().st_size for f in Path(step_dir).rglob("*") if f.is_file())
    (Path(args.output) / "report.json").write_text(json.dumps(report, indent=2))
    for path, per_layer in errors.items():
        print(f"{path:32s} relative error mean {np.mean(per_layer):.4f} max {max(per_layer):.4f}")
    print(
        f"quantize: wrote {step_dir} ({args.qtype}): eval loss {before['loss']:.4f} -> "
        f"{after['loss']:.4f}, parameters {report['bytes_before']:,} -> "
        f"{report['bytes_after']:,} bytes ({report['disk_bytes']:,} on disk)"
    )
    return 0
