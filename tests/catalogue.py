"""The bad-input catalogue's harness: every case gives a one-line error naming the problem and the file or
key, exits non-zero, leaves no output that looks complete, and leaves its inputs untouched.

Each case builds its own inputs under tmp_path and returns (command, expected fragment, output
path, input paths[, ranks]). The inputs are hashed before and after the command. A multi-rank case
expects the one-line error once per rank (every rank learns of a failure on any rank) and no traceback.
The cases live in tests/test_bad_inputs.py (inputs that are wrong) and tests/test_bad_outputs.py (commands
that would destroy or mix what the user has).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from pathlib import Path

from tests.conftest import one_error_line, run_cmd, small_run


class Catalogue(dict):
    """name -> case function; `@catalogue.case` registers one."""

    def case(self, fn):
        self[fn.__name__] = fn
        return fn


def trainer_cmd(*overrides: str, script: str = "trainer.py") -> list[str]:
    return [sys.executable, script, *overrides]


def run_args(ckpt: str, out: Path, train: str, **extra) -> list[str]:
    return small_run(ckpt, out, train, **{"max_steps": 2, **extra})


def convert_cmd(src: Path | str, out: Path) -> list[str]:
    return [sys.executable, "convert2ckpt.py", "--input", str(src), "--output", str(out)]


def copy(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


def digest(paths) -> dict[str, str]:
    out = {}
    for root in paths:
        root = Path(root)
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for p in files:
            out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def looks_complete(out: Path | None, inputs) -> list[str]:
    """Output the failed command left that a user could mistake for a result."""
    if out is None or not out.exists():
        return []
    protected = {Path(p).name for p in inputs}
    names = [n for n in os.listdir(out) if n not in protected]
    return [n for n in names if n.startswith("global_step") or n in ("latest", "model.safetensors.index.json")]


class Inputs:
    def __init__(self, tmp_path, hf_models, converted, sft_data):
        self.tmp, self.hf, self.out = tmp_path, hf_models, tmp_path / "out"
        self.ckpt, self.mha_ckpt, self.train = converted["gqa"], converted["mha"], sft_data[0]
        self.env = {}


def run_case(fn, t: Inputs, monkeypatch) -> None:
    """Run one case and check every promise of the catalogue."""
    cmd, fragment, out, inputs, *rest = fn(t)
    ranks = rest[0] if rest else 1
    before = digest(inputs)
    for key, value in t.env.items():
        monkeypatch.setenv(key, value)
    proc = run_cmd(cmd, timeout=300)
    line = one_error_line(proc, fragment)  # the message is one line
    assert ranks == 1 or proc.stderr.count(line) == ranks, proc.stderr[-3000:]  # once on every rank
    assert digest(inputs) == before, "inputs changed"
    assert not looks_complete(out, inputs), os.listdir(out)
    if out is not None and out.exists():
        assert not [n for n in os.listdir(out) if n.startswith((".saving-", ".tmp"))], os.listdir(out)
    print(f"{fn.__name__}: {line}")
