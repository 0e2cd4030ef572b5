"""The bytes a command is about to read, read into the page cache by a thread of its own, a bounded distance ahead.

Conversion and export read, transform and write on one thread. Reading from disk costs that thread CPU as well
as waiting: the kernel fills the page cache in the reader's time (on the 2-core machine we measure on, `cat` of a
6.8 GB model spends 7 s in the kernel), and asking it to read ahead (`posix_fadvise(WILLNEED)`) costs the asking
thread the same. A `ReadAhead` thread reads the ranges the caller will read next, on another core, while the caller
writes; the caller's own reads are then copies from memory. Measured in docs/measured.md (the conversion rows).

Memory: the page cache only (the kernel's, reclaimable, not the process's resident set), at most `ahead` bytes past
the range the caller has reached. The reads are advice: an error stops the thread quietly and the caller's own read
reports it, naming the file.
"""

from __future__ import annotations

import contextlib
import os
import threading

AHEAD = 512 * 2**20  # bytes read ahead of the caller's position
CHUNK = 8 * 2**20  # one read of the thread (a reused buffer: the data itself is dropped)


class ReadAhead:
    """`with ReadAhead([(path, begin, end), ...]) as ahead:` reads the ranges in order, in the background; the caller
    says `ahead.reached(i)` as it starts range i (ranges are consumed in the order given), which lets the thread on
    to `ahead` bytes past range i's start."""

    def __init__(self, ranges: list[tuple[str, int, int]], ahead: int = AHEAD):
        self.ranges, self.ahead = ranges, ahead
        self._starts, total = [], 0
        for _, begin, end in ranges:
            self._starts.append(total)
            total += max(0, end - begin)
        self._allowed, self._position, self._stop = ahead, 0, False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="read-ahead", daemon=True)

    @property
    def position(self) -> int:
        """Bytes the thread has read so far."""
        return self._position

    def reached(self, index: int) -> None:
        if index < len(self._starts):
            with self._cond:
                self._allowed = max(self._allowed, self._starts[index] + self.ahead)
                self._cond.notify()

    def _may_read(self) -> bool:
        with self._cond:
            self._cond.wait_for(lambda: self._stop or self._position < self._allowed)
            return not self._stop

    def _run(self) -> None:
        view = memoryview(bytearray(CHUNK))
        fd, opened = -1, None
        try:
            for path, begin, end in self.ranges:
                if path != opened:
                    if fd >= 0:
                        os.close(fd)
                        fd = -1
                    fd, opened = os.open(path, os.O_RDONLY), path
                offset = begin
                while offset < end and self._may_read():
                    n = os.preadv(fd, [view[: min(CHUNK, end - offset)]], offset)
                    if n <= 0:
                        return
                    offset += n
                    self._position += n
                if self._stop:
                    return
        except OSError:
            return  # the caller's own read meets the same error and names the file
        finally:
            if fd >= 0:
                os.close(fd)

    def __enter__(self) -> ReadAhead:
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join()


def whole_files(paths: list[str]) -> list[tuple[str, int, int]]:
    """Each file in full, as `ReadAhead` ranges (a missing file: an empty range, the caller names it)."""
    ranges = []
    for path in paths:
        size = 0
        with contextlib.suppress(OSError):
            size = os.path.getsize(path)
        ranges.append((path, 0, size))
    return ranges
