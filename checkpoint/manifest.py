"""Checkpoint manifests and `convert2ckpt.py --verify`.

Every conversion and every trainer save writes `manifest.json` into the tag directory:

    {"files": {"layer_03-model_00-model_states.pt": {"size": ..., "xxh3_128": ...,
               "tensors": {"self_attn.q_proj.weight": {"shape": [...], "dtype": "bfloat16"}, ...}}, ...}}

`--verify` recomputes sizes and hashes and reports, naming the file, anything missing, resized,
altered or unlisted, and refuses any `.pt` file that holds more than plain data (checkpoint/safe_load.py);
`--against HF_DIR` is checkpoint/compare.py.

A checkpoint names only its own files: a manifest entry is a file name in the step directory (never a path that
climbs out of it or an absolute one), and every file there is a regular file (no symlink, device, FIFO or socket).
`check_own_files` refuses anything else in one line naming the entry, before any file is opened: `--verify`,
`--inspect`, exports and resharding (checkpoint/pipeline_reader.py) and resumes (training/run_dir.py) call it.

The hash is xxh3-128 (timed by hand: 10 GB/s here, against sha256's 1.4 GB/s with SHA instructions; on 2 cores the
hash of a 6.8 GB conversion cost 5 s of CPU that the reads and writes needed). It detects damage: bit rot, a
truncated or partial copy, a file of another checkpoint. It is not a signature, and sha256 was not one either:
whoever can change a file can rewrite the manifest beside it; what makes a checkpoint from someone else safe to
load is that its files are read as plain data only (checkpoint/safe_load.py). Manifests written with sha256
(before 2026-11-26) verify as they are.
"""

from __future__ import annotations

import json
import os
import stat

from checkpoint.dtypes import dtype_name
from checkpoint.errors import CheckpointError, Problem
from checkpoint.hashing import HASH, HASHES
from checkpoint.layer_files import is_layer_file, layer_tensor_specs
from checkpoint.names import MANIFEST
from checkpoint.staging import write_text_atomic
from common.progress import Progress

CHUNK = 16 * 2**20


def entry_hash(entry: dict) -> str | None:
    """The hash an entry was written with (the newest of `HASHES` it has), or None."""
    return next((name for name in HASHES if name in entry), None)


def file_hash(path: str, sync: bool = False, algorithm: str = HASH) -> str:
    """A file's hash (`HASH` unless told); with `sync`, also flush it to disk (a save's files are hashed right after
    writing)."""
    digest = HASHES[algorithm]()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
        if sync:
            os.fsync(f.fileno())
    return digest.hexdigest()


def describe_file(path: str, sync: bool = False, hashed: str | None = None) -> dict:
    """size, hash and, for layer files, tensor names/shapes/dtypes (read memory-mapped). `hashed`: the file's hash,
    computed as it was written (checkpoint/direct_io.py), so it is not read back; `sync` then does nothing (whoever
    wrote it flushes it: `DirectFile(fsync=True)`)."""
    entry = {"size": os.path.getsize(path), HASH: hashed or file_hash(path, sync)}
    if is_layer_file(os.path.basename(path)):
        entry["tensors"] = {
            k: {"shape": list(shape), "dtype": dtype_name(dtype)}
            for k, (shape, dtype) in layer_tensor_specs(path).items()
        }
    return entry


def checkpoint_files(step_dir: str) -> list[str]:
    """The regular files of step_dir but its manifest (symlinks not followed)."""
    return sorted(n for n in os.listdir(step_dir) if n != MANIFEST and _mode(os.path.join(step_dir, n)) == "file")


OWN = ("file", "a directory", None)  # what a step directory may hold (None: gone since it was listed)


