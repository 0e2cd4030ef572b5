"""How each key of a pipeline layer splits across tensor-parallel ranks: Megatron's split, one rule per key
(models/sharding.py has the rules' tensor maths). Column layers (q/k/v, gate/up, experts' gate and up) split their
rows, row layers (o_proj, down_proj, experts' down) their columns, transformers' fused experts per half; the rules
agree with each family's `base_model_tp_plan` in transformers (tests/test_families.py).
"""

from __future__ import annotations

import re

from models.families import FAMILIES, family_of
from models.key_table import MOE_SPECS, alternatives
from models.pipe_layout import DECODER, EMBED, LM_HEAD, TIED_PARAM, pipe_layers
from models.sharding import COLUMN, EXPERT_IN, EXPERT_ROW, GATE_UP, GATE_UP_OUT, REPLICA, ROW, VOCAB, parts_rule

_MLP_BLOCKS = ("mlp", *dict.fromkeys(m.block for m in MOE_SPECS if m.block not in ("mlp", "")))  # a dense MLP's names
_SHARED = ("shared_expert", "shared_experts")  # Qwen's and Llama 4's; DeepSeek's, GLM-4.5's and Mistral 4's
TP_COLUMN_MODULES = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    *(f"{block}.{proj}" for block in _MLP_BLOCKS for proj in ("gate_proj", "up_proj")),
    # Fused projections are column layers too, split part by part (`tp_split` gives their parts rule first); LoRA's
    # A on them is replicated inside the split region, so its gradient is summed over TP (models/lora.py).
    "self_attn.qkv_proj",
    "mlp.gate_up_proj",
    # Multi-head latent attention (DeepSeek's): the up-projections to each head's queries and keys/values. Its
    # low-rank down-projections and their norms are replicated (`attention_replicas`).
    "self_attn.q_b_proj",
    "self_attn.kv_b_proj",
    # Linear attention (Gated DeltaNet) by heads: Qwen3-Next's q/k/v/z and b/a rows grouped per key head, Qwen3.5's
    # z, b and a per value head (its q/k/v in one projection: `LINEAR_PARTS`). transformers' plan gathers their
    # outputs (every rank runs every head); a recurrence per head splits as attention does.
    "linear_attn.in_proj_qkvz",
    "linear_attn.in_proj_ba",
    "linear_attn.in_proj_qkv",
    "linear_attn.in_proj_z",
    "linear_attn.in_proj_b",
    "linear_attn.in_proj_a",
    # LFM2's MLP under `feed_forward` (w1 gate, w3 up, w2 down) and its short convolution's in_proj (B, C and x rows
    # part by part: `CONV_PARTS`), whose channels the depthwise convolution keeps (`CONV_CHANNELS`): each rank runs its
    # own channels, as linear attention runs its heads.
    "feed_forward.w1",
    "feed_forward.w3",
    "conv.in_proj",
    # A sparse block's shared expert, as a dense MLP (LoRA may adapt it; its output is partial until the block's).
    *(f"{block}.{shared}.{proj}" for block in _MLP_BLOCKS for shared in _SHARED for proj in ("gate_proj", "up_proj")),
)
TP_ROW_MODULES = ("self_attn.o_proj", "linear_attn.out_proj", *(f"{block}.down_proj" for block in _MLP_BLOCKS))
TP_ROW_MODULES += ("self_attn.out_proj", "feed_forward.w2", "conv.out_proj")  # LFM2's
SHARED_EXPERT_ROW_MODULES = tuple(f"{block}.{shared}.down_proj" for block in _MLP_BLOCKS for shared in _SHARED)
TP_ROW_MODULES += SHARED_EXPERT_ROW_MODULES
# Linear attention's q, k and v channels in one tensor (the projection, the depthwise convolution): part by part.
LINEAR_PARTS = ("linear_attn.in_proj_qkv", "linear_attn.conv1d")
CONV_PARTS = "conv.in_proj"  # a short convolution's B, C and x channels in one projection: part by part
CONV_CHANNELS = ("conv.conv.weight", "conv.conv.bias")  # its depthwise convolution: one row per channel
# One entry per value head (the decay's A_log and dt_bias): split with the heads. Its gated norm (over each head's
# values, one weight for all heads) is replicated.
LINEAR_PER_HEAD = ("linear_attn.A_log", "linear_attn.dt_bias")
# Experts and shared experts split as dense MLPs do: gate and up by rows, down by columns (router: replicated).
_EXPERT_BLOCKS = alternatives([*_MLP_BLOCKS, *(m.hub_block for m in MOE_SPECS)])
_EXPERT_COLUMN = re.compile(
    _EXPERT_BLOCKS
    + r"\.(experts\.\d+\."
    + alternatives(["gate_proj", "up_proj", *(n for m in MOE_SPECS for n in m.expert_names[:2])])
    + r"|shared_experts?\.(gate|up)_proj)"
)
_EXPERT_ROW = re.compile(
    _EXPERT_BLOCKS
    + r"\.(experts\.\d+\."
    + alternatives(["down_proj", *(m.expert_names[2] for m in MOE_SPECS)])
    + r"|shared_experts?\.down_proj)"
)
# transformers' fused in-memory expert parameters (the optimizer's view): gate_up [E, 2I, H] holds each rank's gate
# rows then its up rows (GATE_UP), down [E, H, I] its columns (dim 2: EXPERT_ROW). Experts fused on the hub too
# (`MoeSpec.hub_fused`: also their layer files' keys) are x @ W: gate_up [E, H, 2I] by columns of each half
# (GATE_UP_OUT), down [E, I, H] by rows (EXPERT_IN).
FUSED_GATE_UP, FUSED_DOWN = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"
# The same [E, 2I, H] and [E, H, I] experts in a layer that is their own block (`MoeSpec.beside_mlp`: Gemma 4's).
BESIDE = {m.beside_mlp for m in MOE_SPECS}
FUSED_GATE_UP_KEYS = {FUSED_GATE_UP} | ({"experts.gate_up_proj"} if True in BESIDE else set())
FUSED_DOWN_KEYS = {FUSED_DOWN} | ({"experts.down_proj"} if True in BESIDE else set())
FUSED_XW = {
    **{f"{m.block}.experts.gate_up_proj": GATE_UP_OUT for m in MOE_SPECS if m.hub_fused},
    **{f"{m.block}.experts.down_proj": EXPERT_IN for m in MOE_SPECS if m.hub_fused},
}
# Interleaved gate/up columns (`MoeSpec.interleaved_gate_up`, gpt-oss's, whose block is `mlp` like the [E, 2I, H]
# families': told apart by the config) split in contiguous blocks of dim 2, pairs whole (EXPERT_ROW's arithmetic),
# their bias [E, 2I] in blocks of dim 1, down [E, I, H] by rows (dim 1); the down bias [E, H] is replicated.
INTERLEAVED = {"gate_up_proj": EXPERT_ROW, "gate_up_proj_bias": EXPERT_IN, "down_proj": EXPERT_IN}
PER_HEAD = {name for family in FAMILIES.values() for name in family.per_head}  # split with the heads: COLUMN
# Fused projections (`Family.fused_qkv`, `fused_gate_up`): their rows split part by part (models/sharding.py).
FUSED_QKV, FUSED_GATE_UP_PROJ = "self_attn.qkv_proj", "mlp.gate_up_proj"
QK_NORMS = ("self_attn.q_norm", "self_attn.k_norm")  # per head (replicated), or over the whole projection
_LORA_KEY = re.compile(r"(.+)\.lora_([AB])\.[^.]+\.weight")
# LoRA factors follow the layer they adapt: a column layer's B is split like it and its A replicated; a row
# layer's A is split like it and its B replicated.
_LORA_SPLIT = {(COLUMN, "A"): REPLICA, (COLUMN, "B"): COLUMN, (ROW, "A"): ROW, (ROW, "B"): REPLICA}


