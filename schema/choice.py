"""`Choice`: the base of every enumerated config value."""

from __future__ import annotations

from enum import Enum


class Choice(str, Enum):
    """A config value from a fixed set: compares equal to, formats and serialises as its string."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)
