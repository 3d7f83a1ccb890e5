"""What a complete checkpoint is, how corruption is found, and the shape check against a model.

A step directory `<tier_dir>/<step>/` is COMPLETE when all of these hold:

1. its name is the bare step number. Orbax writes into `<step>.orbax-checkpoint-tmp` and renames
   it at commit (local disks); on object stores, where rename is not atomic, it writes in place
   and marks the end with `commit_success.txt`. Orbax 0.12.4 writes that file last in both modes.
2. `commit_success.txt` exists and `_CHECKPOINT_METADATA` parses with a commit timestamp.
3. `maxtrain_manifest.json` exists, and every file it lists exists with exactly the listed size.
   The manifest is written by the saving process after all items are written and BEFORE Orbax
   commits (an Orbax post-finalization callback, see checkpointer.py), so a committed maxtrain
   checkpoint always has one. It catches what Orbax cannot: files truncated or deleted after the
   commit (a crash half-way through copying a bucket, a bad disk).
4. after the restore, every array's content checksum equals the one the manifest lists for it
   (checksums.py; restore.py checks it): a flipped bit, which no file size shows.

A check here costs one stat per file (tens of files whatever the model size); the restore that
follows reads every byte and is the second line of defence (tensorstore fails on short reads),
and the checksums the third.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import jax
from etils import epath

from maxtrain.common.errors import UserError, first_line
from maxtrain.common.files import write_atomic

MANIFEST = "maxtrain_manifest.json"
COMMIT_FILE = "commit_success.txt"  # orbax atomicity_types.COMMIT_SUCCESS_FILE
ORBAX_METADATA = "_CHECKPOINT_METADATA"
TMP_SUFFIX = ".orbax-checkpoint-tmp"  # orbax atomicity_types.TMP_DIR_SUFFIX
STATE_ITEM = "state"
CONFIG_ITEM = "config"  # {"yaml": the resolved config}
# The persistent tier of Orbax's emergency manager (emergency.py) saves the state as its only
# item, which Orbax names "default".
EMERGENCY_STATE_ITEM = "default"


class CheckpointError(UserError):
    """A checkpoint problem the user must act on (wrong model, unwritable or full storage).

    The CLI prints it as one line and exits with status 2; the message names the path.
    """


class Corrupt(Exception):
    """A step directory that is not a complete checkpoint; the message says what is wrong."""


# ---- listing and verifying steps --------------------------------------------------------------


def step_dirs(tier_dir: epath.Path) -> list[tuple[int, epath.Path]]:
    """(step, path) of every committed-looking step directory, newest first (no I/O beyond ls)."""
    tier_dir = epath.Path(tier_dir)
    if not tier_dir.is_dir():
        return []
    found = [(int(p.name), p) for p in tier_dir.iterdir() if p.name.isdigit() and p.is_dir()]
    return sorted(found, key=lambda sp: -sp[0])


def newest_complete(tier_dir: epath.Path) -> tuple[int, epath.Path] | None:
    """(step, path) of the newest complete step directory in tier_dir (verify), or None."""
    for step, path in step_dirs(tier_dir):
        try:
            verify(path)
        except Corrupt:
            continue
        return step, path
    return None


def in_flight_dir(tier_dir: epath.Path, step: int) -> epath.Path:
    """Where Orbax is writing `step` before its commit: the tmp dir, or in place (object stores)."""
    prefix = f"{step}{TMP_SUFFIX}"  # 0.12.4 names it exactly this; later versions may add a suffix
    tmp = [p for p in tier_dir.iterdir() if p.name.startswith(prefix)]
    return max(tmp, key=lambda p: p.stat().mtime) if tmp else tier_dir / str(step)


def _files(root: epath.Path) -> list[epath.Path]:
    out, stack = [], [root]
    while stack:
        for p in stack.pop().iterdir():
            (stack if p.is_dir() else out).append(p)
    return out


def write_manifest(
    step_dir: epath.Path, step: int, checksums: dict[str, int] | None = None
) -> None:
    """Records the size of every file under the item directories (format: {path: bytes}) and
    the state's content checksums ({leaf path: checksum}, checksums.py) where given.

    Top-level files are left out: Orbax rewrites them at commit, after this runs. Written
    atomically: the local tier of emergency.py adds it to committed steps, where a torn manifest
    would make a good step look corrupt.
    """
    step_dir = epath.Path(step_dir)
    files = {
        str(p.relative_to(step_dir)): p.stat().length
        for item in step_dir.iterdir()
        if item.is_dir()
        for p in _files(item)
    }
    record = {"format": 1, "step": step, "files": dict(sorted(files.items()))}
    if checksums:
        record["checksums"] = checksums
    write_atomic(step_dir / MANIFEST, json.dumps(record, indent=1))


def listed_checksums(step_dir: epath.Path) -> dict[str, int]:
    """The state's content checksums the manifest lists ({}: none, as in older checkpoints).
    Call after verify, which has read the manifest once already."""
    path = epath.Path(step_dir) / MANIFEST
    try:
        return json.loads(path.read_text()).get("checksums", {})
    except (OSError, ValueError) as e:
        raise Corrupt(f"{MANIFEST} unreadable ({first_line(e, 300, typed=True)})") from None


def verify(step_dir: epath.Path, require_manifest: bool = True) -> None:
    """Raises Corrupt(reason) unless step_dir is a complete checkpoint (see module docstring)."""
    step_dir = epath.Path(step_dir)
    if not (step_dir / COMMIT_FILE).exists():
        raise Corrupt(f"{COMMIT_FILE} missing: the save never finished")
    try:
        meta = json.loads((step_dir / ORBAX_METADATA).read_text())
    except (OSError, ValueError) as e:
        raise Corrupt(f"{ORBAX_METADATA} unreadable ({first_line(e, 300, typed=True)})") from None
    if not meta.get("commit_timestamp_nsecs"):
        raise Corrupt(f"{ORBAX_METADATA} has no commit timestamp")
    if not (step_dir / MANIFEST).exists():
        if require_manifest:
            raise Corrupt(f"{MANIFEST} missing")
        return
    try:
        listed = json.loads((step_dir / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError) as e:
        raise Corrupt(f"{MANIFEST} unreadable ({first_line(e, 300, typed=True)})") from None
    for rel, size in listed.items():
        path = step_dir / rel
        if not path.exists():
            raise Corrupt(f"{rel} is missing")
        actual = path.stat().length
        if actual != size:
            raise Corrupt(f"{rel} is {actual} bytes, expected {size}")


def quarantine(step_dir: epath.Path, suffix: str, kind: str = "corrupt") -> epath.Path:
    """Moves a corrupt (or otherwise unusable: kind) step aside, never deleting it, so the step
    number can be saved again and resume skips it."""
    target = step_dir.parent / f"{step_dir.name}.{kind}-{suffix}"
    n = 1
    while target.exists():  # the same step set aside twice within a second
        target, n = step_dir.parent / f"{step_dir.name}.{kind}-{suffix}-{n}", n + 1
    step_dir.rename(target)
    return target


# ---- shapes -----------------------------------------------------------------------------------


def _key_name(k: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def leaf_path(path: Any) -> str:
    """A leaf's key path as 'params/layers/attn/q/kernel'.

    Normalised ('a/0/b') so a namedtuple in the model and the dict Orbax reads back for it name
    a leaf the same way.
    """
    return "/".join(_key_name(k) for k in path)


def flat_shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    """{'params/layers/attn/q/kernel': shape, ...} in tree order."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {leaf_path(path): tuple(leaf.shape) for path, leaf in leaves}


