"""Worker (torchrun, 4 ranks): one training step on a single row of LONG_SEQ tokens through PP=2 x TP=2 with
sequence parallelism (or PP=2 x CP=2: context parallelism), every block recomputed and the loss computed in chunks.

    torchrun --nproc_per_node 4 tests/workers/long_rows.py CKPT_DIR OUT_DIR [--no-sequence-parallel]
        [--context-parallel] [--seq N] [--mlp-tiles K]
    torchrun --nproc_per_node C tests/workers/long_rows.py CKPT_DIR OUT_DIR --stages 1 --cp C --seq N ...

`--stages P` and `--cp C` choose another layout (TP takes the rest of the world; benchmarks/long_context.py runs
PP=1 x CP=C). Each rank writes OUT_DIR/rank{R}.json: the step's loss (the mean over the row's target tokens), and
the peak bytes of the tensors autograd saved in its stage's forward that were alive at once (parameters excluded;
counted with `torch.autograd.graph.saved_tensors_hooks` around the stage's forward, so a recomputed block's
recomputation, which torch keeps outside the hooks, is not in it), its resident memory before the step and its
peak (VmHWM), and the step's seconds.
"""

import json
import os
import resource
import sys
import time

import torch

from models.context_parallel import shard
from models.loss import CausalLMLoss, HeadOutput
from models.partition import stage_bounds
from models.tensor_parallel import TensorParallel
from models.vocab_parallel_loss import vocab_parallel_cross_entropy
from schema.train import TrainConfig
from training.checkpointing import load_stage_weights
from training.distributed import init_distributed, shutdown_distributed
from training.engine import build_module, initialize_engine
from training.precision import resolve
from training.topology import Coords

LONG_SEQ, CHUNK = 32768, 4096


def long_row(vocab: int, seq: int = LONG_SEQ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids [1, S], position_ids [1, S], labels [1, S]): one row, the last position unscored."""
    ids = torch.randint(3, vocab, (1, seq), generator=torch.Generator().manual_seed(0))
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    return ids, torch.arange(seq)[None], labels


class SavedBytes:
    """Live and peak bytes of distinct storages saved for backward (not parameters)."""

    def __init__(self, params):
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.refs: dict[int, int] = {}
        self.live = self.peak = 0

    def pack(self, t):
        key = t.untyped_storage().data_ptr()
        if key in self.params:
            return t
        if key not in self.refs:
            self.refs[key] = 0
            self.live += t.untyped_storage().nbytes()
            self.peak = max(self.peak, self.live)
        self.refs[key] += 1
        return _Held(self, t, key)

    @staticmethod
    def unpack(held):
        return held.tensor if isinstance(held, _Held) else held


class _Held:
    def __init__(self, owner: SavedBytes, tensor, key: int):
        self.owner, self.tensor, self.key, self.nbytes = owner, tensor, key, tensor.untyped_storage().nbytes()

    def __del__(self):
        self.owner.refs[self.key] -= 1
        if not self.owner.refs[self.key]:
            del self.owner.refs[self.key]
            self.owner.live -= self.nbytes


def memory_status(field: str) -> int:
    """A field of /proc/self/status in bytes (VmRSS: resident now; VmHWM: the peak)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def main():
    ckpt_dir, out_dir = sys.argv[1], sys.argv[2]
    flags = sys.argv[3:]
    value = lambda flag, default: int(flags[flags.index(flag) + 1]) if flag in flags else default  # noqa: E731
    sp, seq, stages = "--no-sequence-parallel" not in flags, value("--seq", LONG_SEQ), value("--stages", 2)
    cp = value("--cp", 2 if "--context-parallel" in flags else 1)
    rank, world = init_distributed()
    tp_size = world // (stages * cp)
    from transformers import AutoConfig

    cfg = TrainConfig(
        num_stages=stages,
        tensor_parallel_size=tp_size,
        context_parallel_size=cp,
        sequence_parallel=sp,
        micro_batch_size=1,
        gradient_accumulation_steps=1,
        seq_length=seq,
    )
    resolve(cfg)  # precision and ZeRO stage as the trainer resolves them (training/precision.py)
    cfg.model.activation_checkpointing = 1  # every block
    cfg.model.loss_chunk_size = CHUNK
    if "--mlp-tiles" in flags:
        cfg.model.mlp_tiles = int(flags[flags.index("--mlp-tiles") + 1])
    config = AutoConfig.from_pretrained(ckpt_dir)
    config._attn_implementation = "sdpa"
    coords = Coords(rank, world, stages, tp_size, cp=cp)
    tp = TensorParallel(tp_size, coords.tp_rank, sequence_parallel=sp)
    ce = None  # torch's, on whole logits (TP=1)
    if tp.size > 1:
        ce = lambda logits, labels: vocab_parallel_cross_entropy(logits, labels, tp, config.vocab_size)  # noqa: E731
    loss_fn = CausalLMLoss(ce, CHUNK)
    module = build_module(cfg, coords, config, loss_fn, tp, stage_bounds(config, stages, cfg.model.partition))
    load_stage_weights(module, os.path.join(ckpt_dir, "global_step0"), config, tp)
    engine = initialize_engine(cfg, coords, module, 1)
    saved = SavedBytes(module.parameters())
    forward = module.forward

    def counted_forward(*args, **kwargs):
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            out = forward(*args, **kwargs)
        head = out[0] if isinstance(out, tuple) else out
        if isinstance(head, HeadOutput):  # the head's input: held until the loss (and by it, until backward)
            saved.pack(head.hidden)  # (the peak counts it; the handle dropped at once)
        return out

    module.forward = counted_forward
    ids, pos, labels = long_row(config.vocab_size, seq)
    # DeepSpeed averages the loss and gradients over its data ranks, the CP ranks (each scoring its shard) among them
    scale = torch.tensor(cp / int((labels != -100).sum()))
    ids, labels = shard(ids, coords.cp_rank, cp), shard(labels, coords.cp_rank, cp)  # position_ids whole
    rss_before = memory_status("VmRSS")
    start = time.perf_counter()
    loss = engine.train_batch(iter([((ids, pos), (labels, scale))]))
    seconds = time.perf_counter() - start
    record = {
        "rank": rank,
        "stage": coords.stage,
        "loss": float(loss),
        "peak_saved_bytes": saved.peak,
        "live_after_step": saved.live,
        "step_seconds": seconds,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "rss_before_step_bytes": rss_before,
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    shutdown_distributed()


if __name__ == "__main__":
    main()
