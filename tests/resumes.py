"""Resumes in the tests: a run's directory as it was right after a save (`interrupted_copy`), and the check that a
resumed run trained its own steps as the uninterrupted one did (`assert_resumed_exactly`)."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import torch

from checkpoint.layer_files import load_layer_state
from tests.conftest import read_jsonl


def interrupted_copy(full, part, at: int) -> None:
    """What `full` held right after it saved step `at`: later checkpoints, metrics and `latest` undone."""

    def later(_, names):
        return [n for n in names if (m := re.fullmatch(r"global_step(\d+)", n)) and int(m.group(1)) > at]

    shutil.copytree(full, part, ignore=later)
    (part / "latest").write_text(f"global_step{at}")
    lines = (part / "metrics.jsonl").read_text().splitlines(keepends=True)[:at]
    (part / "metrics.jsonl").write_text("".join(lines))


def tensors(obj, path: str = "") -> dict[str, torch.Tensor]:
    """Every tensor in a loaded checkpoint file, by its path in the nested dicts and lists."""
    if isinstance(obj, torch.Tensor):
        return {path: obj}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list | tuple) else ()
    return {k: v for key, value in items for k, v in tensors(value, f"{path}/{key}").items()}


def load_checkpoint_file(path: str):
    """A checkpoint file of our runs, DeepSpeed's ZeRO shards included (its plain-data types allowed, as a resume
    allows them: training/expert_parallel.py)."""
    from checkpoint.safe_load import deepspeed_data_classes, safe_globals

    with torch.serialization.safe_globals([*safe_globals(), *deepspeed_data_classes()]):
        return torch.load(path, map_location="cpu", weights_only=True)


def assert_resumed_exactly(full: Path, part: Path, at: int) -> None:
    """`part`, an `interrupted_copy` of `full` at step `at` then resumed, trained its own steps as `full` did: the
    metrics of the steps after `at` (the earlier lines were copied) and every tensor of the last checkpoint (layer
    files: weights, or the adapters alone with LoRA; engine and ZeRO files: Adam moments, master weights), bit for
    bit."""
    ref, got = read_jsonl(full / "metrics.jsonl"), read_jsonl(part / "metrics.jsonl")
    assert [m["step"] for m in got] == [m["step"] for m in ref] and len(ref) > at
    for a, b in zip(ref[at:], got[at:], strict=True):
        assert (a["loss"], a["lr"], a["grad_norm"]) == (b["loss"], b["lr"], b["grad_norm"]), (a, b)
    final = f"global_step{ref[-1]['step']}"
    names = sorted(n for n in os.listdir(full / final) if n.endswith((".pt", ".safetensors")))
    assert names == sorted(n for n in os.listdir(part / final) if n.endswith((".pt", ".safetensors")))
    moments = 0
    for name in names:  # a layer file may be empty (LoRA: the embedding's)
        load = load_layer_state if name.startswith("layer_") else load_checkpoint_file
        a, b = tensors(load(str(full / final / name))), tensors(load(str(part / final / name)))
        assert a.keys() == b.keys(), name
        assert all(torch.equal(a[k], b[k]) for k in a), (name, [k for k in a if not torch.equal(a[k], b[k])][:3])
        moments += sum("exp_avg" in k for k in a)
    assert moments, "no Adam moments compared"
