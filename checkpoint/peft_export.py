"""A LoRA run's adapters as a PEFT directory: `convert2ckpt.py --to-peft --input RUN --output DIR`.

    adapter_config.json         PEFT's LoraConfig (r, lora_alpha, lora_dropout, target_modules, use_rslora=false,
                                base_model_name_or_path, task_type CAUSAL_LM), written by PEFT itself
    adapter_model.safetensors   base_model.model.<module>.lora_A.weight [r, in] / .lora_B.weight [out, r]

what `PeftModel.from_pretrained(base, DIR)` and vLLM's LoRA loader read. Every stage's layers, tensor-parallel shards
joined (checkpoint/lora_merge.py `adapters_from_checkpoint` reads the run as `--merge-lora` does). Module names are
the Hugging Face model's own: `model.layers.N.` for a text model; for a run converted from a multimodal container
(its `container_config.json` kept beside) the container's decoder layers, found on its model built on the meta
device, and `target_modules` then a pattern of those layers (a bare name would adapt the vision tower too).
Adapters never go on routed experts (models/lora.py): a run with experts exports its attention's and shared
experts' adapters. (PEFT's own conversion for the MoE families transformers 5 fuses, Mixtral's and Qwen-MoE's
kinds, reads `gate_proj`/`up_proj`/`down_proj` targets as the routed experts' too when it loads an adapter, and
refuses `gate_proj` without `up_proj`: docs/lora_and_preference.md.)

`base_model_name_or_path`: `--base-model`, else the Hugging Face directory (or hub id) the run started from: its
`model_name_or_path`, or the input a converted checkpoint records (`.convert2ckpt.json`); a snapshot of the hub cache
(a run that named a hub id reads one) as its id, ORG/NAME.
"""

from __future__ import annotations

import json
import os
import re

import torch

from checkpoint.dtypes import DTYPES
from checkpoint.errors import CheckpointError
from checkpoint.hf_reader import is_hf_dir
from checkpoint.lora_merge import adapters_from_checkpoint
from checkpoint.names import CONTAINER_CONFIG, LORA_FILE
from checkpoint.outputs import PEFT_EXPORT, read_writer
from checkpoint.pipeline_reader import PipelineCheckpoint
from checkpoint.safetensors_writer import StreamingSafetensorsWriter
from checkpoint.staging import staged_directory
from common.hub import is_hub_id, snapshot_hub_id
from models.key_table import DECODER_PREFIX
from models.pipe_layout import pipe_layers

PEFT_WEIGHTS = "adapter_model.safetensors"  # (adapter_config.json: PEFT's own save_pretrained)


def decoder_prefixes(run_dir: str, config) -> list[str]:
    """The Hugging Face module name of each decoder block ("model.layers.3."), in the exported model's layout."""
    path = os.path.join(run_dir, CONTAINER_CONFIG)
    if not os.path.exists(path):
        return [DECODER_PREFIX.format(block) for block in range(config.num_hidden_layers)]
    import transformers
    from transformers import AutoConfig

    from models.families import family_of

    with open(path) as f:
        conf = json.load(f)
    arch = (conf.get("architectures") or [""])[0]
    if not hasattr(transformers, arch):
        raise CheckpointError(
            f"{path}: architecture {arch!r} is not in transformers; --to-peft cannot name its modules"
        )
    container = AutoConfig.for_model(**conf)
    with torch.device("meta"):
        model = getattr(transformers, arch)(container)
    layer = family_of(config).hf_class("DecoderLayer")
    names = [name for name, m in model.named_modules() if isinstance(m, layer)]
    if not names:  # a text model read as another family's (Qwen3-VL's as Qwen3's): its own decoder layer class
        names = [name for name, m in model.named_modules() if type(m).__name__.endswith("TextDecoderLayer")]
    if len(names) != config.num_hidden_layers:
        raise CheckpointError(f"{path}: {arch} has {len(names)} decoder layers, the run {config.num_hidden_layers}")
    return [f"{name}." for name in names]


def peft_targets(targets: list[str], prefixes: list[str]) -> list[str] | str:
    """`target_modules` for PEFT: the run's names, as trained, for a text model; under a container a pattern of its
    decoder layers only (PEFT matches a bare name in every tower: the vision encoder's `v_proj` too)."""
    if prefixes[0] == DECODER_PREFIX.format(0):
        return targets
    layers = re.escape(re.sub(r"\d+\.$", "", prefixes[0]))
    return rf"{layers}\d+\.(.*\.)?({'|'.join(re.escape(t) for t in targets)})"


