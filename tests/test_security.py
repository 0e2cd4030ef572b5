"""No file a user downloads can run code: a planted pickle is refused by every command, with one line.

The payload would create a marker file when unpickled (`open(marker, "w")`). The attacker is careful: the
manifest is updated to match the planted file, so only a safe load can catch it.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

from checkpoint.layer_files import load_layer_state
from checkpoint.manifest import HASH, file_hash
from tests.conftest import check, launch, run_cmd, small_run

pytestmark = pytest.mark.slow


class Payload:
    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def plant(path: Path, obj) -> None:
    """Replace `path` with `obj` (carrying a payload) and make the manifest agree with it."""
    torch.save(obj, path)
    manifest = path.parent / "manifest.json"
    listed = json.loads(manifest.read_text())
    entry = listed["files"][path.name]
    entry.update({"size": path.stat().st_size, HASH: file_hash(str(path))})
    manifest.write_text(json.dumps(listed))


def peft_adapter(hf_dir: str, out: Path) -> str:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"])).save_pretrained(str(out))
    return str(out)


def assert_refused(proc, marker: Path, what: str, planted: str) -> None:
    """Non-zero exit, no traceback, one error line that refuses the planted file by name, and no payload run."""
    assert proc.returncode != 0, (what, proc.stdout[-2000:])
    assert "Traceback" not in proc.stderr, (what, proc.stderr[-3000:])
    errors = [line for line in proc.stderr.splitlines() if ": error:" in line or ": verify:" in line]
    assert len(errors) == 1 and "refused" in errors[0] and planted in errors[0], (what, proc.stderr[-3000:])
    assert not marker.exists(), f"{what}: the payload ran"


def commands(ckpt: str, tmp: Path, hf_dir: str, adapter: str, train: str) -> dict[str, list[str]]:
    convert = [sys.executable, "convert2ckpt.py"]
    return {
        "--inspect": [*convert, "--inspect", ckpt],
        "--verify": [*convert, "--verify", ckpt],
        "--verify --against": [*convert, "--verify", ckpt, "--against", hf_dir],
        "--to-hf": [*convert, "--to-hf", "--input", ckpt, "--output", str(tmp / "out_hf")],
        "--to-hf --merge-lora": [
            *convert,
            "--to-hf",
            "--input",
            ckpt,
            "--output",
            str(tmp / "out_m"),
            "--merge-lora",
            adapter,
        ],
        "tools.generate": [sys.executable, "-m", "tools.generate", "--checkpoint", ckpt, "--prompt", "1+1="],
        "trainer (initial weights)": [
            sys.executable,
            "trainer.py",
            *small_run(ckpt, tmp / "run", train, max_steps=1),
        ],
    }


@pytest.mark.parametrize("where", ["engine file", "layer file"])
def test_planted_pickle_in_a_checkpoint_is_refused_everywhere(where, converted, hf_models, sft_data, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(converted["gqa"], ckpt)
    marker = tmp_path / "pwned"
    step = ckpt / "global_step0"
    if where == "engine file":
        planted = step / "mp_rank_00_model_states.pt"
        plant(planted, {"module": None, "global_steps": 0, "x": Payload(marker)})
    else:
        planted = step / "layer_02-model_00-model_states.pt"
        plant(planted, {**load_layer_state(str(planted)), "x": Payload(marker)})
    adapter = peft_adapter(hf_models["gqa"], tmp_path / "adapter")
    for what, cmd in commands(str(ckpt), tmp_path, hf_models["gqa"], adapter, sft_data[0]).items():
        assert_refused(run_cmd(cmd, timeout=300), marker, f"{where}, {what}", planted.name)
    # `--verify --against` stops at the scan above; the comparison itself must refuse the file too.
    from checkpoint.compare import compare_with_hf
    from checkpoint.errors import CheckpointError

    with pytest.raises(CheckpointError, match=f"{planted.name}: refused"):
        compare_with_hf(str(ckpt), "global_step0", hf_models["gqa"])
    assert not marker.exists()
    assert not (tmp_path / "out_hf").exists() and not (tmp_path / "run" / "latest").exists()


def test_planted_pickle_in_a_hugging_face_directory_is_refused(hf_models, sft_data, tmp_path):
    """A `pytorch_model.bin` with a payload: conversion, conversion at load, generation and merging refuse it."""
    from safetensors.torch import load_file

    hf = tmp_path / "hf"
    shutil.copytree(hf_models["gqa"], hf, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    state = {}
    for f in Path(hf_models["gqa"]).glob("*.safetensors"):
        state.update(load_file(str(f)))
    marker = tmp_path / "pwned"
    torch.save({**state, "x": Payload(marker)}, hf / "pytorch_model.bin")
    adapter = peft_adapter(hf_models["gqa"], tmp_path / "adapter")
    convert = [sys.executable, "convert2ckpt.py"]
    cases = {
        "convert": [*convert, "--input", str(hf), "--output", str(tmp_path / "ckpt")],
        "conversion at load": [sys.executable, "trainer.py", *small_run(str(hf), tmp_path / "run", sft_data[0])],
        "tools.generate": [sys.executable, "-m", "tools.generate", "--checkpoint", str(hf), "--prompt", "1+1="],
        "--to-hf --merge-lora": [
            *convert,
            "--to-hf",
            "--input",
            str(hf),
            "--output",
            str(tmp_path / "m"),
            "--merge-lora",
            adapter,
        ],
    }
    for what, cmd in cases.items():
        assert_refused(run_cmd(cmd, timeout=300), marker, what, "pytorch_model.bin")
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "run" / "hf_converted").exists()
    # A PEFT adapter in the older .bin format is read through the same safe loader.
    legacy = tmp_path / "legacy_adapter"
    shutil.copytree(adapter, legacy, ignore=shutil.ignore_patterns("*.safetensors"))
    planted = {**load_file(f"{adapter}/adapter_model.safetensors"), "x": Payload(marker)}
    torch.save(planted, legacy / "adapter_model.bin")
    cmd = [
        *convert,
        "--to-hf",
        "--input",
        hf_models["gqa"],
        "--output",
        str(tmp_path / "m2"),
        "--merge-lora",
        str(legacy),
    ]
    assert_refused(run_cmd(cmd, timeout=300), marker, "--merge-lora adapter_model.bin", "adapter_model.bin")


def test_resume_loads_our_own_files_safely(converted, sft_data, tmp_path):
    """The trainer's own loads on resume: per-rank RNG states, the layer files DeepSpeed's loader reads in the same
    layout (handed to ours), and (layout change) every stage's engine file read for optimizer reshaping."""
    marker = tmp_path / "pwned"
    run = tmp_path / "run"
    args = small_run(converted["gqa"], run, sft_data[0], max_steps=2, save_steps=1)
    proc = run_cmd([sys.executable, "trainer.py", *args], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    same = tmp_path / "same_layout"
    shutil.copytree(run, same)
    plant(run / "global_step2" / "rng_state_rank0.pt", {"python": None, "x": Payload(marker)})
    proc = run_cmd([sys.executable, "trainer.py", *args, "resume=true"], timeout=300)
    assert_refused(proc, marker, "rng state", "rng_state_rank0.pt")

    # A resume in the same layout: DeepSpeed's loader reads the layer files through ours (plain tensor data).
    layer = same / "global_step2" / "layer_01-model_00-model_states.pt"
    plant(layer, {**torch.load(layer, weights_only=True), "x": Payload(marker)})
    args = small_run(converted["gqa"], same, sft_data[0], max_steps=2, save_steps=1)
    proc = run_cmd([sys.executable, "trainer.py", *args, "resume=true"], timeout=300)
    assert_refused(proc, marker, "layer file", layer.name)

    two = tmp_path / "two_stages"  # saved with PP=2, resumed with PP=1: optimizer state reshaped by name
    args = small_run(
        converted["gqa"], two, sft_data[0], max_steps=2, num_stages=2, micro_batch_size=1, gradient_accumulation_steps=2
    )
    check(launch(2, *args))
    engine = two / "global_step2" / "mp_rank_01_model_states.pt"
    plant(engine, {**torch.load(engine, weights_only=True), "x": Payload(marker)})
    moved = [a for a in args if not a.startswith(("num_stages", "max_steps"))]  # same global batch of 2
    proc = run_cmd([sys.executable, "trainer.py", *moved, "num_stages=1", "max_steps=3", "resume=true"], timeout=300)
    assert_refused(proc, marker, "optimizer reshaping", engine.name)


def within_seconds(seconds: int, call):
    """`call()`, failed (TimeoutError) if it takes longer than `seconds`: a blocking open or an endless read is
    interrupted by SIGALRM (the test runs in the process's main thread)."""
    import signal

    def expired(*_):
        raise TimeoutError(f"did not finish within {seconds} s")

    before = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        return call()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)


