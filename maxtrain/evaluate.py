"""Scores a trained or imported model: `python -m maxtrain.evaluate CHECKPOINT [key=value ...]`.

    python -m maxtrain.evaluate runs/default                   # every committed task
    python -m maxtrain.evaluate runs/default --tasks prose_continuation --shots 3 --loss
    python -m maxtrain.evaluate imported/ --tasks my_task.jsonl --output results.json

CHECKPOINT is a step, tier or run directory (the newest complete step) or an imported Hugging
Face checkpoint; key=value overrides apply to the config saved with it (the mesh, the data for
--loss). --tasks scores log-likelihood tasks (maxtrain/evaluation/tasks.py: committed names,
task directories or JSONL files) and prints acc, acc_norm and chance per task; --loss prints
the held-out loss and perplexity of the run's data sources (any data.kind) under the objective
the run trained with (DPO: its loss, accuracy and reward margin against the model the run
started from), as the train loop's eval does. The numbers are those the train loop writes for
the same parameters (train.eval_tasks, train.eval_shots). Bad input is one line on stderr and
exit status 2.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from maxtrain.common.errors import (
    ArgumentParser,
    UserError,
    non_negative_int,
    path_first,
    positive_int,
    refuse,
)
from maxtrain.common.files import write_atomic

PROG = "evaluate"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    args.checkpoint, *args.overrides = path_first([args.checkpoint, *args.overrides])
    # Imported here: jax and the model take seconds to import, --help should not wait for them.
    import jax

    from maxtrain import posttrain
    from maxtrain.data import batch_sharding
    from maxtrain.data.streams import data_streams
    from maxtrain.evaluation.harness import chance, task_evaluator
    from maxtrain.evaluation.loss import held_out_loss
    from maxtrain.evaluation.tasks import committed_tasks, load_task
    from maxtrain.inference.loading import find_tokenizer, load_model
    from maxtrain.parallel.mesh import sharding_rules
    from maxtrain.training.step import eval_step

    results: dict[str, float] = {}
    try:
        specs = [] if args.no_tasks else args.tasks.split(",") if args.tasks else committed_tasks()
        for spec in specs:
            load_task(spec)  # a bad task file is refused before the checkpoint is read
        devices = jax.devices()[: args.devices] if args.devices else None
        model = load_model(args.checkpoint, args.overrides, devices, initial=args.init)
        cfg = model.cfg
        if args.loss:
            # The held-out streams are built where evaluation is on: a run trained with
            # train.eval_every=0 still holds its data.eval_fraction of documents out.
            scored = cfg.model_copy(
                update={"train": cfg.train.model_copy(update={"eval_every": 1})}
            )
            _, streams = data_streams(scored)  # data mistakes are found before compiling

            # Scored as the run was trained: DPO's loss against the model it started from.
            objective = posttrain.objective(cfg.train)
            reference = None
            if objective.uses_reference:
                reference = load_model(args.checkpoint, args.overrides, devices, initial=True)
                reference = reference.params

            def traced(params, batch):
                with sharding_rules(model.mesh, cfg.mesh.rules):
                    return eval_step(
                        params, batch, mdef=model.mdef, objective=objective, reference=reference
                    )

            sharding = batch_sharding(model.mesh, cfg.mesh.rules)
            loss = held_out_loss(
                jax.jit(traced), model.params, sharding, streams, cfg.train.eval_steps
            )
            results.update({f"loss/{k}" if "/" in k else k: v for k, v in loss.items()})
        if specs:
            tokenizer, special_tokens = find_tokenizer(model, args.tokenizer)
            evaluator = task_evaluator(
                cfg,
                model.mdef,
                model.mesh,
                specs,
                shots=args.shots,
                tokenizer=tokenizer,
                special_tokens=special_tokens,
            )
            print(f"{PROG}: {model.source()}, scoring {', '.join(specs)} ({args.shots}-shot)")
            results.update(evaluator(model.params, progress=True))
            for prepared in evaluator.prepared:
                results[f"{prepared.task.name}/chance"] = chance(prepared.task)
                results[f"{prepared.task.name}/examples"] = len(prepared.task.test)
    except UserError as e:
        return refuse(PROG, e)
    for key, value in results.items():
        print(f"{key:32s} {value:.4f}" if isinstance(value, float) else f"{key:32s} {value}")
    if args.output is not None:
        record = {"checkpoint": str(model.step_dir), "step": model.step, **results}
        write_atomic(args.output, json.dumps(record, indent=1) + "\n")
        print(f"{PROG}: wrote {args.output}")
    return 0


def _parser() -> ArgumentParser:
    parser = ArgumentParser(prog=f"python -m maxtrain.{PROG}", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a step, tier or run directory, or an imported model")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    parser.add_argument("--tasks", help="comma-separated tasks (default: every committed one)")
    parser.add_argument("--no-tasks", action="store_true", help="score no task (with --loss)")
    parser.add_argument("--shots", type=non_negative_int, default=0)
    parser.add_argument("--loss", action="store_true", help="held-out loss of the run's data")
    parser.add_argument(
        "--init", action="store_true", help="score the run's initial (step 0) parameters instead"
    )
    parser.add_argument("--tokenizer", help="a tokenizer file or directory (default: found)")
    parser.add_argument("--output", type=Path, help="write the results as JSON here")
    parser.add_argument("--devices", type=positive_int, help="use the first N devices")
    return parser


if __name__ == "__main__":
    sys.exit(main())
