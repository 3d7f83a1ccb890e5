"""maxtrain and MaxText compiled for the same TPU topology, side by side on the compiler's figures.

    python tools/compare_maxtext.py --maxtext-python MAXTEXT_ENV/bin/python [--shape SHAPE]
        [--topology v5e:4x4] [--attention plain|kernel] [--unrolled] [--layers N] [--expert E]

Both train steps are compiled by the same TPU compiler (libtpu, no TPU needed: docs/tpu.md) for
the same model, batch (one sequence of 2048 per chip), FSDP over every chip, full remat,
bfloat16 compute and float32 weights: maxtrain through `tools/benchmark.py --dry-run --compile
--topology`, MaxText through its own `train_compile` in its own environment (MaxText is not a
dependency of maxtrain and none of its code is here; install it beside, e.g.
`python3.12 -m venv mt && mt/bin/pip install "maxtext[tpu]==0.2.5" "jax==0.11.2"
"jaxlib==0.11.2" "libtpu==0.0.48.1"`). Prints one JSON line: each side's bytes accessed, FLOPs,
memory per chip and predicted step time (the step-time model, maxtrain/analysis/step_time.py,
on each side's optimized program), and maxtrain's figures over MaxText's.

The shapes are maxtrain's presets (configs/models/), given to MaxText in its own keys: the dense
dense-1.5b and llama3-8b (MaxText's llama2 decoder block) and the MoE qwen3-30b-a3b (128
experts top-8, its qwen3_moe block), mixtral-8x7b (8 top-2) and kanana-moe (Kanana Nano
upcycled to 64 top-8; Llama attention, so MaxText's mixtral block). The MoE shapes compile 4
layers by default (--layers): enough to count whole steps unrolled in minutes. Each side runs
its best MoE kernels: maxtrain tokamax's grouped matmul, MaxText megablox under sparse_matmul
(its defaults), both dropless. --expert E splits the experts E ways on both (maxtrain
mesh.expert, MaxText ici_expert_parallelism), FSDP over the rest.

--attention plain: each one's plain-XLA attention (maxtrain `xla`, MaxText `dot_product`);
kernel: each one's TPU kernel (maxtrain `splash`, MaxText `flash`). --maxtext-option KEY=VALUE
adds a MaxText setting (e.g. float32_qk_product=true float32_logits=true: float32 attention
logits, as maxtrain's plain attention keeps them). --unrolled compiles the layers unrolled
(scan_layers false on both): the compiler's cost analysis counts a loop's body once, so only an
unrolled program's bytes accessed are the whole step's (the step-time model counts a loop by
its trips either way).
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from maxtrain.analysis import step_time
from maxtrain.common import devices
from maxtrain.common.errors import ArgumentParser, UserError, refuse
from maxtrain.config import CONFIGS_DIR, REPO_ROOT, ModelConfig, preset
from maxtrain.parallel.topology import parse_topology

DENSE_SHAPES = ("dense-1.5b", "llama3-8b")
MOE_SHAPES = ("qwen3-30b-a3b", "mixtral-8x7b", "kanana-moe")
MOE_LAYERS = 4
ATTENTION = {"plain": ("xla", "dot_product"), "kernel": ("splash", "flash")}
SEQ_LEN = 2048


@dataclass(frozen=True)
class Comparison:
    """What both sides compile: a preset's shape (`layers` of it; None: all) on a topology."""

    shape: str
    topology: str
    attention: str = "kernel"
    unrolled: bool = False
    layers: int | None = None
    expert: int = 1  # the experts split this many ways, FSDP over the rest of the chips

    @property
    def chips(self) -> int:
        return parse_topology(self.topology)[1]

    def model(self) -> ModelConfig:
        model = preset(self.shape)
        return model.model_copy(update={"num_layers": self.layers or model.num_layers})


def maxtext_model(model: ModelConfig) -> dict:
    """MaxText's keys for a maxtrain model: a Llama-style decoder, dense or all-MoE (dropless,
    top-k renormalised, softmax router), with a qwen3_moe block where heads have a qk-norm."""
    keys = dict(
        base_emb_dim=model.emb_dim,
        base_num_decoder_layers=model.num_layers,
        base_num_query_heads=model.num_heads,
        base_num_kv_heads=model.num_kv_heads or model.num_heads,
        head_dim=model.head_dim or model.emb_dim // model.num_heads,
        base_mlp_dim=model.mlp_dim,
        vocab_size=model.vocab_size,
        rope_max_timescale=int(model.rope.theta),
        normalization_layer_epsilon=model.norm_eps,
        logits_via_embedding=str(model.tie_embeddings).lower(),
        use_qk_norm=str(model.qk_norm == "rms").lower(),
        decoder_block="llama2",
    )
    if model.moe is None:
        return keys
    return keys | dict(
        decoder_block="qwen3_moe" if model.qk_norm == "rms" else "mixtral",
        base_mlp_dim=model.moe.expert_mlp_dim,  # = base_moe_mlp_dim on an all-MoE model
        base_moe_mlp_dim=model.moe.expert_mlp_dim,
        num_experts=model.moe.num_experts,
        num_experts_per_tok=model.moe.top_k,
        norm_topk_prob="true",
        load_balance_loss_weight=model.moe.aux_loss_weight,
        capacity_factor=-1,  # dropless, as maxtrain's
        sparse_matmul="true",
        megablox="true",
    )


