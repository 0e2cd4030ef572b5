"""Reference log-probs for `objective=dpo`: computed once, cached beside the tokenized data, reused by restarts.

DPO and IPO compare the policy's log-probs of each pair's completions with a frozen reference's. Holding a second
model through training would cost a stage's weights again on every rank; instead, before the training stage is
built, a forward-only pipeline pass (a stage of the same layout with the reference weights: `dpo.reference_model`,
else the starting weights `model_name_or_path`, which with LoRA is the base without adapters) scores every pair of
the train and eval stores once, in the stores' own order (a mixture's seed and weights only choose among them).
The last stage keeps each sequence's summed completion log-prob with its pair's id; one reduce brings them to rank
0, which writes them as a [store pairs, 2] float32 array (chosen, rejected) under `<data cache>/reference_logps/`,
named by a digest of the stores' fingerprint, the reference's identity (its config.json, and its files' sizes and
times), the precision and the attention implementation. A restarted or resumed job finds the file and skips the
pass; a changed reference or changed data gets a new one.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist

from checkpoint.hf_reader import is_hf_dir
from checkpoint.names import CONVERTED_DIR, REFERENCE_CONVERTED_DIR
from checkpoint.saves import read_tag
from checkpoint.staging import fsync_dir
from data.dataset import cache_root
from data.sampling import eval_batches, eval_indices, eval_num_batches
from models.config import load_hf_config
from models.layer_config import global_attr
from models.preference import ReferenceScorer
from models.tensor_parallel import token_cross_entropy_for
from schema.train import TrainConfig, eval_micro_batch_size
from training.distributed import agreed, broadcast_object, control_group
from training.errors import RunError
from training.hf_source import source_record

log = logging.getLogger("trainer")

REFERENCE_DIR = "reference_logps"
REDUCE_PAIRS = 1 << 20  # pairs per reduce of the scores to rank 0 (8 MiB)
# What must agree between the policy and a reference model of its own: everything that changes the numbers.
ARCHITECTURE = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "rope_parameters",
    "rope_scaling",
    "rope_theta",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
    "layer_types",
    # layers of their own shape, state shared across layers, experts switched on (Gemma 4's, GLM-5's)
    "per_layer_config",
    "hidden_size_per_layer_input",
    "num_kv_shared_layers",
    "attention_k_eq_v",
    "use_double_wide_mlp",
    "enable_moe_block",
    "indexer_types",
    "num_experts",
    "top_k_experts",
    "moe_intermediate_size",
    "final_logit_softcapping",
    "attn_logit_softcapping",
    "embedding_multiplier",
    "residual_multiplier",
    "attention_multiplier",
    "logits_scaling",
    "logit_scale",
)


def needs_reference(cfg: TrainConfig) -> bool:
    return cfg.objective == "dpo" and cfg.dpo.loss_type != "simpo"


def reference_path(cfg: TrainConfig) -> str:
    """The reference model as configured: `dpo.reference_model`, else the starting weights."""
    return cfg.dpo.reference_model or cfg.model_name_or_path


def reference_identity(path: str) -> dict:
    """What names the reference's weights: its config.json, and its weight files' sizes and modification times."""
    if not os.path.isdir(path):
        raise RunError(f"dpo.reference_model: {path} is not a directory (an HF model or a pipeline checkpoint)")
    try:
        with open(os.path.join(path, "config.json"), "rb") as f:
            config = hashlib.sha256(f.read()).hexdigest()
    except OSError as e:
        raise RunError(f"dpo.reference_model: {path}/config.json: cannot read ({e.strerror})") from None
    if is_hf_dir(path):
        return {**source_record(path), "config": config}
    step = os.path.join(path, read_tag(path))
    files = {}
    for name in sorted(os.listdir(step)):
        full = os.path.join(step, name)
        if os.path.isfile(full):
            st = os.stat(full)
            files[name] = [st.st_size, st.st_mtime_ns]
    return {"source": os.path.abspath(step), "files": files, "config": config}


def check_architecture(cfg: TrainConfig, model_config) -> None:
    """A reference model of its own must have the policy's architecture (its stage is built from the policy's
    config). Raises RunError naming the first field that differs."""
    path = cfg.dpo.reference_model
    try:
        reference = load_hf_config(path)
    except ValueError as e:
        raise RunError(f"dpo.reference_model: {e}") from None
    for key in ARCHITECTURE:
        mine, theirs = (_field(c, key) for c in (model_config, reference))
        if mine != theirs:
            raise RunError(
                f"dpo.reference_model {path}: {key}={theirs} but the policy has {key}={mine} (the "
                "reference must have the policy's architecture)"
            )


def _field(config, key: str):
    """A config's `key` as config.json writes it (layers of their own shape: `per_layer_config`, Gemma 4's)."""
    return config.to_dict().get(key) if key == "per_layer_config" else global_attr(config, key)


def quantized_reference(cfg: TrainConfig) -> list[bool] | None:
    """How the reference pass holds its base in NF4 ([double, experts]), or None: only QLoRA's reference that is the
    policy's own base, as a 4-bit PEFT model's without adapters (another `dpo.reference_model` runs as it is)."""
    if cfg.lora.quantize != "nf4" or cfg.dpo.reference_model not in (None, cfg.model_name_or_path):
        return None
    return [cfg.lora.quantize_double, cfg.lora.quantize_experts]


def cache_file(cfg: TrainConfig, fingerprint: str, identity: dict) -> str:
    key = {
        "pairs": fingerprint,
        "reference": identity,
        "precision": str(cfg.deepspeed.precision),  # resolved (training/precision.py)
        "attn_implementation": str(cfg.model.attn_implementation),
        "nf4": quantized_reference(cfg),  # QLoRA's reference computes on the NF4 base: other log-probs
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return os.path.join(cache_root(cfg.data.cache_dir, cfg.output_dir)[0], REFERENCE_DIR, f"{digest}.npy")


def attach_reference(run) -> None:
    """Give the run's pair datasets their reference log-probs (`PairDataset.reference`), computing the missing ones
    first. Collective: every rank takes part in the pass."""
    cfg, c = run.cfg, run.coords
    names = [n for n, present in (("train", cfg.do_train), ("eval", run.num_eval_rows > 0)) if present]
    plan = None  # {name: (file, pairs in its stores)}, from rank 0 (a data rank)
    with agreed():
        if c.rank == 0:
            if cfg.dpo.reference_model:
                check_architecture(cfg, run.model_config)
            identity = reference_identity(reference_path(cfg))
            plan = {}
            for name in names:
                ds = getattr(run, f"{name}_set")
                plan[name] = (cache_file(cfg, ds.fingerprint(), identity), ds.store_pairs)
    plan = broadcast_object(plan)
    todo = {}  # file -> (name, pairs): train and eval on the same files share one
    if c.rank == 0:
        todo = {path: (name, n) for name, (path, n) in plan.items() if not os.path.exists(path)}
    todo = broadcast_object(todo)
    if todo:
        score_pairs(run, [(name, n, path) for path, (name, n) in todo.items()])
    for name, (path, _) in plan.items():
        if path not in todo:
            log.info("%s pairs: reference log-probs found in %s", name, path)
    with agreed():
        if c.has_data:
            for name, (path, n) in plan.items():
                getattr(run, f"{name}_set").reference = _read(path, n)


def _read(path: str, pairs: int) -> np.ndarray:
    try:
        ref = np.load(path, mmap_mode="r")
    except (OSError, ValueError, EOFError) as e:
        raise RunError(f"{path}: cannot read the reference log-probs ({e}); remove it to compute them again") from None
    if ref.shape != (pairs, 2) or ref.dtype != np.float32:
        raise RunError(
            f"{path}: holds {ref.shape} {ref.dtype} reference log-probs for {pairs} pairs (damaged: "
            "remove it to compute them again)"
        )
    return ref


def _reference_step_dir(run) -> str:
    cfg, c = run.cfg, run.coords
    path = reference_path(cfg)
    if is_hf_dir(path):
        from training.hf_source import convert_on_load

        same = cfg.model_name_or_path and os.path.abspath(path) == os.path.abspath(cfg.model_name_or_path)
        name = CONVERTED_DIR if same else REFERENCE_CONVERTED_DIR
        path, _ = convert_on_load(path, cfg.output_dir, c, run.bounds, name=name)
    with agreed():
        tag = read_tag(path)
    return os.path.join(path, tag)


def score_pairs(run, todo: list[tuple[str, int, str]]) -> None:
    """The reference pass over the stores of the datasets in `todo` ((name, store pairs, file to write)); the stage
    it builds is dropped before the training stage is built."""
    from training.checkpointing import load_stage_weights
    from training.engine import build_module, initialize_forward_engine

    cfg, c, tp = run.cfg, run.coords, run.tp
    source = _reference_step_dir(run)
    scorer = ReferenceScorer(
        token_cross_entropy_for(run.model_config, tp), cfg.model.loss_chunk_size, cfg.model.fused_head_loss
    )
    module = build_module(cfg, c, run.model_config, scorer, tp, run.bounds)
    with agreed():
        load_stage_weights(module, source, run.model_config, tp)
    module._synchronize_tied_weights()
    if (nf4 := quantized_reference(cfg)) is not None:
        from models.nf4 import quantize_stage

        quantize_stage(module, *nf4)
    engine = initialize_forward_engine(cfg, c, module)
    mbs, micro_batches = eval_micro_batch_size(cfg), cfg.gradient_accumulation_steps
    for name, n, path in todo:
        start = time.perf_counter()
        indices = eval_indices(n, c.dp, c.dp_rank, mbs, micro_batches)
        data_iter = None
        if c.has_data:  # every pair of the stores once, in their order; the last stage learns each batch's pair ids
            batches = eval_batches(getattr(run, f"{name}_set").store_order(), indices, mbs, run.collate)
            if c.is_last:
                batches = ((inputs, (*labels, ids)) for (inputs, labels, _), ids in zip(batches, indices.split(mbs)))
            data_iter = batches
        scorer.scored.clear()
        for _ in range(eval_num_batches(n, c.dp, mbs, micro_batches)):
            engine.eval_batch(data_iter, num_micro_batches=micro_batches)
        scores = _collect(scorer.scored if c.is_last and c.tp_rank == 0 and c.cp_rank == 0 else [], n, c.rank)
        with agreed():
            if c.rank == 0:
                _write(path, scores)
        log.info(
            "%s pairs: reference log-probs of %d pairs computed with %s in %.1f s, saved to %s",
            name,
            n,
            source,
            time.perf_counter() - start,
            path,
        )
    # NOTE: the engine's process groups stay (torch offers no safe way to drop them all); its tensors go.
    del engine, module, scorer
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _collect(scored: list, pairs: int, rank: int, chunk: int = REDUCE_PAIRS) -> np.ndarray | None:
    """Rank 0: the [pairs, 2] float32 log-probs that the last stage's scoring ranks (`scored`: (pair ids, log-probs
    [2P]) per micro-batch; empty elsewhere) hold, gathered by reduce `chunk` pairs at a time so no other rank holds
    more than a chunk. Collective over every rank; None on the others. Each pair has exactly one nonzero
    contributor, so the float32 sums are exact."""
    ids = torch.cat([i for i, _ in scored]) if scored else torch.empty(0, dtype=torch.long)
    values = torch.cat([torch.stack([lp[: len(i)], lp[len(i) :]], dim=1) for i, lp in scored]) if scored else None
    keep = ids >= 0  # padding pairs
    ids, values = ids[keep], (values[keep] if values is not None else None)
    out = np.zeros((pairs, 2), dtype=np.float32) if rank == 0 else None
    for start in range(0, pairs, chunk):
        stop = min(start + chunk, pairs)
        buf = torch.zeros(stop - start, 2, dtype=torch.float32)
        mine = (ids >= start) & (ids < stop)
        if values is not None:
            buf[ids[mine] - start] = values[mine]
        dist.reduce(buf, dst=0, group=control_group())  # gloo: CPU tensors under NCCL too
        if out is not None:
            out[start:stop] = buf.numpy()
    return out


def _write(path: str, scores: np.ndarray) -> None:
    """Atomically: written and synced under a temporary name, then renamed into place."""
    directory = os.path.dirname(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        os.makedirs(directory, exist_ok=True)
        with open(tmp, "wb") as f:
            np.save(f, scores)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(directory)
    except OSError as e:
        raise RunError(f"{path}: cannot write the reference log-probs ({e.strerror})") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
