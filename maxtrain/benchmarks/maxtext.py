"""maxtrain and MaxText compiled for the same TPU topology, side by side on the compiler's figures.

    python tools/compare_maxtext.py --maxtext-python MAXTEXT_ENV/bin/python \\
        [--shape dense-1.5b|llama3-8b] [--topology v5e:4x4] [--attention plain|kernel] [--unrolled]

Both train steps are compiled by the same TPU compiler (libtpu, no TPU needed: docs/tpu.md) for
the same model, batch (one sequence per chip), FSDP over every chip, full remat, bfloat16
compute and float32 weights: maxtrain through `tools/benchmark.py --dry-run --compile
--topology`, MaxText through its own `train_compile` in its own environment (MaxText is not a
dependency of maxtrain and none of its code is here; install it beside, e.g.
`python3.12 -m venv mt && mt/bin/pip install "maxtext[tpu]==0.2.5" "jax==0.11.2"
"jaxlib==0.11.2" "libtpu==0.0.48.1"`). Prints one JSON line: each side's bytes accessed, FLOPs
and memory per chip, and maxtrain's bytes over MaxText's.

--attention plain: each one's plain-XLA attention (maxtrain `xla`, MaxText `dot_product`);
kernel: each one's TPU kernel (maxtrain `splash`, MaxText `flash`). --maxtext-option KEY=VALUE
adds a MaxText setting (e.g. float32_qk_product=true float32_logits=true: float32 attention
logits, as maxtrain's plain attention keeps them). --unrolled compiles the layers unrolled
(scan_layers false on both): the compiler's cost analysis counts a loop's body once, so only an
unrolled program's bytes are the whole step's.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from maxtrain.common.errors import ArgumentParser, UserError, refuse
from maxtrain.config import CONFIGS_DIR, REPO_ROOT
from maxtrain.parallel.topology import parse_topology

# MaxText's names for a maxtrain preset's shape (configs/models/*.yml).
SHAPES = {
    "dense-1.5b": dict(
        base_emb_dim=2048,
        base_num_decoder_layers=16,
        base_num_query_heads=32,
        base_num_kv_heads=8,
        head_dim=64,
        base_mlp_dim=8192,
        vocab_size=128256,
        rope_max_timescale=500000,
    ),
    "llama3-8b": dict(
        base_emb_dim=4096,
        base_num_decoder_layers=32,
        base_num_query_heads=32,
        base_num_kv_heads=8,
        head_dim=128,
        base_mlp_dim=14336,
        vocab_size=128256,
        rope_max_timescale=500000,
    ),
}
ATTENTION = {"plain": ("xla", "dot_product"), "kernel": ("splash", "flash")}
SEQ_LEN = 2048


def maxtrain_command(shape: str, topology: str, attention: str, unrolled: bool) -> list[str]:
    """tools/benchmark.py's command line for maxtrain's side of the comparison."""
    _, chips = parse_topology(topology)
    return [
        sys.executable,
        str(REPO_ROOT / "tools" / "benchmark.py"),
        str(CONFIGS_DIR / "base.yml"),
        f"model_name={shape}",
        f"mesh.fsdp={chips}",
        f"train.global_batch_size={chips}",
        f"train.seq_len={SEQ_LEN}",
        "compute.remat=full",
        "compute.param_dtype=float32",
        f"compute.scan_layers={str(not unrolled).lower()}",
        f"compute.attention={ATTENTION[attention][0]}",
        "--dry-run",
        "--compile",
        "--topology",
        topology,
    ]


def maxtrain_side(shape: str, topology: str, attention: str, unrolled: bool) -> dict:
    command = maxtrain_command(shape, topology, attention, unrolled)
    compiled = json.loads(_run(command, "maxtrain").splitlines()[-1])["compiled"]
    return {
        "command": " ".join(
            str(Path(c).relative_to(REPO_ROOT)) if c.startswith(str(REPO_ROOT)) else c
            for c in command[1:]
        ),
        "bytes_accessed_per_chip": compiled["bytes_accessed_per_device"],
        "flops_per_chip": compiled["flops_per_device"],
        "gib_per_chip": {
            "arguments": compiled["gib_per_device"]["arguments"],
            "temporaries": compiled["gib_per_device"]["temporaries"],
        },
        "compile_s": compiled["compile_s"],
    }


def maxtext_side(
    python: str, shape: str, topology: str, attention: str, unrolled: bool, options: list[str]
) -> dict:
    generation, chips = parse_topology(topology)
    if generation != "v5e" and generation != "v6e":
        raise UserError(f"--topology {topology}: this comparison knows v5e and v6e slices")
    settings = {
        **SHAPES[shape],
        "max_target_length": SEQ_LEN,
        "per_device_batch_size": 1,
        "ici_fsdp_parallelism": -1,
        "remat_policy": "full",
        "scan_layers": str(not unrolled).lower(),
        "dtype": "bfloat16",
        "weight_dtype": "float32",
        "attention": ATTENTION[attention][1],
        "decoder_block": "llama2",
        "logits_via_embedding": "false",
    }
    command, out = train_compile(python, topology, settings, options)
    cost = ast.literal_eval(re.search(r"^Cost analysis: (\{.*\})$", out, re.M)[1])
    memory = dict(
        (k, int(v)) for k, v in re.findall(r"(\w+_size_in_bytes)=(\d+)", out.split("Memory")[-1])
    )
    return {
        "command": " ".join(command[2:]),
        "bytes_accessed_per_chip": cost["bytes accessed"],
        "flops_per_chip": cost["flops"],
        "gib_per_chip": {
            "arguments": round(memory["argument_size_in_bytes"] / 2**30, 3),
            "temporaries": round(memory["temp_size_in_bytes"] / 2**30, 3),
        },
    }


def train_compile(
    python: str,
    topology: str,
    settings: dict,
    options: list[str] | None = None,
    libtpu_flags: str = "",
    dump_dir: str | None = None,
) -> tuple[list[str], str]:
    """(command, stdout) of MaxText's `train_compile` in its own environment (`python`) for a
    TPU topology, with MaxText's `settings` (key=value on its base.yml, `options` after them)
    and the LIBTPU_INIT_ARGS flag bundle `libtpu_flags`. With `dump_dir`, XLA writes the
    optimized program there (`optimized_program` reads it) and the compile is stopped once it
    has: what follows is code generation, which the program's text does not show."""
    generation, chips = parse_topology(topology)
    base = _run(
        [python, "-c", "import maxtext, os; print(os.path.dirname(maxtext.__file__))"], "maxtext"
    ).strip()
    settings = {
        "compile_topology": f"{generation}-{chips}",
        "compile_topology_num_slices": 1,
        "skip_jax_distributed_system": "true",
        "run_name": "compare",
        "base_output_directory": "/tmp/maxtext-compare",
        "enable_checkpointing": "false",
        "dataset_type": "synthetic",
        **settings,
    }
    command = [
        python,
        "-m",
        "maxtext.trainers.pre_train.train_compile",
        f"{base}/configs/base.yml",
        *(f"{k}={v}" for k, v in settings.items()),
        *(options or []),
    ]
    env = {**os.environ, "DECOUPLE_GCLOUD": "TRUE", "JAX_PLATFORMS": "cpu"}
    env["TPU_ACCELERATOR_TYPE"] = f"{'v5litepod' if generation == 'v5e' else generation}-{chips}"
    env.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    env.setdefault("TPU_SKIP_MDS_QUERY", "1")
    if libtpu_flags:
        env["LIBTPU_INIT_ARGS"] = libtpu_flags
    if dump_dir is None:
        return command, _run(command, "maxtext", env)
    env["XLA_FLAGS"] = (
        f"--xla_dump_to={dump_dir} --xla_dump_hlo_module_re=jit_train_step --xla_dump_hlo_as_text"
    )
    _run_until_dumped(command, env, dump_dir)
    return command, ""


