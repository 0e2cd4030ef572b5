"""`call.py MODULE:FUNCTION STORE ARGS... OUT`: run `FUNCTION(rank, STORE, *ARGS, OUT)` as this rank (RANK from the
launcher; `{rank}` in OUT replaced by it). How `spawn_ranks` (tests/conftest.py) runs a test's worker function in
ranks forked from the fork server, which has imported torch and transformers, instead of spawning fresh
interpreters that import them again (each ~3 CPU seconds)."""

import importlib
import os
import sys

if __name__ == "__main__":
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
    module, function = sys.argv[1].split(":")
    rank = int(os.environ["RANK"])
    store, *args, out = sys.argv[2:]
    getattr(importlib.import_module(module), function)(rank, store, *args, out.format(rank=rank))
