"""What a launch may do with `output_dir` before it writes there: never mix two runs, never destroy one.

Rank 0 decides, before any other rank writes (the others wait in `agreed()`):

- A fresh run (`resume=false`) into an `output_dir` that holds checkpoints is refused, naming them and the
  three ways on: `resume=auto`, another `output_dir`, or `overwrite_output_dir=true`.
- `overwrite_output_dir=true` renames the earlier run aside as a whole (`<output_dir>.earlier-<UTC time>`,
  one atomic rename) and starts an empty `output_dir`; the keyed caches (`data_cache`, `hf_converted`) are
  moved back, since they are checked against their sources before any reuse. Nothing is deleted.
- A fresh run into an `output_dir` that holds only an earlier run's records (`metrics.jsonl`,
  `eval_results.json`: a run stopped before its first save) moves that run aside the same way, with a log
  line: metrics are never appended across runs.
- `resume_from=global_stepN` (a rollback) resumes that complete checkpoint; checkpoints newer than it are
  moved into `output_dir/rolled_back-<UTC time>/` and `latest` names N, so neither a later save nor a
  later `resume=auto` mixes the abandoned steps with the new ones.
"""

from __future__ import annotations

import logging
import os
import time

from checkpoint.errors import CheckpointError
from checkpoint.manifest import check_own_files, read_manifest
from checkpoint.names import CONVERTED_DIR, LATEST, MANIFEST, REFERENCE_CONVERTED_DIR, TAG_PATTERN
from checkpoint.outputs import is_within, real_path
from checkpoint.saves import complete_checkpoints, read_latest
from checkpoint.staging import fsync_dir, write_text_atomic
from schema.train import TrainConfig, resume_mode
from training.errors import RunError

log = logging.getLogger("trainer")

RECORDS = ("metrics.jsonl", "eval_results.json")  # what a run that trained at all leaves behind
CACHES = ("data_cache", CONVERTED_DIR, REFERENCE_CONVERTED_DIR)  # keyed by their sources: safe to carry over


def _stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime())


def _free(path: str) -> str:
    candidate, n = path, 1
    while os.path.exists(candidate):
        n += 1
        candidate = f"{path}-{n}"
    return candidate


def check_paths(cfg: TrainConfig) -> None:
    """`output_dir` must not be the model or tokenizer directory, nor a directory of data shards: a run writes
    config.json, tokenizer and report files there."""
    out = real_path(cfg.output_dir)
    for key, path in _inputs(cfg):
        if real_path(path) == out:
            raise RunError(
                f"output_dir {cfg.output_dir} is {key}: a run writes config.json, tokenizer and report "
                "files there; choose another output_dir"
            )


def _inputs(cfg: TrainConfig) -> list[tuple[str, str]]:
    files = []
    for key in ("train_file", "eval_file"):
        value = getattr(cfg, key)
        for path in [value] if isinstance(value, str) else list(value or []):
            files.append((key, path))
    return [
        (k, p)
        for k, p in [
            ("model_name_or_path", cfg.model_name_or_path),
            ("tokenizer_name_or_path", cfg.tokenizer_name_or_path),
            ("dpo.reference_model", cfg.dpo.reference_model),
            *files,
        ]
        if p
    ]


def move_earlier_run(cfg: TrainConfig) -> str:
    """Rename `output_dir` aside and start it empty, keeping the keyed caches. Returns where the run went."""
    out = real_path(cfg.output_dir)  # a symlinked output_dir: the directory it points at moves, the link stays

    def under(path: str, parent: str) -> bool:
        return path == parent or is_within(path, parent)

    for key, path in _inputs(cfg):
        real = real_path(path)
        if under(real, out) and not any(under(real, os.path.join(out, c)) for c in CACHES):
            raise RunError(
                f"output_dir {cfg.output_dir} holds {key} {path}; moving the earlier run aside would "
                "move it too: choose another output_dir"
            )
    aside = _free(f"{out}.earlier-{_stamp()}")
    os.rename(out, aside)
    os.makedirs(out)
    for name in CACHES:
        if os.path.exists(os.path.join(aside, name)):
            os.rename(os.path.join(aside, name), os.path.join(out, name))
    fsync_dir(os.path.dirname(out))
    return aside


