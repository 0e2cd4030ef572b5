"""The wiring between model code and DeepSpeed: the LayerSpec list and the PipelineModule.

Each rank builds only the layers of its own stage (DeepSpeed builds `specs[start:stop]`), with
stage bounds the run computed once (`models.partition.stage_bounds`, from the config alone), and with tensor parallelism
only its shard of each (models/tensor_parallel.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe.dualpipev import DualPipeVModule

from models.context_parallel import ContextParallel
from models.expert_parallel import ExpertParallel
from models.layers import DecoderOptions, DecoderPipe, block_index
from models.moe import file_keys_of, num_experts
from models.pipe_layout import TIED_KEY, pipe_layers
from models.tensor_parallel import TensorParallel, tp_layer_class_and_args, tp_tied_head_forward


def layer_specs(
    config, tp: TensorParallel, options: DecoderOptions | None = None, ep: ExpertParallel | None = None
) -> list[LayerSpec]:
    """One spec per entry of `models.pipe_layout.pipe_layers`, in the same order."""
    specs = []
    for layer in pipe_layers(config.num_hidden_layers, config.tie_word_embeddings):
        cls, args = tp_layer_class_and_args(layer, config, tp, options, ep)
        if config.tie_word_embeddings and not layer.has_file:  # the LM head: a second use of layer 0's module
            specs.append(TiedLayerSpec(TIED_KEY, cls, *args, forward_fn=tp_tied_head_forward(config, tp)))
        elif config.tie_word_embeddings and layer.index == 0:
            specs.append(TiedLayerSpec(TIED_KEY, cls, *args))
        else:
            specs.append(LayerSpec(cls, *args))
    return specs


class PipelineStageModule(PipelineModule):
    """`PipelineModule` whose stage bounds come from `stage_bounds` instead of building every layer."""

    def __init__(
        self, config, bounds: list[int], tp: TensorParallel, options: DecoderOptions, ep: ExpertParallel, **kwargs
    ):
        # NOTE: set before nn.Module.__init__ on purpose: PipelineModule.__init__ partitions and
        # builds immediately, and plain attributes are allowed before Module's own fields exist.
        self._precomputed_bounds = list(bounds)
        self.model_config = config
        self._tp, self._ep, self._cp = tp, ep, options.context
        super().__init__(layers=layer_specs(config, tp, options, ep), partition_method="precomputed", **kwargs)

    def _partition_layers(self, method="precomputed"):
        stage_id = self._topo.get_coord(self.global_rank).pipe
        self.parts = self._precomputed_bounds
        if len(self.parts) != self.num_stages + 1 or self.parts[-1] != len(self._layer_specs):
            raise ValueError(f"stage bounds {self.parts} do not fit {self.num_stages} stages")
        self._set_bounds(start=self.parts[stage_id], stop=self.parts[stage_id + 1])
        # The grid exists now and the layers are built next: give them their tensor-parallel group (DeepSpeed's
        # "slice" group: the ranks of this stage and DP replica), and their expert-parallel groups.
        self._tp.group = self._grid.get_slice_parallel_group()
        if self._ep.size > 1:
            expert_groups(self._topo, self.global_rank, self._ep)
        if self._cp.size > 1:
            context_groups(self._topo, self.global_rank, self._cp)

    def _get_frozen_parameter_names(self, layer):
        """The layer-file keys of `layer`'s frozen parameters (LoRA saves without them): a sparse block's fused
        experts and router, and a tensor the hub keeps in parts, are stored under the hub's keys (models/moe.py)."""
        names = super()._get_frozen_parameter_names(layer)
        if not isinstance(layer, DecoderPipe):
            return names
        held = self._ep.local_experts(num_experts(self.model_config)) if layer.sparse else None
        block = block_index(layer)
        return [key for name in names for key in file_keys_of(self.model_config, block, name, held)]

    def forward(self, forward_input):
        """The stage's layers; a carried tensor that is a view of a larger one (the per-layer inputs still to come,
        models/carry.py) is made contiguous before the pipeline sends it (the last stage's head output is no tensor:
        `models.loss.HeadOutput`)."""
        out = super().forward(forward_input)
        return tuple(t.contiguous() if torch.is_tensor(t) else t for t in out) if isinstance(out, tuple) else out

    def local_layer_indices(self) -> list[int]:
        """The pipeline layers this rank holds."""
        return list(range(self._local_start, self._local_stop))

    def phases(self) -> list[int]:
        """The stage halves this rank runs (one here; DualPipeV's ranks hold two)."""
        return [0]

    def activate_phase(self, phase: int) -> None:
        """Expose the layers of `phase` as forward_funcs (one phase here)."""


