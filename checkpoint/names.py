"""Every name inside a checkpoint directory, in one place.

CKPT_DIR/latest                                 the tag to load ("global_stepN")
CKPT_DIR/global_stepN/                          one checkpoint (a "step directory")
    layer_XX-model_YY-model_states.pt           weights of pipeline layer XX, tensor-parallel rank YY
    mp_rank_XX_model_states.pt                  DeepSpeed engine state of model-parallel rank XX
    [bf16_]zero_pp_rank_D_mp_rank_XX_optim_states.pt   ZeRO optimizer shard of DP rank D
    rng_state_rankR.pt, layout.json, manifest.json
CKPT_DIR/lora.json, piece.json, conversion.json, hf_converted/, .convert2ckpt.json
"""

from __future__ import annotations

import re

LATEST = "latest"
MANIFEST = "manifest.json"
LAYOUT_FILE = "layout.json"
LORA_FILE = "lora.json"
PIECE_FILE = "piece.json"
CONVERSION_RECORD = "conversion.json"
CONVERTED_DIR = "hf_converted"  # conversion at load time: output_dir/hf_converted
REFERENCE_CONVERTED_DIR = "hf_converted_reference"  # the same, of an HF dpo.reference_model
CONVERTED_TAG = "global_step0"  # the one tag of a converted checkpoint
CARRIED_FILE = "hub_extra.safetensors"  # hub tensors carried untrained (checkpoint/carried.py)
CONTAINER_CONFIG = "container_config.json"  # a multimodal source's own config.json, for exports in its layout
WRITER_FILE = ".convert2ckpt.json"  # which convert2ckpt command wrote a directory (checkpoint/outputs.py)

# Files that make a directory loadable with AutoModelForCausalLM / AutoTokenizer (weights aside).
MODEL_SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    CONTAINER_CONFIG,
)

STAGING_PREFIX = ".saving-"
DELETING_PREFIX = ".deleting-"
TAG_PATTERN = re.compile(r"global_step(\d+)")
ENGINE_FILE = re.compile(r"mp_rank_(\d+)_model_states\.pt")
ZERO_FILE = re.compile(r"(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")


def step_tag(step: int) -> str:
    return f"global_step{step}"


def staging_tag(tag: str) -> str:
    return f"{STAGING_PREFIX}{tag}"


def engine_file(mp_rank: int) -> str:
    """DeepSpeed's per-model-parallel-rank engine file (with pipelines: one per stage x TP rank)."""
    return f"mp_rank_{mp_rank:02d}_model_states.pt"


def rng_file(rank: int) -> str:
    return f"rng_state_rank{rank}.pt"


def written_marker(rank: int) -> str:
    """In a save's staging directory: this rank's files are durable (its manifest entries inside); removed when the
    save is published (training/saving.py)."""
    return f".written-rank{rank}.json"


def engine_files(names: list[str]) -> list[str]:
    return sorted(n for n in names if ENGINE_FILE.fullmatch(n))


# DeepSpeed's per-layer weight files: pipeline layer XX (models/pipe_layout.py), tensor-parallel rank YY.
LAYER_FILE_FORMATS = ("pt", "safetensors")
_LAYER_FILE = re.compile(r"layer_(\d+)-model_(\d+)-model_states\.(pt|safetensors)")


def layer_file_name(index: int, tp_rank: int = 0, fmt: str = "pt") -> str:
    """DeepSpeed's per-layer file name; zero-padded because DeepSpeed globs `layer_XX-*`."""
    return f"layer_{index:02d}-model_{tp_rank:02d}-model_states.{fmt}"


def parse_layer_file_name(name: str) -> tuple[int, int, str] | None:
    """(layer index, TP rank, format) of a layer file name, or None for any other file."""
    m = _LAYER_FILE.fullmatch(name)
    return (int(m.group(1)), int(m.group(2)), m.group(3)) if m else None