def _qkv_rows(module: str, config) -> tuple[int, int, int]:
    """The rows of q, k and v in a fused q/k/v tensor (`Family.fused_qkv`'s projection: heads x head_dim; linear
    attention's projection and depthwise convolution: its key and value channels)."""
    if module == CONV_PARTS:
        return config.hidden_size, config.hidden_size, config.hidden_size
    if module in LINEAR_PARTS:
        k = config.linear_num_key_heads * config.linear_key_head_dim
        return k, k, config.linear_num_value_heads * config.linear_value_head_dim
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    return config.num_attention_heads * head_dim, kv, kv


def _fused_rule(module: str, key: str, config) -> str | None:
    """The parts rule of a fused projection (`Family.fused_qkv`, `fused_gate_up`, linear attention's q/k/v), or None
    for any other module: q/k/v by their rows (the config's, so it is needed), gate and up by halves."""
    if module in (FUSED_QKV, CONV_PARTS, *LINEAR_PARTS):
        if config is None:
            raise ValueError(f"{key}: the split of a fused q/k/v projection needs the model's config")
        return parts_rule(*_qkv_rows(module, config))
    return parts_rule(1, 1) if module == FUSED_GATE_UP_PROJ else None


def fused_parts_shape(key: str, config) -> tuple:
    """The shape of a decoder key whose rule is a fused q/k/v's parts, the parts' rows as a tuple in dim 0
    (DeepSpeed's sub-parameter shape), then the projection's input columns or the depthwise convolution's
    [1, kernel]."""
    module, param = key.rsplit(".", 1)
    rest = (1, config.linear_conv_kernel_dim) if module == "linear_attn.conv1d" else (config.hidden_size,)
    return (_qkv_rows(module, config), *rest) if param == "weight" else (_qkv_rows(module, config),)


