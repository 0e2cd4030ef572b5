"""python -m tests.claims [--check]: check the ledger, then write (or with --check compare) docs/claims.md."""

from __future__ import annotations

import sys

from tests.claims.ledger import PAGE, problems, render

if __name__ == "__main__":
    for problem in (found := problems()):
        print(problem)
    if "--check" in sys.argv:
        sys.exit(1 if found or PAGE.read_text() != render() else 0)
    PAGE.write_text(render())
    print(f"{PAGE}: {len(found)} problems")
