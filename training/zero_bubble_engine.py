"""The pipeline engines behind `pipeline_schedule`: DeepSpeed's own for 1F1B and DualPipeV, and a zero-bubble one.

`ZeroBubbleEngine` is DeepSpeed's `PipelineEngine` with two changes, both through its instruction map: a
`BackwardPass` runs with the stage's `WeightGradStore` active, so the decoder blocks' linear layers queue their
weight gradients instead of computing them (models/weight_grad.py), and a `WeightPass` computes the oldest
queued group. The schedule (training/schedules.py) runs every W before the gradients are reduced, clipped and
applied, so the optimizer sees the gradients 1F1B computes.
"""

from __future__ import annotations

import torch
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.pipe.schedule import BackwardPass, RecvGrad

from models.weight_grad import WeightGradStore, defer_weight_gradients
from training.schedules import WeightPass, ZeroBubbleSchedule


class ZeroBubbleEngine(PipelineEngine):
    """`PipelineEngine` running `ZeroBubbleSchedule`. Made from a built engine by `make_zero_bubble`."""

    store: WeightGradStore

    def _train_schedule(self):
        return ZeroBubbleSchedule(micro_batches=self.micro_batches, stages=self.num_stages, stage_id=self.stage_id)

    def _exec_backward_pass(self, buffer_id):
        self.store.active = True
        try:
            super()._exec_backward_pass(buffer_id)
        finally:
            self.store.active = False
            self.store.close_backward()

    def _exec_recv_grads(self, buffer_id):
        # NOTE: DeepSpeed receives every output gradient into one reused buffer, and autograd hands that very
        # tensor, uncopied through the residual add, to the stage's last linear layer as its output gradient: a
        # deferred W would read the next micro-batch's gradient. Receive into the buffer, back-propagate a copy.
        self.grad_layer = getattr(self, "_grad_recv_buffer", None)
        super()._exec_recv_grads(buffer_id)
        self._grad_recv_buffer = self.grad_layer
        received = self.grad_layer
        self.grad_layer = received.clone() if isinstance(received, torch.Tensor) else [g.clone() for g in received]

    def reset_activation_shape(self):
        super().reset_activation_shape()
        self._grad_recv_buffer = None  # shaped like the old activations

    def _exec_weight_pass(self, buffer_id):
        bf16 = isinstance(self.optimizer, BF16_Optimizer)
        if bf16:  # its low-precision grads were added to the fp32 ones after each backward: start from zero
            self.optimizer.clear_lp_grads()
        self.store.run_oldest()
        if bf16:
            self.optimizer.update_hp_grads(clear_lp_grads=False)

    # NOTE: the map holds functions, not method names: the overridden backward must be entered here too.
    _INSTRUCTION_MAP = {
        **PipelineEngine._INSTRUCTION_MAP,
        BackwardPass: _exec_backward_pass,
        RecvGrad: _exec_recv_grads,
        WeightPass: _exec_weight_pass,
    }


def make_zero_bubble(engine: PipelineEngine) -> ZeroBubbleEngine:
    """Turn a built 1F1B engine into a zero-bubble one: the decoder blocks' linear layers defer their weight
    gradients to the engine's store. Returns the same object."""
    from models.layers import DecoderPipe

    store = WeightGradStore()
    blocks = [m for m in engine.module.modules() if isinstance(m, DecoderPipe)]
    defer_weight_gradients(blocks, store)
    engine.__class__ = ZeroBubbleEngine
    engine.store = store
    return engine
