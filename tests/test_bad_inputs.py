"""The bad-input catalogue: every case gives a one-line error naming the problem and the file or key,
exits non-zero, leaves no output that looks complete, and leaves its inputs untouched.

Each case builds its own inputs under tmp_path and returns (command, expected fragment, output
path, input paths[, ranks]). The inputs are hashed before and after the command. A multi-rank case
expects the one-line error once per rank (every rank learns of a failure on any rank) and no traceback.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, free_port, run_cmd, small_run

pytestmark = pytest.mark.slow

CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def trainer_cmd(*overrides: str, script: str = "trainer.py") -> list[str]:
    return [sys.executable, script, *overrides]


def run_args(ckpt: str, out: Path, train: str, **extra) -> list[str]:
    return small_run(ckpt, out, train, **{"max_steps": 2, **extra})


def convert_cmd(src: Path | str, out: Path) -> list[str]:
    return [sys.executable, "convert2ckpt.py", "--input", str(src), "--output", str(out)]


def copy(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ---------------------------------------------------------------- conversion inputs


def edit_config(src: Path, **changes) -> None:
    conf = json.loads((src / "config.json").read_text())
    conf.update(changes)
    (src / "config.json").write_text(json.dumps(conf))


@case
def unsupported_model_type(t):
    src = copy(t.hf["gqa"], t.tmp / "hf")
    edit_config(src, model_type="gemma")
    return (
        convert_cmd(src, t.out),
        "model_type='gemma' is not supported (supported: llama, mistral, qwen2, qwen3)",
        t.out,
        [src],
    )


@case
def mistral_relabelled_as_llama(t):
    src = copy(t.hf["mistral"], t.tmp / "hf")
    edit_config(src, model_type="llama")
    return convert_cmd(src, t.out), "model_type='llama' with sliding_window=6", t.out, [src]


@case
def missing_hf_shard(t):
    src = copy(t.hf["gqa"], t.tmp / "hf")
    shard = sorted(n for n in os.listdir(src) if n.endswith(".safetensors"))[1]
    os.remove(src / shard)
    return convert_cmd(src, t.out), shard, t.out, [src]


@case
def truncated_safetensors(t):
    src = copy(t.hf["gqa"], t.tmp / "hf")
    shard = src / sorted(n for n in os.listdir(src) if n.endswith(".safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-100])
    return convert_cmd(src, t.out), f"{shard.name}: truncated", t.out, [src]


@case
def keys_of_another_architecture(t):
    from safetensors.torch import save_file

    src = copy(t.hf["gqa"], t.tmp / "hf")
    save_file({"transformer.h.0.attn.c_attn.weight": torch.zeros(2, 2)}, str(src / "extra.safetensors"))
    index = json.load(open(src / "model.safetensors.index.json"))
    index["weight_map"]["transformer.h.0.attn.c_attn.weight"] = "extra.safetensors"
    json.dump(index, open(src / "model.safetensors.index.json", "w"))
    return convert_cmd(src, t.out), "transformer.h.0.attn.c_attn.weight", t.out, [src]


@case
def tokenizer_larger_than_embedding(t):
    from transformers import AutoTokenizer

    src = copy(t.hf["gqa"], t.tmp / "hf")
    tok = AutoTokenizer.from_pretrained(str(src))
    tok.add_tokens([f"<extra_{i}>" for i in range(80)])
    tok.save_pretrained(str(src))
    return convert_cmd(src, t.out), "vocab_size=64", t.out, [src]


@case
def shard_size_transformers_does_not_accept(t):
    out = t.tmp / "hf"
    cmd = [sys.executable, "convert2ckpt.py", "--to-hf", "--input", t.ckpt, "--output", str(out),
           "--max-shard-size", "5G"]  # fmt: skip
    return cmd, "--max-shard-size 5G: expected a whole number with a unit", out, [t.ckpt]


@case
def empty_layer_range(t):
    cmd = [*convert_cmd(t.hf["gqa"], t.out), "--layers", "5-2"]
    return cmd, "--layers 5-2: 5-2 is an empty range", t.out, [t.hf["gqa"]]


@case
def flipped_byte_in_checkpoint(t):
    ckpt = copy(t.ckpt, t.tmp / "ckpt")
    layer = ckpt / "global_step0" / "layer_02-model_00-model_states.pt"
    data = bytearray(layer.read_bytes())
    data[len(data) // 2] ^= 0xFF
    layer.write_bytes(bytes(data))
    return [sys.executable, "convert2ckpt.py", "--verify", str(ckpt)], layer.name, None, [ckpt]


# ---------------------------------------------------------------- run configuration


@case
def num_stages_beyond_layer_count(t):
    return trainer_cmd(*run_args(t.ckpt, t.out, t.train, num_stages=6)), "num_stages=6", t.out, [t.ckpt]


@case
def world_size_not_divisible_by_stages(t):
    cmd = trainer_cmd(*run_args(t.ckpt, t.out, t.train, num_stages=2))
    return cmd, "num_stages=2 does not divide the world size 1", t.out, [t.ckpt]


@case
def tensor_parallel_not_dividing_the_world(t):
    cmd = trainer_cmd(*run_args(t.ckpt, t.out, t.train, tensor_parallel_size=2))
    return cmd, "num_stages=1 x tensor_parallel_size=2 does not divide the world size 1", t.out, [t.ckpt]


@case
def tensor_parallel_not_dividing_kv_heads(t):
    launcher = str(Path(sys.executable).parent / "deepspeed")  # 4 ranks: every one of them says it
    cmd = [launcher, "--num_gpus", "4", "--master_port", str(free_port()), "trainer.py",
           *run_args(t.ckpt, t.out, t.train, tensor_parallel_size=4)]  # fmt: skip
    return cmd, "tensor_parallel_size=4 must divide num_attention_heads=4 and num_key_value_heads=2", t.out, [t.ckpt], 4


@case
def conversion_tp_not_dividing_heads(t):
    cmd = [*convert_cmd(t.hf["gqa"], t.out), "--tp", "3"]
    return cmd, "--tp 3: must divide num_attention_heads=4", t.out, [t.hf["gqa"]]


@case
def partition_not_summing_to_layers(t):
    cmd = trainer_cmd(*run_args(t.ckpt, t.out, t.train, **{"model.partition": "[3]"}))
    return cmd, "sum to num_hidden_layers=4", t.out, [t.ckpt]


@case
def sequence_beyond_max_positions(t):
    cmd = trainer_cmd(*run_args(t.ckpt, t.out, t.train, seq_length=4096))
    return cmd, "exceeds max_position_embeddings=256", t.out, [t.ckpt]


@case
def unknown_config_key(t):
    cmd = trainer_cmd(*run_args(t.ckpt, t.out, t.train), "lerning_rate=1e-4")
    return cmd, "lerning_rate: unknown config key (did you mean learning_rate?)", t.out, [t.ckpt]


@case
def value_of_wrong_type(t):
    cmd = trainer_cmd(*run_args(t.ckpt, t.out, t.train), "micro_batch_size=two")
    return cmd, "micro_batch_size=two: Value 'two' of type 'str' could not be converted to Integer", t.out, [t.ckpt]


@case
def unknown_model_preset(t):
    return trainer_cmd(*run_args(t.ckpt, t.out, t.train), "model=llama9"), "model=llama9: unknown preset", t.out, []


@case
def checkpoint_of_another_model_size(t):
    ckpt = copy(t.ckpt, t.tmp / "ckpt")  # config.json: GQA (2 KV heads); one layer file from the MHA model
    layer = "layer_02-model_00-model_states.pt"
    shutil.copy(Path(t.mha_ckpt) / "global_step0" / layer, ckpt / "global_step0" / layer)
    cmd = trainer_cmd(*run_args(str(ckpt), t.out, t.train))
    return cmd, f"{layer}: does not fit this model", t.out, [ckpt]


@case
def model_preset_of_another_size(t):
    cmd = trainer_cmd(*run_args(t.ckpt, t.out, t.train), "model=llama2_7b")
    return cmd, "model.vocab_size=32000 (preset llama2_7b)", t.out, [t.ckpt]


@case
def flash_attention_without_flash_attn(t):
    cmd = trainer_cmd(*run_args(t.ckpt, t.out, t.train), "model.attn_implementation=flash_attention_2")
    return cmd, "flash-attn", t.out, [t.ckpt]


@case
def unknown_lora_target_module(t):
    cmd = trainer_cmd(*run_args(t.ckpt, t.out, t.train, **{"lora.enabled": "true",
                                                            "lora.target_modules": "[q_proj,qproj]"}))  # fmt: skip
    return cmd, "lora.target_modules: 'qproj' is not a linear layer of the decoder", t.out, [t.ckpt]


@case
def checkpoint_without_tokenizer_files(t):
    ckpt = copy(t.ckpt, t.tmp / "ckpt")
    for name in os.listdir(ckpt):
        if name.startswith(("tokenizer", "special_tokens")):
            os.remove(ckpt / name)
    cmd = trainer_cmd(*run_args(str(ckpt), t.out, t.train))
    return cmd, f"model_name_or_path {ckpt}: no tokenizer files", t.out, [ckpt]


@case
def do_eval_without_eval_file(t):
    cmd = trainer_cmd(*run_args(t.ckpt, t.out, t.train, do_eval="true"))
    return cmd, "do_eval=true needs eval_file", t.out, [t.ckpt]


@case
def resume_without_checkpoint(t):
    cmd = trainer_cmd(*run_args(t.ckpt, t.out, t.train, resume="true"))
    return cmd, f"resume=true but output_dir {t.out} holds no checkpoint", t.out, [t.ckpt]


@case
def output_dir_not_writable(t):
    blocker = t.tmp / "a_file"
    blocker.write_text("not a directory")
    out = blocker / "run"
    return trainer_cmd(*run_args(t.ckpt, out, t.train)), f"output_dir {out}: cannot create", None, [t.ckpt, blocker]


# ---------------------------------------------------------------- data


@case
def empty_dataset(t):
    data = t.tmp / "empty.jsonl"
    data.write_text("\n")
    return trainer_cmd(*run_args(t.ckpt, t.out, str(data))), f"{data}: empty dataset", t.out, [t.ckpt, data]


@case
def jsonl_row_not_json(t):
    data = t.tmp / "bad.jsonl"
    data.write_text('{"text": "one two"}\n{"text": "three\n')
    return trainer_cmd(*run_args(t.ckpt, t.out, str(data))), f"{data}:2: not valid JSON", t.out, [t.ckpt, data]


@case
def bad_json_row_on_four_ranks(t):
    """Rank 0 finds the bad row while tokenizing; ranks 1-3 learn of it and exit with the same line."""
    data = t.tmp / "bad.jsonl"
    data.write_text('{"text": "one two"}\n{"text": "three\n' + '{"text": "four"}\n' * 30)
    launcher = str(Path(sys.executable).parent / "deepspeed")
    cmd = [launcher, "--num_gpus", "4", "--master_port", str(free_port()), "trainer.py",
           *run_args(t.ckpt, t.out, str(data), num_stages=2)]  # fmt: skip
    return cmd, f"{data}:2: not valid JSON", t.out, [t.ckpt, data], 4


@case
def rows_without_target_tokens(t):
    data = t.tmp / "prompts_only.jsonl"  # every prompt fills seq_length, so no response token survives
    rows = [{"prompt": "one two three four " * 8, "response": "five"} for _ in range(8)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cmd = trainer_cmd(*run_args(t.ckpt, t.out, str(data)))
    return cmd, f"{data}: none of the 8 rows has a target token", t.out, [t.ckpt, data]


@case
def missing_train_file(t):
    missing = "/nonexistent/train.jsonl"
    return trainer_cmd(*run_args(t.ckpt, t.out, missing)), f"{missing}: cannot read", t.out, [t.ckpt]


# ---------------------------------------------------------------- while saving


@case
def disk_full_during_save(t):
    """Step 1 is saved; saving step 2 hits ENOSPC: the error names the file, step 1 stays `latest`."""
    out = t.tmp / "run"
    first = run_cmd(trainer_cmd(*run_args(t.ckpt, out, t.train, max_steps=1)))
    assert first.returncode == 0, first.stderr[-2000:]
    t.env["FAULT"] = "enospc:step=2"
    cmd = trainer_cmd(*run_args(t.ckpt, out, t.train, resume="true"), script="tests/workers/faulty_trainer.py")
    return cmd, "No space left on device", out, [t.ckpt, out / "global_step1", out / "latest"]


# ---------------------------------------------------------------- the test


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


def test_catalogue_is_large_enough():
    assert len(CASES) >= 15


def test_readme_counts_the_catalogue():
    readme = (REPO / "README.md").read_text()
    assert f"`tests/test_bad_inputs.py` is the catalogue ({len(CASES)} cases)" in readme


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input(name, hf_models, converted, sft_data, tmp_path, monkeypatch):
    t = Inputs(tmp_path, hf_models, converted, sft_data)
    cmd, fragment, out, inputs, *rest = CASES[name](t)
    ranks = rest[0] if rest else 1
    before = digest(inputs)
    for key, value in t.env.items():
        monkeypatch.setenv(key, value)
    proc = run_cmd(cmd, timeout=300)
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if fragment in line]  # the message is one line
    assert errors and (ranks == 1 or len(errors) == ranks), proc.stderr[-3000:]  # once on every rank
    assert all(line == errors[0] for line in errors), errors
    assert digest(inputs) == before, "inputs changed"
    assert not looks_complete(out, inputs), os.listdir(out)
    if out is not None and out.exists():
        assert not [n for n in os.listdir(out) if n.startswith((".saving-", ".tmp"))], os.listdir(out)
    print(f"{name}: {errors[-1]}")
