"""What a launch does with output_dir: which checkpoint `latest` leads to and why, fresh runs never mixed with
earlier ones, rollbacks to an older step, and every numeric setting checked before a step is taken."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from checkpoint.saves import choose_checkpoint, written_saves
from schema.compose import compose_config
from schema.train import TrainConfig
from tests.conftest import check, read_jsonl, run_cmd, small_run
from training.errors import RunError
from training.run_dir import check_resume_from, prepare_output_dir, roll_back
from training.validate import validate


def make_steps(out: Path, steps, latest=None) -> None:
    for step in steps:
        (out / f"global_step{step}").mkdir(parents=True)
        (out / f"global_step{step}" / "weights").write_text(str(step))
    if latest:
        (out / "latest").write_text(latest)


@pytest.mark.parametrize(
    "steps,latest,tag,why",
    [
        ((1, 2), "global_step2", "global_step2", None),
        ((1, 2), "global_step1", "global_step2", "'latest' names global_step1 but global_step2 is complete and newer"),
        ((1, 2), "global_step3", "global_step2", "'latest' names global_step3, which is missing; global_step2 is"),
        ((1,), None, "global_step1", "no 'latest' file; global_step1 is the newest complete checkpoint"),
        ((), "global_step3", None, "'latest' names global_step3, which is missing, and no complete checkpoint"),
        ((), None, None, None),
    ],
)
def test_which_checkpoint_latest_leads_to_and_why(tmp_path, steps, latest, tag, why):
    make_steps(tmp_path, steps, latest)
    got_tag, got_why = choose_checkpoint(str(tmp_path))
    assert got_tag == tag
    assert (got_why is None) if why is None else got_why.startswith(why), got_why


def cfg_for(out: Path, **kw) -> TrainConfig:
    return TrainConfig(output_dir=str(out), model_name_or_path=str(out.parent / "model"), train_file="t.jsonl", **kw)


def test_a_save_every_rank_wrote_is_published_at_the_next_start_only_when_newer(tmp_path):
    """`written_saves`: the staging directories the next start publishes (its layout file's ranks, PP x TP x CP x
    DP, each with its marker; newer than every published checkpoint), oldest first. The others are removed."""
    (tmp_path / "global_step4").mkdir()

    def staging(step: int, ranks: int, **layout) -> str:
        d = tmp_path / f".saving-global_step{step}"
        d.mkdir()
        shape = {"num_stages": 2, "dp_size": 2, "tp_size": 1, "context_parallel_size": 1} | layout
        (d / "layout.json").write_text(json.dumps(shape))
        for r in range(ranks):
            (d / f".written-rank{r}.json").write_text(json.dumps({"entries": {}}))
        return str(d)

    staging(3, 4)  # older than global_step4
    five, seven = staging(5, 4), staging(7, 8, tp_size=2)
    staging(6, 3)  # one rank had not finished
    staging(8, 4, tp_size=2)  # half of TP x PP x DP = 8
    broken = tmp_path / ".saving-global_step9"
    broken.mkdir()  # no layout file: not a save every rank wrote
    assert written_saves(str(tmp_path)) == [(five, "global_step5", 4), (seven, "global_step7", 8)]
    # At start, before a fresh run looks for an earlier run's checkpoints: published, so a fresh run refuses them.
    from training.assembly import commit_written_saves

    commit_written_saves(cfg_for(tmp_path))
    assert (tmp_path / "latest").read_text() == "global_step7" and (tmp_path / "global_step5").is_dir()
    assert not (tmp_path / ".saving-global_step7").exists() and (tmp_path / ".saving-global_step6").exists()
    with pytest.raises(RunError, match="holds checkpoints of an earlier run"):
        prepare_output_dir(cfg_for(tmp_path, resume="false"))


def test_a_kill_inside_publish_leaves_a_save_the_next_start_publishes(tmp_path, monkeypatch):
    """`publish` keeps every rank's marker until the rename: a kill after the manifest is written but before the
    rename leaves a staging directory `written_saves` still finds; once published, the markers are gone."""
    import training.saving as saving

    staging = tmp_path / ".saving-global_step5"
    staging.mkdir()
    (staging / "layout.json").write_text(json.dumps({"num_stages": 2, "dp_size": 1}))
    for r in range(2):
        (staging / f"w{r}").write_text(str(r))
        (staging / f".written-rank{r}.json").write_text(json.dumps({"entries": {}}))
    (staging / "manifest.json.tmp-123").write_text("{")  # an earlier kill inside the manifest's write

    def killed(*args):
        raise SystemExit("killed")

    monkeypatch.setattr(saving, "publish_checkpoint", killed)
    with pytest.raises(SystemExit):
        saving.publish(str(staging), "global_step5", 2, cfg_for(tmp_path))
    assert sorted(json.loads((staging / "manifest.json").read_text())["files"]) == ["layout.json", "w0", "w1"]
    assert written_saves(str(tmp_path)) == [(str(staging), "global_step5", 2)]
    monkeypatch.undo()
    saving.publish(str(staging), "global_step5", 2, cfg_for(tmp_path))
    published = tmp_path / "global_step5"
    assert sorted(os.listdir(published)) == ["layout.json", "manifest.json", "w0", "w1"]
    assert (tmp_path / "latest").read_text() == "global_step5"


def test_fresh_run_refuses_checkpoints_and_overwrite_moves_the_run_aside(tmp_path):
    out = tmp_path / "run"
    make_steps(out, (2, 3), "global_step3")
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    for cache in ("data_cache", "hf_converted"):
        (out / cache).mkdir()
        (out / cache / "x").write_text(cache)
    with pytest.raises(RunError, match=r"holds checkpoints of an earlier run \(global_step2, global_step3\)"):
        prepare_output_dir(cfg_for(out))
    prepare_output_dir(cfg_for(out, resume="auto"))  # resuming is what the checkpoints are for
    assert sorted(os.listdir(out)) == [
        "data_cache",
        "global_step2",
        "global_step3",
        "hf_converted",
        "latest",
        "metrics.jsonl",
    ]
    prepare_output_dir(cfg_for(out, overwrite_output_dir=True))
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("run.earlier-")]
    assert sorted(os.listdir(out)) == ["data_cache", "hf_converted"]  # the keyed caches come along
    assert sorted(os.listdir(aside)) == ["global_step2", "global_step3", "latest", "metrics.jsonl"]
    assert (aside / "global_step3" / "weights").read_text() == "3"


def test_fresh_run_moves_an_earlier_runs_metrics_aside(tmp_path):
    """A run stopped before its first save left metrics: a fresh run never appends to them."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    prepare_output_dir(cfg_for(out))
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("run.earlier-")]
    assert not (out / "metrics.jsonl").exists() and (aside / "metrics.jsonl").read_text().count("step") == 2


