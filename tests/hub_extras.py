"""What hub checkpoints hold beyond what transformers' save_pretrained writes for a tiny model, added to a saved
directory: multi-token-prediction layers, Gemma 4's unread k/v tensors; a trained model's tempered attention; and
weights moved off their initial values (`perturb`)."""

from __future__ import annotations

import json
import os

import torch


def hf_state(hf_dir: str) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face directory's safetensors shards."""
    from safetensors.torch import load_file

    state = {}
    for name in sorted(os.listdir(hf_dir)):
        if name.endswith(".safetensors"):
            state.update(load_file(os.path.join(hf_dir, name)))
    return state


def add_mtp_layer(hf_dir: str, under: str = "layers") -> list[str]:
    """Give an HF directory a multi-token-prediction layer, as the hub checkpoints keep one (transformers builds none
    and skips it at load): after the last decoder layer as DeepSeek-V3's and GLM-4.5's (`under="layers"`; config.json
    counts it, `num_nextn_predict_layers`), or under `mtp.` as Qwen3-Next's (`under="mtp"`): the last decoder layer's
    tensors again, its own norms, projection and head, one tensor FP8 with its scale, in a shard of its own listed
    in the index. Returns its keys."""
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    text = config.get("text_config", config)  # a multimodal container's text model (Qwen3.5's)
    last = text["num_hidden_layers"] - 1
    mtp = f"model.layers.{last + 1}." if under == "layers" else "mtp.layers.0."
    layer = f"model.language_model.layers.{last}." if text is not config else f"model.layers.{last}."
    state = hf_state(hf_dir)
    extra = {mtp + k.removeprefix(layer): v.clone() for k, v in state.items() if k.startswith(layer)}
    hidden = text["hidden_size"]
    generator = torch.Generator().manual_seed(3)
    extra |= {
        mtp + "enorm.weight": torch.rand(hidden, generator=generator),
        mtp + "hnorm.weight": torch.rand(hidden, generator=generator),
        mtp + "eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=generator).to(torch.float8_e4m3fn),
        mtp + "eh_proj.weight_scale_inv": torch.rand(1, 2, generator=generator),
        mtp + "shared_head.norm.weight": torch.rand(hidden, generator=generator),
    }
    add_hub_tensors(hf_dir, extra, "model-mtp.safetensors")
    if under == "layers":
        config["num_nextn_predict_layers"] = 1
        with open(os.path.join(hf_dir, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
    return sorted(extra)


def add_unread_kv(hf_dir: str) -> list[str]:
    """Give a Gemma 4 directory the k/v projections and k norms its K/V-reusing layers keep on the hub (transformers
    builds none and skips them at load), in a shard of their own. Returns their keys."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(hf_dir).get_text_config()  # a container's (Gemma4ForConditionalGeneration)
    layers = (
        "model.language_model.layers." if any(".language_model." in k for k in hf_state(hf_dir)) else "model.layers."
    )
    generator, extra = torch.Generator().manual_seed(4), {}
    for block, mode in enumerate(config.kv_sharing_modes):
        if mode == "reuse":
            layer = config.per_layer_config[block]
            rows, prefix = layer.num_key_value_heads * layer.head_dim, f"{layers}{block}.self_attn."
            extra[prefix + "k_proj.weight"] = torch.randn(rows, config.hidden_size, generator=generator)
            if not (config.attention_k_eq_v and config.layer_types[block] != "sliding_attention"):  # values = keys
                extra[prefix + "v_proj.weight"] = torch.randn(rows, config.hidden_size, generator=generator)
            extra[prefix + "k_norm.weight"] = torch.rand(layer.head_dim, generator=generator)
    add_hub_tensors(hf_dir, extra, "model-unread.safetensors")
    return sorted(extra)


def temper_attention(hf_dir: str, factor: float = 0.5) -> None:
    """Scale the q/k norms' weights of a saved model. Gemma 4's attention scores normalised queries against normalised
    keys unscaled (`scaling` 1.0): at init (norm weights 1) a tiny model's logits have a std of sqrt(head_dim) and its
    softmax is near one-hot, which turns fp32 rounding into losses 4e-4 apart after 4 steps at lr 3e-3 (its fp32
    training against fp64's; Gemma 3's agree to 1e-7). At 0.5 its fp32 and fp64 training agree to 1e-7 too."""
    from safetensors.torch import load_file, save_file

    for name in os.listdir(hf_dir):
        if name.endswith(".safetensors"):
            state = load_file(os.path.join(hf_dir, name))
            tempered = {
                k: v * factor if k.endswith(("q_norm.weight", "k_norm.weight")) else v for k, v in state.items()
            }
            save_file(tempered, os.path.join(hf_dir, name), metadata={"format": "pt"})


def add_hub_tensors(hf_dir: str, extra: dict, shard: str) -> None:
    """Save `extra` as one more shard of an HF directory, listed in its index (made when it had one shard)."""
    from safetensors.torch import save_file

    save_file(extra, os.path.join(hf_dir, shard), metadata={"format": "pt"})
    index_path = os.path.join(hf_dir, "model.safetensors.index.json")
    if not os.path.exists(index_path):  # one shard: index it, as a sharded checkpoint is
        weight_map = {k: "model.safetensors" for k in hf_state(hf_dir) if k not in extra}
        with open(index_path, "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(index_path) as f:
        index = json.load(f)
    index["weight_map"] |= {k: shard for k in extra}
    with open(index_path, "w") as f:
        json.dump(index, f, indent=2)


@torch.no_grad()
def perturb(model) -> None:
    """Norms, biases and routers' score biases moved off their init (ones, zeros), so a key the pipeline dropped
    or read into the wrong place would show in the logits; DeepSeek-V4's hyper-connection biases and scales, its
    compressors' position biases and Apertus's xIELU scalars too, and DeepSeek-V4's hash routers' token -> experts
    tables (zeros at init: every token to expert 0) made distinct experts per token."""
    generator = torch.Generator().manual_seed(1)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_floating_point() and (
            "norm" in name
            or name.endswith(("bias", "e_score_correction_bias", "sinks"))
            or name.endswith(("hc.base", "hc.scale", "hc_base", "hc_scale", "position_bias"))
            or name.endswith(("act_fn.alpha_p", "act_fn.alpha_n"))  # Apertus's xIELU scalars
        ):
            tensor.add_(torch.randn(tensor.shape, generator=generator).to(tensor.dtype) * 0.2)
        elif name.endswith("tid2eid"):  # [V, k] experts of each token
            experts, k = model.config.n_routed_experts, tensor.shape[1]
            rows = [torch.randperm(experts, generator=generator)[:k] for _ in range(tensor.shape[0])]
            tensor.copy_(torch.stack(rows))
