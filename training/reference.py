"""Reference log-probs for `objective=dpo`: computed once, cached beside the tokenized data, reused by restarts.

DPO and IPO compare the policy's log-probs of each pair's completions with a frozen reference's. Holding a second
model through training would cost a stage's weights again on every rank; instead, before the training stage is
built, a forward-only pipeline pass (a stage of the same layout with the reference weights: `dpo.reference_model`,
else the starting weights `model_name_or_path`, which with LoRA is the base without adapters) scores every train
and eval pair. The last stage keeps each sequence's summed completion log-prob; one reduce brings them to rank 0,
which writes them as a [pairs, 2] float32 array (chosen, rejected) under `<data cache>/reference_logps/`, named by a
digest of the pairs' fingerprint, the reference's identity (its path, file sizes and times) and the precision. A
restarted or resumed job finds the file and skips the pass; a changed reference or changed data gets a new one.
"""

from __future__ import annotations

import functools
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
from checkpoint.names import CONVERTED_DIR
from checkpoint.saves import read_tag
from data.dataset import cache_root
from data.sampling import eval_batches, eval_indices, eval_num_batches
from models.preference import ReferenceScorer
from models.tensor_parallel import vocab_parallel, vocab_parallel_token_cross_entropy
from training.config import TrainConfig
from training.distributed import agreed, broadcast_object, control_group
from training.errors import RunError
from training.precision import resolve_precision

log = logging.getLogger("trainer")

REFERENCE_DIR = "reference_logps"


def needs_reference(cfg: TrainConfig) -> bool:
    return cfg.objective == "dpo" and cfg.dpo.loss_type != "simpo"


def reference_path(cfg: TrainConfig) -> str:
    """The reference model as configured: `dpo.reference_model`, else the starting weights."""
    return cfg.dpo.reference_model or cfg.model_name_or_path


def reference_identity(path: str) -> dict:
    """What names the reference's weights: its directory and its files' sizes and modification times."""
    if not os.path.isdir(path):
        raise RunError(f"dpo.reference_model: {path} is not a directory (an HF model or a pipeline checkpoint)")
    step = path if is_hf_dir(path) else os.path.join(path, read_tag(path))
    files = {}
    for name in sorted(os.listdir(step)):
        full = os.path.join(step, name)
        if os.path.isfile(full):
            st = os.stat(full)
            files[name] = [st.st_size, int(st.st_mtime)]
    return {"source": os.path.abspath(step), "files": files}


def cache_file(cfg: TrainConfig, fingerprint: str, identity: dict) -> str:
    key = {"pairs": fingerprint, "reference": identity, "precision": resolve_precision(cfg.deepspeed.precision),
           "attn_implementation": str(cfg.model.attn_implementation)}  # fmt: skip
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return os.path.join(cache_root(cfg.data.cache_dir, cfg.output_dir)[0], REFERENCE_DIR, f"{digest}.npy")


def attach_reference(run) -> None:
    """Give the run's pair datasets their reference log-probs (`PairDataset.reference`), computing the missing ones
    first. Collective: every rank takes part in the pass."""
    cfg, c = run.cfg, run.coords
    wanted = [(name, n) for name, n in (("train", run.plan.num_rows if cfg.do_train else 0),
                                        ("eval", run.num_eval_rows)) if n]  # fmt: skip
    files = None
    with agreed():
        if c.rank == 0:
            identity = reference_identity(reference_path(cfg))
            files = {name: cache_file(cfg, getattr(run, f"{name}_set").fingerprint(), identity) for name, _ in wanted}
    files = broadcast_object(files)
    missing = broadcast_object([name for name, _ in wanted if not os.path.exists(files[name])] if c.rank == 0 else None)
    if missing:
        score_pairs(run, [(name, n, files[name]) for name, n in wanted if name in missing])
    for name, _ in wanted:
        if name not in missing:
            log.info("%s pairs: reference log-probs found in %s", name, files[name])
    with agreed():
        if c.has_data:
            for name, n in wanted:
                ref = np.load(files[name], mmap_mode="r")
                if ref.shape != (n, 2) or ref.dtype != np.float32:
                    raise RunError(f"{files[name]}: holds {ref.shape} {ref.dtype} reference log-probs for {n} pairs "
                                   "(damaged: remove it to compute them again)")  # fmt: skip
                getattr(run, f"{name}_set").reference = ref


def _reference_step_dir(run) -> str:
    cfg, c = run.cfg, run.coords
    path = reference_path(cfg)
    if is_hf_dir(path):
        from training.hf_source import convert_on_load

        same = cfg.model_name_or_path and os.path.abspath(path) == os.path.abspath(cfg.model_name_or_path)
        name = CONVERTED_DIR if same else f"{CONVERTED_DIR}_reference"
        path, _ = convert_on_load(path, cfg.output_dir, c, run.bounds, name=name)
    with agreed():
        tag = read_tag(path)
    return os.path.join(path, tag)


def score_pairs(run, todo: list[tuple[str, int, str]]) -> None:
    """The reference pass over the datasets in `todo` ((name, pairs, file to write)); the stage it builds is dropped
    before the training stage is built."""
    from training.checkpointing import load_stage_weights
    from training.engine import build_module, initialize_forward_engine

    cfg, c, tp = run.cfg, run.coords, run.tp
    start = time.perf_counter()
    source = _reference_step_dir(run)
    token_ce = None
    if vocab_parallel(run.model_config, tp):
        token_ce = functools.partial(vocab_parallel_token_cross_entropy, tp=tp, vocab_size=run.model_config.vocab_size)
    scorer = ReferenceScorer(token_ce, cfg.model.loss_chunk_size)
    module = build_module(cfg, c, run.model_config, scorer, tp, run.bounds)
    with agreed():
        load_stage_weights(module, source, run.model_config, tp)
    module._synchronize_tied_weights()
    engine = initialize_forward_engine(cfg, c, module)
    mbs, micro_batches = cfg.eval_micro_batch_size or cfg.micro_batch_size, cfg.gradient_accumulation_steps
    for name, n, path in todo:
        indices = eval_indices(n, c.dp, c.dp_rank, mbs, micro_batches)
        data_iter = None
        if c.has_data:
            data_iter = eval_batches(getattr(run, f"{name}_set"), indices, mbs, run.collate)
            if c.is_last:
                data_iter = ((inputs, labels) for inputs, labels, _ in data_iter)
        scorer.logps.clear()
        for _ in range(eval_num_batches(n, c.dp, mbs, micro_batches)):
            engine.eval_batch(data_iter, num_micro_batches=micro_batches)
        scores = torch.zeros(n, 2, dtype=torch.float64)
        if c.is_last and c.tp_rank == 0:  # every TP rank of the last stage holds the same log-probs
            for batch, logps in zip(indices.split(mbs), scorer.logps, strict=True):
                p, keep = len(batch), batch >= 0
                scores[batch[keep]] = torch.stack([logps[:p], logps[p:]], dim=1)[keep].double()
        dist.reduce(scores, dst=0, group=control_group())  # gloo: CPU tensors under NCCL too
        with agreed():
            if c.rank == 0:
                _write(path, scores.float().numpy())
        log.info("%s pairs: reference log-probs of %d pairs computed with %s in %.1f s, saved to %s", name, n, source,
                 time.perf_counter() - start, path)  # fmt: skip
    del engine, module, scorer
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _write(path: str, scores: np.ndarray) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}.npy"
    try:
        np.save(tmp, scores)
        os.replace(tmp, path)
    except OSError as e:
        raise RunError(f"{path}: cannot write the reference log-probs ({e.strerror})") from None
