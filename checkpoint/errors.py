"""The checkpoint error type, shared by every reader and writer in this package, and problems reported as data."""

from dataclasses import dataclass


class CheckpointError(Exception):
    """A checkpoint is missing, truncated, unsafe or does not match what is expected. One-line message."""


@dataclass(frozen=True)
class Problem:
    """Something wrong with one file of a checkpoint (`--verify` lists them; callers never parse the text)."""

    path: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"
