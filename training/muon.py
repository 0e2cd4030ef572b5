"""Muon for the decoder layers' matrices, AdamW for the rest, as one optimizer DeepSpeed's pipeline engine steps.

`optim.name=muon` (docs/training.md). Which parameters Muon takes (`muon_matrix`): every matrix of a decoder layer
(attention and MLP projections, routers, each expert's matrices, shared experts, MLA's low-rank projections, LoRA's
A and B); embeddings, the LM head, norms, biases and every other tensor go to AdamW with the run's AdamW settings.

Each matrix is orthogonalised as the unsplit, unfused model's would be (`pieces`):
- under tensor parallelism every rank gathers the matrix's shards over its TP group (models/sharding.py `merge`),
  orthogonalises the whole and keeps its own block; the gathered matrix is dropped after its update;
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
from models.sharding import COLUMN, EXPERT_IN, EXPERT_ROW, GATE_UP, GATE_UP_OUT, REPLICA, ROW, merge, part_rows, shard
from models.tp_rules import tp_split

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's (Keller Jordan's quintic)
NS_EPS = 1e-7
_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
# the dimension of each 2-D piece along which tensor parallelism splits it, by the whole tensor's rule
_PIECE_SPLIT = {COLUMN: 0, ROW: 1, GATE_UP: 0, EXPERT_ROW: 1, GATE_UP_OUT: 1, EXPERT_IN: 0}


WHOLE, INTERLEAVED = "whole", "interleaved"  # how a parameter's matrices are cut, beside its TP rule
_FUSED_EXPERTS = re.compile(r"(.+\.)?experts\.(gate_up_proj|down_proj)")


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
            for p in group["params"]:
                # NOTE: DeepSpeed's engine gives every trainable parameter a gradient (zeros where none flowed);
                # a TP rank skipping one would leave its peers waiting in the gather.
                if p.grad is None:
                    continue
                if self.partitions is not None:  # DeepSpeed's bf16 optimizer: `p` is a flat DP partition
                    self._partition_step(p, index, group)
                else:
                    self._muon_step(p, group)
        return loss

    def _momentum(self, p: torch.Tensor, group: dict) -> torch.Tensor:
        """The momentum buffer moved by `p.grad`, and the update Newton-Schulz orthogonalises (Nesterov's or it)."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
        buf, momentum = state["momentum_buffer"], group["momentum"]
        buf.lerp_(p.grad, 1 - momentum)  # elementwise: the same on a shard or a partition as on the whole matrix
        return p.grad.lerp(buf, momentum) if group["nesterov"] else buf

    def _orthogonalised(self, param: torch.Tensor, update: torch.Tensor, group: dict) -> list:
        """(this rank's block of each orthogonalised piece, that piece's step size) of `param`'s `update`, in the
        order of `pieces(param, ...)`. Under TP the whole matrix is gathered for it and dropped after."""
        (rule, how), tp = self._plan_of(param), self._tp
        split = tp is not None and tp.size > 1 and rule != REPLICA
        if split:
            shards = [torch.empty_like(update) for _ in range(tp.size)]
            dist.all_gather(shards, update.contiguous(), group=tp.group)
            update = merge(shards, rule)
            del shards
        wholes, out = pieces(update, rule, how), []
        for whole in wholes:
            ortho = newton_schulz(whole, group["ns_steps"], getattr(torch, _DTYPES[group["ns_dtype"]]))
            if split and param.ndim == 2 and len(wholes) == 1:  # the matrix is the parameter: its own split
                ortho = shard(ortho, rule, tp.rank, tp.size)
            elif split:  # one part, half or expert of it: split along that piece's dimension
                ortho = ortho.chunk(tp.size, _PIECE_SPLIT.get(rule, 0))[tp.rank]
            out.append((ortho, adjusted_lr(group["lr"], group["adjust_lr"], whole.shape)))
        return out

    def _muon_step(self, p: torch.Tensor, group: dict) -> None:
        """torch.optim.Muon's step of one parameter (this rank's TP shard of it), its own optimizer state."""
        orthogonal = self._orthogonalised(p, self._momentum(p, group), group)
        rule, how = self._plan_of(p)
        p.mul_(1 - group["lr"] * group["weight_decay"])
        for own, (ortho, step) in zip(pieces(p, rule, how), orthogonal, strict=True):
            own.add_(ortho, alpha=-step)

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
        offset = 0
        for param, whole in zip(bf16.bf16_groups[index], bf16.fp32_groups_gradients[index], strict=True):
            low, high = max(offset, start), min(offset + param.numel(), start + size)
            if low < high:  # every TP rank of this DP rank meets the same matrices: their gathers pair up
                mine = torch.empty(param.shape, dtype=partition.dtype, device=partition.device)
                for own, (ortho, piece_step) in zip(
                    pieces(mine, *self._plan_of(param)),
                    self._orthogonalised(param, whole.view(param.shape), group),
                    strict=True,
                ):
                    own.copy_(ortho).mul_(piece_step / lr if lr else 0.0)
                step[low - start : high - start] = mine.view(-1)[low - offset : high - offset]
            offset += param.numel()
        partition.grad.copy_(step)
        partition.mul_(1 - lr * group["weight_decay"])
        partition.add_(partition.grad, alpha=-lr)


def steps_each_parameter(optimizer) -> bool:
    """Whether `optimizer` is ours as built (AdamW, or Muon with AdamW), holding its state per parameter: DeepSpeed's
    fp32 ZeRO-0 path steps it as it is; its bf16 and ZeRO optimizers wrap it around flat partitions."""
    return type(optimizer) in (torch.optim.AdamW, MuonAdamW)
