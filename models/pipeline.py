"""LayerSpec list, stage partitioning and the loss: the wiring between model code and DeepSpeed.

Each rank builds only the layers of its own stage (DeepSpeed builds `specs[start:stop]`). Stage
bounds are computed here from the config alone: DeepSpeed's own `partition_method="parameters"`
instantiates every layer of the model on every rank just to count parameters, which for a 70B
model means 280 GB of fp32 per rank before training starts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime import utils as ds_utils

from models.layers import DecoderLayerPipe, EmbeddingPipe, LMHeadPipe, NormPipe, tied_lm_head_forward
from models.layout import DECODER, EMBED, LM_HEAD, NORM, pipe_layers

IGNORE_INDEX = -100
TIED_KEY = "embed"
PARTITION_METHODS = ("parameters", "uniform")


def layer_specs(config) -> list[LayerSpec]:
    """One spec per entry of `models.layout.pipe_layers`, in the same order."""
    tied = config.tie_word_embeddings
    specs = []
    for layer in pipe_layers(config.num_hidden_layers, tied):
        if layer.kind == EMBED:
            specs.append(TiedLayerSpec(TIED_KEY, EmbeddingPipe, config) if tied else LayerSpec(EmbeddingPipe, config))
        elif layer.kind == DECODER:
            specs.append(LayerSpec(DecoderLayerPipe, config, layer.block))
        elif layer.kind == NORM:
            specs.append(LayerSpec(NormPipe, config))
        elif layer.kind == LM_HEAD:
            specs.append(
                TiedLayerSpec(TIED_KEY, EmbeddingPipe, config, forward_fn=tied_lm_head_forward)
                if tied
                else LayerSpec(LMHeadPipe, config)
            )
    return specs


def layer_param_counts(config) -> list[int]:
    """Parameters per pipeline layer, counted on the meta device (no memory, no init)."""
    with torch.device("meta"):
        sizes = {
            EMBED: sum(p.numel() for p in EmbeddingPipe(config).parameters()),
            DECODER: sum(p.numel() for p in DecoderLayerPipe(config, 0).parameters()),
            NORM: sum(p.numel() for p in NormPipe(config).parameters()),
        }
    sizes[LM_HEAD] = sizes[EMBED]  # same matmul cost whether tied or not
    return [sizes[layer.kind] for layer in pipe_layers(config.num_hidden_layers, config.tie_word_embeddings)]


def stage_bounds(config, num_stages: int, partition: str | Sequence[int] = "parameters") -> list[int]:
    """Layer-index bounds of each stage: stage s owns layers [bounds[s], bounds[s+1]).

    Args:
        config: a `LlamaConfig`.
        num_stages: pipeline stages.
        partition: "parameters" (balance parameter counts), "uniform" (decoder blocks spread
            evenly; embedding on the first stage, norm and head on the last), or a list with the
            number of decoder blocks of each stage, e.g. [2, 3, 3, 2].

    Raises:
        ValueError: the partition cannot be honoured; the message names the offending value.
    """
    num_layers = config.num_hidden_layers
    if num_stages < 1:
        raise ValueError(f"num_stages={num_stages} must be >= 1")
    if num_stages > num_layers:
        raise ValueError(f"num_stages={num_stages} is larger than the model's {num_layers} decoder layers")
    if isinstance(partition, str):
        if partition == "parameters":
            bounds = ds_utils.partition_balanced(weights=layer_param_counts(config), num_parts=num_stages)
            if all(b < e for b, e in zip(bounds[:-1], bounds[1:])):
                return [int(b) for b in bounds]
            partition = "uniform"  # NOTE: balancing left a stage empty (huge vocab, few layers)
        if partition != "uniform":
            raise ValueError(f"partition={partition!r}: expected one of {PARTITION_METHODS} or a list of block counts")
        per_stage = [num_layers // num_stages + (s < num_layers % num_stages) for s in range(num_stages)]
    else:
        per_stage = [int(n) for n in partition]
        if len(per_stage) != num_stages:
            raise ValueError(f"partition={per_stage} has {len(per_stage)} entries but num_stages={num_stages}")
        if sum(per_stage) != num_layers or min(per_stage) < 1:
            raise ValueError(
                f"partition={per_stage} must give every stage >= 1 decoder layer and sum to "
                f"num_hidden_layers={num_layers} (sums to {sum(per_stage)})"
            )
    # Decoder block b is layer b + 1; embedding joins stage 0, norm and head the last stage.
    bounds, end = [0], 1
    for n in per_stage:
        end += n
        bounds.append(end)
    bounds[-1] = num_layers + 3
    return bounds


class LlamaPipelineModule(PipelineModule):
    """`PipelineModule` whose stage bounds come from `stage_bounds` instead of building every layer."""

    def __init__(self, config, bounds: list[int], **kwargs):
        # NOTE: set before nn.Module.__init__ on purpose: PipelineModule.__init__ partitions and
        # builds immediately, and plain attributes are allowed before Module's own fields exist.
        self._precomputed_bounds = list(bounds)
        self.llama_config = config
        super().__init__(layers=layer_specs(config), partition_method="precomputed", **kwargs)

    def _partition_layers(self, method="precomputed"):
        stage_id = self._topo.get_coord(self.global_rank).pipe
        self.parts = self._precomputed_bounds
        if len(self.parts) != self.num_stages + 1 or self.parts[-1] != len(self._layer_specs):
            raise ValueError(f"stage bounds {self.parts} do not fit {self.num_stages} stages")
        self._set_bounds(start=self.parts[stage_id], stop=self.parts[stage_id + 1])

    def local_layer_indices(self) -> range:
        return range(self._local_start, self._local_stop)


def build_pipeline_module(
    config,
    topology,
    partition: str | Sequence[int] = "parameters",
    activation_checkpointing: bool = False,
    loss_fn=None,
    skip_init: bool = True,
) -> LlamaPipelineModule:
    """Build this rank's stage of the LLaMA pipeline.

    Args:
        config: `LlamaConfig` with `_attn_implementation` set.
        topology: a DeepSpeed `ProcessTopology` with a `pipe` axis.
        partition: see `stage_bounds`.
        activation_checkpointing: recompute each decoder layer in backward (non-reentrant; the
            engine config must carry `pipeline.use_reentrant: false`).
        loss_fn: `CausalLMLoss` or any callable (logits, labels) -> loss.
        skip_init: leave weights uninitialised because a checkpoint will overwrite them.
    """
    from transformers.initialization import no_init_weights

    bounds = stage_bounds(config, topology.get_dim("pipe"), partition)
    ctx = no_init_weights() if skip_init else contextlib.nullcontext()
    with ctx:
        return LlamaPipelineModule(
            config,
            bounds,
            topology=topology,
            loss_fn=loss_fn,
            activation_checkpoint_interval=1 if activation_checkpointing else 0,
            checkpointable_layers=["DecoderLayerPipe"],
        )


class CausalLMLoss:
    """fp32 cross-entropy summed over scored tokens, times a per-step scale.

    Labels arrive already shifted (labels[t] is the target of position t; see `data.collator`),
    together with `scale` = (micro-batches x DP size) / (target tokens in the whole global
    batch). DeepSpeed divides each micro-batch loss by the micro-batch count and averages
    gradients over DP ranks, so the optimizer sees the gradient of the mean loss over every
    target token of the step, however tokens fall across micro-batches. A micro-batch with no
    target token adds exactly 0.

    `totals()` returns the (summed loss, token count) seen since the last `reset()`: the exact
    token-weighted figures for metrics and evaluation.
    """

    __name__ = "CausalLMLoss"

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.loss_sum = 0.0
        self.tokens = 0

    def totals(self) -> tuple[float, int]:
        return self.loss_sum, self.tokens

    def __call__(self, logits: torch.Tensor, labels_and_scale) -> torch.Tensor:
        labels, scale = labels_and_scale  # [B, S] long, [] float
        loss_sum = F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        self.loss_sum += float(loss_sum.detach())
        self.tokens += int((labels != IGNORE_INDEX).sum())
        return loss_sum * scale.to(loss_sum.device)
