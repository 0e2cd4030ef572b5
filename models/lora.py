"""LoRA adapters on the decoder layers (through `peft`), and merging them back: W + (alpha / r) * B @ A.

Adapters are injected into each decoder layer (models/layers.DecoderPipe) after its base weights are loaded; every other
parameter is frozen. Keys inside a layer follow peft: the base `self_attn.q_proj.weight` becomes
`self_attn.q_proj.base_layer.weight`, with `self_attn.q_proj.lora_A.default.weight` [r, in] and
`self_attn.q_proj.lora_B.default.weight` [out, r] beside it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
from torch import nn

from models.families import FAMILIES, family_of, hf_classes
from models.key_table import linear_layers, linear_modules
from models.layer_kinds import attends, is_linear_attention, is_sparse_layer
from models.layers import block_index
from models.partition import layer_shape
from models.pipe_layout import DECODER
from models.sharding import REPLICA, ROW, shard
from models.tensor_parallel import TensorParallel, TPDecoderPipe, leave_tp, sum_grad_over_tp
from models.tp_rules import SHARED_EXPERT_ROW_MODULES, TP_COLUMN_MODULES, TP_ROW_MODULES, tp_split

ADAPTER = "default"
LORA_A, LORA_B = f".lora_A.{ADAPTER}.weight", f".lora_B.{ADAPTER}.weight"


def _matches(module: str, target: str) -> bool:
    return module == target or module.endswith("." + target)


def attention_modules(config) -> list[str]:
    """The linear layers of a family's attention, as named in its decoder layer (MLA: q_a_proj, kv_b_proj, ...): not
    one of other maths that subclasses nn.Linear (DeepSeek-V4's grouped `o_a_proj`: PEFT's adapter would treat it as
    one matrix)."""
    block = next(b for b in range(config.num_hidden_layers) if attends(config, b))
    frozen = tuple(f"{name}." for name in family_of(config).frozen)  # no gradients: nothing for an adapter to learn
    attention = f"{family_of(config).attention}."  # `self_attn.` (Nemotron-H's `mixer.`)
    return [
        m
        for m in linear_layers(config, block)
        if m.startswith(attention) and "_proj" in m.rsplit(".", 1)[-1] and not m.startswith(frozen)
    ]


def check_target_modules(targets: list[str], config=None) -> None:
    """Every `lora.target_modules` entry must name a linear layer of the decoder (PEFT matches a name or its
    last dotted parts; it only complains when nothing at all matches); with `config`, an attention entry one of
    the family's own (`q_proj` names nothing in DeepSeek's latent attention), linear attention's projections where
    the family has them (Qwen3.5's `in_proj_qkv`, `in_proj_z`, `out_proj` ...). With experts: adapters go on
    attention, dense MLP layers and shared experts, never on the routed experts (PEFT's `target_parameters`), nor
    on modules transformers runs without gradients (DeepSeek-V3.2's indexer). Raises ValueError naming the entry."""
    dense = config is not None and family_of(config).moe is None
    modules = linear_modules(config if dense else None)  # a dense family's own (fused q/k/v: qkv_proj)
    attention = attention_modules(config) if config is not None else []
    recurrent = recurrent_modules(config) if config is not None else []  # linear attention's (Qwen3.5's)
    modules += [m for m in attention + recurrent if m not in modules]
    for target in targets:
        if not any(_matches(m, target) for m in modules):
            names = ", ".join(dict.fromkeys(m.rsplit(".", 1)[-1] for m in modules))
            raise ValueError(f"lora.target_modules: {target!r} is not a linear layer of the decoder ({names})")
        own = (*attention, *recurrent)  # (Kimi Linear's delta attention is a `self_attn` too)
        other = [m for m in modules if m.startswith("self_attn.") and m not in own and _matches(m, target)]
        if config is not None and other and not any(_matches(m, target) for m in attention):
            names = ", ".join(m.rsplit(".", 1)[-1] for m in attention)
            raise ValueError(f"lora.target_modules: {target!r} is not in {config.model_type}'s attention ({names})")


def recurrent_modules(config) -> list[str]:
    """The linear layers of a block of a family's recurrent kind (Gated DeltaNet's `linear_attn.in_proj_qkv`, Mamba's
    `mamba.in_proj`, ...) outside its attention and its sparse block (Granite 4's `shared_mlp` too), as named in its
    decoder layer: modules of exactly `nn.Linear`'s maths; none for a family without such layers."""
    block = next((b for b in range(config.num_hidden_layers) if is_linear_attention(config, b)), None)
    if block is None:
        return []
    moe = family_of(config).moe
    sparse = moe is not None and moe.block and is_sparse_layer(config, block)  # (Granite 4's experts beside Mamba)
    attention = attention_modules(config) if any(attends(config, b) for b in range(config.num_hidden_layers)) else []
    return [
        m
        for m in linear_layers(config, block)
        if m not in attention and not (sparse and m.startswith(f"{moe.block}."))  # (Kimi Linear's is a `self_attn`)
    ]


def lora_tp_refusal(config) -> str | None:
    """Why adapters on this family's attention cannot be split over tensor-parallel ranks, or None: MLA's low-rank
    projections are replicated under TP and their adapters' gradients would need the TP sum, not built."""
    extra = [m for m in attention_modules(config) if m not in linear_modules()]
    if not extra:
        return None
    kind = "replicated" if family_of(config).replicated_attention else "latent"  # (DeepSeek-V4's: whole per rank)
    return (
        f"LoRA on {config.model_type}'s {kind} attention ({extra[0].rsplit('.', 1)[-1]}, ...) is not split over "
        "tensor-parallel ranks; use pipeline, expert and data parallelism"
    )


def exclude_pattern(modules) -> str | None:
    """PEFT's `exclude_modules` for `modules` (names of modules no gradient reaches, `Family.frozen`) and everything
    inside them, or None."""
    names = [re.escape(name) for name in modules]
    return rf"(.*\.)?({'|'.join(names)})\..*" if names else None


def add_lora(
    module: nn.Module,
    r: int,
    alpha: float,
    dropout: float,
    target_modules: list[str],
    seed: int,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> int:
    """Inject LoRA into every decoder layer of `module` and freeze everything else.

    Every adapter starts the same whatever the layout: A is drawn (PEFT's kaiming-uniform) on its whole
    shape from a generator of its own, seeded by (`seed`, block, module), and this tensor-parallel rank
    keeps its shard of it; B is zero. Data-parallel replicas, tensor-parallel ranks and the
    single-process reference therefore agree. Returns the number of trainable parameters.
    """
    from peft import LoraConfig, inject_adapter_in_model

    for p in module.parameters():
        p.requires_grad_(False)
    for layer in module.modules():
        if isinstance(layer, hf_classes("DecoderLayer")):  # ours (built on HF's) or HF's own (the reference)
            # the targets this layer has (Gemma 4's K/V-reusing layers have no k/v projections: PEFT would refuse)
            names = [name for name, _ in layer.named_modules()]
            present = [t for t in target_modules if any(_matches(name, t) for name in names)]
            if not present:
                continue
            # never inside a module no gradient reaches (DeepSeek-V4's indexer has a `q_b_proj` too)
            family = next(f for f in FAMILIES.values() if isinstance(layer, f.hf_class("DecoderLayer")))
            frozen = [f for f in family.frozen if f in names]  # (where the layer has one: PEFT warns else)
            config = LoraConfig(
                r=r,
                lora_alpha=alpha,
                lora_dropout=dropout,
                target_modules=present,
                exclude_modules=exclude_pattern(frozen),
            )
            with torch.random.fork_rng(devices=[]):  # injection draws random numbers: keep the global stream
                inject_adapter_in_model(config, layer, adapter_name=ADAPTER)
            _init_adapters(layer, seed, tp_rank, tp_size)
    trainable = 0
    for name, p in module.named_parameters():
        p.requires_grad_(".lora_" in name)
        trainable += p.numel() if p.requires_grad else 0
    return trainable


@torch.no_grad()
def _init_adapters(layer: nn.Module, seed: int, tp_rank: int, tp_size: int) -> None:
    block = block_index(layer)
    known = linear_modules()  # seeded by position: the table's first, then the family's others by name (MLA's)
    others = sorted(n for n, m in layer.named_modules() if hasattr(m, "lora_A") and n not in known)
    for i, name in enumerate(known + others):
        try:
            target = layer.get_submodule(name)
        except AttributeError:  # a sparse block has no dense MLP
            continue
        if not hasattr(target, "lora_A"):
            continue
        a = target.lora_A[ADAPTER].weight  # [r, in] (this rank's columns of a row-parallel layer)
        rule = tp_split(DECODER, name + LORA_A)
        whole = torch.empty(a.shape[0], a.shape[1] * (tp_size if rule == ROW else 1))
        generator = torch.Generator().manual_seed(seed * 1_000_003 + block * 1_009 + i)
        torch.nn.init.kaiming_uniform_(whole, a=math.sqrt(5), generator=generator)
        a.copy_(shard(whole, rule, tp_rank, tp_size))
        target.lora_B[ADAPTER].weight.zero_()


def adapter_param_counts(config, targets: list[str], r: int, tp_size: int = 1) -> list[int]:
    """LoRA's trainable parameters per pipeline layer, one tensor-parallel rank's share: A [r, in] and B [out, r] on
    each targeted linear layer of a decoder block (A split with a row layer's input, B with a column layer's
    output), counted on the meta device (the memory planner's; tests hold it to PEFT's injected model)."""
    from models.layers import build_layer
    from models.pipe_layout import pipe_layers

    counts, built = [], {}
    with torch.device("meta"):
        for layer in pipe_layers(config.num_hidden_layers, config.tie_word_embeddings):
            if layer.kind != DECODER:
                counts.append(0)
                continue
            kind = layer_shape(layer, config)  # (layers of their own shape: Gemma 4's reusing and global layers)
            if kind not in built:
                n = 0
                for name, module in build_layer(layer, config).named_modules():
                    if isinstance(module, nn.Linear) and any(_matches(name, t) for t in targets):
                        a_split = tp_split(DECODER, name + LORA_A, config) == ROW
                        b_split = tp_split(DECODER, name + LORA_B, config) != REPLICA
                        n += r * module.in_features // (tp_size if a_split else 1)
                        n += r * module.out_features // (tp_size if b_split else 1)
                built[kind] = n
            counts.append(built[kind])
    return counts


@dataclass(frozen=True)
class LoraDelta:
    """One adapted module: W += scale * B @ A, with A [r, in], B [out, r]."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float


def merge_adapter(base: dict[str, torch.Tensor], deltas: dict[str, LoraDelta]) -> dict[str, torch.Tensor]:
    """Merge one layer's adapters into its base weights (keys as in the base layer file).

    Args:
        base: {"self_attn.q_proj.weight": W [out, in], ...} (plain keys, no `base_layer`).
        deltas: {"self_attn.q_proj": LoraDelta, ...}.

    The arithmetic is PEFT's `merge_and_unload` for fp32 weights: W + (B @ A) * scale, in fp32.
    """
    merged = dict(base)
    for module, d in deltas.items():
        w = base[module + ".weight"]
        merged[module + ".weight"] = (w.float() + (d.b.float() @ d.a.float()) * d.scale).to(w.dtype)
    return merged


def parallelize_lora(module: nn.Module, tp: TensorParallel) -> None:
    """The collectives of LoRA adapters on split layers (their shards come from models/lora.py).

    Column layer: A is replicated and used inside the split region, so its gradient is summed over TP.
    Row layer: A holds this rank's input columns, so A x is partial and summed over TP before B (under sequence
    parallelism reduce-scattered to this rank's positions, as the layer's own output is, and B, replicated,
    sees only those: its gradient is summed over TP). A shared expert's down projection is no row layer: its output
    stays partial until the sparse block's is summed (models/tensor_parallel.py `split_sparse_block`), so B sees the
    partial A x and its gradient is summed over TP.
    """
    if tp.size == 1:
        return
    for layer in module.modules():
        if not isinstance(layer, TPDecoderPipe):
            continue
        for name, target in layer.named_modules():  # (sparse layers have no dense MLP)
            if name not in TP_COLUMN_MODULES + TP_ROW_MODULES or not hasattr(target, "lora_A"):
                continue
            if name in SHARED_EXPERT_ROW_MODULES:
                for lora_b in target.lora_B.values():
                    sum_grad_over_tp(lora_b.weight, tp)
                continue
            for lora_a in target.lora_A.values():
                if name in TP_COLUMN_MODULES:
                    sum_grad_over_tp(lora_a.weight, tp)
                else:
                    lora_a.register_forward_hook(lambda _module, _inputs, out: leave_tp(out, tp))
            if name in TP_ROW_MODULES and tp.sp:
                for lora_b in target.lora_B.values():
                    sum_grad_over_tp(lora_b.weight, tp)
