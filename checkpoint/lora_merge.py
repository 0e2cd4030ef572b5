"""Where LoRA adapters come from for `convert2ckpt.py --to-hf --merge-lora [ADAPTER_DIR]`, and their scale.

- From a LoRA training checkpoint: its layer files hold only the adapters; `lora.json` in the run
  directory names the base checkpoint and r / alpha.
- From a PEFT adapter directory (`adapter_config.json`, `adapter_model.safetensors`), merged into
  a pipeline checkpoint or a Hugging Face directory.

The merge is PEFT's own: W + scale * B @ A per module, with scale = alpha / r, or alpha / sqrt(r)
with `use_rslora`, where r and alpha come from `rank_pattern` / `alpha_pattern` when a pattern
matches the module's name (PEFT's matching rule, `peft.utils.other.get_pattern_key`). Adapters that
are not plain LoRA (DoRA, trained biases, `modules_to_save`, other PEFT types, ...) are refused,
naming the field, rather than merged into a model that silently differs from PEFT's.
"""

from __future__ import annotations

import json
import math
import os
import re

import torch
from safetensors.torch import load_file

from checkpoint.errors import CheckpointError
from checkpoint.names import LORA_FILE
from checkpoint.pipeline_reader import PipelineCheckpoint
from checkpoint.safe_load import load_pt
from models.key_table import DECODER_PREFIX, hf_decoder_module
from models.lora import LORA_A, LORA_B, LoraDelta
from models.pipe_layout import DECODER, decoder_index

# PEFT's saved key of a decoder module's factor: "base_model.model." + the HF module name + ".lora_A.weight".
PEFT_KEY = re.compile(
    re.escape("base_model.model." + DECODER_PREFIX).replace(r"\{\}", r"(\d+)") + r"(.+)\.lora_([AB])\.weight"
)
# adapter_config.json fields that make an adapter something other than plain LoRA (merge would differ).
NOT_PLAIN = (
    "use_dora",
    "lora_bias",
    "layer_replication",
    "target_parameters",
    "trainable_token_indices",
    "alora_invocation_tokens",
    "use_qalora",
    "use_bdlora",
    "arrow_config",
    "kasa_config",
    "monteclora_config",
)


def lora_scale(alpha: float, r: int, use_rslora: bool = False) -> float:
    """PEFT's `LoraLayer.update_layer`: alpha / sqrt(r) with rsLoRA, else alpha / r."""
    return alpha / math.sqrt(r) if use_rslora else alpha / r


def _pattern_value(patterns: dict, module: str, default):
    from peft.utils.other import get_pattern_key

    return patterns.get(get_pattern_key(list(patterns), module), default)


def check_plain_lora(conf: dict, where: str) -> None:
    """Refuse, naming the field, an adapter config that PEFT would merge differently from W + s B A."""
    if conf.get("peft_type", "LORA") != "LORA":
        raise CheckpointError(f"{where}: peft_type={conf['peft_type']!r}; only LoRA adapters merge")
    for field in NOT_PLAIN:
        if conf.get(field):
            raise CheckpointError(f"{where}: {field}={conf[field]!r} is not plain LoRA; refusing to merge it")
    if conf.get("bias", "none") != "none":
        raise CheckpointError(f"{where}: bias={conf['bias']!r} (trained biases) is not plain LoRA; refusing to merge")
    if conf.get("modules_to_save"):
        raise CheckpointError(
            f"{where}: modules_to_save={conf['modules_to_save']} (fully trained modules) is not plain LoRA; "
            "refusing to merge it"
        )


def adapters_from_checkpoint(run) -> tuple[PipelineCheckpoint, dict[int, dict[str, LoraDelta]]]:
    """(the base checkpoint, opened, {layer index: {module: LoraDelta}}) of a LoRA training run's checkpoint `run`
    (a `PipelineCheckpoint`; its layer files hold the adapters only, `lora.json` names the base)."""
    path = os.path.join(run.ckpt_dir, LORA_FILE)
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: missing; --merge-lora without a directory needs a LoRA training run")
    with open(path) as f:
        info = json.load(f)
    adapters = {}
    for layer in run.layers:
        if layer.kind != DECODER:
            continue
        state = run.load_whole(layer)  # TP shards merged
        deltas = {}
        for key, a in state.items():
            if key.endswith(LORA_A):
                module = key.removesuffix(LORA_A)
                scale = lora_scale(info["alpha"], a.shape[0], info.get("use_rslora", False))
                deltas[module] = LoraDelta(a, state[module + LORA_B], scale)
        adapters[layer.index] = deltas
    return PipelineCheckpoint(info["base"]), adapters


def adapters_from_peft(adapter_dir: str, config) -> dict[int, dict[str, LoraDelta]]:
    """{layer index: {module: LoraDelta}} of a PEFT LoRA adapter directory, scaled as PEFT scales it."""
    conf_path = os.path.join(adapter_dir, "adapter_config.json")
    weights = os.path.join(adapter_dir, "adapter_model.safetensors")
    legacy = os.path.join(adapter_dir, "adapter_model.bin")  # PEFT's format before safetensors
    if not os.path.exists(conf_path):
        raise CheckpointError(f"{conf_path}: missing (not a PEFT adapter directory)")
    if not os.path.exists(weights) and not os.path.exists(legacy):
        raise CheckpointError(f"{weights}: missing, and no adapter_model.bin either (not a PEFT adapter directory)")
    try:
        with open(conf_path) as f:
            conf = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{conf_path}: not valid JSON ({e})") from None
    check_plain_lora(conf, conf_path)
    factors: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    if os.path.exists(weights):
        state = load_file(weights)
    else:  # plain tensor data only, through the safe loader: a pickle that names anything else is refused
        weights = legacy
        state = load_pt(legacy, what="PEFT adapter")
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise CheckpointError(f"{legacy}: not a PEFT adapter state dict (a dict of tensors)")
    for key, tensor in state.items():
        m = PEFT_KEY.fullmatch(key)
        if not m or int(m.group(1)) >= config.num_hidden_layers:
            raise CheckpointError(f"{weights}: {key} is not a LoRA weight of this model's decoder layers")
        factors.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = tensor
    adapters: dict[int, dict[str, LoraDelta]] = {}
    for (block, module), ab in sorted(factors.items()):
        if set(ab) != {"A", "B"}:
            raise CheckpointError(f"{weights}: {hf_decoder_module(block, module)} has lora_{set(ab).pop()} only")
        name = hf_decoder_module(block, module)  # the key PEFT matches patterns against
        r = _pattern_value(conf.get("rank_pattern") or {}, name, conf["r"])
        if ab["A"].shape[0] != r:
            raise CheckpointError(f"{weights}: {name} has rank {ab['A'].shape[0]} but the config gives r={r}")
        alpha = _pattern_value(conf.get("alpha_pattern") or {}, name, conf["lora_alpha"])
        delta = LoraDelta(ab["A"], ab["B"], lora_scale(alpha, r, conf.get("use_rslora", False)))
        adapters.setdefault(decoder_index(block), {})[module] = delta
    return adapters
