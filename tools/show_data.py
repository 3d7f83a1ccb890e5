"""Writes what the model sees: the global batch of each of the first N steps, for any data config.

    python tools/show_data.py CONFIG.yml [key=value ...] --steps N --out batches.npz

The batches come from the train loop's own entry point (`maxtrain.train.data_streams`), on one
process, so every row of each global batch is there, in row order. The .npz holds one array per
key of the train step's batch, each [N, global_batch_size, seq_len] int32: `inputs`, `targets`,
`loss_mask`, `segment_ids`, `positions`. Diff it against another stack's token ids (for a
Megatron config, sample s of Megatron's train dataset is `inputs[s // B, s % B]` plus the last
`targets` token), or against an older run's file, to see whether two runs train on the same data.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from maxtrain import config as config_lib  # noqa: E402
from maxtrain.data import BATCH_KEYS  # noqa: E402
from maxtrain.data.errors import DataError  # noqa: E402
from maxtrain.errors import ArgumentParser, UserError, positive_int, refuse  # noqa: E402
from maxtrain.train import data_streams  # noqa: E402

PROG = "show_data"


def collect(cfg: config_lib.Config, steps: int) -> dict[str, np.ndarray]:
    """{key: [steps, global_batch_size, seq_len]} of the first `steps` global batches."""
    train, _ = data_streams(cfg)
    batches = []
    try:
        for _ in range(steps):
            batches.append(next(train))
    except StopIteration:
        raise DataError(f"the data ends after {len(batches)} steps, before {steps}") from None
    finally:
        if callable(getattr(train, "close", None)):
            train.close()
    return {k: np.stack([b[k] for b in batches]) for k in BATCH_KEYS}


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    parser.add_argument("--steps", type=positive_int, required=True)
    parser.add_argument("--out", type=Path, required=True, metavar="F.npz")
    args = parser.parse_intermixed_args(argv)
    try:
        # The config is checked as the train loop checks it (eval streams included): what one
        # refuses, so does the other; only the train batches are written.
        cfg = config_lib.load(args.config, args.overrides)
        arrays = collect(cfg, args.steps)
    except UserError as e:
        return refuse(PROG, e)
    np.savez_compressed(args.out, **arrays)
    shape = "x".join(map(str, arrays["inputs"].shape))
    print(f"{PROG}: wrote {args.out}: {', '.join(BATCH_KEYS)} [{shape}] (steps x rows x tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
