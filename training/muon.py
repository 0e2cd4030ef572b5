"""Muon for the decoder layers' matrices, AdamW for the rest, as one optimizer DeepSpeed's pipeline engine steps.

`optim.name=muon` (docs/training.md). Which parameters Muon takes (`muon_matrix`): every matrix of a decoder layer
(attention and MLP projections, routers, each expert's matrices, shared experts, MLA's low-rank projections, LoRA's
A and B); embeddings, the LM head, norms, biases and every other tensor go to AdamW with the run's AdamW settings.

Each matrix is orthogonalised as the unsplit, unfused model's would be (`pieces`):
- under tensor parallelism the split matrices go in rounds of T: the i-th of a round is gathered whole on TP rank i
  (models/sharding.py `merge`), orthogonalised there, and its blocks scattered back (`shard`), so the TP ranks
  share the work and a whole matrix exists on one rank, for its round only;
- a fused projection is one matrix per logical part: q, k and v of `qkv_proj`, gate and up of `gate_up_proj` (and of
  fused experts, gpt-oss's interleaved columns too), each expert on its own (experts held by this rank under EP are
  whole here, so nothing crosses the EP group).
The step size of each matrix follows its own shape (`optim.muon_adjust_lr`), as torch.optim.Muon's `_adjust_lr`.

The arithmetic is torch.optim.Muon's (torch 2.13: momentum by `lerp`, Nesterov, a quintic Newton-Schulz in bf16,
decoupled weight decay), held equal to it in tests/test_muon.py; the momentum and the AdamW moments are held per
parameter like AdamW's, so checkpoints save, resume and move between layouts by parameter name
(checkpoint/optimizer_reshape.py).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import torch
import torch.distributed as dist

from models.families import family_of
from models.pipe_layout import DECODER, TIED_PARAM, pipe_layers
from models.sharding import (
    GATE_UP,
    GATE_UP_OUT,
    REPLICA,
    merge,
    merged_shape,
    part_rows,
    shard,
)
from models.tp_rules import tp_split

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's (Keller Jordan's quintic)
NS_EPS = 1e-7
_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


WHOLE, INTERLEAVED = "whole", "interleaved"  # how a parameter's matrices are cut, beside its TP rule
_FUSED_EXPERTS = re.compile(r"(.+\.)?experts\.(gate_up_proj|up_proj|down_proj)")


def muon_plan(name: str, param: torch.Tensor, config) -> tuple[str, str] | None:
    """How Muon updates the pipeline module's parameter `name`: (its TP rule, how its matrices are cut: `pieces`),
    or None where AdamW does (`layer_plan`)."""
    if name == TIED_PARAM:
        return None
    index, key = name.split(".", 1)
    kind = pipe_layers(config.num_hidden_layers, config.tie_word_embeddings)[int(index)].kind
    return layer_plan(key, param, config) if kind == DECODER else None


def layer_plan(key: str, param: torch.Tensor, config) -> tuple[str, str] | None:
    """`muon_plan` of the parameter `key` of a decoder layer (transformers' name within the layer). Muon takes its
    2-D weights, and transformers' fused experts ([E, ., .]: a matrix per expert); not norms, biases or a
    convolution's kernel."""
    experts = _FUSED_EXPERTS.fullmatch(key)
    if not ((param.ndim == 2 and key.endswith("weight")) or (param.ndim == 3 and experts)):
        return None  # (gpt-oss's [E, 2I] expert biases are 2-D: AdamW's, as every bias)
    moe = family_of(config).moe
    if ".lora_" in key:
        how = WHOLE
    elif experts and experts.group(2) == "gate_up_proj" and moe is not None and moe.interleaved_gate_up:
        how = INTERLEAVED
    else:
        how = ""
    return tp_split(DECODER, key, config), how


def pieces(t: torch.Tensor, rule: str, how: str = "") -> list[torch.Tensor]:
    """The 2-D matrices Muon orthogonalises one by one in `t` (a whole tensor or one TP rank's shard, alike): each
    expert of a 3-D tensor, each part of a fused projection (`rule` "parts:..."), each half of fused gate/up experts,
    gpt-oss's interleaved gate (even columns) and up (odd columns) (`how` INTERLEAVED); `how` WHOLE: the matrix
    as it is (LoRA's B of a fused projection, a matrix like any other in PEFT). Views of `t`."""
    if t.ndim == 3:
        return [m for expert in t for m in pieces(expert, rule, how)]
    if how == INTERLEAVED:
        return [t[:, 0::2], t[:, 1::2]]
    if how == WHOLE:
        return [t]
    if (rows := part_rows(rule, t.shape[0])) is not None:
        return list(t.split(rows, 0))
    if rule == GATE_UP:
        return list(t.chunk(2, 0))
    if rule == GATE_UP_OUT:
        return list(t.chunk(2, 1))
    return [t]


def newton_schulz(update: torch.Tensor, steps: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """torch.optim.Muon's orthogonalisation (`_zeropower_via_newtonschulz`, torch 2.13) of one matrix, in bf16 as
    torch's, or in fp32 (`optim.muon_ns_dtype`)."""
    a, b, c = NS_COEFFICIENTS
    x = update.to(dtype, copy=True)
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=NS_EPS))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, rule: str, shape: torch.Size) -> float:
    """torch.optim.Muon's step size of a matrix of `shape` (`optim.muon_adjust_lr`): (A, B) as the matrix is held,
    [out, in] for a Linear's weight, [in, out] for experts held as x @ W (Llama 4's, gpt-oss's), which only
    `original` tells apart."""
    rows, cols = shape[:2]
    ratio = 0.2 * math.sqrt(max(rows, cols)) if rule == "match_rms_adamw" else math.sqrt(max(1, rows / cols))
    return lr * ratio


