"""Where LoRA adapters come from for `convert2ckpt.py --to-hf --merge-lora [ADAPTER_DIR]`.

- From a LoRA training checkpoint: its layer files hold only the adapters; `lora.json` in the run
  directory names the base checkpoint and r / alpha.
- From a PEFT adapter directory (`adapter_config.json`, `adapter_model.safetensors`), merged into
  a pipeline checkpoint or a Hugging Face directory.
"""

from __future__ import annotations

import json
import os
import re

import torch
from safetensors.torch import load_file

from checkpoint.hf_reader import CheckpointError
from checkpoint.layer_files import find_layer_file, load_layer_state
from models.layout import DECODER, pipe_layers
from models.lora import ADAPTER

LORA_FILE = "lora.json"
PEFT_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(.+)\.lora_([AB])\.weight$")


def adapters_from_checkpoint(ckpt_dir: str, tag: str, config) -> tuple[str, dict[int, dict], float]:
    """(base checkpoint dir, {layer index: adapter state}, alpha / r) of a LoRA training run."""
    path = os.path.join(ckpt_dir, LORA_FILE)
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: missing; --merge-lora without a directory needs a LoRA training run")
    with open(path) as f:
        info = json.load(f)
    adapters = {}
    for layer in pipe_layers(config.num_hidden_layers, config.tie_word_embeddings):
        if layer.kind != DECODER:
            continue
        file = find_layer_file(os.path.join(ckpt_dir, tag), layer.index)
        if file is None:
            raise CheckpointError(f"{os.path.join(ckpt_dir, tag)}: no adapter file for layer {layer.index}")
        adapters[layer.index] = {k: v for k, v in load_layer_state(file).items() if ".lora_" in k}
    return info["base"], adapters, info["alpha"] / info["r"]


def adapters_from_peft(adapter_dir: str, config) -> tuple[dict[int, dict], float]:
    """({layer index: adapter state in our key names}, alpha / r) of a PEFT LoRA adapter directory."""
    conf_path = os.path.join(adapter_dir, "adapter_config.json")
    weights = os.path.join(adapter_dir, "adapter_model.safetensors")
    for path in (conf_path, weights):
        if not os.path.exists(path):
            raise CheckpointError(f"{path}: missing (not a PEFT adapter directory)")
    with open(conf_path) as f:
        conf = json.load(f)
    if conf.get("peft_type", "LORA") != "LORA" or conf.get("use_rslora") or conf.get("use_dora"):
        raise CheckpointError(f"{conf_path}: only plain LoRA adapters merge (no rsLoRA/DoRA/other PEFT types)")
    adapters: dict[int, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(weights).items():
        m = PEFT_KEY.match(key)
        if not m or int(m.group(1)) >= config.num_hidden_layers:
            raise CheckpointError(f"{weights}: {key} is not a LoRA weight of this model's decoder layers")
        block, module, which = int(m.group(1)), m.group(2), m.group(3)
        adapters.setdefault(block + 1, {})[f"{module}.lora_{which}.{ADAPTER}.weight"] = tensor
    return adapters, conf["lora_alpha"] / conf["r"]