_OPTIMIZED = "*jit_train_step*.after_optimizations.txt"


def optimized_program(dump_dir: str) -> str:
    """The optimized train step XLA dumped to `dump_dir` (its scheduled program's text)."""
    found = sorted(Path(dump_dir).glob(_OPTIMIZED))
    if not found:
        raise UserError(f"MaxText's compile wrote no optimized program to {dump_dir}")
    return found[-1].read_text()


def _run_until_dumped(command: list[str], env: dict, dump_dir: str) -> None:
    """Runs a compile until XLA has dumped its optimized program (or the compile ends). Its
    log goes to a file: a pipe nobody reads would fill and stop it."""
    log = Path(dump_dir) / "compile.log"
    with log.open("w") as out, subprocess.Popen(command, env=env, stdout=out, stderr=out) as run:
        while run.poll() is None:
            written = list(Path(dump_dir).glob(_OPTIMIZED))
            if written and time.time() - written[0].stat().st_mtime > 5:  # complete
                run.terminate()
                run.wait()
                return
            time.sleep(2)
    if run.returncode:
        tail = "\n".join(log.read_text().strip().splitlines()[-5:])
        raise UserError(f"maxtext's compile failed (exit {run.returncode}):\n{tail}")


def _run(command: list[str], who: str, env: dict | None = None) -> str:
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
        raise UserError(f"{who}'s compile failed (exit {done.returncode}):\n{tail}")
    return done.stdout


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="compare_maxtext", description=__doc__.splitlines()[0])
    parser.add_argument("--maxtext-python", required=True, help="python of MaxText's environment")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="dense-1.5b")
    parser.add_argument("--topology", default="v5e:4x4", help="as libtpu names it (v5e:4x4)")
    parser.add_argument("--attention", choices=sorted(ATTENTION), default="plain")
    parser.add_argument("--unrolled", action="store_true", help="layers unrolled on both sides")
    parser.add_argument(
        "--maxtext-option", action="append", default=[], metavar="KEY=VALUE", help="MaxText key"
    )
    args = parser.parse_args(argv)
    try:
        if not Path(args.maxtext_python).is_file():
            raise UserError(f"--maxtext-python {args.maxtext_python}: no such file")
        ours = maxtrain_side(args.shape, args.topology, args.attention, args.unrolled)
        theirs = maxtext_side(
            args.maxtext_python,
            args.shape,
            args.topology,
            args.attention,
            args.unrolled,
            args.maxtext_option,
        )
    except UserError as e:
        return refuse("compare_maxtext", e)
    result = {
        "shape": args.shape,
        "topology": args.topology,
        "attention": args.attention,
        "layers": "unrolled" if args.unrolled else "scanned",
        "maxtrain": ours,
        "maxtext": theirs,
        "bytes_ratio": round(
            ours["bytes_accessed_per_chip"] / theirs["bytes_accessed_per_chip"], 4
        ),
    }
    print(json.dumps(result))
    return 0
