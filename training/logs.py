"""Per-rank logging: console levels and the per-rank log files in output_dir/logs/."""

from __future__ import annotations

import logging
import os

from training.topology import Coords

log = logging.getLogger("trainer")
LOG_DIR = "logs"


def rank_log_path(output_dir: str, rank: int) -> str:
    return os.path.join(output_dir, LOG_DIR, f"rank{rank}.log")


def configure_logging(coords: Coords, all_ranks: bool = False) -> None:
    """Console: INFO from rank 0 and the reporting rank (every rank with `all_ranks`), warnings from the others."""
    level = logging.INFO if all_ranks or coords.rank == 0 or coords.reporting else logging.WARNING
    logging.basicConfig(level=level, format=f"[rank{coords.rank}] %(asctime)s %(message)s", datefmt="%H:%M:%S")
    log.setLevel(level)
    # bitsandbytes' CPU backend (imported by peft where installed) warns that an optional inference kernel is absent
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


def log_to_file(output_dir: str, rank: int) -> str:
    """Also append this rank's trainer log to output_dir/logs/rank{R}.log (kept across resumes)."""
    path = rank_log_path(output_dir, rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    log.addHandler(handler)
    return path
