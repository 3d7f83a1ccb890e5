"""Writing files and directories so that a reader sees them whole or not at all.

Both work on local paths and on any path etils.epath writes (gs://...): checkpoint sidecars and
manifests live beside the checkpoints, wherever those are.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import IO, Any

from etils import epath


def write_atomic(
    path: epath.PathLike, data: str | bytes | Callable[[IO[bytes]], Any], *, fsync: bool = False
) -> None:
    """Writes data to path through a temporary name beside it, renamed over it.

    data: text, bytes, or a function that writes into the open binary file (a large array
    streamed by np.save). A reader (or a process that resumes after a crash) finds the old file
    or the new one, never a torn one; rename is atomic on local filesystems, and an object store
    publishes an object whole. A failed write removes the temporary file. fsync: flush the data
    to disk before the rename, for a file that marks something complete and must survive a power
    loss (local paths only).
    """
    path = epath.Path(path)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    try:
        with tmp.open("w" if isinstance(data, str) else "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        tmp.replace(path)
    except BaseException:
        with contextlib.suppress(OSError):  # the error that got us here is the one to report
            tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_directory(output: epath.PathLike) -> Iterator[epath.Path]:
    """Yields the staging path `<output>.partial-<pid>` (not yet created) to write a directory
    in; renames it to `output` when the block completes and removes it if the block raises.

    So `output` appears complete or not at all (on local disks, where a directory rename is
    atomic), and a failed write leaves nothing behind. The staging path is a sibling of
    `output`: the rename never crosses filesystems.
    """
    output = epath.Path(output)
    staging = output.parent / f"{output.name}.partial-{os.getpid()}"
    try:
        yield staging
        staging.rename(output)
    except BaseException:
        with contextlib.suppress(OSError):  # the error that got us here is the one to report
            staging.rmtree(missing_ok=True)
        raise