def maxtrain_command(run: Comparison, save_hlo: str | None = None) -> list[str]:
    """tools/benchmark.py's command line for maxtrain's side of the comparison (with
    `save_hlo`, it writes its optimized program there)."""
    moe = [f"mesh.expert={run.expert}", "compute.grouped_matmul=tokamax"]
    return [
        sys.executable,
        str(REPO_ROOT / "tools" / "benchmark.py"),
        str(CONFIGS_DIR / "base.yml"),
        f"model_name={run.shape}",
        *([f"model.num_layers={run.layers}"] if run.layers else []),
        f"mesh.fsdp={run.chips // run.expert}",
        *(moe if run.shape in MOE_SHAPES else []),
        f"train.global_batch_size={run.chips}",
        f"train.seq_len={SEQ_LEN}",
        "compute.remat=full",
        "compute.param_dtype=float32",
        f"compute.scan_layers={str(not run.unrolled).lower()}",
        f"compute.attention={ATTENTION[run.attention][0]}",
        "--dry-run",
        "--compile",
        "--topology",
        run.topology,
        *(["--save-hlo", save_hlo] if save_hlo else []),
    ]


def maxtext_settings(run: Comparison) -> dict:
    """MaxText's settings (key=value on its base.yml) for its side of the comparison."""
    return {
        **maxtext_model(run.model()),
        "max_target_length": SEQ_LEN,
        "per_device_batch_size": 1,
        "ici_fsdp_parallelism": -1,
        "ici_expert_parallelism": run.expert,
        # an expert axis of 8 on a 4x4 slice splits a physical axis, as maxtrain's mesh does
        "allow_split_physical_axes": "true",
        "remat_policy": "full",
        "scan_layers": str(not run.unrolled).lower(),
        "dtype": "bfloat16",
        "weight_dtype": "float32",
        "attention": ATTENTION[run.attention][1],
    }


def maxtrain_side(run: Comparison, programs: Path | None = None) -> dict:
    """maxtrain's compile through tools/benchmark.py, and the step-time model on its optimized
    program placed on the slice as MaxText's is (`predict`): the benchmark's own prediction
    places collectives by its mesh's axes, which MaxText's program does not name."""
    with tempfile.TemporaryDirectory() as scratch:
        saved = (programs or Path(scratch)) / "maxtrain.hlo"
        command = maxtrain_command(run, str(saved))
        compiled = json.loads(_run(command, "maxtrain").splitlines()[-1])["compiled"]
        prediction = predict(saved.read_text(), run.topology)
    throughput = compiled["predicted"]
    flops_per_token = throughput["tflops_per_chip"] * 1e12 / throughput["tokens_per_sec_per_chip"]
    summary = step_time.summary(prediction, run.chips * SEQ_LEN, run.chips, flops_per_token)
    return {
        "command": " ".join(
            str(Path(c).relative_to(REPO_ROOT)) if c.startswith(str(REPO_ROOT)) else c
            for c in command[1 : command.index("--save-hlo")]
        ),
        **_figures(
            compiled["bytes_accessed_per_device"],
            compiled["flops_per_device"],
            compiled["gib_per_device"],
        ),
        "predicted": _predicted(summary),
        "flops_per_token": flops_per_token,
        "compile_s": compiled["compile_s"],
    }


def maxtext_side(
    python: str,
    run: Comparison,
    options: list[str],
    flops_per_token: float,
    programs: Path | None = None,
) -> dict:
    """MaxText's compile, its cost analysis and memory as it prints them, and the step-time
    model on the optimized program it dumps (kept in `programs`/maxtext.hlo if given); MFU
    counts the same model FLOPs as maxtrain's."""
    if parse_topology(run.topology)[0] not in ("v5e", "v6e"):
        raise UserError(f"--topology {run.topology}: this comparison knows v5e and v6e slices")
    with tempfile.TemporaryDirectory() as dump:
        settings = maxtext_settings(run)
        command, out = train_compile(
            python, run.topology, settings, options, dump_dir=dump, finish=True
        )
        program = optimized_program(dump)
    if programs:
        (programs / "maxtext.hlo").write_text(program)
    prediction = predict(program, run.topology)
    cost = ast.literal_eval(re.search(r"^Cost analysis: (\{.*\})$", out, re.M)[1])
    memory = dict(
        (k, int(v)) for k, v in re.findall(r"(\w+_size_in_bytes)=(\d+)", out.split("Memory")[-1])
    )
    summary = step_time.summary(prediction, run.chips * SEQ_LEN, run.chips, flops_per_token)
    gib = {k.removesuffix("_size_in_bytes"): v / 2**30 for k, v in memory.items()}
    return {
        "command": " ".join(command[2:]),
        **_figures(
            cost["bytes accessed"],
            cost["flops"],
            {"arguments": gib["argument"], "temporaries": gib["temp"]},
        ),
        "predicted": _predicted(summary),
    }


