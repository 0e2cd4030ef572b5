"""Checkpoint manifests and `convert2ckpt.py --verify`.

Every conversion and every trainer save writes `manifest.json` into the tag directory:

    {"files": {"layer_03-model_00-model_states.pt": {"size": ..., "sha256": ...,
               "tensors": {"self_attn.q_proj.weight": {"shape": [...], "dtype": "bfloat16"}, ...}}, ...}}

`--verify` recomputes sizes and hashes and reports, naming the file, anything missing, resized,
altered or unlisted; with `--against HF_DIR` it also runs a fixed probe batch through the
checkpoint (one layer file in memory at a time) and through the Hugging Face model, and prints the
largest logit difference.
"""

from __future__ import annotations

import hashlib
import json
import os

import torch

from checkpoint.hf_reader import CheckpointError
from checkpoint.layer_files import find_layer_file, is_layer_file, layer_tensor_specs, load_layer_state

MANIFEST = "manifest.json"
CHUNK = 16 * 2**20


def sha256_file(path: str, sync: bool = False) -> str:
    """sha256 of a file; with `sync`, also flush it to disk (a save's files are hashed right after writing)."""
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
        if sync:
            os.fsync(f.fileno())
    return digest.hexdigest()


def describe_file(path: str, sync: bool = False) -> dict:
    """size, sha256 and, for layer files, tensor names/shapes/dtypes (read memory-mapped)."""
    entry = {"size": os.path.getsize(path), "sha256": sha256_file(path, sync)}
    if is_layer_file(os.path.basename(path)):
        entry["tensors"] = {
            k: {"shape": list(shape), "dtype": str(dtype).removeprefix("torch.")}
            for k, (shape, dtype) in layer_tensor_specs(path).items()
        }
    return entry


def checkpoint_files(step_dir: str) -> list[str]:
    return sorted(n for n in os.listdir(step_dir) if os.path.isfile(os.path.join(step_dir, n)) and n != MANIFEST)


def write_manifest(step_dir: str, entries: dict[str, dict]) -> str:
    """Write `manifest.json` atomically (temp file + rename)."""
    path = os.path.join(step_dir, MANIFEST)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"files": dict(sorted(entries.items()))}, f, indent=1)
    os.replace(tmp, path)
    return path


def build_manifest(step_dir: str, names: list[str] | None = None, sync: bool = False) -> dict[str, dict]:
    return {n: describe_file(os.path.join(step_dir, n), sync) for n in (names or checkpoint_files(step_dir))}


def verify_manifest(step_dir: str) -> list[str]:
    """Problems found, one line each naming the file; empty when the checkpoint matches its manifest."""
    path = os.path.join(step_dir, MANIFEST)
    if not os.path.exists(path):
        return [f"{path}: missing (checkpoint has no manifest)"]
    with open(path) as f:
        listed = json.load(f)["files"]
    problems = []
    for name, want in listed.items():
        file = os.path.join(step_dir, name)
        if not os.path.exists(file):
            problems.append(f"{file}: missing")
            continue
        size = os.path.getsize(file)
        if size != want["size"]:
            problems.append(f"{file}: size {size} but the manifest says {want['size']}")
        elif sha256_file(file) != want["sha256"]:
            problems.append(f"{file}: contents changed (sha256 differs from the manifest)")
    for name in checkpoint_files(step_dir):
        if name not in listed and not name.startswith("."):
            problems.append(f"{os.path.join(step_dir, name)}: not listed in the manifest")
    return problems


@torch.inference_mode()
def probe_logits_streamed(ckpt_dir: str, config, tag: str, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits of the checkpoint on `input_ids`, building and loading one pipeline layer at a time."""
    from models.layers import DecoderLayerPipe, EmbeddingPipe, LMHeadPipe, NormPipe, tied_lm_head_forward
    from models.layout import DECODER, EMBED, LM_HEAD, NORM, pipe_layers

    config._attn_implementation = "eager"
    step_dir = os.path.join(ckpt_dir, tag)
    build = {EMBED: EmbeddingPipe, NORM: NormPipe, LM_HEAD: LMHeadPipe}
    position_ids = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    x, embedding = (input_ids, position_ids), None
    for layer in pipe_layers(config.num_hidden_layers, config.tie_word_embeddings):
        if not layer.has_file:  # tied LM head: the embedding's weight
            x = tied_lm_head_forward(embedding, x)
            continue
        module = DecoderLayerPipe(config, layer.block) if layer.kind == DECODER else build[layer.kind](config)
        path = find_layer_file(step_dir, layer.index)
        if path is None:
            raise CheckpointError(f"{step_dir}: no file for pipeline layer {layer.index}")
        state = load_layer_state(path)
        module.load_state_dict(state, strict=True)
        module.float().eval()
        x = module(x)
        if layer.kind == EMBED:
            embedding = module
    return x


def compare_with_hf(ckpt_dir: str, tag: str, hf_dir: str, seq_len: int = 16) -> float:
    """Max |logit difference| between the checkpoint and the HF model on a fixed probe batch (fp32)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from checkpoint.convert import load_llama_config

    config = load_llama_config(ckpt_dir)
    hf_config = AutoConfig.from_pretrained(hf_dir)
    if (hf_config.num_hidden_layers, hf_config.hidden_size) != (config.num_hidden_layers, config.hidden_size):
        raise CheckpointError(f"{hf_dir}: a different model size than {ckpt_dir}")
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (2, seq_len), generator=generator)
    ours = probe_logits_streamed(ckpt_dir, config, tag, ids)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    with torch.inference_mode():
        ref = model(ids).logits
    return float((ours.float() - ref).abs().max())
