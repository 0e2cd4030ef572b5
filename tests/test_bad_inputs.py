"""The bad-input catalogue, inputs that are wrong (tests/catalogue.py is the harness and says what each case
must show; tests/test_bad_outputs.py holds the commands that would destroy or mix what the user has)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from tests.catalogue import Catalogue, Inputs, convert_cmd, copy, run_args, run_case, trainer_cmd
from tests.conftest import REPO, deepspeed_cmd, run_cmd

pytestmark = pytest.mark.slow

CASES = Catalogue()
case = CASES.case
config_case = CASES.config_case
data_case = CASES.data_case


# ---------------------------------------------------------------- conversion inputs


def edit_config(src: Path, **changes) -> None:
    conf = json.loads((src / "config.json").read_text())
    conf.update(changes)
    (src / "config.json").write_text(json.dumps(conf))


@case
def unsupported_model_type(t):
    from models.config import SUPPORTED_MODEL_TYPES

    src = copy(t.hf["gqa"], t.tmp / "hf")
    edit_config(src, model_type="gemma")
    return (
        convert_cmd(src, t.out),
        f"model_type='gemma' is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})",  # the registry's
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
    cmd = [
        sys.executable,
        "convert2ckpt.py",
        "--to-hf",
        "--input",
        t.ckpt,
        "--output",
        str(out),
        "--max-shard-size",
        "5G",
    ]
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


@case
def corrupt_manifest(t):
    ckpt = copy(t.ckpt, t.tmp / "ckpt")
    (ckpt / "global_step0" / "manifest.json").write_text('{"files": {"layer_00')
    cmd = [sys.executable, "convert2ckpt.py", "--verify", str(ckpt)]
    return cmd, "manifest.json: not a manifest (JSONDecodeError)", None, [ckpt]


# ---------------------------------------------------------------- run configuration


@config_case
def num_stages_beyond_layer_count(t):
    return trainer_cmd(*run_args(t.ckpt, t.out, t.train, num_stages=6)), "num_stages=6", t.out, [t.ckpt]


@config_case
def world_size_not_divisible_by_stages(t):
    cmd = trainer_cmd(*run_args(t.ckpt, t.out, t.train, num_stages=2))
    return cmd, "num_stages=2 does not divide the world size 1", t.out, [t.ckpt]


@config_case
def tensor_parallel_not_dividing_the_world(t):
    cmd = trainer_cmd(*run_args(t.ckpt, t.out, t.train, tensor_parallel_size=2))
    return cmd, "num_stages=1 x tensor_parallel_size=2 does not divide the world size 1", t.out, [t.ckpt]


@case
def tensor_parallel_not_dividing_kv_heads(t):
    cmd = deepspeed_cmd(4, *run_args(t.ckpt, t.out, t.train, tensor_parallel_size=4))  # 4 ranks: each says it
    return cmd, "tensor_parallel_size=4 must divide num_key_value_heads=2", t.out, [t.ckpt], 4


@case
def conversion_tp_not_dividing_heads(t):
    cmd = [*convert_cmd(t.hf["gqa"], t.out), "--tp", "3"]
    return cmd, "--tp 3: must divide num_attention_heads=4", t.out, [t.hf["gqa"]]


@config_case
def bf16_without_zero_keeping_fp32_gradients(t):
    cmd = trainer_cmd(*run_args(t.ckpt, t.out, t.train, deepspeed="bf16_zero1", **{"deepspeed.zero_stage": 0}))
    return cmd, "deepspeed.zero_stage=0 with bf16 needs deepspeed.grad_accum_dtype=bf16", t.out, [t.ckpt]


@config_case
def partition_not_summing_to_layers(t):
    cmd = trainer_cmd(*run_args(t.ckpt, t.out, t.train, **{"model.partition": "[3]"}))
    return cmd, "sum to num_hidden_layers=4", t.out, [t.ckpt]


@config_case
def sequence_beyond_max_positions(t):
    cmd = trainer_cmd(*run_args(t.ckpt, t.out, t.train, seq_length=4096))
    return cmd, "exceeds max_position_embeddings=256", t.out, [t.ckpt]


@case
def unknown_config_key(t):
    cmd = trainer_cmd(*run_args(t.ckpt, t.out, t.train), "lerning_rate=1e-4")
    return cmd, "lerning_rate: unknown config key (did you mean learning_rate?)", t.out, [t.ckpt]


@config_case
def value_of_wrong_type(t):
    cmd = trainer_cmd(*run_args(t.ckpt, t.out, t.train), "micro_batch_size=two")
    return cmd, "micro_batch_size=two: Value 'two' of type 'str' could not be converted to Integer", t.out, [t.ckpt]


@config_case
def unknown_model_preset(t):
    return trainer_cmd(*run_args(t.ckpt, t.out, t.train), "model=llama9"), "model=llama9: unknown preset", t.out, []


@case
def checkpoint_of_another_model_size(t):
    ckpt = copy(t.ckpt, t.tmp / "ckpt")  # config.json: GQA (2 KV heads); one layer file from the MHA model
    layer = "layer_02-model_00-model_states.pt"
    shutil.copy(Path(t.mha_ckpt) / "global_step0" / layer, ckpt / "global_step0" / layer)
    cmd = trainer_cmd(*run_args(str(ckpt), t.out, t.train))
    return cmd, f"{layer}: does not fit this model", t.out, [ckpt]


@config_case
def model_preset_of_another_size(t):
    cmd = trainer_cmd(*run_args(t.ckpt, t.out, t.train), "model=llama2_7b")
    return cmd, "model.vocab_size=32000 (preset llama2_7b)", t.out, [t.ckpt]


@config_case
def preset_field_the_family_lacks(t):
    cmd = trainer_cmd(*run_args(t.ckpt, t.out, t.train), "+model.config_fields.q_lora_ranks=8")
    return cmd, "model.config_fields.q_lora_ranks: not a field of LlamaConfig (llama)", t.out, [t.ckpt]


@config_case
def preset_field_of_another_model(t):
    cmd = trainer_cmd(*run_args(t.ckpt, t.out, t.train), "+model.config_fields.hidden_act=gelu")
    return cmd, "model.config_fields.hidden_act=gelu (preset from_checkpoint) but", t.out, [t.ckpt]


@config_case
def flash_attention_without_flash_attn(t):
    cmd = trainer_cmd(*run_args(t.ckpt, t.out, t.train), "model.attn_implementation=flash_attention_2")
    return cmd, "flash-attn", t.out, [t.ckpt]


@config_case
def unknown_lora_target_module(t):
    cmd = trainer_cmd(
        *run_args(t.ckpt, t.out, t.train, **{"lora.enabled": "true", "lora.target_modules": "[q_proj,qproj]"})
    )
    return cmd, "lora.target_modules: 'qproj' is not a linear layer of the decoder", t.out, [t.ckpt]


@case
def checkpoint_without_tokenizer_files(t):
    ckpt = copy(t.ckpt, t.tmp / "ckpt")
    for name in os.listdir(ckpt):
        if name.startswith(("tokenizer", "special_tokens")):
            os.remove(ckpt / name)
    cmd = trainer_cmd(*run_args(str(ckpt), t.out, t.train))
    return cmd, f"model_name_or_path {ckpt}: no tokenizer files", t.out, [ckpt]


@config_case
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


@data_case
def empty_dataset(t):
    data = t.tmp / "empty.jsonl"
    data.write_text("\n")
    return trainer_cmd(*run_args(t.ckpt, t.out, str(data))), f"{data}: empty dataset", t.out, [t.ckpt, data]


@data_case
def jsonl_row_not_json(t):
    data = t.tmp / "bad.jsonl"
    data.write_text('{"text": "one two"}\n{"text": "three\n')
    return trainer_cmd(*run_args(t.ckpt, t.out, str(data))), f"{data}:2: not valid JSON", t.out, [t.ckpt, data]


@case
def bad_json_row_on_four_ranks(t):
    """Rank 0 finds the bad row while tokenizing; ranks 1-3 learn of it and exit with the same line."""
    data = t.tmp / "bad.jsonl"
    data.write_text('{"text": "one two"}\n{"text": "three\n' + '{"text": "four"}\n' * 30)
    cmd = deepspeed_cmd(4, *run_args(t.ckpt, t.out, str(data), num_stages=2))
    return cmd, f"{data}:2: not valid JSON", t.out, [t.ckpt, data], 4


@data_case
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


@data_case
def lone_surrogate_in_jsonl(t):
    data = t.tmp / "surrogate.jsonl"
    data.write_text('{"text": "one two"}\n{"text": "three \\ud800 four"}\n')
    cmd = trainer_cmd(*run_args(t.ckpt, t.out, str(data)))
    return cmd, f"{data}:2: 'text' is not valid Unicode (a lone surrogate \\ud800", t.out, [t.ckpt, data]


@data_case
def jsonl_bytes_not_utf8(t):
    data = t.tmp / "latin1.jsonl"
    data.write_bytes('{"text": "one two"}\n{"text": "caf\u00e9"}\n'.encode("latin-1"))
    cmd = trainer_cmd(*run_args(t.ckpt, t.out, str(data)))
    return cmd, f"{data}:2: not UTF-8 text (byte 0xe9 at column 14)", t.out, [t.ckpt, data]


@data_case
def row_with_text_and_prompt(t):
    data = t.tmp / "both.jsonl"
    data.write_text('{"text": "one two"}\n{"text": "three", "prompt": "1+1=", "response": "2"}\n')
    cmd = trainer_cmd(*run_args(t.ckpt, t.out, str(data)))
    return cmd, f"{data}:2: row has both 'prompt'/'response' and 'text'", t.out, [t.ckpt, data]


@data_case
def chat_template_that_raises(t):
    """A `tool` turn under a template that allows only alternating user/assistant turns (Llama-2 style)."""
    ckpt = copy(t.ckpt, t.tmp / "ckpt")
    conf = json.loads((ckpt / "tokenizer_config.json").read_text())
    conf["chat_template"] = (
        "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
    )
    (ckpt / "tokenizer_config.json").write_text(json.dumps(conf))
    data = t.tmp / "chat.jsonl"
    turns = [
        {"role": "user", "content": "1+1="},
        {"role": "tool", "content": "2"},
        {"role": "assistant", "content": "2"},
    ]
    good = [{"role": "user", "content": "2+2="}, {"role": "assistant", "content": "4"}]
    data.write_text(json.dumps({"messages": turns}) + "\n" + json.dumps({"messages": good}) + "\n")
    cmd = trainer_cmd(*run_args(str(ckpt), t.out, str(data)))
    fragment = f"{data}:1: the tokenizer's chat template refused this conversation: Conversation roles must alternate"
    return cmd, fragment, t.out, [ckpt, data]


# ---------------------------------------------------------------- numeric settings (one line each, before any step)


@case
def learning_rate_inf_with_skip(t):
    cmd = trainer_cmd(*run_args(t.ckpt, t.out, t.train, learning_rate="inf", nonfinite_loss="skip"))
    return cmd, "learning_rate=inf must be a finite number in [0, inf]", t.out, [t.ckpt]


@config_case
def negative_warmup_ratio(t):
    cmd = trainer_cmd(*run_args(t.ckpt, t.out, t.train, **{"optim.warmup_ratio": -0.5}))
    return cmd, "optim.warmup_ratio=-0.5 must be a finite number in [0, 1]", t.out, [t.ckpt]


@config_case
def adam_beta1_above_one(t):
    cmd = trainer_cmd(*run_args(t.ckpt, t.out, t.train, **{"optim.beta1": 1.5}))
    return cmd, "optim.beta1=1.5 must be a finite number in [0, 1)", t.out, [t.ckpt]


@data_case
def data_cache_dir_not_writable(t):
    blocker = t.tmp / "a_file"
    blocker.write_text("not a directory")
    cmd = trainer_cmd(*run_args(t.ckpt, t.out, t.train, **{"data.cache_dir": str(blocker / "cache")}))
    return (
        cmd,
        f"{blocker / 'cache'}: cannot write the tokenized store of {t.train} (Not a directory)",
        t.out,
        [t.ckpt, blocker],
    )


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


def test_docs_count_the_catalogue():
    from tests.test_bad_outputs import CASES as OUTPUT_CASES

    page = (REPO / "docs" / "reliability_and_security.md").read_text()
    assert f"the catalogue ({len(CASES) + len(OUTPUT_CASES)} cases)" in page


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input(name, hf_models, converted, sft_data, tmp_path, monkeypatch):
    run_case(CASES[name], Inputs(tmp_path, hf_models, converted, sft_data), monkeypatch, CASES.in_process.get(name))
