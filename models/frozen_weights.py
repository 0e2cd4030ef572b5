"""A LoRA run's frozen base weights held in a compact format and dequantized at each matmul: QLoRA's NF4
(models/nf4.py) and the hub's own FP8 blocks and MXFP4 experts (models/hub_quantized.py, `lora.keep_quantized`).

A held weight is a small module of buffers with `dequantize(dtype)` (the dense weight, made for one product) and
`shape`, `device`, `dtype` answering as a tensor's would (PEFT places its adapters by them). A linear layer holding
one keeps its class's forward contract (`nn.Linear`: PEFT wraps it as any linear layer); its product is
bitsandbytes' `MatMul4Bit` written out for any format: forward dequantizes in the input's dtype, backward again
for the input's gradient, and nothing of the weight's size is kept between the two. A sparse block's fused experts
([E, ., .] tensors, which transformers' experts code reads as attributes in whichever implementation it runs) are
dequantized into those attributes at each call of the block and dropped after it: a forward holds one layer's
experts dense at a time, and with every block recomputed so does backward (training/validate.py refuses the rest).

Held buffers are stored as bytes (uint8: DeepSpeed's casts of a module to bf16 leave them alone; device moves carry
them) and are not persistent: checkpoints hold the adapters, and every start holds the base again from its source.

Model code only: no distributed code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """`t`'s storage as a flat uint8 tensor (a held buffer: no cast of the module touches it)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


class HeldWeight(nn.Module):
    """A held weight's base: `device` and `dtype` (what is stored: uint8) answer as a tensor's would, from its first
    buffer; subclasses give `shape` (the dense weight's) and `dequantize(dtype)`."""

    @property
    def device(self) -> torch.device:
        return next(self.buffers()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.buffers()).dtype


class _HeldMatmul(torch.autograd.Function):
    """`F.linear(x, W, bias)` with W dequantized for the product: backward dequantizes it again for the input's
    gradient. The weight is frozen; a trained bias gets its gradient."""

    @staticmethod
    def forward(ctx, x, weight: nn.Module, bias):
        ctx.weight, ctx.bias_dtype = weight, None if bias is None else bias.dtype
        return F.linear(x, weight.dequantize(x.dtype), bias)

    @staticmethod
    def backward(ctx, grad):
        grad_bias = None
        if ctx.needs_input_grad[2]:
            grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0, dtype=ctx.bias_dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.matmul(grad, ctx.weight.dequantize(grad.dtype))
        return grad_x, None, grad_bias


def held_linear(x: torch.Tensor, weight: nn.Module, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ bias) with W a held weight."""
    return _HeldMatmul.apply(x, weight, bias)


class HeldLinear(nn.Linear):
    """An `nn.Linear` whose weight is a held weight."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return held_linear(x, self.weight, self.bias)


_CLASSES: dict[type, type] = {nn.Linear: HeldLinear}


def held_class(cls: type) -> type | None:
    """The held class of a linear layer class (`nn.Linear`, or a subclass that routes its product through a
    `matmul(x, weight)` attribute: the tensor-parallel row layer), or None."""
    if cls in _CLASSES:
        return _CLASSES[cls]
    if cls.__mro__[1] is nn.Linear and "matmul" in cls.__dict__:
        _CLASSES[cls] = type(f"Held{cls.__name__}", (cls,), {"matmul": staticmethod(held_linear)})
        return _CLASSES[cls]
    return None


def hold_linear(layer: nn.Linear, weight: nn.Module) -> None:
    """`layer` computes with the held `weight` from now on, in place (its class becomes the held one; its bias
    stays; its dense weight is dropped)."""
    cls = held_class(type(layer))
    if cls is None:
        raise ValueError(f"{type(layer).__name__} cannot hold its weight in a compact format")
    if tuple(weight.shape) != tuple(layer.weight.shape):
        raise ValueError(f"a held weight of shape {list(weight.shape)} for a {list(layer.weight.shape)} layer")
    del layer.weight
    layer.weight = weight
    layer.__class__ = cls


def expert_weights(experts: nn.Module) -> list[str]:
    """The fused [E, ., .] weight parameters of an experts module (its biases excluded)."""
    return [n for n, p in experts.named_parameters(recurse=False) if p.dim() == 3 and p.is_floating_point()]


def hold_experts(experts: nn.Module, held: dict[str, nn.Module], block: nn.Module | None = None) -> None:
    """An experts module's fused weights (`held`: {parameter name: its held weight}) computed from their held form,
    in place; biases stay. Each call of the sparse `block` (default: the experts module; expert parallelism and
    routed experts call transformers' experts functions on the module directly, inside the block) dequantizes them
    into attributes of the experts (in the dtype of the block's input) and drops them after."""
    for name, weight in held.items():
        if tuple(weight.shape) != tuple(getattr(experts, name).shape):
            raise ValueError(f"a held {name} of shape {list(weight.shape)} for {list(getattr(experts, name).shape)}")
        delattr(experts, name)
        experts.add_module(f"{name}_held", weight)
    experts.held_weights = list(held)

    def dense(_block, args, kwargs):
        dtype = next(t.dtype for t in (*args, *kwargs.values()) if torch.is_tensor(t) and t.is_floating_point())
        for n in experts.held_weights:
            experts.__dict__[n] = getattr(experts, f"{n}_held").dequantize(dtype)

    def drop(*_):
        for n in experts.held_weights:
            experts.__dict__.pop(n, None)

    (block or experts).register_forward_pre_hook(dense, with_kwargs=True)
    (block or experts).register_forward_hook(drop, always_call=True)


def held_bytes(module: nn.Module) -> int:
    """Bytes of `module`'s parameters and buffers (what a stage holds of its weights)."""
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])