class DualPipeStageModule(PipelineStageModule, DualPipeVModule):
    """The DualPipeV module (DeepSpeed's `DualPipeVModule`: rank r builds stages r and 2p - 1 - r of a model cut
    into 2p stages) with stage bounds from `stage_bounds(config, 2p, ...)`. Rank 0 holds both the embedding and
    the LM head, so tied embeddings are one module there."""

    def _partition_layers(self, method="precomputed"):
        self.num_stages *= 2
        super()._partition_layers(method)
        mirror = self.num_stages - 1 - self.stage_id
        self.phase_bounds = [(self._local_start, self._local_stop), (self.parts[mirror], self.parts[mirror + 1])]

    def local_layer_indices(self) -> list[int]:
        return [i for start, stop in self.phase_bounds for i in range(start, stop)]

    def phases(self) -> list[int]:
        return [0, 1]

    def activate_phase(self, phase: int) -> None:
        DualPipeVModule.activate_phase(self, phase)


def expert_groups(topology, rank: int, ep: ExpertParallel) -> None:
    """Carve every stage's expert-parallel groups out of its DP ranks (each TP rank apart): E consecutive DP ranks
    split the experts (`ep.group`, ep.rank = DP rank mod E); the DP ranks holding the same experts reduce their
    gradients (`ep.data_group`, DP / E of them). Collective: every rank creates every group, in one order."""
    import torch.distributed as dist

    dims = topology.get_dim("pipe"), topology.get_dim("data"), topology.get_dim("model")
    for stage in range(dims[0]):
        for tp_rank in range(dims[2]):
            ranks = [topology.get_rank(pipe=stage, data=d, model=tp_rank) for d in range(dims[1])]
            for first in range(0, dims[1], ep.size):
                group = dist.new_group(ranks[first : first + ep.size])
                if rank in ranks[first : first + ep.size]:
                    ep.group, ep.rank = group, ranks.index(rank) % ep.size
            for offset in range(ep.size):
                group = dist.new_group(ranks[offset :: ep.size])
                if rank in ranks[offset :: ep.size]:
                    ep.data_group = group


def context_groups(topology, rank: int, cp: ContextParallel) -> None:
    """Every stage's context-parallel groups: the C consecutive indices of DeepSpeed's data axis that share a DP
    replica (training/topology.py), each TP rank apart. Collective: every rank creates every group, in one order."""
    import torch.distributed as dist

    dims = topology.get_dim("pipe"), topology.get_dim("data"), topology.get_dim("model")
    for stage in range(dims[0]):
        for tp_rank in range(dims[2]):
            for first in range(0, dims[1], cp.size):
                ranks = [topology.get_rank(pipe=stage, data=d, model=tp_rank) for d in range(first, first + cp.size)]
                group = dist.new_group(ranks)
                if rank in ranks:
                    cp.group = group
                    assert cp.rank == ranks.index(rank), "context-parallel rank differs from training/topology.py's"


def build_pipeline_module(
    config,
    topology,
    tp: TensorParallel,
    bounds: Sequence[int],
    options: DecoderOptions | None = None,
    loss_fn=None,
    skip_init: bool = True,
    dual: bool = False,
    ep: ExpertParallel | None = None,
) -> PipelineStageModule:
    """Build this rank's stage of the pipeline.

    Args:
        config: transformers config of the model, with `_attn_implementation` set.
        topology: a DeepSpeed `ProcessTopology` with `pipe`, `data` and `model` (tensor-parallel) axes.
        tp: this rank's tensor-parallel place (size 1: no tensor parallelism).
        bounds: stage s builds pipeline layers bounds[s]..bounds[s + 1] - 1 (`models.partition.stage_bounds`).
        options: packed rows, and which decoder blocks recompute in backward (`models.layers.DecoderOptions`;
            each block checkpoints itself, so DeepSpeed's own interval stays 0).
        loss_fn: `models.loss.CausalLMLoss` or any callable (logits, labels) -> loss.
        skip_init: leave weights uninitialised because a checkpoint will overwrite them.
        dual: DualPipeV: `bounds` cut the model into 2 x pipe stages, rank r builds stages r and 2p - 1 - r.
        ep: expert parallelism (its groups are carved from the topology here); None: every rank holds every expert.
    """
    from transformers.initialization import no_init_weights

    ctx = no_init_weights() if skip_init else contextlib.nullcontext()
    with ctx:
        return (DualPipeStageModule if dual else PipelineStageModule)(
            config,
            bounds,
            tp,
            options or DecoderOptions(),
            ep or ExpertParallel(),
            topology=topology,
            loss_fn=loss_fn,
            activation_checkpoint_interval=0,
        )
