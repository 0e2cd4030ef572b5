"""Progress of a long command (convert, export, reshard, verify, the tokenized store's build).

On a terminal (stderr a TTY) a tqdm bar: units done of the total, their rate and the time left, and bytes with their
rate beside. Anywhere else (a pipe, a log file under SLURM or CI) one plain line each time another tenth of the work
is done, so a log holds at most ten progress lines per task and no carriage returns:

    converting: 50% (8/16 layers, 1.2 GB, 310 MB/s, 4 s left)
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable


def _count(amount: float, unit: str) -> str:
    """Bytes as `1.2 GB`, other amounts (`tokens`) as `1,234,567 tokens`."""
    return _size(amount) if unit == "B" else f"{amount:,.0f} {unit}"


def _size(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if nbytes < 1000 or unit == "TB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1000
    return ""


class Progress:
    """`update(n, nbytes)` as units of work finish; `close()` at the end (also as a context manager).

    Args:
        what: the task, first word of each line (`converting`).
        total: units of the whole task (0: nothing is shown).
        unit: their name (`layers`, `files`, `rows`).
        amount: what the second argument of `update` counts (`B`: bytes; or e.g. `tokens`).
        every: without a total, a line every this many seconds (0: none).
        log: where lines go when there is no terminal (default: stderr).
        bar: force the bar on or off (default: stderr is a terminal).
    """

    def __init__(
        self,
        what: str,
        total: int,
        unit: str = "layers",
        amount: str = "B",
        log: Callable[[str], None] | None = None,
        every: float = 0.0,
        bar: bool | None = None,
    ):
        self.what, self.total, self.unit, self.amount, self.every = what, total, unit, amount, every
        self.last = 0.0
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.done = self.nbytes = self.tenths = 0
        self.start = time.perf_counter()
        self.bar = None
        if total > 0 and (sys.stderr.isatty() if bar is None else bar):
            from tqdm import tqdm

            try:
                width, height = os.get_terminal_size(sys.stderr.fileno())
            except (OSError, ValueError):
                width = height = 0
            self.bar = tqdm(
                total=total,
                unit=unit.rstrip("s") or unit,
                desc=what,
                mininterval=0.5,
                file=sys.stderr,
                ncols=None if width else 100,  # a terminal that reports no size (a bare pty): tqdm would draw nothing
                nrows=None if height else 24,
            )

    def update(self, n: int = 1, nbytes: int = 0) -> None:
        self.done, self.nbytes = self.done + n, self.nbytes + nbytes
        seconds = max(time.perf_counter() - self.start, 1e-9)
        rate = f"{_count(self.nbytes, self.amount)}, {_count(self.nbytes / seconds, self.amount)}/s"
        if self.bar is not None:
            self.bar.update(n)
            if self.nbytes:
                self.bar.set_postfix_str(rate, refresh=False)
            return
        if self.total <= 0:
            if self.every and seconds - self.last >= self.every:
                self.last = seconds
                self.log(f"{self.what}: {self.done:,} {self.unit}, {rate}")
            return
        tenths = min(10, self.done * 10 // self.total)
        if tenths > self.tenths:
            self.tenths = tenths
            left = seconds * (self.total - self.done) / self.done if self.done < self.total else 0.0
            sizes = f", {rate}" if self.nbytes else ""
            self.log(
                f"{self.what}: {100 * self.done // self.total}% ({self.done}/{self.total} {self.unit}{sizes}, "
                f"{left:.0f} s left)"
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
