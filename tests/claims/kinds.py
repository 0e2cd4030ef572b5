"""What a sentence of the docs can be, in the claims ledger (tests/claims/): a claim a test holds, a figure a
benchmark measures, or words that look like a claim and are not one."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Claim:
    """A claim held by an assertion.

    says:   the page's own words (whitespace as on one line) that make the claim;
    test:   where the assertion is: "tests/x.py::name" (a test or the helper it calls) or a worker file;
    holds:  the assertion's own text in that source (whitespace-insensitive);
    bound:  the tolerance it asserts (0 for equality), None where it is not a number (a count, a message);
    figure: the measured figure the page quotes for it, None where the page quotes only the bound.
    """

    says: str
    test: str
    holds: str
    bound: float | None = None
    figure: float | None = None


@dataclass(frozen=True)
class Benchmark:
    """A figure measured by a command and reported, not asserted (speed, memory on a GPU, a one-off run)."""

    says: str
    by: str  # the script that measures it (a path that exists)


@dataclass(frozen=True)
class NotAClaim:
    """Words that match the claim words but state no result (advice, a definition, a goal)."""

    says: str
    why: str