def test_a_symlinked_output_dir_moves_what_it_points_at(tmp_path):
    """output_dir -> /scratch/run: the run there is renamed aside and the link keeps pointing at the new run."""
    real, link = tmp_path / "scratch" / "run", tmp_path / "home" / "run"
    make_steps(real, (2,), "global_step2")
    (real / "data_cache").mkdir()
    link.parent.mkdir()
    link.symlink_to(real)
    prepare_output_dir(cfg_for(link, overwrite_output_dir=True))
    assert link.is_symlink() and os.path.realpath(link) == str(real)
    assert sorted(os.listdir(real)) == ["data_cache"]
    (aside,) = (tmp_path / "scratch").glob("run.earlier-*")
    assert sorted(os.listdir(aside)) == ["global_step2", "latest"]


def test_output_dir_may_not_be_an_input(tmp_path):
    shards = tmp_path / "corpus"
    shards.mkdir()
    for out, key in ((shards, "train_file"), (tmp_path / "model", "model_name_or_path")):
        cfg = TrainConfig(output_dir=str(out), model_name_or_path=str(tmp_path / "model"), train_file=str(shards))
        with pytest.raises(RunError, match=f"output_dir {out} is {key}: a run writes config.json"):
            prepare_output_dir(cfg)


def test_resume_from_checks_completeness_and_rolls_back(tmp_path):
    make_steps(tmp_path, (1, 2, 3), "global_step3")
    (tmp_path / "global_step1" / "manifest.json").write_text(json.dumps({"files": {"weights": {"size": 1}}}))
    (tmp_path / "global_step2" / "manifest.json").write_text(json.dumps({"files": {"gone": {"size": 1}}}))
    with pytest.raises(RunError, match="global_step2/gone is missing or resized"):
        check_resume_from(str(tmp_path), "global_step2")
    with pytest.raises(RunError, match=r"is not a complete checkpoint \(complete ones: global_step1, global_step2, g"):
        check_resume_from(str(tmp_path), "global_step7")
    check_resume_from(str(tmp_path), "global_step1")
    assert roll_back(str(tmp_path), "global_step1") == ["global_step2", "global_step3"]
    (aside,) = tmp_path.glob("rolled_back-*")
    assert sorted(os.listdir(aside)) == ["global_step2", "global_step3"]
    assert choose_checkpoint(str(tmp_path)) == ("global_step1", None)


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("learning_rate", float("inf"), "learning_rate=inf must be a finite number in [0, inf]"),
        ("learning_rate", -1e-4, "learning_rate=-0.0001 must be"),
        ("optim.beta1", 1.5, "optim.beta1=1.5 must be a finite number in [0, 1)"),
        ("optim.beta2", 1.0, "optim.beta2=1.0 must be a finite number in [0, 1)"),
        ("optim.eps", 0.0, "optim.eps=0.0 must be a finite number in (0, inf]"),
        ("optim.weight_decay", -0.1, "optim.weight_decay=-0.1 must be"),
        ("optim.max_grad_norm", float("nan"), "optim.max_grad_norm=nan must be"),
        ("optim.warmup_ratio", -0.5, "optim.warmup_ratio=-0.5 must be a finite number in [0, 1]"),
        ("optim.warmup_ratio", 1.5, "optim.warmup_ratio=1.5 must be"),
        ("optim.warmup_steps", -1, "optim.warmup_steps=-1 must be >= 0"),
        ("optim.min_lr_ratio", 2.0, "optim.min_lr_ratio=2.0 must be"),
        ("dist_timeout_minutes", 0.0, "dist_timeout_minutes=0.0 must be"),
        ("logging_steps", 0, "logging_steps=0 must be >= 1"),
        ("max_steps", -2, "max_steps=-2 must be -1"),
        ("save_steps", -1, "save_steps=-1 must be >= 0"),
        ("lora.alpha", float("inf"), "lora.alpha=inf must be"),
        ("lora.dropout", 1.0, "lora.dropout=1.0 must be"),
        ("data.train_weights", [1.0, float("nan")], "data.train_weights[1]=nan must be"),
        ("resume_from", "step5", "resume_from=step5 must name a checkpoint like global_step500"),
        ("overwrite_output_dir", True, "overwrite_output_dir=true starts a fresh run"),
        ("dpo.beta", 0.0, "dpo.beta=0.0 must be a finite number in (0, inf]"),
        ("dpo.sft_weight", -1.0, "dpo.sft_weight=-1.0 must be a finite number in [0, inf]"),
        ("dpo.gamma", float("nan"), "dpo.gamma=nan must be"),
        ("dpo.data.packing", True, "data.packing=true: objective=dpo scores each pair's two sequences"),
        ("dpo.data.concatenate", True, "data.concatenate=true: objective=dpo"),
    ],
)
def test_every_numeric_setting_is_checked_before_training(key, value, message):
    cfg = TrainConfig(model_name_or_path="m", train_file=["a.jsonl", "b.jsonl"])
    cfg.lora.enabled = key.startswith("lora.")
    if key == "overwrite_output_dir":
        cfg.resume = "auto"
    if key.startswith("dpo.data."):  # a data setting refused for objective=dpo
        key = key.removeprefix("dpo.")
        cfg.objective = "dpo"
    cfg.objective = "dpo" if key.startswith("dpo.") else cfg.objective
    owner, _, name = key.rpartition(".")
    setattr(getattr(cfg, owner) if owner else cfg, name, value)
    with pytest.raises(ValueError) as e:
        validate(cfg)
    assert str(e.value).startswith(message), str(e.value)