def prepare_output_dir(cfg: TrainConfig) -> None:
    """Rank 0, before anything is written to `output_dir`: refuse or move aside an earlier run (module docstring)."""
    check_paths(cfg)
    out = cfg.output_dir
    if resume_mode(cfg) != "false" or not os.path.isdir(out):
        return
    tags = [tag for _, tag in complete_checkpoints(out)]
    latest = read_latest(out)
    records = [name for name in RECORDS if os.path.exists(os.path.join(out, name))]
    if (tags or latest) and not cfg.overwrite_output_dir:
        found = ", ".join(tags[-3:]) if tags else f"'latest' -> {latest}"
        raise RunError(
            f"output_dir {out} holds checkpoints of an earlier run ({found}) and resume=false; "
            "continue it with resume=auto, start elsewhere with a new output_dir, or pass "
            "overwrite_output_dir=true to move the earlier run aside"
        )
    if tags or latest or records:
        aside = move_earlier_run(cfg)
        why = "overwrite_output_dir=true" if tags or latest else f"a fresh run found {', '.join(records)}"
        log.warning("%s: moved the earlier run in %s to %s (nothing deleted)", why, out, aside)


def check_own_checkpoint(step_dir: str, what: str) -> None:
    """Refuse (RunError, one line naming the entry) a checkpoint whose manifest names a file outside it, or that
    holds a symlink, device or FIFO (checkpoint/manifest.py `check_own_files`), before DeepSpeed opens any file."""
    try:
        check_own_files(step_dir)
    except CheckpointError as e:
        raise RunError(f"{what}: {e}") from None


def check_resume_from(output_dir: str, tag: str) -> None:
    """`resume_from` must name a complete checkpoint of `output_dir`. Raises RunError."""
    step_dir = os.path.join(output_dir, tag)
    complete = ", ".join(t for _, t in complete_checkpoints(output_dir)) or "none"
    if not TAG_PATTERN.fullmatch(tag) or not os.path.isdir(step_dir):
        raise RunError(f"resume_from={tag}: {step_dir} is not a complete checkpoint (complete ones: {complete})")
    check_own_checkpoint(step_dir, f"resume_from={tag}")
    if os.path.exists(os.path.join(step_dir, MANIFEST)):
        for name, entry in read_manifest(step_dir).items():
            path = os.path.join(step_dir, name)
            if not os.path.exists(path) or os.path.getsize(path) != entry.get("size"):
                raise RunError(
                    f"resume_from={tag}: {path} is missing or resized (incomplete checkpoint; "
                    f"complete ones: {complete})"
                )


def roll_back(output_dir: str, tag: str) -> list[str]:
    """Rank 0, once the resume from `tag` worked: move checkpoints newer than it aside and point `latest` at it.
    Returns the tags moved. RunError (one line) when the filesystem refuses."""
    try:
        return _roll_back(output_dir, tag)
    except OSError as e:
        raise RunError(
            f"resume_from={tag}: cannot move the newer checkpoints of {output_dir} aside ({e.strerror or e})"
        ) from None


def _roll_back(output_dir: str, tag: str) -> list[str]:
    step = int(TAG_PATTERN.fullmatch(tag).group(1))
    newer = [t for s, t in complete_checkpoints(output_dir) if s > step]
    if newer:
        aside = _free(os.path.join(output_dir, f"rolled_back-{_stamp()}"))
        os.makedirs(aside)
        for t in newer:
            os.rename(os.path.join(output_dir, t), os.path.join(aside, t))
            universal = os.path.join(output_dir, f"{t}_universal")
            if os.path.isdir(universal):
                os.rename(universal, os.path.join(aside, f"{t}_universal"))
        log.warning("resume_from=%s: moved the newer checkpoints %s to %s", tag, ", ".join(newer), aside)
    if read_latest(output_dir) != tag:
        write_text_atomic(os.path.join(output_dir, LATEST), tag)
    return newer