@pytest.mark.parametrize("kind", ["climbing", "absolute", "device", "fifo", "symlink"])
def test_a_manifest_names_only_the_checkpoints_own_files(kind, converted, tmp_path):
    """A planted manifest entry (its size and hash right) that climbs out of the checkpoint, is absolute (`/dev/zero`,
    which a hash would read for ever), or names a device, a FIFO or a symlink to a FIFO outside: `--verify` refuses it
    in one line within seconds, and so do `--inspect`, `--to-hf` and a resume, before any file is opened (what lies
    outside is a FIFO: opening it would block)."""
    import os
    import stat

    from checkpoint.errors import CheckpointError
    from checkpoint.manifest import entry_hash
    from training.errors import RunError
    from training.run_dir import check_resume_from

    ckpt = tmp_path / "ckpt"
    shutil.copytree(converted["gqa"], ckpt)
    step = ckpt / "global_step0"
    outside = tmp_path / "outside.fifo"
    os.mkfifo(outside)
    name = {"climbing": "../../outside.fifo", "absolute": "/dev/zero"}.get(kind, "tokenizer.extra")
    if kind == "device":
        os.mknod(step / name, stat.S_IFCHR | 0o600, os.makedev(1, 5))  # /dev/zero's numbers
    elif kind == "fifo":
        os.mkfifo(step / name)
    elif kind == "symlink":
        (step / name).symlink_to(outside)
    listed = json.loads((step / "manifest.json").read_text())
    algorithm = entry_hash(next(iter(listed["files"].values())))
    listed["files"][name] = {"size": 0, algorithm: file_hash(os.devnull, algorithm=algorithm)}
    (step / "manifest.json").write_text(json.dumps(listed))
    where = f"entry {name!r}" if kind in ("climbing", "absolute") else str(step / name)

    proc = within_seconds(60, lambda: run_cmd([sys.executable, "convert2ckpt.py", "--verify", str(ckpt)]))
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("convert2ckpt:") and where in lines[0], proc.stderr
    for cmd in (["--inspect", str(ckpt)], ["--to-hf", "--input", str(ckpt), "--output", str(tmp_path / "hf")]):
        proc = run_cmd([sys.executable, "convert2ckpt.py", *cmd])
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and where in proc.stderr, (cmd, proc.stderr)
    assert not (tmp_path / "hf").exists()
    with pytest.raises(RunError, match=f"^resume_from=global_step0: .*{re.escape(where)}"):
        check_resume_from(str(ckpt), "global_step0")
    from checkpoint.pipeline_reader import PipelineCheckpoint

    with pytest.raises(CheckpointError, match=re.escape(where)):
        PipelineCheckpoint(str(ckpt))