def _mode(path: str) -> str | None:
    """What `path` is, its symlinks not followed: "file", "a symlink", "a directory", ...; None when absent."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    kinds = [(stat.S_ISREG, "file"), (stat.S_ISLNK, "a symlink"), (stat.S_ISDIR, "a directory")]
    kinds += [(stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")]
    return next((kind for test, kind in kinds if test(mode)), "a socket")


def entry_problem(step_dir: str, name) -> str | None:
    """Why manifest entry `name` is not a regular file of step_dir's own (or None; absent is no problem here:
    `verify_manifest` reports it missing). Only the entry's name is looked at, and the file's kind (lstat)."""
    if not isinstance(name, str) or name in ("", ".", "..") or os.path.basename(name) != name or "\0" in name:
        return "names a path outside the checkpoint (an entry is a file name in its directory)"
    kind = _mode(os.path.join(step_dir, name))
    return None if kind in (None, "file") else f"is {kind}, not a regular file of the checkpoint"


def foreign_files(step_dir: str) -> list[Problem]:
    """Files of step_dir that are symlinks, devices, FIFOs or sockets (none is opened)."""
    kinds = [
        (os.path.join(step_dir, name), _mode(os.path.join(step_dir, name))) for name in sorted(os.listdir(step_dir))
    ]
    return [Problem(p, f"{kind}, not a regular file of the checkpoint") for p, kind in kinds if kind not in OWN]


def check_own_files(step_dir: str) -> None:
    """Refuse (CheckpointError, one line naming the file or the entry) a step directory holding a symlink, device,
    FIFO or socket, or whose manifest names anything but a regular file inside it (`read_manifest`). Opens nothing
    but the manifest."""
    problems = foreign_files(step_dir)
    if problems:
        raise CheckpointError(str(problems[0]))
    if _mode(os.path.join(step_dir, MANIFEST)) is not None:
        read_manifest(step_dir)


def write_manifest(step_dir: str, entries: dict[str, dict]) -> str:
    """Write `manifest.json` atomically (temp file + rename)."""
    path = os.path.join(step_dir, MANIFEST)
    write_text_atomic(path, json.dumps({"files": dict(sorted(entries.items()))}, indent=1))
    return path


def build_manifest(
    step_dir: str, names: list[str] | None = None, sync: bool = False, known: dict[str, dict] | None = None
) -> dict[str, dict]:
    """Entries of `names` (default: every file of step_dir); those in `known` (described as they were
    written, see `BackgroundDescriber`) are taken as they are."""
    known = known or {}
    return {
        n: known[n] if n in known else describe_file(os.path.join(step_dir, n), sync)
        for n in (names or checkpoint_files(step_dir))
    }


class BackgroundDescriber:
    """Manifest entries of files just written, computed in a thread while the caller writes the next one.

    Hashing overlaps the writing (the hash and file reads release the GIL) instead of every file being hashed
    again at the end; a file hashed as it was written (`hashed`) is not read back.
    """

    def __init__(self):
        from concurrent.futures import ThreadPoolExecutor

        self.pool, self.pending = ThreadPoolExecutor(max_workers=1), {}

    def add(self, path: str, hashed: str | None = None) -> None:
        self.pending[os.path.basename(path)] = self.pool.submit(describe_file, path, hashed=hashed)

    def entries(self) -> dict[str, dict]:
        """Wait for every file; {name: entry}. Raises what describing a file raised."""
        out = {name: future.result() for name, future in self.pending.items()}
        self.pool.shutdown()
        return out


def read_manifest(step_dir: str) -> dict[str, dict]:
    """{file name: entry} of step_dir's manifest. Raises CheckpointError naming it when missing or unreadable."""
    path = os.path.join(step_dir, MANIFEST)
    if _mode(path) not in ("file", None):
        raise CheckpointError(f"{path}: {_mode(path)}, not a regular file of the checkpoint")
    try:
        with open(path) as f:
            listed = json.load(f)["files"]
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (checkpoint has no manifest)") from None
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not a manifest ({type(e).__name__})") from None
    if not isinstance(listed, dict):
        raise CheckpointError(f"{path}: not a manifest (its files are not a mapping)")
    for name in listed:
        if why := entry_problem(step_dir, name):
            raise CheckpointError(f"{path}: entry {name!r} {why}")
    return listed


def copy_verified(src: str, dst_dir: str, entry: dict) -> None:
    """Copy `src` into dst_dir, hashing it on the way; refuse (CheckpointError naming it) a file whose size or
    hash differs from its manifest `entry` (damaged in transit). One read of the file."""
    if _mode(src) != "file":
        raise CheckpointError(f"{src}: {_mode(src) or 'missing'}, not a regular file of the checkpoint")
    algorithm = entry_hash(entry) or HASH
    digest, size = HASHES[algorithm](), 0
    with open(src, "rb", buffering=0) as f, open(os.path.join(dst_dir, os.path.basename(src)), "wb") as out:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
            size += len(chunk)
            out.write(chunk)
    if size != entry["size"] or digest.hexdigest() != entry.get(algorithm):
        raise CheckpointError(f"{src}: contents changed (size or {algorithm} differs from its manifest)")


def verify_manifest(step_dir: str, progress: bool = False) -> list[Problem]:
    """Problems found (`Problem`: the file and the reason); empty when the checkpoint matches its manifest.
    `progress`: show the hashing's progress (common/progress.py)."""
    path = os.path.join(step_dir, MANIFEST)
    problems = foreign_files(step_dir)  # before any file is opened: a checkpoint holds and names only its own
    if problems:
        return problems
    try:
        listed = read_manifest(step_dir)  # (refuses an entry outside the step directory)
    except CheckpointError as e:
        return [Problem(path, str(e).removeprefix(f"{path}: "))]
    if not all(isinstance(v, dict) and "size" in v and entry_hash(v) for v in listed.values()):
        return [Problem(path, f"not a manifest (entries without size and a hash: {', '.join(HASHES)})")]
    problems = []
    shown = Progress("verifying", len(listed) if progress else 0, unit="files")
    for name, want in listed.items():
        file = os.path.join(step_dir, name)
        if not os.path.exists(file):
            problems.append(Problem(file, "missing"))
            continue
        size = os.path.getsize(file)
        if size != want["size"]:
            problems.append(Problem(file, f"size {size} but the manifest says {want['size']}"))
        elif file_hash(file, algorithm=(algorithm := entry_hash(want))) != want[algorithm]:
            problems.append(Problem(file, f"contents changed ({algorithm} differs from the manifest)"))
        shown.update(1, size)
    shown.close()
    for name in checkpoint_files(step_dir):
        if name not in listed and not name.startswith("."):
            problems.append(Problem(os.path.join(step_dir, name), "not listed in the manifest"))
    return problems