def tp_split(kind: str, key: str, config=None) -> str:
    """How `key` of a layer of `kind` splits (see models/sharding.py): COLUMN, ROW, VOCAB, REPLICA, a fused
    expert rule, or a fused projection's parts (`config`: the model's, which q/k/v in one projection and q/k norms
    over the whole projection need; without it q/k norms are per head, replicated)."""
    if kind in (EMBED, LM_HEAD):
        return VOCAB
    if kind != DECODER:
        return REPLICA
    if config is not None and family_of(config).replicated_attention and key.startswith("self_attn."):
        return REPLICA  # whole on every rank, as transformers' plan keeps it (DeepSeek-V4's)
    if key in PER_HEAD or key in LINEAR_PER_HEAD or key in CONV_CHANNELS:
        return COLUMN
    moe = family_of(config).moe if config is not None else None
    if moe is not None and moe.interleaved_gate_up and key.startswith(f"{moe.block}.experts."):
        return INTERLEAVED.get(key.removeprefix(f"{moe.block}.experts."), REPLICA)
    fused = {f"{moe.block}.experts.gate_up_proj": GATE_UP, f"{moe.block}.experts.down_proj": EXPERT_ROW} if moe else {}
    if moe is not None and not moe.hub_fused and moe.block not in ("mlp", "") and key in fused:
        # transformers' fused [E, 2I, H] and [E, H, I] under a block of another name, one key per expert on the
        # hub (LFM2-MoE's `feed_forward`, whose names Llama 4's x @ W experts share: told apart by the config)
        return fused[key]
    lora = _LORA_KEY.fullmatch(key)
    name = key.replace(".base_layer", "")
    module, param = (lora.group(1), "weight") if lora else (name.rsplit(".", 1) if "." in name else (name, ""))
    rule = COLUMN if module in TP_COLUMN_MODULES else ROW if module in TP_ROW_MODULES else REPLICA
    if module in QK_NORMS and config is not None and family_of(config).qk_norm_whole:  # one weight per q/k row
        return COLUMN
    if module in (FUSED_QKV, FUSED_GATE_UP_PROJ, CONV_PARTS, *LINEAR_PARTS):  # a column layer, part by part (A: whole)
        return REPLICA if lora and lora.group(2) == "A" else _fused_rule(module, key, config)
    if _EXPERT_COLUMN.fullmatch(module):
        rule = COLUMN
    elif _EXPERT_ROW.fullmatch(module):
        rule = ROW
    elif key in FUSED_GATE_UP_KEYS:
        return GATE_UP
    elif key in FUSED_DOWN_KEYS:
        return EXPERT_ROW
    elif key in FUSED_XW:
        return FUSED_XW[key]
    if lora:
        return _LORA_SPLIT.get((rule, lora.group(2)), REPLICA)
    return REPLICA if rule == ROW and param == "bias" else rule


def row_layer(module, prefix: str, config):
    """The one row-parallel linear layer of `module` (named `prefix` in the decoder layer: an attention's o_proj, an
    MLP's down_proj; LFM2's out_proj and w2), as the split rules name it."""
    rows = [m for n, m in module.named_children() if tp_split(DECODER, f"{prefix}.{n}.weight", config) == ROW]
    assert len(rows) == 1, (prefix, rows)
    return rows[0]


def attention_replicas(attention, config) -> list:
    """The parameters of a decoder layer's attention (`attention`, transformers' module) that every tensor-parallel
    rank holds whole although only its heads use their output (MLA's low-rank `q_a_proj`, `kv_a_proj_with_mqa` and
    their norms): each rank's gradient is partial, so it is summed over TP. Per-head q/k norms and the row layer's
    bias have rules of their own (models/tensor_parallel.py); frozen ones (DeepSeek-V3.2's indexer) take none."""
    own = ("o_proj.", "out_proj.", *(f"{n.removeprefix('self_attn.')}." for n in QK_NORMS))
    return [
        p
        for name, p in attention.named_parameters()
        if p.requires_grad and not name.startswith(own) and tp_split(DECODER, f"self_attn.{name}", config) == REPLICA
    ]


def param_tp_split(name: str, num_layers: int, tie_word_embeddings: bool, config=None) -> str:
    """How the pipeline module's parameter `name` splits across tensor-parallel ranks (models/sharding.py)."""
    if name == TIED_PARAM:
        return tp_split(EMBED, "weight")
    index, key = name.split(".", 1)
    return tp_split(pipe_layers(num_layers, tie_word_embeddings)[int(index)].kind, key, config)
