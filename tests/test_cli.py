"""trainer.py command line: typed config, plain `python` runs, clear one-line errors."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from models.partition import stage_bounds
from tests.catalogue import config_error
from tests.conftest import REPO, check, run_cmd
from tools.tiny_models import tiny_config


def trainer(*overrides: str):
    return run_cmd([sys.executable, "trainer.py", *overrides], timeout=300)


def base(converted, sft_data, out) -> list[str]:
    return [
        f"model_name_or_path={converted['gqa']}",
        f"output_dir={out}",
        f"train_file={sft_data[0]}",
        f"eval_file={sft_data[1]}",
        "seq_length=16",
        "micro_batch_size=4",
        "max_steps=2",
        "deepspeed=fp32",
    ]


@pytest.mark.slow
def test_plain_python_single_rank_run(converted, sft_data, tmp_path):
    out = tmp_path / "run"
    check(trainer(*base(converted, sft_data, out), "gradient_accumulation_steps=2", "--local_rank=0"))
    assert len([json.loads(x) for x in open(out / "metrics.jsonl")]) == 2
    assert (out / "global_step2").is_dir() and (out / "latest").read_text() == "global_step2"
    assert json.load(open(out / "eval_results.json"))["eval_tokens"] > 0
    report = json.load(open(out / "data_report.json"))  # the data as training saw it
    assert report["train"]["rows"] == 400 and report["eval"]["rows"] == 37
    assert 0 < report["train"]["target_share"] < 1 and report["train"]["rows_without_targets"] == 0
    assert report["eval"]["target_tokens"] == json.load(open(out / "eval_results.json"))["eval_tokens"]
    assert (out / "train_config.yaml").exists() and (out / "config.json").exists()
    verify = run_cmd([sys.executable, "convert2ckpt.py", "--verify", str(out)])  # the save wrote a manifest
    assert verify.returncode == 0 and "every file matches manifest.json" in verify.stdout, verify.stderr
    assert not (out / ".hydra").exists() and not list(tmp_path.glob("outputs"))
    # output_dir is itself a model directory: evaluate it alone (do_train=false) in a new run.
    again = tmp_path / "eval_only"
    overrides = base(converted, sft_data, again)
    overrides[0] = f"model_name_or_path={out}"
    check(trainer(*overrides, "do_train=false"))
    assert not (again / "metrics.jsonl").exists() and not (again / "latest").exists()
    first, second = json.load(open(out / "eval_results.json")), json.load(open(again / "eval_results.json"))
    assert second["eval_loss"] == pytest.approx(first["eval_loss"], rel=1e-6)
    assert second["eval_tokens"] == first["eval_tokens"]


def test_config_inspection_and_typed_keys(converted, sft_data, tmp_path):
    proc = check(trainer("--cfg", "job", "model=llama2_70b", "num_stages=8"))
    assert "num_key_value_heads: 8" in proc.stdout and "num_stages: 8" in proc.stdout
    # Misspelt and mistyped keys: in-process through the trainer's own checks (an unknown key's one line on stderr
    # and its exit code are the launched catalogue case tests/test_bad_inputs.py::unknown_config_key).
    assert "lerning_rate" in config_error(["lerning_rate=1e-4"])
    assert "atn_implementation" in config_error(["model.atn_implementation=eager"])
    assert "micro_batch_size" in config_error(["micro_batch_size=two"])


def test_override_checks_name_the_first_bad_override_in_order():
    """`check_overrides` merges every override at once, and one at a time only when that fails: the same answer as
    one at a time always (a key given twice is checked each time: the later one would hide the earlier's problem)."""
    from schema.compose import CONF_DIR, check_overrides

    assert check_overrides(["learning_rate=1e-4", "seq_length=32", "data.packing=true"], CONF_DIR) is None
    twice = check_overrides(["learning_rate=abc", "learning_rate=1e-4"], CONF_DIR)
    assert twice.startswith("learning_rate=abc: "), twice
    first = check_overrides(["seq_length=x", "model=nope", "lerning_rate=1"], CONF_DIR)
    assert first.startswith("seq_length=x: "), first
    preset = check_overrides(["model=nope", "seq_length=x"], CONF_DIR)
    assert preset.startswith("model=nope: unknown preset"), preset
    assert check_overrides(["-m", "learning_rate=1e-4,3e-4", "+extra=1", "hydra.run.dir=."], CONF_DIR) is None


def test_stage_bounds_rules():
    config = tiny_config(num_hidden_layers=10, vocab_size=64)
    assert stage_bounds(config, 4, [2, 3, 3, 2]) == [0, 3, 6, 9, 13]  # embed with stage 0, norm+head last
    assert stage_bounds(config, 3, "uniform") == [0, 5, 8, 13]
    bounds = stage_bounds(config, 4, "parameters")
    assert bounds[0] == 0 and bounds[-1] == 13 and all(a < b for a, b in zip(bounds, bounds[1:]))
    for bad, msg in [([2, 3, 3], "has 3 entries"), ([2, 3, 3, 1], "sum to"), ([0, 5, 3, 2], ">= 1")]:
        with pytest.raises(ValueError, match=msg):
            stage_bounds(config, 4, bad)
    with pytest.raises(ValueError, match="larger than the model's 10 decoder layers"):
        stage_bounds(config, 11)
    with pytest.raises(ValueError, match="expected one of"):
        stage_bounds(config, 2, "params")


@pytest.mark.slow
def test_safetensors_layer_files_train_export_and_verify(hf_models, converted, sft_data, tmp_path):
    """--format safetensors: the trainer loads it (same eval as .pt), export is bit-identical, verify passes."""
    ckpt = tmp_path / "st"
    proc = run_cmd(
        [
            sys.executable,
            "convert2ckpt.py",
            "--input",
            hf_models["gqa"],
            "--output",
            str(ckpt),
            "--format",
            "safetensors",
        ]
    )
    assert proc.returncode == 0, proc.stderr
    assert all(n.endswith(".safetensors") for n in os.listdir(ckpt / "global_step0") if n.startswith("layer_"))
    results = []
    for name, path in [("pt", converted["gqa"]), ("st", str(ckpt))]:
        overrides = base(converted, sft_data, tmp_path / f"eval_{name}")
        overrides[0] = f"model_name_or_path={path}"
        check(trainer(*overrides, "do_train=false"))
        results.append(json.load(open(tmp_path / f"eval_{name}" / "eval_results.json")))
    assert results[0] == results[1]
    export = tmp_path / "hf"
    assert (
        run_cmd(
            [sys.executable, "convert2ckpt.py", "--to-hf", "--input", str(ckpt), "--output", str(export)]
        ).returncode
        == 0
    )
    from safetensors.torch import load_file

    a = {
        k: v
        for f in os.listdir(hf_models["gqa"])
        if f.endswith(".safetensors")
        for k, v in load_file(os.path.join(hf_models["gqa"], f)).items()
    }
    b = {k: v for f in os.listdir(export) if f.endswith(".safetensors") for k, v in load_file(export / f).items()}
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert run_cmd([sys.executable, "convert2ckpt.py", "--verify", str(ckpt)]).returncode == 0


@pytest.mark.slow
def test_hydra_multirun_sweeps_learning_rate(converted, sft_data, tmp_path):
    """`trainer.py -m learning_rate=a,b output_dir=.../lr_${learning_rate}`: one run per value, in one process."""
    args = base(converted, sft_data, tmp_path / "lr_${learning_rate}")
    args = [a for a in args if not a.startswith("max_steps")] + ["max_steps=2", "do_eval=false"]
    proc = run_cmd([sys.executable, "trainer.py", "-m", "learning_rate=1e-3,3e-3", *args], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = {lr: tmp_path / f"lr_{lr}" for lr in ("0.001", "0.003")}
    for lr, out in runs.items():
        assert (out / "latest").read_text() == "global_step2"
        assert f"learning_rate: {lr}" in (out / "train_config.yaml").read_text()
    first = [json.loads(x)["lr"] for x in open(runs["0.001"] / "metrics.jsonl")]
    second = [json.loads(x)["lr"] for x in open(runs["0.003"] / "metrics.jsonl")]
    assert second[0] == pytest.approx(3 * first[0])
    assert not (REPO / "multirun").exists() and not (REPO / "multirun.yaml").exists()


def test_ranks_come_from_the_launcher_srun_or_nothing():
    """training/launch_env.py: a launcher's RANK/WORLD_SIZE win; an srun task reads SLURM's variables; SLURM's batch
    script without srun (SLURM_PROCID=0, no step) is a world of one and says why."""
    from training.launch_env import first_host, resolve_launch, tasks_on_node

    launcher = {"RANK": "3", "WORLD_SIZE": "8", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0"}
    assert resolve_launch(launcher).startswith("ranks from the launcher") and launcher["RANK"] == "3"
    task = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "16",
        "SLURM_LOCALID": "1",
        "SLURM_STEP_ID": "0",
        "SLURM_NODEID": "1",
        "SLURM_JOB_ID": "4321",
        "SLURM_JOB_NODELIST": "gpu007",
        "SLURM_STEP_TASKS_PER_NODE": "8(x2)",
    }
    assert "ranks from SLURM (srun step 4321.0): world size 16" in resolve_launch(task)
    assert {k: task[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")} == {
        "RANK": "5",
        "WORLD_SIZE": "16",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "8",
        "MASTER_ADDR": "gpu007",
    }
    assert task["MASTER_PORT"] == str(20000 + 4321 % 20000)
    exported = {**task, "MASTER_PORT": "29511"}
    for key in ("RANK", "WORLD_SIZE"):
        exported.pop(key)
    resolve_launch(exported)
    assert exported["MASTER_PORT"] == "29511"  # a port the job exports is kept
    batch = {"SLURM_PROCID": "0", "SLURM_NTASKS": "16", "SLURM_JOB_ID": "4321"}
    assert "not an srun task" in resolve_launch(batch) and batch["WORLD_SIZE"] == "1"
    assert resolve_launch({}) == "a world of one (no launcher)"
    assert [tasks_on_node("4(x2),3", n) for n in range(3)] == [4, 4, 3]
    assert first_host("node12") == "node12"


@pytest.mark.slow
def test_a_recipe_runs_a_checkpoint_of_another_shape(converted, sft_data, tmp_path):
    """`experiment=llama2_70b_4node model_name_or_path=<a tiny checkpoint>`: the recipe's layout and settings, the
    checkpoint's shape (no model=from_checkpoint), one step on one rank."""
    out = tmp_path / "run"
    overrides = ["experiment=llama2_70b_4node", f"model_name_or_path={converted['gqa']}", f"output_dir={out}"]
    overrides += [f"train_file={sft_data[0]}", "num_stages=1", "seq_length=16", "gradient_accumulation_steps=1"]
    check(trainer(*overrides, "max_steps=1", "save_steps=0", "resume=false", "do_eval=false"))
    saved = (out / "train_config.yaml").read_text()
    assert "plan_model: llama2_70b" in saved and "name: from_checkpoint" in saved and "hidden_size: null" in saved
    assert "activation_checkpointing: true" in saved  # the recipe's own model settings
