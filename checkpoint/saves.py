"""Crash-safe training checkpoints: stage, publish by rename, then point `latest` at them; retention.

A save is written into `output_dir/.saving-global_stepN/` by every rank. Only when every rank has
finished and the manifest is written does rank 0 rename it to `global_stepN/` and then replace
`latest` (write to a temporary file, fsync, rename). So at any moment:

- a directory named `global_stepN` is complete (it only ever appears by rename);
- `latest` names a complete checkpoint (it is replaced only after the rename);
- a crash leaves at most a `.saving-*` directory. The next start publishes it when every rank had finished
  writing it (each rank's marker, written after its files were fsynced: only the commit was missing) and it is
  newer than every published checkpoint (`written_saves`); else the next save or start removes it.

Between the rename and the `latest` update a crash leaves `latest` one checkpoint behind;
`newest_checkpoint` takes the newest complete directory, so nothing saved is lost.
"""

from __future__ import annotations

import os
import shutil

from checkpoint.errors import CheckpointError
from checkpoint.names import (
    CONVERTED_TAG,
    DELETING_PREFIX,
    LATEST,
    LAYOUT_FILE,
    PIECE_FILE,
    STAGING_PREFIX,
    TAG_PATTERN,
    staging_tag,
    written_marker,
)
from checkpoint.staging import publish_dir, remove_tree, write_text_atomic


def clean_stale(output_dir: str) -> list[str]:
    """Remove what interrupted saves and deletions left behind. Returns the names removed."""
    if not os.path.isdir(output_dir):
        return []
    removed = []
    for name in sorted(os.listdir(output_dir)):
        if name.startswith((STAGING_PREFIX, DELETING_PREFIX)):
            shutil.rmtree(os.path.join(output_dir, name), ignore_errors=True)
            removed.append(name)
    return removed


def every_rank_wrote(staging: str, ranks: int) -> bool:
    """Whether each of `ranks` ranks left its marker in `staging`: its files are durable (training/saving.py)."""
    return all(os.path.exists(os.path.join(staging, written_marker(r))) for r in range(ranks))


def written_saves(output_dir: str) -> list[tuple[str, str, int]]:
    """(staging directory, tag, ranks) of each interrupted save that every rank finished writing, newer than every
    published checkpoint, oldest first: its layout file names the ranks (PP x TP x CP x DP) and each rank's marker
    is there. What training/saving.py `publish` needs to commit it as the run would have."""
    import json

    if not os.path.isdir(output_dir):
        return []
    newest = max((step for step, _ in complete_checkpoints(output_dir)), default=-1)
    found = []
    for name in sorted(os.listdir(output_dir)):
        m = TAG_PATTERN.fullmatch(name.removeprefix(STAGING_PREFIX))
        staging = os.path.join(output_dir, name)
        if not name.startswith(STAGING_PREFIX) or not m or int(m.group(1)) <= newest:
            continue
        try:
            with open(os.path.join(staging, LAYOUT_FILE)) as f:
                layout = json.load(f)
            ranks = int(layout["num_stages"]) * int(layout["dp_size"])
            ranks *= int(layout.get("tp_size", 1)) * int(layout.get("context_parallel_size", 1))
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if every_rank_wrote(staging, ranks):
            found.append((int(m.group(1)), staging, m.group(0), ranks))
    return [(staging, tag, ranks) for _, staging, tag, ranks in sorted(found)]


def complete_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """(step, tag) of every published checkpoint in `output_dir`, oldest first."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        m = TAG_PATTERN.fullmatch(name)
        if m and os.path.isdir(os.path.join(output_dir, name)):
            found.append((int(m.group(1)), name))
    return sorted(found)


def read_latest(output_dir: str) -> str | None:
    path = os.path.join(output_dir, LATEST)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read().strip() or None


def newest_checkpoint(output_dir: str) -> str | None:
    """The tag to resume: `latest`, or a newer published checkpoint if a crash came before `latest` moved."""
    return choose_checkpoint(output_dir)[0]


def choose_checkpoint(output_dir: str) -> tuple[str | None, str | None]:
    """(the tag to resume, or None; why, when it is not the one `latest` names, else None).

    `latest` wins when it names a published checkpoint at least as new as every other; a newer published one
    (a crash between its rename and the `latest` update) or, when `latest` names a missing directory, the
    newest published one is taken instead, and the reason says so.
    """
    latest = read_latest(output_dir)
    complete = complete_checkpoints(output_dir)
    exists = bool(latest) and os.path.isdir(os.path.join(output_dir, latest))
    if not complete:
        if latest and not exists:
            return None, f"'latest' names {latest}, which is missing, and no complete checkpoint is left"
        return latest, None  # None, or a checkpoint written by other tools (a tag that is not global_stepN)
    step, tag = complete[-1]
    m = TAG_PATTERN.fullmatch(latest or "")
    if exists and (not m or int(m.group(1)) >= step):
        return latest, None
    if latest is None:
        return tag, f"no 'latest' file; {tag} is the newest complete checkpoint"
    if not exists:
        return tag, f"'latest' names {latest}, which is missing; {tag} is the newest complete checkpoint"
    return tag, f"'latest' names {latest} but {tag} is complete and newer (a save interrupted before 'latest' moved)"


def read_tag(ckpt_dir: str, tag: str | None = None) -> str:
    """`tag`, or the checkpoint to use in `ckpt_dir`: `latest`, or a newer complete one. The one tag rule of
    the trainer, export, inspect, verify and generate."""
    if tag:
        return tag
    found = newest_checkpoint(ckpt_dir)
    if found is None and os.path.exists(os.path.join(ckpt_dir, PIECE_FILE)):
        return CONVERTED_TAG  # a piece (some layers or TP ranks): each rank loads the files it needs from it
    if found is None:
        raise CheckpointError(f"{ckpt_dir}: no 'latest' file, so no checkpoint to load; pass a tag")
    return found


def publish_checkpoint(output_dir: str, tag: str) -> None:
    """Rank 0, after every rank finished writing `.saving-<tag>`: make it `tag`, then point `latest` at it.
    Retention (`prune`) comes after, by the caller: a failing deletion must not read as a failed save."""
    # A checkpoint of the same step (saved again by a resumed run) is replaced as every output is (`publish_dir`).
    publish_dir(os.path.join(output_dir, staging_tag(tag)), os.path.join(output_dir, tag))
    write_text_atomic(os.path.join(output_dir, LATEST), tag)


def prune(output_dir: str, keep_last_n: int, keep: str) -> list[str]:
    """Delete all but the newest `keep_last_n` checkpoints; never `keep` (what `latest` names)."""
    if keep_last_n <= 0:
        return []
    complete = [tag for _, tag in complete_checkpoints(output_dir)]
    doomed = [tag for tag in complete[:-keep_last_n] if tag != keep]
    for tag in doomed:
        remove_tree(os.path.join(output_dir, f"{tag}_universal"))
        remove_tree(os.path.join(output_dir, tag))
    return doomed