class MuonAdamW(torch.optim.Optimizer):
    """One optimizer over groups marked `muon` (Muon) or not (AdamW: a torch.optim.AdamW over the same group dicts
    and the same state, so the LR schedule and checkpoints see one optimizer).

    Args:
        groups: parameter groups; each has `muon` (bool) and `weight_decay`.
        plan_of: each Muon parameter's TP rule (models/sharding.py) and how its matrices are cut (`pieces`).
        tp: this rank's tensor-parallel place (`models.tp_collectives.TensorParallel`); None: one rank.
        adamw: AdamW's keyword arguments (betas, eps, fused).
    """

    def __init__(
        self,
        groups: list[dict],
        *,
        lr: float,
        momentum: float,
        nesterov: bool,
        ns_steps: int,
        ns_dtype: str,
        adjust_lr: str,
        plan_of: Callable[[torch.Tensor], tuple[str, str]],
        tp=None,
        adamw: dict | None = None,
    ):
        defaults = {"lr": lr, "momentum": momentum, "nesterov": nesterov, "ns_steps": ns_steps, "ns_dtype": ns_dtype}
        super().__init__(groups, {**defaults, "adjust_lr": str(adjust_lr), "muon": False})
        self._adamw_kwargs = adamw or {}
        self.partitions = None  # DeepSpeed's bf16 optimizer, when it holds the master weights (`_partition_step`)
        self._plan_of, self._tp = plan_of, tp
        self._link_adamw()

    def _link_adamw(self) -> None:
        """AdamW steps the groups not marked `muon`, over these group dicts and this state."""
        plain = [g for g in self.param_groups if not g["muon"]]
        self._adamw = None
        if plain:
            self._adamw = torch.optim.AdamW([{"params": g["params"]} for g in plain], **self._adamw_kwargs)
            for group, defaults in zip(plain, self._adamw.param_groups, strict=True):
                for key, value in defaults.items():
                    group.setdefault(key, value)
            self._adamw.param_groups, self._adamw.state = plain, self.state

    def step_partitions_of(self, bf16_optimizer) -> None:
        """From now on the Muon groups' parameters are `bf16_optimizer`'s flat DP partitions of the master weights
        (DeepSpeed's `BF16_Optimizer`, which wraps this optimizer): `_partition_step`."""
        self.partitions = bf16_optimizer

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        self._link_adamw()  # the loaded group dicts and state replace ours

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._adamw is not None:
            self._adamw.step()
        for index, group in enumerate(self.param_groups):
            if not group["muon"]:
                continue
            # NOTE: DeepSpeed's engine gives every trainable parameter a gradient (zeros where none flowed): the TP
            # ranks of a stage see the same matrices in the same order, so their gathers and scatters pair up.
            params = [p for p in group["params"] if p.grad is not None]
            if self.partitions is not None:  # DeepSpeed's bf16 optimizer: each `p` is a flat DP partition
                for partition in params:
                    self._partition_step(partition, index, group)
                continue
            lr, decay = group["lr"], group["weight_decay"]
            updates = ((p, self._momentum(p, group), p) for p in params)  # lazily: a round's updates at a time
            for p, blocks in self._orthogonalised(updates, group):
                p.mul_(1 - lr * decay)
                for own, (ortho, step) in zip(pieces(p, *self._plan_of(p)), blocks, strict=True):
                    own.add_(ortho, alpha=-step)
        return loss

    def _momentum(self, p: torch.Tensor, group: dict) -> torch.Tensor:
        """The momentum buffer moved by `p.grad`, and the update Newton-Schulz orthogonalises (Nesterov's or it)."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
        buf, momentum = state["momentum_buffer"], group["momentum"]
        buf.lerp_(p.grad, 1 - momentum)  # elementwise: the same on a shard or a partition as on the whole matrix
        return p.grad.lerp(buf, momentum) if group["nesterov"] else buf

    def _orthogonalised(self, updates, group: dict):
        """For each (parameter, its update, key) of `updates`: yield (key, [(this rank's block of an orthogonalised
        piece, that piece's step size) in the order of `pieces`]). A matrix held whole is orthogonalised here. Those
        split over TP go in rounds of T: the i-th matrix of a round is gathered to TP rank i, orthogonalised whole
        there and its blocks scattered back, so the TP ranks share the Newton-Schulz work (each whole matrix exists
        on one rank, for its round only)."""
        tp, pending = self._tp, []
        for param, update, key in updates:
            rule, how = self._plan_of(param)
            if tp is None or tp.size == 1 or rule == REPLICA:
                wholes = pieces(update, rule, how)
                yield key, [(self._newton_schulz(m, group), self._step_size(m.shape, group)) for m in wholes]
                continue
            pending.append((param, update, key))
            if len(pending) == tp.size:
                yield from self._round(pending, group)
                pending = []
        if pending:
            yield from self._round(pending, group)

    def _round(self, batch: list, group: dict):
        """One round of `_orthogonalised` over the TP group: TP rank i orthogonalises the i-th matrix of `batch`."""
        tp, mine = self._tp, None
        for owner, (param, update, _) in enumerate(batch):
            target = dist.get_global_rank(tp.group, owner)
            if owner == tp.rank:
                shards = [torch.empty_like(update) for _ in range(tp.size)]
                dist.gather(update.contiguous(), shards, dst=target, group=tp.group)
                whole = merge(shards, self._plan_of(param)[0])
                del shards
                mine = torch.empty(whole.shape, dtype=_dtype(group), device=whole.device)
                for out, matrix in zip(pieces(mine, *self._plan_of(param)), pieces(whole, *self._plan_of(param))):
                    out.copy_(self._newton_schulz(matrix, group))
                del whole
            else:
                dist.gather(update.contiguous(), None, dst=target, group=tp.group)
        for owner, (param, update, key) in enumerate(batch):
            rule, how = self._plan_of(param)
            block = torch.empty(update.shape, dtype=_dtype(group), device=update.device)
            blocks = [shard(mine, rule, r, tp.size) for r in range(tp.size)] if owner == tp.rank else None
            dist.scatter(block, blocks, src=dist.get_global_rank(tp.group, owner), group=tp.group)
            whole = torch.empty(merged_shape([tuple(update.shape)] * tp.size, rule), device="meta")
            sizes = [self._step_size(m.shape, group) for m in pieces(whole, rule, how)]
            yield key, list(zip(pieces(block, rule, how), sizes, strict=True))

    @staticmethod
    def _newton_schulz(matrix: torch.Tensor, group: dict) -> torch.Tensor:
        return newton_schulz(matrix, group["ns_steps"], _dtype(group))

    @staticmethod
    def _step_size(shape, group: dict) -> float:
        return adjusted_lr(group["lr"], group["adjust_lr"], shape)

    def _partition_step(self, partition: torch.Tensor, index: int, group: dict) -> None:
        """Muon's step of this DP rank's flat fp32 partition of group `index` under DeepSpeed's bf16 optimizer
        (`BF16_Optimizer`, deepspeed 0.19.8: fp32 gradients of the whole group on every rank, reduced and clipped;
        the master weights and optimizer state partitioned over DP). The momentum moves on the partition alone;
        the updates of every partition are gathered into the group's fp32 gradient buffer (free by now: no
        memory of its own), each matrix that meets this partition is orthogonalised whole, and the partition takes
        its part, each piece's step size folded in (`-lr` applied to the whole partition)."""
        bf16, lr = self.partitions, group["lr"]
        dp_group = bf16.real_dp_process_group[index]
        flat, size = bf16.fp32_groups_gradients_flat[index], partition.numel()
        start = dist.get_rank(group=dp_group) * size
        step = self._momentum(partition, group).clone()
        dist.all_gather(list(flat.chunk(dist.get_world_size(group=dp_group))), step, group=dp_group)
        step.zero_()  # the partition's update is in `flat` now: the buffer takes the step
        met, offset = [], 0  # the matrices meeting this partition: the same on every TP rank of this DP rank
        for param, whole in zip(bf16.bf16_groups[index], bf16.fp32_groups_gradients[index], strict=True):
            low, high = max(offset, start), min(offset + param.numel(), start + size)
            if low < high:
                met.append((param, whole.view(param.shape), (param, offset, low, high)))
            offset += param.numel()
        for (param, offset, low, high), blocks in self._orthogonalised(met, group):
            mine = torch.empty(param.shape, dtype=partition.dtype, device=partition.device)
            for own, (ortho, piece_step) in zip(pieces(mine, *self._plan_of(param)), blocks, strict=True):
                own.copy_(ortho).mul_(piece_step / lr if lr else 0.0)
            step[low - start : high - start] = mine.view(-1)[low - offset : high - offset]
        partition.grad.copy_(step)
        partition.mul_(1 - lr * group["weight_decay"])
        partition.add_(partition.grad, alpha=-lr)


def _dtype(group: dict) -> torch.dtype:
    """The dtype of the group's Newton-Schulz iteration (`optim.muon_ns_dtype`)."""
    return getattr(torch, _DTYPES[group["ns_dtype"]])


def steps_each_parameter(optimizer) -> bool:
    """Whether `optimizer` is ours as built (AdamW, or Muon with AdamW), holding its state per parameter: DeepSpeed's
    fp32 ZeRO-0 path steps it as it is; its bf16 and ZeRO optimizers wrap it around flat partitions."""
    return type(optimizer) in (torch.optim.AdamW, MuonAdamW)