@pytest.mark.parametrize(
    "override,message",
    [
        ("objective=ppo", "objective=ppo: choose one of sft, dpo"),
        ("dpo.loss_type=kto", "dpo.loss_type=kto: choose one of sigmoid, ipo, simpo"),
        ("pipeline_schedule=gpipe", "pipeline_schedule=gpipe: choose one of 1f1b, zero_bubble, dualpipev"),
        ("deepspeed.precision=fp8", "deepspeed.precision=fp8: choose one of auto, fp32, bf16, fp16"),
    ],
)
def test_every_choice_is_an_enum_checked_when_composing(override, message):
    with pytest.raises(ValueError) as e:
        compose_config([override])
    assert str(e.value) == message


def test_seq_length_that_tp_does_not_divide_is_padded_inside():
    """TP=3 with seq_length=128 trained before sequence parallelism was on by default; it still does: batches are
    padded to 129 positions (3 equal shards), the padding after every real token and never a target. Training with
    such a length equals the single-process reference: the qwen2-tp2-dp2-recompute layout of tests/test_training.py
    runs seq_length=15 under TP=2."""
    import torch

    from data.collator import CausalLMCollator
    from models.loss import IGNORE_INDEX
    from schema.train import padded_seq_length

    cfg = compose_config(["tensor_parallel_size=3", "seq_length=128", "model_name_or_path=m", "train_file=a.jsonl"])
    validate(cfg)
    assert (cfg.seq_length, padded_seq_length(cfg)) == (128, 129)
    cfg.sequence_parallel = False
    assert padded_seq_length(cfg) == 128
    ids = torch.arange(1, 129)
    (input_ids, positions), labels, tokens = CausalLMCollator(129, 0)([(ids, torch.ones(128, dtype=torch.bool))])
    assert input_ids.shape == positions.shape == labels.shape == (1, 129) and int(tokens) == 128
    assert torch.equal(input_ids[0, :128], ids) and int(input_ids[0, 128]) == 0
    assert torch.equal(labels[0, :127], ids[1:]) and (labels[0, 127:] == IGNORE_INDEX).all()


