"""torch's Muon on transformers' model, as `optim.name=muon` defines it: torch.optim.Muon on the decoder layers'
matrices, torch.optim.AdamW (the trainer's AdamW groups) on every other parameter, one LR schedule for both.

A fused parameter of transformers' model is one matrix per logical part here, cut by the config's arithmetic written
out below (not by the trainer's tables): Phi-3's q, k and v rows of `qkv_proj` and gate and up halves of
`gate_up_proj`; each expert of transformers' fused [E, 2I, H] / [E, H, I] experts, and the gate and up halves of
each. torch.optim.Muon steps a stand-in tensor per part (it takes 2-D parameters only), whose values go back into
the model's tensor after each step: Muon's update of a matrix depends on that matrix's values and gradient alone.
With `optim.muon_ns_dtype=fp32` torch's Newton-Schulz runs as it is written, in fp32 instead of bf16
(`_newton_schulz_fp32`, patched in for the step).
"""

from __future__ import annotations

import copy
import re
from unittest import mock

import torch
import torch.optim._muon

from training.engine import lr_schedule, make_optimizer

_LAYER = re.compile(r"model\.layers\.\d+\.(.+)")


def _cut(key: str, t: torch.Tensor, config) -> list[torch.Tensor] | None:
    """The logical matrices of decoder-layer tensor `key` (views of `t`), or None when Muon does not take it."""
    if t.ndim == 3 and key in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
        halves = key.endswith("gate_up_proj")
        return [half for expert in t for half in (expert.chunk(2, 0) if halves else (expert,))]
    if t.ndim != 2:
        return None
    if key == "self_attn.qkv_proj.weight":
        head_dim = config.hidden_size // config.num_attention_heads
        q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
        return list(t.split([q, kv, kv], 0))
    if key == "mlp.gate_up_proj.weight":
        return list(t.chunk(2, 0))
    return [t]


def _newton_schulz_fp32(grad, ns_coefficients, ns_steps, eps):
    """torch 2.13's `torch.optim._muon._zeropower_via_newtonschulz` with its `grad.bfloat16()` in fp32."""
    a, b, c = ns_coefficients
    x = grad.float().clone()
    if grad.size(0) > grad.size(1):
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if grad.size(0) > grad.size(1) else x


class TorchMuon:
    """torch.optim.Muon + torch.optim.AdamW over `model`, stepped as one optimizer (see the module's note)."""

    def __init__(self, model, cfg, total_steps: int):
        o, config = cfg.optim, model.config
        self.model, self.parts, matrices, rest = model, [], [], []
        self.fp32 = str(o.muon_ns_dtype) == "fp32"
        for name, p in model.named_parameters():
            layer = _LAYER.fullmatch(name)
            views = _cut(layer.group(1), p, config) if layer and p.requires_grad else None
            if views is None:
                rest.append((name, p))
            elif len(views) == 1:
                matrices.append(p)
            else:
                for i, view in enumerate(views):
                    stand_in = torch.nn.Parameter(view.detach().clone())
                    self.parts.append((layer.group(1), p, i, stand_in))
                    matrices.append(stand_in)
        self.muon = torch.optim.Muon(
            matrices,
            lr=cfg.learning_rate,
            weight_decay=o.weight_decay,
            momentum=o.muon_momentum,
            nesterov=o.muon_nesterov,
            ns_steps=o.muon_ns_steps,
            adjust_lr_fn=str(o.muon_adjust_lr),
        )
        self.schedules = [torch.optim.lr_scheduler.LambdaLR(self.muon, lr_schedule(cfg, total_steps))]
        self.adamw = None
        if any(p.requires_grad for _, p in rest):  # (LoRA: every trainable parameter is an adapter's matrix)
            adamw_cfg = copy.deepcopy(cfg)
            adamw_cfg.optim.name = "adamw"
            self.adamw, adamw_schedule = make_optimizer(adamw_cfg, rest, total_steps)
            self.schedules.append(adamw_schedule)

    def step(self) -> None:
        config = self.model.config
        for key, p, i, stand_in in self.parts:
            stand_in.data.copy_(_cut(key, p.data, config)[i])
            stand_in.grad = None if p.grad is None else _cut(key, p.grad, config)[i].clone()
        if self.adamw is not None:
            self.adamw.step()
        if self.fp32:
            with mock.patch.object(torch.optim._muon, "_zeropower_via_newtonschulz", _newton_schulz_fp32):
                self.muon.step()
        else:
            self.muon.step()
        for key, p, i, stand_in in self.parts:
            _cut(key, p.data, config)[i].copy_(stand_in.data)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad(set_to_none=set_to_none)


class _Schedules:
    def __init__(self, schedules):
        self.schedules = schedules

    def step(self) -> None:
        for schedule in self.schedules:
            schedule.step()


def reference_optimizer(cfg, model, total_steps: int):
    """(optimizer, LR schedule) of the single-process reference: the trainer's AdamW, or torch's Muon above."""
    if str(cfg.optim.name) == "adamw":
        return make_optimizer(cfg, model.named_parameters(), total_steps)
    optimizer = TorchMuon(model, cfg, total_steps)
    return optimizer, _Schedules(optimizer.schedules)
