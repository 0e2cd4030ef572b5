"""Writing outputs so that nothing half-written ever looks finished.

- `staged_directory`: every conversion, combination and export writes into a temporary sibling
  directory and renames it into place at the end; an interrupted run leaves only the temporary
  directory, never something at the output path.
- `write_text_atomic`: small files (`latest`, `layout.json`) replaced by rename after an fsync.
- `remove_tree`: a directory is renamed aside before it is deleted, so it never looks complete half-way.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator

from checkpoint.errors import CheckpointError
from checkpoint.names import DELETING_PREFIX, LATEST, TAG_PATTERN


def fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_text_atomic(path: str, text: str) -> None:
    """Replace `path` with `text` so that readers see the old or the new content, never a mix."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def remove_tree(path: str) -> None:
    """Delete a directory so that it never looks complete half-way: rename it aside first."""
    if not os.path.exists(path):
        return
    parent, name = os.path.split(os.path.abspath(path))
    aside = os.path.join(parent, f"{DELETING_PREFIX}{name}-{os.getpid()}")
    os.replace(path, aside)
    shutil.rmtree(aside, ignore_errors=True)


def _holds_checkpoint(path: str) -> bool:
    return os.path.isdir(path) and (
        os.path.exists(os.path.join(path, LATEST)) or any(TAG_PATTERN.match(n) for n in os.listdir(path))
    )


def publish_staged(tmp: str, out_dir: str) -> None:
    """Move a finished temporary directory to `out_dir`; an existing output is removed only after that."""
    out_dir = os.path.abspath(out_dir)
    old = None
    if os.path.exists(out_dir):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.old-", dir=os.path.dirname(out_dir))
        os.rename(out_dir, os.path.join(old, "x"))
    os.rename(tmp, out_dir)
    if old:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def staged_directory(out_dir: str, force: bool = False) -> Iterator[str]:
    """Yield a fresh temporary directory beside `out_dir`; on success it becomes `out_dir`.

    Refuses an existing, non-empty `out_dir` unless `force` (which replaces it only after the new one
    is complete). On any exception the temporary directory is removed and `out_dir` is untouched.

    Raises:
        CheckpointError: `out_dir` exists (without `force`) or its parent is not writable.
    """
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)) and not force:
        what = "already holds a checkpoint" if _holds_checkpoint(out_dir) else "exists and is not empty"
        raise CheckpointError(f"{out_dir}: output {what}; pass --force to replace it")
    parent = os.path.dirname(out_dir)
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"{parent}: cannot create ({e.strerror})") from None
    if not os.access(parent, os.W_OK):
        raise CheckpointError(f"{parent}: not writable")
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    try:
        yield tmp
        publish_staged(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
