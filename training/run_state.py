"""What a built run holds (training/assembly.py builds it, training/loop.py drives it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from data.sampling import TrainPlan
from models.tensor_parallel import TensorParallel
from schema.train import TrainConfig
from training.topology import Coords

if TYPE_CHECKING:  # (annotations only: importing them here would load DeepSpeed and transformers for a dataclass)
    from deepspeed.runtime.pipe.engine import PipelineEngine
    from torch.utils.data import Dataset
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

    from data.collator import CausalLMCollator
    from models.loss import CausalLMLoss
    from models.preference import PreferenceLoss


@dataclass
class Run:
    """Everything a built run holds; the loop (training/loop.py) drives it."""

    cfg: TrainConfig
    coords: Coords
    model_config: PretrainedConfig
    loss_fn: CausalLMLoss | PreferenceLoss  # PreferenceLoss for objective=dpo
    bounds: list[int]  # stage s holds pipeline layers bounds[s]..bounds[s + 1] - 1 (computed once)
    plan: TrainPlan | None = None  # set once the data is loaded
    total_steps: int = 0
    num_eval_rows: int = 0
    ephemeral_data: bool = False  # data.cache_dir="": the stores are removed after the run
    engine: PipelineEngine | None = None
    step: int = 0
    data_state: dict = field(default_factory=dict)  # what decides the data order (checkpointing.DATA_KEYS)
    layout: dict = field(default_factory=dict)  # what a save records of this layout
    tokenizer: PreTrainedTokenizerBase | None = None  # on the ranks that read data
    train_set: Dataset | None = None  # rows, pairs, packed rows or blocks (a placeholder on middle stages)
    eval_set: Dataset | None = None
    collate: CausalLMCollator | None = None  # (PairCollator for objective=dpo: a CausalLMCollator)
    tp: TensorParallel = field(default_factory=TensorParallel)
    loaded_layers: list[int] = field(default_factory=list)
    lora_base: str | None = None

    def dp_group(self):
        return self.engine.grid.get_data_parallel_group()
