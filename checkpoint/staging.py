"""Writing outputs so that nothing half-written ever looks finished.

- `staged_directory`: every conversion, combination and export writes into a temporary sibling
  directory and renames it into place at the end; an interrupted run leaves only the temporary
  directory, never something at the output path.
- `write_text_atomic`: small files (`latest`, `layout.json`) replaced by rename after an fsync.
- `publish_dir`: the one publisher of a finished directory (outputs and training checkpoints): old aside, new in.
- `remove_tree`: a directory is renamed aside before it is deleted, so it never looks complete half-way.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import shutil
from collections.abc import Iterator

from checkpoint.errors import CheckpointError
from checkpoint.names import DELETING_PREFIX
from checkpoint.outputs import check_output, write_writer

# A filesystem that cannot fsync a directory says so with one of these (some network and FUSE filesystems): its
# renames are as durable as it makes them, and the log says so once a process.
NO_DIR_FSYNC = (errno.EINVAL, errno.ENOTSUP, errno.EBADF)
_NO_DIR_FSYNC_SAID = []  # the directory it was first said for


def fsync_dir(path: str) -> None:
    """Flush directory `path`'s entries (a rename into it) to disk. Raises OSError naming it when that fails (EIO:
    the rename may not survive a crash); a filesystem that cannot fsync directories is logged once and passed."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        if e.errno not in NO_DIR_FSYNC:
            raise OSError(e.errno, f"cannot flush directory {path} to disk ({e.strerror})") from None
        if not _NO_DIR_FSYNC_SAID:  # once a process
            _NO_DIR_FSYNC_SAID.append(path)
            logging.getLogger(__name__).warning("%s: the filesystem cannot fsync directories (%s)", path, e.strerror)


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


def make_unique_dir(parent: str, prefix: str) -> str:
    """Create a new directory `parent/prefix<random>` with the mode `mkdir` gives under the umask.

    NOTE: not `tempfile.mkdtemp`, whose directories are 0700 whatever the umask: renamed into place they
    would keep teammates on a shared cluster out of a converted model.
    """
    for _ in range(100):
        path = os.path.join(parent, f"{prefix}{secrets.token_hex(4)}")
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"{parent}: no free name for {prefix}*")


def publish_dir(staged: str, final: str) -> None:
    """The one way a finished directory takes its place, for conversions, exports and training checkpoints alike.

    An existing `final` is first renamed aside (`.deleting-<name>-<pid>`, a name no reader takes as complete and the
    next start or save removes), then `staged` is renamed to `final`, the parent fsynced, and the old one deleted. A
    crash at any moment leaves `final` complete (old or new) or absent, never partial: between the two renames the
    old copy is aside and the new one still under its staging name, both whole. Training checkpoints then fall back
    to the newest complete one (checkpoint/saves.py `choose_checkpoint`)."""
    final = os.path.abspath(final)
    parent, name = os.path.split(final)
    fsync_dir(staged)
    aside = None
    if os.path.exists(final):
        aside = os.path.join(parent, f"{DELETING_PREFIX}{name}-{os.getpid()}")
        os.replace(final, aside)
    os.replace(staged, final)
    fsync_dir(parent)
    if aside:
        shutil.rmtree(aside, ignore_errors=True)


@contextlib.contextmanager
def staged_directory(out_dir: str, force: bool, kind: str, command: str, inputs: list[str]) -> Iterator[str]:
    """Yield a fresh temporary directory beside `out_dir`; on success it becomes `out_dir`.

    An existing, non-empty `out_dir` is replaced only with `force` and only if it is a previous output of
    the same `kind` (checkpoint/outputs.py), and only after the new one is complete. The output records
    which `command` wrote it from which `inputs`. On any exception the temporary directory is removed and
    `out_dir` is untouched.

    Raises:
        CheckpointError: `out_dir` exists and may not be replaced, or its parent is not writable.
    """
    out_dir = os.path.abspath(out_dir)
    check_output(out_dir, kind, force, [("input", p) for p in inputs])
    parent = os.path.dirname(out_dir)
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"{parent}: cannot create ({e.strerror})") from None
    if not os.access(parent, os.W_OK):
        raise CheckpointError(f"{parent}: not writable")
    tmp = make_unique_dir(parent, f".{os.path.basename(out_dir)}.tmp-")
    try:
        yield tmp
        write_writer(tmp, kind, command, inputs)
        publish_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
