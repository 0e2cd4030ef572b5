"""Run set-up helpers: where a rank sits, model config and tokenizer, data counts, output dir, logging."""

from __future__ import annotations

import json
import logging
import os
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from checkpoint.hf_reader import CheckpointError
from checkpoint.pipeline_reader import read_tag
from checkpoint.saves import write_text_atomic
from data.dataset import count_rows
from models.pipeline import IGNORE_INDEX
from training.config import TrainConfig

log = logging.getLogger("trainer")

ARCH_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_theta",
    "tie_word_embeddings",
)


class RunError(Exception):
    """A user-facing problem with the run's inputs: one line naming the key or file."""


@dataclass(frozen=True)
class Coords:
    """Where this rank sits: PP x DP with pipe as the outer axis (rank = stage * dp + dp_rank)."""

    rank: int
    world: int
    num_stages: int

    @property
    def dp(self) -> int:
        return max(1, self.world // self.num_stages)  # >= 1 so logging works before validate_layout

    @property
    def stage(self) -> int:
        return self.rank // self.dp

    @property
    def dp_rank(self) -> int:
        return self.rank % self.dp

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def has_data(self) -> bool:
        return self.is_first or self.is_last

    @property
    def reporting(self) -> bool:
        """The one rank that writes metrics and results: last stage, DP rank 0 (it has the loss)."""
        return self.is_last and self.dp_rank == 0


def load_model_config(cfg: TrainConfig):
    """`LlamaConfig` from the checkpoint's config.json (checked against a preset) or from the preset."""
    from transformers import AutoConfig, LlamaConfig

    preset = {k: getattr(cfg.model, k) for k in ARCH_KEYS if getattr(cfg.model, k) is not None}
    if cfg.model_name_or_path:
        path = os.path.join(cfg.model_name_or_path, "config.json")
        if not os.path.exists(path):
            raise RunError(f"model_name_or_path: {path} is missing (convert the model with convert2ckpt.py)")
        config = AutoConfig.from_pretrained(cfg.model_name_or_path)
        if config.model_type != "llama":
            raise RunError(f"{path}: model_type={config.model_type!r} is not a LLaMA model")
        for key, want in preset.items():
            have = config.rope_parameters.get("rope_theta") if key == "rope_theta" else getattr(config, key)
            if have != want:
                raise RunError(f"model.{key}={want} (preset {cfg.model.name}) but {path} has {key}={have}")
    else:
        config = LlamaConfig(**{k: v for k, v in preset.items() if k != "rope_theta"})
        if "rope_theta" in preset:
            config.rope_parameters["rope_theta"] = preset["rope_theta"]
    impl = cfg.model.attn_implementation
    if impl == "flash_attention_2":
        try:
            import flash_attn  # noqa: F401
        except ImportError:
            raise RunError(
                "model.attn_implementation=flash_attention_2 needs flash-attn (requirements-gpu.txt)"
            ) from None
    config._attn_implementation = impl
    rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if cfg.seq_length > config.max_position_embeddings and rope_type == "default":
        raise RunError(
            f"seq_length={cfg.seq_length} exceeds max_position_embeddings={config.max_position_embeddings} "
            "and the model configures no RoPE scaling"
        )
    return config


def load_tokenizer(cfg: TrainConfig, vocab_size: int):
    from transformers import AutoTokenizer

    path = cfg.tokenizer_name_or_path or cfg.model_name_or_path
    if path is None:
        raise RunError("tokenizer_name_or_path is not set")
    tokenizer = AutoTokenizer.from_pretrained(path)
    if len(tokenizer) > vocab_size:
        raise RunError(f"tokenizer {path} has {len(tokenizer)} tokens but the model's vocab_size is {vocab_size}")
    return tokenizer


class LossScaledBatches:
    """Last stage: attach to every micro-batch of a step the scale that makes the loss a global token mean.

    Reads a step's micro-batches ahead, counts their target tokens, sums the count over the DP
    group and yields ((input_ids, position_ids), (labels, scale)) with
    scale = micro_batches * dp / global_target_tokens (see `CausalLMLoss`).
    """

    def __init__(self, batches, micro_batches: int, dp_group, dp_size: int):
        self.batches, self.micro_batches, self.dp_group, self.dp_size = batches, micro_batches, dp_group, dp_size
        self.pending: list = []
        self.step_tokens = 0

    def __iter__(self):
        return self

    def __next__(self):
        if not self.pending:
            step = [next(self.batches) for _ in range(self.micro_batches)]
            tokens = torch.tensor([sum(int((labels != IGNORE_INDEX).sum()) for _, labels in step)], dtype=torch.long)
            if self.dp_size > 1:
                dist.all_reduce(tokens, group=self.dp_group)
            self.step_tokens = int(tokens)
            scale = torch.tensor(self.micro_batches * self.dp_size / max(self.step_tokens, 1))
            self.pending = [(inputs, (labels, scale)) for inputs, labels in step]
        return self.pending.pop(0)


def as_float(value) -> float | None:
    """DeepSpeed reports the grad norm as a float (fp32 path) or a 0-d tensor (bf16/ZeRO optimizers)."""
    return None if value is None else float(value)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict:
    """This rank's random generators (python, numpy, torch, CUDA): dropout masks after a resume match."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(path: str) -> None:
    state = torch.load(path, weights_only=False)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def truncate_metrics(path: str, step: int) -> None:
    """Keep the metrics of steps <= `step` (those after the resumed checkpoint are trained again)."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    keep = [line for line in lines if json.loads(line)["step"] <= step]
    if len(keep) != len(lines):
        write_text_atomic(path, "".join(keep))


def configure_logging(coords: Coords, all_ranks: bool = False) -> None:
    """Console: INFO from rank 0 and the reporting rank (every rank with `all_ranks`), warnings from the others."""
    level = logging.INFO if all_ranks or coords.rank == 0 or coords.reporting else logging.WARNING
    logging.basicConfig(level=level, format=f"[rank{coords.rank}] %(asctime)s %(message)s", datefmt="%H:%M:%S")
    log.setLevel(level)


def log_to_file(output_dir: str, rank: int) -> str:
    """Also append this rank's trainer log to output_dir/logs/rank{R}.log (kept across resumes)."""
    path = os.path.join(output_dir, "logs", f"rank{rank}.log")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    log.addHandler(handler)
    return path


def broadcast_row_counts(cfg: TrainConfig) -> tuple[int, int]:
    """Rank 0 counts rows (a line count, no parsing); every rank gets the same numbers."""
    counts = [0, 0]
    if dist.get_rank() == 0:
        counts = [
            count_rows(cfg.train_file) if cfg.do_train else 0,
            count_rows(cfg.eval_file) if cfg.do_eval else 0,
        ]
    dist.broadcast_object_list(counts, src=0)
    return counts[0], counts[1]


def prepare_output_dir(path: str) -> None:
    """Every rank makes sure output_dir exists and is writable before any rank writes to it."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise RunError(f"output_dir {path}: cannot create ({e.strerror})") from None
    if not os.access(path, os.W_OK):
        raise RunError(f"output_dir {path}: not writable")


def checkpoint_tag(path: str) -> str:
    """The checkpoint in `path` to load: `latest`, or a newer complete one (checkpoint/saves.py)."""
    try:
        return read_tag(path)
    except CheckpointError:
        raise RunError(
            f"{path}: no 'latest' file, so no checkpoint to load (nor Hugging Face weights to convert)"
        ) from None
