"""What a writing command may do to the paths it is given: never touch an input, replace only its own output.

Every command of `convert2ckpt.py` that writes (conversion, `--combine`, `--tp` resharding, `--to-hf` with
or without `--merge-lora`, `--to-peft`) checks, before anything is read or written:

- the output is not an input, does not contain one and is not inside one (paths resolved, symlinks
  followed): `--output` equal to `--input`, or its parent, would be replaced wholesale by `--force`;
- an existing, non-empty output is replaced (with `--force`) only when it is a previous output of the
  same kind of command, recognised by the record `.convert2ckpt.json` that every output gets. A Hugging
  Face model directory, a training run or anything else this tool did not write is refused, naming what
  was found, with or without `--force`.
"""

from __future__ import annotations

import json
import os
import shutil

from checkpoint.errors import CheckpointError
from checkpoint.names import LATEST, TAG_PATTERN, WRITER_FILE

# What each command writes; `--force` replaces an output only of the same kind.
PIPELINE = "pipeline checkpoint"  # conversion, --combine, --tp resharding (whole or a piece)
HF_EXPORT = "Hugging Face export"  # --to-hf, with or without --merge-lora
PEFT_EXPORT = "PEFT adapter"  # --to-peft
KINDS = (PIPELINE, HF_EXPORT, PEFT_EXPORT)


def real_path(path: str) -> str:
    """`path` absolute with every symlink resolved."""
    return os.path.realpath(os.path.abspath(path))


def copy_from_input(src: str, dst: str, input_dir: str) -> None:
    """Copy file `src` of `input_dir` to `dst`, refusing (CheckpointError, one line) a symlink that points outside
    the input: a hub snapshot's links into its repository's blobs are inside it, `/etc/passwd` is not."""
    from common.hub import snapshot_repository

    real, root = real_path(src), real_path(input_dir)
    root = snapshot_repository(root) or root  # a hub cache snapshot: its files link into ../../blobs
    if not is_within(real, root):
        raise CheckpointError(f"{src}: a symlink to {real}, outside the input {input_dir}: not copied")
    shutil.copy2(src, dst)


def is_within(path: str, parent: str) -> bool:
    """Whether resolved `path` lies strictly inside resolved `parent`."""
    return os.path.commonpath([path, parent]) == parent and path != parent


def check_not_overlapping(output: str, inputs: list[tuple[str, str]]) -> None:
    """Refuse an `output` that is, contains or lies inside one of `inputs` ([(what, path)]).

    Raises:
        CheckpointError: one line naming both paths.
    """
    out = real_path(output)
    for what, path in inputs:
        if not path:
            continue
        src = real_path(path)
        if out == src:
            raise CheckpointError(f"--output {output} is the {what} {path}; write to a new directory")
        if is_within(src, out):
            raise CheckpointError(f"--output {output} contains the {what} {path}; write to a new directory")
        if is_within(out, src):
            raise CheckpointError(f"--output {output} is inside the {what} {path}; write to a new directory")


def read_writer(path: str) -> dict | None:
    """The record of the convert2ckpt command that wrote directory `path`, or None."""
    try:
        with open(os.path.join(path, WRITER_FILE)) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def write_writer(path: str, kind: str, command: str, inputs: list[str]) -> None:
    """Record in directory `path` that convert2ckpt wrote it, and from what."""
    record = {"kind": kind, "command": command, "inputs": [os.path.abspath(p) for p in inputs]}
    with open(os.path.join(path, WRITER_FILE), "w") as f:
        json.dump(record, f, indent=2)


def describe(path: str) -> str:
    """What an existing directory not written by this tool looks like, for the refusal."""
    names = set(os.listdir(path))
    steps = sorted((n for n in names if TAG_PATTERN.fullmatch(n)), key=lambda n: int(n[len("global_step") :]))
    if "metrics.jsonl" in names or "train_config.yaml" in names:
        found = ", ".join(steps[-3:] + sorted(names & {"metrics.jsonl", "train_config.yaml"}))
        return f"a training run ({found})"
    if steps or LATEST in names:
        return f"a pipeline checkpoint ({', '.join(steps[-3:]) or LATEST})"
    weights = sorted(n for n in names if n.endswith((".safetensors", ".bin", ".index.json")))
    if "config.json" in names and weights:
        return f"a Hugging Face model directory (config.json, {weights[0]})"
    return f"a directory of {len(names)} entries ({', '.join(sorted(names)[:3])})"


def check_replaceable(output: str, kind: str, force: bool) -> None:
    """An existing, non-empty `output` may be replaced only with `force` and only if this tool wrote it as `kind`.

    Raises:
        CheckpointError: one line saying what was found there.
    """
    out = os.path.abspath(output)
    if not os.path.exists(out):
        return
    if not os.path.isdir(out):
        raise CheckpointError(f"{out}: output exists and is a file, not a directory")
    if not os.listdir(out):
        return
    record = read_writer(out)
    if record is not None and ({"metrics.jsonl", "train_config.yaml"} & set(os.listdir(out))):
        record = None  # a training run used it as its output_dir since: it is the run now
    if record is not None and record.get("kind") == kind:
        if not force:
            raise CheckpointError(
                f"{out}: output already holds a {kind} written by convert2ckpt; pass --force to replace it"
            )
        return
    if record is not None:
        found = f"a {record.get('kind')} written by convert2ckpt {record.get('command', '')}".rstrip()
    else:
        found = f"{describe(out)} that convert2ckpt did not write"
    hint = f"--force replaces only a previous {kind} of convert2ckpt" if force else f"not a {kind}"
    raise CheckpointError(f"{out}: output exists and holds {found} ({hint}); choose another --output")


def check_output(output: str, kind: str, force: bool, inputs: list[tuple[str, str]]) -> None:
    """Both rules above, before a command reads or writes anything. Raises CheckpointError."""
    check_not_overlapping(output, inputs)
    check_replaceable(output, kind, force)
