"""What single modules keep for backward, measured on the meta device (the memory planner's parts,
tools/activation_bytes.py): an experts module's gate, a dense MLP (a sparse block's shared expert), the head that mixes
residual streams into one (DeepSeek-V4's), and the stand-in the planner runs in place of a sparse block."""

from __future__ import annotations

from collections.abc import Callable

import torch

from models.layer_kinds import residual_streams

TOKENS = 64  # positions each module is measured on (what it keeps grows linearly with them)


def saved_bytes(run: Callable[[], object], held=()) -> int:
    """Bytes of the distinct storages autograd saves for backward while `run()` runs, those of `held` (parameters,
    an input counted elsewhere) aside."""
    skip = {t.untyped_storage()._cdata for t in held}
    saved: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage()._cdata not in skip:
            saved[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(saved.values())


def stream_head_bytes(config, act_bytes: int) -> float:
    """Per position, what the final norm's layer keeps before the norm where the hidden states are N residual
    streams (the family's `HyperHead`, DeepSeek-V4's: its fp32 norm of the streams, their mixing weights and its
    input), measured in the compute dtype; 0 with one stream."""
    if residual_streams(config) == 1:
        return 0.0
    from models.layers import build_layer
    from models.pipe_layout import NORM, pipe_layers

    dtype = torch.float32 if act_bytes == 4 else torch.bfloat16
    layer = next(x for x in pipe_layers(config.num_hidden_layers, False) if x.kind == NORM)
    with torch.device("meta"):
        head = build_layer(layer, config).to(dtype).hc_head
    x = torch.empty(1, TOKENS, residual_streams(config), config.hidden_size, dtype=dtype, device="meta")
    return saved_bytes(lambda: head(x.requires_grad_()), head.parameters()) / TOKENS


def mlp_bytes(mlp: torch.nn.Module, h: int, dtype) -> float:
    """Bytes a dense MLP (a sparse block's shared expert) keeps per token for backward, its input aside (the
    block's: counted with it)."""
    x = torch.empty(TOKENS, h, dtype=dtype, device="meta", requires_grad=True)
    return saved_bytes(lambda: mlp(x), [x, *mlp.parameters()]) / TOKENS


def gate_bytes(experts: torch.nn.Module, dtype) -> float | None:
    """Bytes an experts module's gate (transformers' `_apply_gate`: SwiGLU, gpt-oss's and DeepSeek-V4's clamped
    SwiGLU; gateless experts' activation) keeps per routed token, its input (gate and up) and its output (down's
    input) included; None where the module has neither of transformers' experts interface."""
    gated = getattr(experts, "has_gate", True)  # (gateless experts, Nemotron-H's: up, the activation, down)
    gate_up = getattr(experts, "gate_up_proj" if gated else "up_proj", None)
    if gate_up is None or not hasattr(experts, "_apply_gate" if gated else "act_fn"):
        return None
    width = gate_up.shape[-1] if getattr(experts, "is_transposed", False) else gate_up.shape[-2]  # 2 x this rank's
    x = torch.empty(TOKENS, width, dtype=dtype, device="meta", requires_grad=True)

    def run():
        out = experts._apply_gate(x) if gated else experts.act_fn(x)
        SavesInput.apply(out.unsqueeze(0), TOKENS)  # down's input

    # gate and up: the up projection's output, which it keeps
    return (saved_bytes(run, [x]) + x.untyped_storage().nbytes()) / TOKENS


class KeepsInput(torch.nn.Module):
    """A sparse block (or a tiled MLP) on the meta device: keeps its input for backward, as the router's matmul and
    a tiled MLP do; what else a sparse block keeps is `sparse_mlp_bytes`."""

    def __init__(self, as_tuple: bool, positions: int):
        super().__init__()
        self.as_tuple, self.positions = as_tuple, positions  # the residual's (this rank's under SP)

    def forward(self, x, *_routing, **_tokens):  # (experts beside a dense MLP: with the router's choice and weights;
        # DeepSeek-V4's sparse blocks: with the tokens, for its hash routers)
        out = SavesInput.apply(x, self.positions)
        return (out, None) if self.as_tuple else out


class SavesInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, positions):
        ctx.save_for_backward(x)
        return x.new_empty(x.shape if positions is None else (x.shape[0], positions, x.shape[-1]))

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("a stand-in for measuring the memory planner's saved bytes")
