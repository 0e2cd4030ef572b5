"""`convert2ckpt.py --input CKPT --output OUT --tp T`: a pipeline checkpoint written for another number of
tensor-parallel ranks.

Each layer is read whole (its shards merged) and written as T shards (models/sharding.py), one layer in
memory at a time, so any degree that divides the heads converts to any other (2 -> 3 as well as 2 -> 4 or
4 -> 1). Works on converted checkpoints and trainer saves; the output is weights only (`global_step0`,
like a conversion), or a piece with `--tp-ranks` / `--layers` (each node writes the ranks it trains).
"""

from __future__ import annotations

import os
import time

from checkpoint.dtypes import dtype_name
from checkpoint.errors import CheckpointError
from checkpoint.hf_reader import read_model_config
from checkpoint.layer_files import unchecked_zip_records
from checkpoint.manifest import BackgroundDescriber
from checkpoint.names import LORA_FILE
from checkpoint.outputs import PIPELINE, check_output
from checkpoint.pipeline_reader import PipelineCheckpoint
from checkpoint.staging import staged_directory
from checkpoint.writer import TAG, ConvertStats, check_tp, finish_converted, finish_piece, write_layer
from common.progress import Progress


def reshard_checkpoint(
    ckpt_dir: str,
    out_dir: str,
    tp_size: int,
    tp_ranks: list[int] | None = None,
    layers: list[int] | None = None,
    tag: str | None = None,
    fmt: str = "pt",
    force: bool = False,
    log=print,
) -> ConvertStats:
    """Write `ckpt_dir/<tag>`'s weights as `tp_size` tensor-parallel shards per layer into `out_dir`.

    Raises:
        CheckpointError: bad input (a LoRA run, a degree that does not divide the heads); nothing written.
    """
    start = time.perf_counter()
    check_output(out_dir, PIPELINE, force, [("input", ckpt_dir)])
    config = read_model_config(ckpt_dir)
    if os.path.exists(os.path.join(ckpt_dir, LORA_FILE)):
        raise CheckpointError(
            f"{ckpt_dir}: a LoRA run's layer files hold its adapters only; export it with --to-hf --merge-lora and "
            "convert that"
        )
    check_tp(config, tp_size, tp_ranks)
    ckpt = PipelineCheckpoint(ckpt_dir, tag, config)
    step_dir, saved_tp = ckpt.step_dir, ckpt.tp_size
    todo = list(ckpt.layers)
    if layers is not None:
        todo = [layer for layer in todo if layer.index in layers]
    whole = layers is None and (tp_ranks is None or sorted(tp_ranks) == list(range(tp_size)))
    stats, dtype = ConvertStats(), None
    with staged_directory(out_dir, force, PIPELINE, "--tp", [ckpt_dir]) as tmp:
        out_step = os.path.join(tmp, TAG)
        os.makedirs(out_step)
        describer, progress = BackgroundDescriber(), Progress("resharding", len(todo))
        for layer in todo:
            state = ckpt.load_whole(layer)
            dtype = dtype or dtype_name(next(iter(state.values())).dtype)
            with unchecked_zip_records():
                paths = write_layer(out_step, layer, state, fmt, config.vocab_size, tp_size, tp_ranks, config)
            for path, hashed in paths.items():
                describer.add(path, hashed)
            stats.layers_written += 1
            stats.tensors += len(state)
            stats.bytes_written += sum(os.path.getsize(p) for p in paths)
            stats.files += [os.path.basename(p) for p in paths]
            progress.update(1, sum(os.path.getsize(p) for p in paths))
            del state
        progress.close()
        known = describer.entries()
        if whole:
            finish_converted(tmp, ckpt_dir, dtype, known=known)
        else:
            finish_piece(tmp, ckpt_dir, [layer.index for layer in todo], dtype, None, tp_size, tp_ranks, known=known)
    stats.seconds = time.perf_counter() - start
    log(
        f"{'resharded' if whole else 'piece of'} {step_dir} (TP {saved_tp}) -> {out_dir} (TP {tp_size}): "
        f"{len(stats.files)} layer files, {stats.bytes_written / 2**20:.1f} MiB in {stats.seconds:.1f}s"
    )
    return stats
