"""Mixture-of-experts blocks as pipeline layers: keys, router statistics and the load-balancing loss.

The sparse block is transformers' own (`MixtralSparseMoeBlock`, `Qwen3MoeSparseMoeBlock`, ...: router, fused
experts, shared expert), run inside the family's own decoder layer. This module adds what a pipeline needs:

Keys. transformers keeps a layer's experts fused in memory (`mlp.experts.gate_up_proj` [E, 2I, H], gate rows
then up rows; `mlp.experts.down_proj` [E, H, I]) while hub checkpoints hold one key per expert
(models/key_table.py `MOE_KEYS`). Our layer files keep the hub's keys: a state-dict hook splits the fused
parameters at save and stacks them at load (`expert_keys`), so conversion and export stay key-for-key copies
and a tensor-parallel layer file holds each expert's own shard (gate/up by rows, down by columns).

Router statistics. transformers' load-balancing loss (`load_balancing_loss_func`) pools every sparse layer of
the model before its product:

    aux = E * sum_e (F_e / N) * (P_e / N)      F_e: tokens routed to e (top-k, summed over layers)
                                               P_e: router probability of e (summed over tokens and layers)
                                               N:   tokens x sparse layers (padding excluded)

so it is no sum of per-layer terms and its layers live on different stages. Each stage adds its layers' F, P
and N to one fp32 tensor that travels with the hidden states (`RouterStats`, [2E + 2]: P, F, N, and the largest
expert load seen so far); only P carries a gradient, and it reaches every stage's routers through the
pipeline's own backward. The last stage forms `aux` exactly as transformers does (`aux_loss`).

Model code only: no DeepSpeed, no distributed code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.families import family_of
from models.key_table import expert_parts, hub_parts, moe_key
from models.layer_kinds import is_sparse_layer

# How the experts of a block run (transformers' `experts_implementation`): its models' default. One grouped
# matmul over all local experts (torch's `grouped_mm`, with transformers' own loop where the kernel cannot run).
DEFAULT_EXPERTS_IMPLEMENTATION = "grouped_mm"


def num_experts(config) -> int:
    return getattr(config, family_of(config).moe.num_experts)


def is_moe(config) -> bool:
    return family_of(config).moe is not None


def experts_per_token(config) -> int:
    """The experts a token is routed to (`MoeSpec.top_k`'s config field)."""
    return getattr(config, family_of(config).moe.top_k)


def dense_mlp(config) -> str:
    """The name of a decoder layer's dense MLP: `mlp`, or the sparse block's name in a family whose dense layers hold
    their MLP under it (Llama 4's `feed_forward`)."""
    family = family_of(config)
    return family.mlp if family.moe is None or family.moe.beside_mlp else family.moe.block


def in_block(block: str, name: str) -> str:
    """`name` inside a sparse block named `block` ("" : the layer itself, Gemma 4's `MoeSpec.beside_mlp`)."""
    return f"{block}.{name}" if block else name


def empty_stats(config, device=None) -> torch.Tensor:
    """The statistics of no layer yet: zeros [2E + 2] fp32."""
    return torch.zeros(2 * num_experts(config) + 2, dtype=torch.float32, device=device)


def token_mask(lengths: torch.Tensor, seq: int) -> torch.Tensor:
    """[B * S] fp32: 1 at the real tokens of each row (the first `lengths[b]` positions), 0 at padding."""
    return (torch.arange(seq, device=lengths.device)[None, :] < lengths[:, None]).reshape(-1).float()


def layer_sums(
    router_logits: torch.Tensor, top_k: int, mask: torch.Tensor, chosen: torch.Tensor | None = None
) -> torch.Tensor:
    """One sparse layer's [P | F | N] from its router logits [N, E], as `load_balancing_loss_func` reduces them (its
    softmax in the logits' dtype, its own top-k, the padding mask as a weight). `chosen` [N, k]: the experts a
    router that chooses its own (`MoeSpec.router_choice`) chose, counted in F instead of the softmax's top-k."""
    experts = router_logits.shape[-1]
    probs = F.softmax(router_logits, dim=-1)
    selected = torch.topk(probs, top_k, dim=-1)[1] if chosen is None else chosen
    counts = torch.zeros(experts, dtype=torch.float32, device=probs.device).scatter_add_(
        0, selected.reshape(-1), mask.repeat_interleave(top_k)
    )
    prob_sum = (probs.float() * mask[:, None]).sum(dim=0)
    return torch.cat([prob_sum, counts, mask.sum()[None]])


def with_load(sums: torch.Tensor) -> torch.Tensor:
    """A layer's [P | F | N] and its load: the busiest expert's tokens over the mean -> [P | F | N | load]."""
    experts = (sums.shape[0] - 1) // 2
    counts = sums[experts : 2 * experts].detach()
    return torch.cat([sums, (counts.max() / counts.mean().clamp_min(1e-12))[None]])


def layer_stats(router_logits: torch.Tensor, top_k: int, mask: torch.Tensor) -> torch.Tensor:
    """One sparse layer's [P | F | N | load] from its router logits [N, E] (`layer_sums`, `with_load`)."""
    return with_load(layer_sums(router_logits, top_k, mask))


def add_stats(total: torch.Tensor, layer: torch.Tensor) -> torch.Tensor:
    """Running statistics plus one layer's: sums add, the load is the larger of the two."""
    experts = (total.shape[0] - 2) // 2
    summed = total[: 2 * experts + 1] + layer[: 2 * experts + 1]
    return torch.cat([summed, torch.maximum(total[-1:], layer[-1:]).detach()])


def count_chosen(stats: torch.Tensor, counts: torch.Tensor | None) -> torch.Tensor:
    """A sparse layer's running count of the tokens its router sent to each expert this step, plus one micro-batch's
    (F of its statistics, over real tokens; under context parallelism the CP group's: the whole rows')."""
    experts = (stats.shape[0] - 2) // 2
    chosen = stats[experts : 2 * experts].detach().double()
    return chosen if counts is None else counts + chosen


@torch.no_grad()
def balance(router: nn.Module, counts: torch.Tensor, rate: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing, once per optimizer step: each expert's score bias
    (`e_score_correction_bias`, which only steers the choice of experts, not their weights) rises by `rate` when
    the expert received fewer tokens than the mean over experts this step, falls by `rate` when more, and stays when
    equal. `counts` [E]: the step's tokens per expert over the whole global batch (every data-parallel rank)."""
    step = torch.sign(counts.mean() - counts) * rate
    router.e_score_correction_bias += step.to(router.e_score_correction_bias.dtype)


def aux_loss(stats: torch.Tensor) -> torch.Tensor:
    """transformers' load-balancing loss from the statistics of every sparse layer (0 when there are none)."""
    experts = (stats.shape[0] - 2) // 2
    prob_sum, counts, rows = stats[:experts], stats[experts : 2 * experts].detach(), stats[2 * experts].detach()
    rows = rows.clamp_min(1.0)
    return (counts / rows * (prob_sum / rows)).sum() * experts


# ---------------------------------------------------------------------------------------------------- keys


def router_of(block: nn.Module, config) -> nn.Module:
    """The router of a sparse block (`gate`; Llama 4's `router`)."""
    return getattr(block, family_of(config).moe.router)


def router_param(config) -> str:
    """The in-memory name of a sparse layer's router weight (`mlp.gate.weight`, `feed_forward.router.weight`)."""
    moe = family_of(config).moe
    return in_block(moe.block, f"{moe.router}.weight")


def _fused_names(config, prefix: str) -> tuple[str, str]:
    """The in-memory names of the experts' (gate and) up and down parameters of the layer at `prefix`."""
    block = family_of(config).moe.block
    return tuple(prefix + in_block(block, f"experts.{name}") for name in expert_parts(config))


def _hub_names(config, prefix: str) -> tuple[str, str, str, str]:
    """(router, gate, up, down) key templates of the layer at `prefix` (expert number as {e})."""
    return tuple(prefix + moe_key(config, part, "{e}") for part in ("router", "gate", "up", "down"))


def expert_keys(layer: nn.Module, config, ep=None) -> None:
    """Give a decoder layer with a sparse block the hub's per-expert keys (see the module docstring). With expert
    parallelism (`ep`, models/expert_parallel.py) the layer holds experts `ep.local_experts(E)`: loading takes those
    from the file's E, and saving writes all E from `layer.gathered_experts` (set by the caller, which gathered
    them over the group) when it is there."""
    mine = ep.local_experts(num_experts(config)) if ep is not None else range(num_experts(config))
    if family_of(config).moe.hub_fused:
        return _fused_expert_keys(layer, config, mine)
    router_mem = router_param(config)
    gated = "gate_up_proj" in expert_parts(config)

    def to_hub(module, state_dict, prefix, local_metadata):
        gate_up_name, down_name = _fused_names(config, prefix)
        router, gate, up, down = _hub_names(config, prefix)
        if prefix + router_mem in state_dict and router != prefix + router_mem:
            state_dict[router] = state_dict.pop(prefix + router_mem)
        if gate_up_name in state_dict:
            gate_up, down_proj = state_dict.pop(gate_up_name), state_dict.pop(down_name)
            gathered = getattr(module, "gathered_experts", None)  # {parameter of the experts: all E}
            gate_up, down_proj = (gathered[name] for name in expert_parts(config)) if gathered else (gate_up, down_proj)
            first = 0 if gathered else mine.start  # not gathered: this rank's experts under their own numbers
            half = gate_up.shape[1] // 2 if gated else 0  # gateless experts: up rows only
            for e in range(gate_up.shape[0]):
                if gated:
                    state_dict[gate.format(e=first + e)] = gate_up[e, :half].clone()
                state_dict[up.format(e=first + e)] = gate_up[e, half:].clone()
                state_dict[down.format(e=first + e)] = down_proj[e].clone()

    def from_hub(module, state_dict, prefix, *args):
        gate_up_name, down_name = _fused_names(config, prefix)
        router, gate, up, down = _hub_names(config, prefix)
        if router in state_dict and router != prefix + router_mem:
            state_dict[prefix + router_mem] = state_dict.pop(router)
        if up.format(e=0) in state_dict:
            experts = num_experts(config)
            gates = [state_dict.pop(gate.format(e=e)) for e in range(experts)] if gated else []
            ups = [state_dict.pop(up.format(e=e)) for e in range(experts)]
            downs = [state_dict.pop(down.format(e=e)) for e in range(experts)]
            local = slice(mine.start, mine.stop)
            state_dict[gate_up_name] = torch.cat([torch.stack(part[local]) for part in (gates, ups) if part], dim=1)
            state_dict[down_name] = torch.stack(downs[local])

    layer.register_state_dict_post_hook(to_hub)
    layer.register_load_state_dict_pre_hook(from_hub)


def _fused_expert_keys(layer: nn.Module, config, mine: range) -> None:
    """`expert_keys` where the hub's keys are transformers' own fused parameters (Llama 4): only expert parallelism
    needs hooks (load this rank's experts `mine` of the file's E; save all E from `gathered_experts`)."""
    if len(mine) == num_experts(config):
        return

    experts = in_block(family_of(config).moe.block, "experts.")

    def to_hub(module, state_dict, prefix, local_metadata):
        gathered = getattr(module, "gathered_experts", None)
        for name, whole in (gathered or {}).items():
            state_dict[prefix + experts + name] = whole

    def from_hub(module, state_dict, prefix, *args):  # every tensor of the experts holds E along dim 0
        for name in [k for k in state_dict if k.startswith(prefix + experts)]:
            if state_dict[name].shape[0] == num_experts(config):
                state_dict[name] = state_dict[name][mine.start : mine.stop]

    layer.register_state_dict_post_hook(to_hub)
    layer.register_load_state_dict_pre_hook(from_hub)


def param_name_of(config, key: str) -> str | None:
    """The in-memory parameter a layer-file key of a decoder layer belongs to when it is one parameter: the key
    itself, the router's transformers name, the whole of a tensor the hub keeps in parts (`hub_parts`), or None for
    one expert's slice of the fused experts."""
    whole = next((whole for whole, pieces in hub_parts(config).items() if key in pieces), None)
    if whole is not None:
        return whole
    moe = family_of(config).moe
    if moe is None or moe.hub_fused:
        return key
    if key == moe_key(config, "router"):
        return router_param(config)
    return None if ".experts." in key else key


def file_keys_of(config, block: int, name: str, experts: range | None = None) -> list[str]:
    """The layer-file keys of in-memory parameter `name` of decoder block `block` (LoRA's frozen-key filter);
    `experts`: the experts the layer's state dict holds (under expert parallelism, frozen experts are not gathered:
    this rank's own, `expert_keys`), default all; a tensor the hub keeps in parts, its parts' keys."""
    if name in hub_parts(config):
        return list(hub_parts(config)[name])
    if not is_sparse_layer(config, block) or family_of(config).moe.hub_fused:
        return [name]
    if name == router_param(config):
        return [moe_key(config, "router")]
    block = family_of(config).moe.block
    parts = {in_block(block, f"experts.{n}"): held for n, held in expert_parts(config).items()}.get(name)
    if parts is None:
        return [name]
    return [moe_key(config, part, e) for e in experts or range(num_experts(config)) for part in parts]


# ---------------------------------------------------------------------------------------------------- the loss


def default_aux_loss_coef(config) -> float:
    """transformers' coefficient of the load-balancing loss: `router_aux_loss_coef` when the model config asks for
    router logits (`output_router_logits`), else 0 (what its ForCausalLM adds to the loss; Llama 4's adds none)."""
    if not family_of(config).moe.aux_loss or not getattr(config, "output_router_logits", False):
        return 0.0
    return float(config.router_aux_loss_coef)


class WithAuxLoss:
    """The last stage's loss of a model with experts: the wrapped loss (`models.loss.CausalLMLoss`,
    `models.preference.PreferenceLoss`) on the logits, plus `coef` x transformers' load-balancing loss of the
    micro-batch (`aux_loss`; DeepSpeed's averaging over micro-batches and DP ranks makes it the mean over the
    step's micro-batches, as gradient accumulation with transformers' models does). With `coef` 0 the statistics
    still get a (zero) gradient: every float tensor a stage receives must get one back.

    `router_sums` ([aux sum, micro-batches, largest expert load]) accumulate for the metrics until `reset()`.
    Everything else is the wrapped loss's.
    """

    def __init__(self, loss, coef: float):
        self.loss, self.coef = loss, coef
        self.__name__ = f"{loss.__name__}+aux"
        self.router_sums: torch.Tensor | None = None

    def __getattr__(self, name):
        return getattr(self.__dict__["loss"], name)

    @property
    def context(self):
        """The wrapped pair loss's context-parallel place (AttributeError for a token loss, which has none)."""
        return self.loss.context

    @context.setter
    def context(self, value) -> None:
        self.loss.context = value

    def reset(self) -> None:
        self.loss.reset()
        self.router_sums = None

    def __call__(self, outputs, labels):
        logits, stats = outputs
        loss = self.loss(logits, labels)
        aux = aux_loss(stats)
        one = torch.ones((), dtype=torch.float64, device=aux.device)
        sums = torch.stack([aux.detach().double(), one, stats[-1].detach().double()])
        if self.router_sums is None:
            self.router_sums = sums
        else:
            self.router_sums = torch.cat(
                [self.router_sums[:2] + sums[:2], torch.maximum(self.router_sums[2:], sums[2:])]
            )
        return loss + self.coef * aux.to(loss.dtype)
