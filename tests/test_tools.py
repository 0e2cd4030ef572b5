"""tools/: greedy generation from pipeline checkpoints equals transformers' own; metric plots."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from tests.baseline import hf_model
from tests.conftest import read_jsonl, run_cmd
from tools.generate import load_model
from tools.plot_metrics import plot


@pytest.mark.slow
def test_generation_from_pipeline_checkpoint_matches_hf(hf_models, converted):
    ids = torch.tensor([[1, 5, 9, 13, 17]])
    reference = hf_model(hf_models["tied"], dtype=torch.float32).eval()  # in memory of its own, as ours
    ours = load_model(converted["tied"])
    with torch.no_grad():
        want = reference.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
        got = ours.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
        torch.testing.assert_close(ours(ids).logits, reference(ids).logits, rtol=0, atol=0)
        # An HF directory goes through the same streaming reader (not from_pretrained): the same model exactly.
        torch.testing.assert_close(load_model(hf_models["tied"])(ids).logits, reference(ids).logits, rtol=0, atol=0)
    assert torch.equal(got, want)
    cli = [sys.executable, "-m", "tools.generate", "--prompt", "1+2=", "--max-new-tokens", "6", "--checkpoint"]
    from_ckpt, from_hf = run_cmd([*cli, converted["gqa"]]), run_cmd([*cli, hf_models["gqa"]])
    assert from_ckpt.returncode == 0 and from_ckpt.stdout.startswith("1+2="), from_ckpt.stderr[-2000:]
    assert from_ckpt.stdout == from_hf.stdout
    missing = run_cmd([*cli, "/nonexistent"])
    assert missing.returncode == 2 and "generate: error:" in missing.stderr and "Traceback" not in missing.stderr


@pytest.mark.slow
def test_every_family_loads_for_generation_as_transformers_does(hf_models, converted):
    """`tools.generate`'s loader (checkpoint/hf_model.py) on every tiny model, from its pipeline checkpoint and from
    its Hugging Face directory: the logits of transformers' `from_pretrained` (within 1e-6). Per-expert hub keys
    (Mixtral's), renamed ones (DeepSeek-V4's) and computed buffers (Gemma's embedding scale) included."""
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[1, 5, 9, 13, 17, 21]])
    for variant, hf_dir in hf_models.items():
        reference = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            want = reference(ids).logits
            for source in (converted[variant], hf_dir):
                got = load_model(source)(ids).logits
                torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=f"{variant}: {source}")


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
    from matplotlib import image

    for p in paths:
        assert open(p, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
        pixels = image.imread(p)  # a drawn figure: not empty, not one colour
        assert pixels.shape[0] >= 300 and pixels.shape[1] >= 400 and float(pixels[..., :3].std()) > 0.05, p
    bad = run_cmd([sys.executable, "-m", "tools.plot_metrics", str(tmp_path / "nothing")])
    assert bad.returncode == 2 and "metrics.jsonl: missing" in bad.stderr


@pytest.mark.slow
def test_metrics_reach_tensorboard_and_wandb_offline(converted, sft_data, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    args = [
        f"model_name_or_path={converted['gqa']}",
        f"output_dir={out}",
        f"train_file={sft_data[0]}",
        f"eval_file={sft_data[1]}",
        "seq_length=16",
        "micro_batch_size=4",
        "max_steps=3",
        "deepspeed=fp32",
        "report_to=[tensorboard,wandb]",
    ]
    proc = run_cmd([sys.executable, "trainer.py", *args], env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [m["loss"] for m in read_jsonl(out / "metrics.jsonl")]
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx(losses, rel=1e-6)
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3]
    assert len(events.Scalars("eval/loss")) == 1
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb")), os.listdir(out / "wandb")

    from tests.catalogue import config_error  # the trainer's own checks, in-process (one launch per kind)

    assert "report_to: unknown reporter 'mlflow'" in config_error([*args[:-1], "report_to=[mlflow]"])


def test_progress_bar_on_a_terminal_only(tmp_path, monkeypatch):
    import io

    from training.reporting import StepReporter

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    record = {"loss": 1.5, "tokens_per_second": 900.0, "lr": 1e-3}
    for tty, expect_bar in [(True, True), (False, False)]:
        err = Terminal() if tty else io.StringIO()
        monkeypatch.setattr(sys, "stderr", err)
        out = tmp_path / f"tty{tty}"
        out.mkdir()
        reporter = StepReporter(str(out), [], total_steps=8, first_step=3, run_config={})
        for step in range(4, 9):
            reporter.step({"step": step, **record})
        reporter.close()
        assert ("8/8" in err.getvalue() and "loss=1.5000" in err.getvalue()) == expect_bar, err.getvalue()
        assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [4, 5, 6, 7, 8]


def test_only_rank0_and_the_reporting_rank_log_info_unless_all_ranks():
    import logging

    from training.logs import configure_logging
    from training.topology import Coords

    log = logging.getLogger("trainer")
    levels = {}
    for rank in range(4):  # PP=2 x DP=2: rank 0 and rank 2 (last stage, DP 0, reports)
        for all_ranks in (False, True):
            configure_logging(Coords(rank, 4, 2), all_ranks)
            levels[rank, all_ranks] = log.level
    assert [levels[r, False] for r in range(4)] == [logging.INFO, logging.WARNING, logging.INFO, logging.WARNING]
    assert all(levels[r, True] == logging.INFO for r in range(4))


@pytest.mark.slow
def test_chat_generation_renders_the_template_and_the_models_dtype(tmp_path):
    """`--chat`: the prompt as a user turn through the chat template with its generation prompt (Qwen3's, thinking
    off through --chat-template-kwargs), the model in its own dtype (bf16 here): the tokens transformers' own
    `generate` gives on `apply_chat_template`'s ids."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.test_chat_templates import GEMMA, HARMONY, LLAMA3, QWEN_SPECIALS, trl_template
    from tools.tiny_models import SAMPLE_TEXTS, make_bpe_tokenizer, make_hf_model, tiny_config

    specials = QWEN_SPECIALS + HARMONY + LLAMA3 + GEMMA
    tok_dir = make_bpe_tokenizer(str(tmp_path / "tok"), SAMPLE_TEXTS * 20, 400, specials)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    tok.chat_template = trl_template("qwen3")
    hf = make_hf_model(str(tmp_path / "qwen3"), tiny_config("qwen3", vocab_size=len(tok)), dtype=torch.bfloat16)
    tok.save_pretrained(hf)
    messages = [{"role": "system", "content": "add"}, {"role": "user", "content": "12+30="}]
    ids = tok.apply_chat_template(
        messages, add_generation_prompt=True, enable_thinking=False, return_tensors="pt", return_dict=True
    )["input_ids"]
    reference = AutoModelForCausalLM.from_pretrained(hf)  # its config's dtype
    assert reference.dtype == torch.bfloat16
    with torch.no_grad():
        want = reference.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.eos_token_id)
    expected = "12+30=" + tok.decode(want[0, ids.shape[1] :], skip_special_tokens=True) + "\n"
    cli = [sys.executable, "-m", "tools.generate", "--checkpoint", hf, "--prompt", "12+30=", "--chat"]
    cli += ["--system", "add", "--chat-template-kwargs", '{"enable_thinking": false}', "--max-new-tokens", "8"]
    got = run_cmd(cli)
    assert got.returncode == 0 and got.stdout == expected, got.stderr[-2000:]
    bad = run_cmd([*cli[:-2], "--chat-template-kwargs", "[1]"])
    assert bad.returncode == 2 and "generate: error: --chat-template-kwargs [1]: not a JSON object" in bad.stderr