@pytest.mark.slow
def test_rollback_and_overwrite_on_real_runs(converted, sft_data, tmp_path):
    """resume_from=global_step1 after 3 saved steps retrains steps 2-3 exactly (bit-identical losses and
    weights), moves the abandoned checkpoints aside and logs why; resumed with max_steps=5 the schedule is the
    5-step one's; overwrite_output_dir=true then starts over."""
    from checkpoint.layer_files import load_layer_state

    out = tmp_path / "run"
    args = small_run(converted["gqa"], out, sft_data[0], max_steps=3, save_steps=1, learning_rate=3e-3)

    def weights(step_dir: Path) -> dict:
        files = sorted(step_dir.glob("layer_*"))
        return {f"{f.name}:{k}": v for f in files for k, v in load_layer_state(str(f)).items()}

    def curve(metrics: list[dict]) -> list[tuple]:
        return [(m["step"], m["loss"], m["lr"], m["grad_norm"]) for m in metrics]

    check(run_cmd([sys.executable, "trainer.py", *args]))
    first, first_weights = read_jsonl(out / "metrics.jsonl"), weights(out / "global_step3")
    (out / "latest").write_text("global_step1")  # and a stale `latest`: resume=auto says which it takes
    auto = run_cmd([sys.executable, "trainer.py", *args, "resume=auto", "max_steps=3"])
    assert "'latest' names global_step1 but global_step3 is complete and newer" in check(auto).stderr
    proc = check(run_cmd([sys.executable, "trainer.py", *args, "resume_from=global_step1"]))
    assert "resume_from=global_step1: moved the newer checkpoints global_step2, global_step3" in proc.stderr
    again = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in again] == [1, 2, 3] and curve(again) == curve(first)
    assert weights(out / "global_step3").keys() == first_weights.keys()
    assert all((weights(out / "global_step3")[k] == v).all() for k, v in first_weights.items())
    (aside,) = out.glob("rolled_back-*")
    assert sorted(os.listdir(aside)) == ["global_step2", "global_step3"]

    # Resumed with max_steps=5, steps 4-5 follow the 5-step schedule (they kept the 3-step one's floor before).
    longer = check(run_cmd([sys.executable, "trainer.py", *args, "resume=auto", "max_steps=5"]))
    assert "the LR schedule follows this run's settings from step 3 on" in longer.stderr
    assert "max_steps/num_train_epochs (total steps): 3 -> 5" in longer.stderr
    five = tmp_path / "five"
    check(
        run_cmd(
            [
                sys.executable,
                "trainer.py",
                *small_run(converted["gqa"], five, sft_data[0], max_steps=5, learning_rate=3e-3),
            ]
        )
    )
    again = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in again] == [1, 2, 3, 4, 5]
    assert [m["lr"] for m in again[3:]] == [m["lr"] for m in read_jsonl(five / "metrics.jsonl")[3:]]

    check(run_cmd([sys.executable, "trainer.py", *args, "max_steps=1", "overwrite_output_dir=true"]))
    (earlier,) = tmp_path.glob("run.earlier-*")
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl")] == [1]
    assert read_jsonl(earlier / "metrics.jsonl") == again and (earlier / "global_step3").is_dir()
    assert sorted(n for n in os.listdir(out) if n.startswith("global_step")) == ["global_step1"]
