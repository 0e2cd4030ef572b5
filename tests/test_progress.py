"""Progress of long commands (common/progress.py): a tqdm bar on a terminal, a line per tenth of the work in logs."""

from __future__ import annotations

import os
import pty
import re
import subprocess
import sys

import pytest

from common.progress import Progress
from tests.conftest import REPO, run_cmd, subprocess_env
from tools.tiny_models import make_hf_model, tiny_config

LINE = re.compile(r"^converting: (\d+)% \((\d+)/19 layers, [\d.]+ [KMG]?B, [\d.]+ [KMG]?B/s, \d+ s left\)$")


def test_a_line_per_tenth_without_a_terminal():
    lines = []
    with Progress("exporting", 37, unit="tensors", log=lines.append, bar=False) as p:
        for _ in range(37):
            p.update(1, 1_500_000)
    assert len(lines) == 10 and lines[-1].startswith("exporting: 100% (37/37 tensors, 55.5 MB, ")
    assert [int(re.match(r"exporting: (\d+)%", line)[1]) // 10 for line in lines] == list(range(1, 11))
    tokens = []
    with Progress("tokenizing a.jsonl", 0, unit="rows", amount="tokens", log=tokens.append, bar=False) as p:
        p.update(5, 100)  # no total: nothing to say
    assert tokens == []


@pytest.fixture(scope="module")
def deep_model(tmp_path_factory, tokenizer_dir) -> str:
    out = str(tmp_path_factory.mktemp("deep") / "hf16")
    make_hf_model(out, tiny_config(num_hidden_layers=16), seed=3, tokenizer_dir=tokenizer_dir)
    return out


@pytest.mark.slow
def test_converter_progress_on_a_pipe_and_on_a_terminal(deep_model, tmp_path):
    """A 16-layer model: on a pipe at most a dozen progress lines, no carriage return; on a pseudo-terminal the
    bar (tqdm's carriage-return redraws, 19/19 pipeline layers)."""
    cmd = [sys.executable, "convert2ckpt.py", "--input", deep_model]
    piped = run_cmd([*cmd, "--output", str(tmp_path / "a")])  # in this process, its stderr captured (not a terminal)
    assert piped.returncode == 0, piped.stderr[-2000:]
    lines = [line for line in piped.stderr.splitlines() if line.startswith("converting:")]
    assert 1 <= len(lines) <= 12 and all(LINE.match(line) for line in lines), lines
    assert LINE.match(lines[-1])[1] == "100" and "\r" not in piped.stderr + piped.stdout
    controller, terminal = pty.openpty()
    proc = subprocess.Popen(
        [*cmd, "--output", str(tmp_path / "b")], cwd=REPO, env=subprocess_env(), stdout=terminal, stderr=terminal
    )
    os.close(terminal)
    seen = b""
    while True:
        try:
            chunk = os.read(controller, 65536)
        except OSError:  # the terminal closed: the command exited
            break
        if not chunk:
            break
        seen += chunk
    os.close(controller)
    assert proc.wait(60) == 0, seen[-2000:]
    text = seen.decode(errors="replace")
    assert "\r" in text and "19/19" in text and "layer/s" in text and "converting: 100% (" not in text, text[-2000:]