def frozen_modules(config) -> str | None:
    """PEFT's `exclude_modules` for what models/lora.py leaves unadapted: modules transformers runs without gradients
    (DeepSeek-V3.2's indexer has a `q_b_proj` too)."""
    from models.families import family_of
    from models.lora import exclude_pattern

    return exclude_pattern(family_of(config).frozen)


def base_model_name(run_dir: str, lora_base: str) -> str:
    """The Hugging Face model the adapters apply to, as far as the run knows it (else the base checkpoint): a hub
    id the run named is written as the id, not as the cache snapshot the ranks read."""
    source = None
    config = os.path.join(run_dir, "train_config.yaml")
    if os.path.exists(config):
        from omegaconf import OmegaConf

        source = OmegaConf.load(config).get("model_name_or_path")
    if source and (is_hf_dir(source) or is_hub_id(source)):
        return snapshot_hub_id(source) or source  # a hub id's snapshot (the ranks read it) as the id
    record = read_writer(source or lora_base) or read_writer(lora_base) or {}
    hf = [p for p in record.get("inputs", []) if is_hf_dir(p)]
    return (snapshot_hub_id(hf[0]) or hf[0]) if len(hf) == 1 else os.path.abspath(source or lora_base)


def export_peft(
    run_dir: str,
    out_dir: str,
    tag: str | None = None,
    base_model: str | None = None,
    dtype: str | None = None,
    force: bool = False,
    log=print,
) -> int:
    """Write the adapters of the LoRA run `run_dir` (its `tag`, default the latest) as a PEFT directory `out_dir`.
    Returns the number of adapted modules.

    Raises:
        CheckpointError: not a LoRA run, or bad input; nothing is left in `out_dir`.
    """
    from peft import LoraConfig

    if not os.path.exists(os.path.join(run_dir, LORA_FILE)):
        raise CheckpointError(f"{os.path.join(run_dir, LORA_FILE)}: missing; --to-peft needs a LoRA training run")
    ckpt = PipelineCheckpoint(run_dir, tag)
    with open(os.path.join(run_dir, LORA_FILE)) as f:
        info = json.load(f)
    base, adapters = adapters_from_checkpoint(ckpt)
    prefixes = decoder_prefixes(run_dir, ckpt.config)
    layers = pipe_layers(ckpt.config.num_hidden_layers, ckpt.config.tie_word_embeddings)
    blocks = {layer.index: layer.block for layer in layers}
    cast = DTYPES[dtype] if dtype else None
    tensors = {}
    for index, deltas in sorted(adapters.items()):
        for module, delta in sorted(deltas.items()):
            name = f"base_model.model.{prefixes[blocks[index]]}{module}"
            for part, value in (("lora_A", delta.a), ("lora_B", delta.b)):
                tensors[f"{name}.{part}.weight"] = (value.to(cast) if cast else value).contiguous()
    if not tensors:
        raise CheckpointError(f"{ckpt.step_dir}: the run's layer files hold no adapters")
    config = LoraConfig(
        r=info["r"],
        lora_alpha=info["alpha"],
        lora_dropout=info.get("dropout", 0.0),
        target_modules=peft_targets(list(info["target_modules"]), prefixes),
        exclude_modules=frozen_modules(ckpt.config),
        base_model_name_or_path=base_model or base_model_name(run_dir, base.ckpt_dir),
        task_type="CAUSAL_LM",
    )
    plan = [(key, tuple(t.shape), t.dtype) for key, t in tensors.items()]
    with staged_directory(out_dir, force, PEFT_EXPORT, "--to-peft", [run_dir]) as tmp:
        with StreamingSafetensorsWriter(os.path.join(tmp, PEFT_WEIGHTS), plan, metadata={"format": "pt"}) as w:
            for key, tensor in tensors.items():
                w.write(key, tensor)
        config.save_pretrained(tmp)
    modules = len(tensors) // 2
    log(f"exported {modules} adapted modules of {ckpt.step_dir} -> {out_dir} (base {config.base_model_name_or_path})")
    return modules
