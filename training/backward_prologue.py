"""DeepSpeed's backward prologue on the last stage's loss.

NOTE: DeepSpeed runs its backward prologue from hooks it puts on the tensors a module's forward returns
(`DeepSpeedEngine.forward`: `register_output_backward_hooks`), so that it comes before any gradient is accumulated;
the bf16 optimizer clears its low-precision gradients there, and without it each micro-batch's gradients are added
to the fp32 ones again with every later micro-batch's. The last stage returns the head's `models.loss.HeadOutput`
(no tensor: the logits are made inside the loss), with experts beside it the router statistics, whose gradient may
arrive after the head weight's. So on the last stage the prologue hangs on the loss itself, the root of backward,
and the hooks on the outputs are removed (one prologue per backward, as DeepSpeed's one manager gives it).
"""

from __future__ import annotations

import torch
from deepspeed.runtime.utils import register_output_backward_hooks


class LossWithPrologue:
    """The stage's loss function, its result hooked with the engine's backward prologue; every other attribute is
    the wrapped loss's."""

    def __init__(self, loss, engine):
        self.loss, self.engine = loss, engine
        self.__name__ = getattr(loss, "__name__", type(loss).__name__)

    def __getattr__(self, name):
        return getattr(self.__dict__["loss"], name)

    def __call__(self, outputs, labels):
        loss = self.loss(outputs, labels)
        if torch.is_grad_enabled() and isinstance(loss, torch.Tensor) and loss.requires_grad:
            for out in outputs if isinstance(outputs, tuple) else (outputs,):
                for manager in getattr(out, "_backward_hook_managers", ()):
                    manager.remove_hooks()
            engine = self.engine
            register_output_backward_hooks(loss, engine._backward_prologue, engine._backward_prologue_per_tensor)
        return loss


def prologue_on_the_loss(engine) -> None:
    """Wrap the engine's pipeline module's loss function (a stage without one is left as it is)."""
    module = engine.module
    if module.loss_fn is not None and not isinstance(module.loss_fn, LossWithPrologue):
        module.loss_fn = LossWithPrologue(module.loss_fn, engine)
