"""tools/: greedy generation from pipeline checkpoints equals transformers' own; metric plots."""

from __future__ import annotations

import json
import sys

import torch

from tests.conftest import run_cmd
from tools.generate import load_model
from tools.plot_metrics import plot


def test_generation_from_pipeline_checkpoint_matches_hf(hf_models, converted):
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[1, 5, 9, 13, 17]])
    reference = AutoModelForCausalLM.from_pretrained(hf_models["tied"], dtype=torch.float32).eval()
    ours = load_model(converted["tied"])
    with torch.no_grad():
        want = reference.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
        got = ours.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
        torch.testing.assert_close(ours(ids).logits, reference(ids).logits, rtol=0, atol=0)
    assert torch.equal(got, want)
    cli = [sys.executable, "-m", "tools.generate", "--prompt", "1+2=", "--max-new-tokens", "6", "--checkpoint"]
    from_ckpt, from_hf = run_cmd([*cli, converted["gqa"]]), run_cmd([*cli, hf_models["gqa"]])
    assert from_ckpt.returncode == 0 and from_ckpt.stdout.startswith("1+2="), from_ckpt.stderr[-2000:]
    assert from_ckpt.stdout == from_hf.stdout
    missing = run_cmd([*cli, "/nonexistent"])
    assert missing.returncode == 2 and "generate: error:" in missing.stderr and "Traceback" not in missing.stderr


def test_plots_from_metrics(tmp_path):
    rows = [
        {"step": s, "loss": 3.0 / s, "lr": 1e-3 * min(1, s / 5), "grad_norm": 1.0 + s % 3, "tokens_per_second": 900.0}
        for s in range(1, 41)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "eval_results.json").write_text(json.dumps({"step": 40, "eval_loss": 0.2}))
    paths = plot(str(tmp_path))
    assert [p.rsplit("/", 1)[1] for p in paths] == [
        "loss.png",
        "lr.png",
        "grad_norm.png",
        "throughput.png",
        "overview.png",
    ]
    for p in paths:
        assert open(p, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    bad = run_cmd([sys.executable, "-m", "tools.plot_metrics", str(tmp_path / "nothing")])
    assert bad.returncode == 2 and "metrics.jsonl: missing" in bad.stderr
