"""Bytes on disk of a float parameters-only checkpoint against its post-training quantizations.

    python tools/benchmark_ptq.py [--model qwen3-0.6b] [--qtypes int8 int4] [--dir DIR]

Writes the model's freshly initialised float parameters with `save_parameters` (what
`tools/convert_hf.py` and `tools/quantize.py` write too), then runs
`tools/quantize.py` on them
once per qtype and prints one JSON line per checkpoint: its bytes on disk, the parameters'
bytes in memory and the held-out loss before and after (synthetic data: at initialisation
only the change means anything). DIR (new; default: a temporary directory) is removed
afterwards. Mistakes print one line and exit 2.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from flax import nnx

from maxtrain import config as config_lib
from maxtrain import models as model_lib
from maxtrain.checkpointing.export import save_parameters
from maxtrain.common.errors import ArgumentParser, UserError, refuse
from maxtrain.training import run_model


def disk_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in Path(directory).rglob("*") if f.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="benchmark_ptq", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen3-0.6b", help="a preset in configs/models")
    parser.add_argument("--qtypes", nargs="+", choices=("int8", "int4"), default=["int8", "int4"])
    parser.add_argument("--dir", help="a new directory to write in (default: a temporary one)")
    args = parser.parse_args(argv)

    overrides = [f"model_name={args.model}", "data.kind=synthetic"]
    try:
        cfg = config_lib.load(config_lib.CONFIGS_DIR / "base.yml", overrides)
        if args.dir and Path(args.dir).exists():  # it is removed afterwards: never someone's
            raise UserError(f"{args.dir} already exists; name a new directory")
    except UserError as e:
        return refuse("benchmark_ptq", e)
    params = nnx.to_pure_dict(nnx.state(model_lib.build(run_model.model_spec(cfg)), nnx.Param))
    root = Path(args.dir or tempfile.mkdtemp(prefix="benchmark_ptq-"))
    try:
        step_dir = save_parameters(root / "float", params, config_yaml=config_lib.to_yaml(cfg))
        print(
            json.dumps(
                {"model": args.model, "qtype": "float32", "disk_bytes": disk_bytes(step_dir)}
            )
        )
        del params
        for qtype in args.qtypes:
            out = root / qtype
            quantize = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "tools/quantize.py",
                    str(config_lib.CONFIGS_DIR / "base.yml"),
                    *overrides,
                    "train.seq_len=64",
                    "train.global_batch_size=4",
                    "--eval-batches=1",
                    "--source",
                    str(root / "float"),
                    "--output",
                    str(out),
                    f"--qtype={qtype}",
                ],  # fmt: skip
                stdout=subprocess.DEVNULL,
            )
            if quantize.returncode:  # it printed why
                return quantize.returncode
            report = json.loads((out / "report.json").read_text())
            line = {"model": args.model, "qtype": qtype}
            line |= {k: report[k] for k in ("disk_bytes", "bytes_before", "bytes_after")}
            line |= {"loss_before": report["eval_before"]["loss"]}
            line |= {"loss_after": report["eval_after"]["loss"]}
            print(json.dumps(line))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0