def predict(program: str, topology: str) -> step_time.StepTimePrediction:
    """The step-time model on a TPU program compiled for `topology` (one slice)."""
    generation, _ = parse_topology(topology)
    shape = tuple(int(d) for d in topology.split(":")[1].split("x"))
    return step_time.predict(
        program, devices.chip(f"tpu {generation}"), step_time.Placement(slice_shape=shape)
    )


def _figures(bytes_accessed: float, flops: float, gib: dict) -> dict:
    return {
        "bytes_accessed_per_chip": bytes_accessed,
        "flops_per_chip": flops,
        "gib_per_chip": {k: round(gib[k], 3) for k in ("arguments", "temporaries")},
    }


def _predicted(summary: dict) -> dict:
    """What the comparison shows of a step-time summary (step_time.summary)."""
    keys = ("step_s", "mfu", "tokens_per_sec_per_chip", "tflops_per_chip", "bound")
    keys += ("seconds_by_category", "hbm_gb_per_chip", "top_instructions")
    return {k: summary[k] for k in keys}


def train_compile(
    python: str,
    topology: str,
    settings: dict,
    options: list[str] | None = None,
    libtpu_flags: str = "",
    dump_dir: str | None = None,
    finish: bool = False,
) -> tuple[list[str], str]:
    """(command, stdout) of MaxText's `train_compile` in its own environment (`python`) for a
    TPU topology, with MaxText's `settings` (key=value on its base.yml, `options` after them)
    and the LIBTPU_INIT_ARGS flag bundle `libtpu_flags`. With `dump_dir`, XLA writes the
    optimized program there (`optimized_program` reads it) and, unless `finish`, the compile is
    stopped once it has (stdout ""): what follows is code generation, which the program's text
    does not show, and only then the cost analysis and memory MaxText prints."""
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
    if finish:
        return command, _run(command, "maxtext", env)
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
    parser.add_argument("--shape", choices=[*DENSE_SHAPES, *MOE_SHAPES], default="dense-1.5b")
    parser.add_argument("--topology", default="v5e:4x4", help="as libtpu names it (v5e:4x4)")
    parser.add_argument("--attention", choices=sorted(ATTENTION), default="plain")
    parser.add_argument("--unrolled", action="store_true", help="layers unrolled on both sides")
    parser.add_argument("--layers", type=int, help=f"default: all; {MOE_LAYERS} of an MoE shape")
    parser.add_argument("--expert", type=int, default=1, help="experts split this many ways")
    parser.add_argument(
        "--maxtext-option", action="append", default=[], metavar="KEY=VALUE", help="MaxText key"
    )
    parser.add_argument(
        "--save-programs", metavar="DIR", help="writes both optimized programs there, to read"
    )
    args = parser.parse_args(argv)
    try:
        if not Path(args.maxtext_python).is_file():
            raise UserError(f"--maxtext-python {args.maxtext_python}: no such file")
        run = comparison(args)
        programs = Path(args.save_programs) if args.save_programs else None
        if programs:
            programs.mkdir(parents=True, exist_ok=True)
        ours = maxtrain_side(run, programs)
        theirs = maxtext_side(
            args.maxtext_python, run, args.maxtext_option, ours.pop("flops_per_token"), programs
        )
    except UserError as e:
        return refuse("compare_maxtext", e)
    print(json.dumps(result(run, ours, theirs)))
    return 0


def comparison(args) -> Comparison:
    """The comparison the command line asks for, or why there is none."""
    moe = args.shape in MOE_SHAPES
    layers = args.layers or (MOE_LAYERS if moe else None)
    if layers is not None and layers < 1:
        raise UserError(f"--layers {layers}: expected a positive number of layers")
    run = Comparison(args.shape, args.topology, args.attention, args.unrolled, layers, args.expert)
    if args.expert != 1:
        experts = run.model().moe.num_experts if moe else 0
        if not moe or args.expert < 1 or run.chips % args.expert or experts % args.expert:
            raise UserError(
                f"--expert {args.expert}: expected an MoE shape ({', '.join(MOE_SHAPES)}) and a "
                f"divisor of both its experts and the topology's {run.chips} chips"
            )
    return run


def result(run: Comparison, ours: dict, theirs: dict) -> dict:
    """The comparison's JSON line: both sides, and maxtrain's figures over MaxText's."""

    def ratio(figure) -> float:
        return round(figure(ours) / figure(theirs), 4)

    return {
        "shape": run.shape,
        "topology": run.topology,
        "attention": run.attention,
        "layers": f"{run.model().num_layers} {'unrolled' if run.unrolled else 'scanned'}",
        "expert": run.expert,
        "maxtrain": ours,
        "maxtext": theirs,
        "bytes_ratio": ratio(lambda side: side["bytes_accessed_per_chip"]),
        "temporaries_ratio": ratio(lambda side: side["gib_per_chip"]["temporaries"]),
        "predicted_step_ratio": ratio(lambda side: side["predicted"]["step_s"]),
    }
