"""The catalogue's second half: commands that would destroy or mix what the user has (tests/catalogue.py is
the harness). Each is refused in one line before anything is touched, and the hashed inputs and earlier
outputs are byte-identical afterwards."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from tests.catalogue import Catalogue, Inputs, convert_cmd, copy, run_args, run_case, trainer_cmd

pytestmark = pytest.mark.slow

CASES = Catalogue()
case = CASES.case


def fake_run(ckpt: str, run: Path, steps=(2, 3)) -> Path:
    """A training run's directory as the trainer leaves it: checkpoints, `latest`, metrics, config, logs."""
    run.mkdir(parents=True)
    for step in steps:
        shutil.copytree(Path(ckpt) / "global_step0", run / f"global_step{step}")
    (run / "latest").write_text(f"global_step{steps[-1]}")
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 4)))
    (run / "train_config.yaml").write_text("seed: 42\n")
    (run / "logs").mkdir()
    (run / "logs" / "rank0.log").write_text("step 3/3\n")
    for name in ("config.json", "tokenizer_config.json"):
        shutil.copy(Path(ckpt) / name, run / name)
    return run


def to_hf(src, out, *extra) -> list[str]:
    return [sys.executable, "convert2ckpt.py", "--to-hf", "--input", str(src), "--output", str(out), *extra]


# ---------------------------------------------------------------- convert2ckpt: outputs that are inputs


@case
def convert_force_onto_its_input(t):
    src = copy(t.hf["gqa"], t.tmp / "hf")
    return [*convert_cmd(src, src), "--force"], f"--output {src} is the input {src}", None, [src]


@case
def convert_force_onto_parent_of_input(t):
    src = copy(t.hf["gqa"], t.tmp / "models" / "hf")
    parent = src.parent
    return [*convert_cmd(src, parent), "--force"], f"--output {parent} contains the input {src}", None, [parent]


@case
def convert_output_symlinked_to_input(t):
    src = copy(t.hf["gqa"], t.tmp / "hf")
    link = t.tmp / "link"
    link.symlink_to(src)
    return [*convert_cmd(src, link), "--force"], f"--output {link} is the input {src}", None, [src]


@case
def export_force_onto_its_training_run(t):
    run = fake_run(t.ckpt, t.tmp / "run")
    return to_hf(run, run, "--force"), f"--output {run} is the input {run}", None, [run]


@case
def export_inside_its_training_run(t):
    run = fake_run(t.ckpt, t.tmp / "run")
    out = run / "hf"
    return to_hf(run, out, "--force"), f"--output {out} is inside the input {run}", None, [run]


@case
def reshard_into_its_input(t):
    ckpt = copy(t.ckpt, t.tmp / "ckpt")
    out = ckpt / "tp2"
    cmd = [*convert_cmd(ckpt, out), "--tp", "2", "--force"]
    return cmd, f"--output {out} is inside the input {ckpt}", None, [ckpt]


@case
def combine_onto_one_of_its_pieces(t):
    pieces = [t.tmp / "piece_a", t.tmp / "piece_b"]
    for piece in pieces:
        copy(t.ckpt, piece)
    cmd = [sys.executable, "convert2ckpt.py", "--combine", *map(str, pieces), "--output", str(pieces[0]), "--force"]
    return cmd, f"--output {pieces[0]} is the piece {pieces[0]}", None, pieces


@case
def merge_lora_into_the_adapter_directory(t):
    adapter = t.tmp / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4}))
    (adapter / "adapter_model.safetensors").write_bytes(b"\0" * 16)
    cmd = to_hf(t.ckpt, adapter, "--merge-lora", str(adapter), "--force")
    return cmd, f"--output {adapter} is the adapter {adapter}", None, [adapter, t.ckpt]


# ---------------------------------------------------------------- convert2ckpt: --force onto what it did not write


@case
def convert_force_onto_a_hugging_face_directory(t):
    other = copy(t.hf["mha"], t.tmp / "other_hf")
    cmd = [*convert_cmd(t.hf["gqa"], other), "--force"]
    fragment = f"{other}: output exists and holds a Hugging Face model directory (config.json, model-00001-of-"
    return cmd, fragment, None, [other, t.hf["gqa"]]


@case
def export_force_onto_another_training_run(t):
    run = fake_run(t.ckpt, t.tmp / "run")
    cmd = to_hf(t.ckpt, run, "--force")
    fragment = f"{run}: output exists and holds a training run (global_step2, global_step3, metrics.jsonl"
    return cmd, fragment, None, [run, t.ckpt]


@case
def export_force_onto_a_converted_checkpoint(t):
    ckpt = copy(t.ckpt, t.tmp / "ckpt")  # written by convert2ckpt, but a pipeline checkpoint, not an export
    cmd = to_hf(t.mha_ckpt, ckpt, "--force")
    fragment = f"{ckpt}: output exists and holds a pipeline checkpoint written by convert2ckpt convert"
    return cmd, fragment, None, [ckpt, t.mha_ckpt]


# ---------------------------------------------------------------- the trainer: runs never mixed


@case
def fresh_run_into_an_output_dir_with_checkpoints(t):
    run = fake_run(t.ckpt, t.tmp / "run")
    cmd = trainer_cmd(*run_args(t.ckpt, run, t.train))
    fragment = (
        f"output_dir {run} holds checkpoints of an earlier run (global_step2, global_step3) and resume=false; "
        "continue it with resume=auto, start elsewhere with a new output_dir, or pass "
        "overwrite_output_dir=true"
    )
    return cmd, fragment, None, [run, t.ckpt]


@case
def output_dir_is_the_model(t):
    ckpt = copy(t.ckpt, t.tmp / "ckpt")
    cmd = trainer_cmd(*run_args(str(ckpt), ckpt, t.train, resume="auto"))
    return cmd, f"output_dir {ckpt} is model_name_or_path", None, [ckpt]


@case
def overwrite_would_move_the_train_file(t):
    run = fake_run(t.ckpt, t.tmp / "run")
    train = run / "train.jsonl"
    shutil.copy(t.train, train)
    cmd = trainer_cmd(*run_args(t.ckpt, run, str(train), overwrite_output_dir="true"))
    return cmd, f"output_dir {run} holds train_file {train}; moving the earlier run aside", None, [run, t.ckpt]


@case
def resume_from_an_incomplete_checkpoint(t):
    run = fake_run(t.ckpt, t.tmp / "run", steps=(1, 2))
    missing = run / "global_step2" / "layer_02-model_00-model_states.pt"
    os.remove(missing)
    cmd = trainer_cmd(*run_args(t.ckpt, run, t.train, resume_from="global_step2"))
    fragment = f"resume_from=global_step2: {missing} is missing or resized (incomplete checkpoint"
    kept = [run / "global_step1", run / "global_step2", run / "latest", run / "metrics.jsonl"]
    return cmd, fragment, None, kept


@pytest.mark.parametrize("name", list(CASES))
def test_bad_output(name, hf_models, converted, sft_data, tmp_path, monkeypatch):
    run_case(CASES[name], Inputs(tmp_path, hf_models, converted, sft_data), monkeypatch)
