"""`convert2ckpt.py --verify CKPT --against HF_DIR`: the checkpoint's logits against the HF model's.

A fixed probe batch runs through the checkpoint one pipeline layer at a time (one layer file in
memory) and through the Hugging Face model in fp32 with eager attention, streamed too: transformers
loads it with every decoder layer offloaded to disk (its own loader and accelerate's hooks), so a
layer's weights are read from the HF files just before its forward and dropped after it. Only the
modules outside the layer lists (embeddings, final norm, head) stay in memory for the whole pass.
Weights transformers only renames are read from the HF files in place; weights it converts (experts
fused into one tensor, dequantized FP8) are written once, in fp32, to a temporary folder under
$TMPDIR, removed afterwards.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import torch

from checkpoint.errors import CheckpointError
from checkpoint.hf_reader import read_model_config
from checkpoint.pipeline_reader import PipelineCheckpoint
from models.head import split_stats, tied_lm_head_forward
from models.layers import build_layer
from models.pipe_layout import EMBED, pipe_layers


@torch.inference_mode()
def probe_logits_streamed(ckpt: PipelineCheckpoint, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits of the checkpoint on `input_ids`, building and loading one pipeline layer at a time."""
    config = ckpt.config
    config._attn_implementation = "eager"
    position_ids = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    x, embedding = (input_ids, position_ids), None
    for layer in pipe_layers(config.num_hidden_layers, config.tie_word_embeddings):
        if not layer.has_file:  # tied LM head: the embedding's weight
            x = tied_lm_head_forward(embedding, x)
            continue
        module = build_layer(layer, config)
        module.load_state_dict(ckpt.load_whole(layer), strict=True)
        module.float().eval()
        x = module(x)
        if layer.kind == EMBED:
            embedding = module
    return split_stats(x)[0]


def _reference_class(hf_dir: str, hf_config):
    """transformers' class for `hf_dir` and the config to build it with: its causal LM; for a model type
    transformers maps to none, the class config.json names (Kimi K2.5's container); for another name of a
    family's architecture (Kimi K2's `kimi_k2`), that class with the family's config, whose model_type picks
    transformers' weight renames. The config is None where transformers reads config.json itself."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from models.families import ALIASES

    with open(os.path.join(hf_dir, "config.json")) as f:
        conf = json.load(f)
    if conf.get("model_type") in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return transformers.AutoModelForCausalLM, None
    cls = getattr(transformers, conf["architectures"][0])
    return cls, (hf_config if conf.get("model_type") in ALIASES else None)


def streaming_device_map(model: torch.nn.Module) -> dict[str, str]:
    """accelerate's device map for `model` (built on the meta device): each element of every outermost
    nn.ModuleList (the decoder layers, a vision tower's blocks) on "disk", every other module with its own
    parameters or buffers on "cpu" (those tensors by name where the module has children)."""
    device_map, under_list = {}, []
    for name, module in model.named_modules():
        if any(name.startswith(prefix) for prefix in under_list):
            continue
        if isinstance(module, torch.nn.ModuleList):
            under_list.append(f"{name}.")
            device_map.update({f"{name}.{child}": "disk" for child, _ in module.named_children()})
        elif next(module.children(), None) is not None:  # its own tensors by name (LLaVA-NeXT's `image_newline`):
            own = [n for n, _ in (*module.named_parameters(recurse=False), *module.named_buffers(recurse=False))]
            device_map.update({f"{name}.{n}" if name else n: "cpu" for n in own})  # its name would take its children
        elif any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False)):
            device_map[name] = "cpu"
    return device_map


def hf_reference_streamed(hf_dir: str, hf_config, offload_dir: str):
    """transformers' model of `hf_dir` in fp32 (eager attention), its decoder layers offloaded to disk."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    cls, config = _reference_class(hf_dir, hf_config)
    kwargs = dict(dtype=torch.float32, attn_implementation="eager")
    with init_empty_weights():
        built = config or AutoConfig.from_pretrained(hf_dir)
        empty = cls.from_config(built, **kwargs) if cls is AutoModelForCausalLM else cls._from_config(built, **kwargs)
    device_map = streaming_device_map(empty)
    if config is not None:
        kwargs["config"] = config
    return cls.from_pretrained(hf_dir, device_map=device_map, offload_folder=offload_dir, **kwargs)


def compare_with_hf(ckpt_dir: str, tag: str, hf_dir: str, seq_len: int = 16) -> float:
    """Max |logit difference| between the checkpoint and the HF model on a fixed probe batch (fp32)."""
    ckpt = PipelineCheckpoint(ckpt_dir, tag)
    config = ckpt.config
    hf_config = read_model_config(hf_dir)
    if (hf_config.num_hidden_layers, hf_config.hidden_size) != (config.num_hidden_layers, config.hidden_size):
        raise CheckpointError(f"{hf_dir}: a different model size than {ckpt_dir}")
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (2, seq_len), generator=generator)
    ours = probe_logits_streamed(ckpt, ids)
    offload_dir = tempfile.mkdtemp(prefix="verify-offload-")
    try:
        model = hf_reference_streamed(hf_dir, hf_config, offload_dir)
        with torch.inference_mode():
            ref = model(ids).logits
    finally:
        shutil.rmtree(offload_dir, ignore_errors=True)
    return float((ours.float() - ref).abs().max())