def fingerprint(tree: Any) -> str:
    """A short hash of every leaf's path, shape and dtype: equal trees, equal fingerprints."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    desc = [(leaf_path(p), tuple(x.shape), str(x.dtype)) for p, x in leaves]
    return hashlib.sha256(json.dumps(desc).encode()).hexdigest()[:16]


def state_dir(step_dir: epath.Path) -> epath.Path:
    """Where a step directory holds the train state: `state`, or `default` (emergency layout)."""
    step_dir = epath.Path(step_dir)
    emergency = step_dir / EMERGENCY_STATE_ITEM
    return emergency if emergency.is_dir() else step_dir / STATE_ITEM


def read_state_shapes(step_dir: epath.Path) -> dict[str, tuple[int, ...]]:
    """Leaf shapes of the saved state, read from its metadata file only (no array data)."""
    import orbax.checkpoint as ocp

    try:
        md = ocp.PyTreeCheckpointHandler().metadata(state_dir(step_dir))
    except Exception as e:  # any failure to read metadata means the step is unusable
        raise Corrupt(f"state metadata unreadable ({first_line(e, 300, typed=True)})") from None
    return flat_shapes(getattr(md, "tree", md))


def check_shapes(
    saved: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]], where: str
) -> None:
    """Raises CheckpointError naming the first leaf (in model order) whose shape differs."""
    for path, shape in expected.items():
        if path not in saved:
            raise CheckpointError(
                f"checkpoint {where} does not match the model: {path!r} (shape {shape}) is "
                "not in the checkpoint"
            )
        if saved[path] != shape:
            raise CheckpointError(
                f"checkpoint {where} does not match the model: {path!r} has shape "
                f"{saved[path]} in the checkpoint, the model expects {shape}"
            )
    extra = [p for p in saved if p not in expected]
    if extra:
        raise CheckpointError(
            f"checkpoint {where} does not match the model: {extra[0]!r} (shape "
            f"{saved[extra[0]]}) is in the checkpoint but not in the model"
        )
