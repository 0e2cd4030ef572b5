"""`convert2ckpt.py --to-peft`: a LoRA run's adapters as a PEFT directory, named as the exported model names its
modules (a multimodal container's too), and its refusals (tests/test_lora.py holds TP=2 and a run with experts)."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from tests.conftest import check, launch, run_cmd
from tests.test_training import overrides, parity_cfg


@pytest.mark.slow
@pytest.mark.parametrize("container", ["gemma3", "qwen3_vl"])
def test_adapters_of_a_container_run_load_into_the_container(container, tokenizer_dir, sft_data, tmp_path):
    """Gemma 3's text model converted from its multimodal checkpoint (Gemma3ForConditionalGeneration, the text
    layers under `model.language_model.` in memory, `language_model.model.` on disk), and Qwen3-VL's (its text layers
    a class of their own, read as Qwen3's), LoRA-trained at PP=2: the PEFT directory loads with
    `PeftModel.from_pretrained` onto the multimodal model, every adapter from the file, whose text logits equal the
    trainer's (adapters merged on load) within 1e-5."""
    from peft import PeftModel
    from safetensors.torch import load_file

    from checkpoint.hf_model import load_causal_lm
    from tests.conftest import convert_in_process
    from tests.multimodal import multimodal

    torch.manual_seed(0)
    model, _, _, _ = multimodal(container)
    model.save_pretrained(tmp_path / "mm")
    assert convert_in_process(["--input", str(tmp_path / "mm"), "--output", str(tmp_path / "ckpt")]).returncode == 0
    cfg = parity_cfg(sft_data[0])
    lora = ["lora.enabled=true", "lora.r=4", "lora.alpha=8.0", "lora.target_modules=[q_proj,v_proj,down_proj]"]
    run = tmp_path / "run"
    args = overrides(cfg, str(tmp_path / "ckpt"), str(run), 2, tokenizer_name_or_path=tokenizer_dir, max_steps=2)
    check(launch(2, *args, *lora))
    check(
        run_cmd([sys.executable, "convert2ckpt.py", "--to-peft", "--input", str(run), "--output", str(tmp_path / "a")])
    )
    conf = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert conf["base_model_name_or_path"] == str(tmp_path / "mm") and conf["r"] == 4 and conf["lora_alpha"] == 8.0
    saved = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    assert all(k.startswith("base_model.model.model.language_model.layers.") for k in saved), sorted(saved)[:2]
    peft = PeftModel.from_pretrained(type(model).from_pretrained(str(tmp_path / "mm")), str(tmp_path / "a")).eval()
    assert len([k for k in peft.state_dict() if ".lora_" in k]) == len(saved)
    ids = torch.randint(3, 60, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(peft(ids).logits, load_causal_lm(str(run))(ids).logits, rtol=1e-5, atol=1e-5)


def test_to_peft_refuses_what_is_not_a_lora_run(converted, tmp_path):
    """A converted checkpoint (no adapters) and --to-peft beside --merge-lora: one line each, exit 2, no output."""
    out = tmp_path / "adapter"
    cli = [sys.executable, "convert2ckpt.py", "--to-peft", "--output", str(out), "--input"]
    proc = run_cmd([*cli, converted["gqa"]])
    assert proc.returncode == 2 and "lora.json: missing; --to-peft needs a LoRA training run" in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()
    both = run_cmd([*cli, converted["gqa"], "--merge-lora"])
    assert both.returncode == 2 and "--to-peft writes the adapters alone" in both.stderr and not out.exists()


def test_a_hub_snapshot_is_named_by_its_id(hf_models, tmp_path):
    """A run that named a hub id trains from the cache's snapshot (`models--ORG--NAME/snapshots/<commit>`): the
    PEFT config names the id, and so does a checkpoint converted from such a snapshot; other directories stay paths."""
    import shutil

    from checkpoint.outputs import write_writer
    from checkpoint.peft_export import base_model_name

    snapshot = tmp_path / "hub" / "models--acme--tiny-llama-v2" / "snapshots" / "0123abcd"
    shutil.copytree(hf_models["gqa"], snapshot)
    run = tmp_path / "run"
    run.mkdir()
    (run / "train_config.yaml").write_text(f"model_name_or_path: {snapshot}\n")
    assert base_model_name(str(run), str(tmp_path / "unused")) == "acme/tiny-llama-v2"
    (run / "train_config.yaml").write_text(f"model_name_or_path: {hf_models['gqa']}\n")
    assert base_model_name(str(run), str(tmp_path / "unused")) == hf_models["gqa"]
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    write_writer(str(ckpt), "pipeline checkpoint", "convert2ckpt.py", [str(snapshot)])
    (run / "train_config.yaml").write_text(f"model_name_or_path: {ckpt}\n")
    assert base_model_name(str(run), str(ckpt)) == "acme/tiny-llama-v2"
