"""Saving training checkpoints, off the critical path by default (`checkpoint.async_save`).

A save has three phases:

1. **snapshot**, on the training thread, every rank: DeepSpeed's `save_checkpoint` runs as always (every collective,
   the expert gather of expert parallelism, the optimizer's state), but its checkpoint engine is ours for the call
   (`SnapshotEngine`, DeepSpeed's `CheckpointEngine` interface): each file's state is copied into reusable host
   buffers (pinned on a GPU) and nothing is written. The loop is blocked only this long (`save_seconds`).
2. **write**, in the background, every rank: one thread writes this rank's files into `.saving-<tag>/` with
   `torch.save`, fsyncs and describes each for the manifest (checkpoint/background_writer.py).
3. **commit**, at a step boundary once every rank's files are durable (the stop-flag all-reduce of each step also
   carries "written" and "failed"): rank 0 merges the manifest and publishes (checkpoint/saves.py: rename, then
   `latest`, then `keep_last_n`, which only ever sees published checkpoints).

One save is in flight at most: the next save, SIGTERM, the end of training and evaluation at the end wait for it to
commit first (`finish`); a failure on any rank abandons it (the daemon writer dies with the process; `salvage`
publishes it if every rank had written it). The next start publishes a staging directory that every rank finished
writing (each rank's marker) and is newer than every published checkpoint, and removes any other
(checkpoint/saves.py `written_saves`, training/assembly.py). A write error stops the run on every rank with one line
naming the file. `checkpoint.async_save=false` writes and commits inside the call (the path before this module).

NOTE: why not DeepSpeed's decoupled engine (`decoupled_checkpoint_engine.py`): it commits `latest` itself, outside
our publish-by-rename (the crash story of checkpoint/saves.py), and hands states to a separate process by pickling
them; ours keeps one publisher and writes from buffers reused across saves. Its interface is what we implement.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time

import torch.distributed as dist
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

from checkpoint.background_writer import BackgroundWriter, HostSnapshot
from checkpoint.manifest import checkpoint_files, describe_file, write_manifest
from checkpoint.names import MANIFEST, rng_file, staging_tag, step_tag, written_marker
from checkpoint.optimizer_reshape import OPTIMIZER_NAMES, optimizer_param_names
from checkpoint.saves import every_rank_wrote, prune, publish_checkpoint
from checkpoint.staging import remove_tree
from checkpoint.universal import write_layout
from schema.train import TrainConfig
from training.checkpointing import rng_state
from training.distributed import agreed, broadcast_object, control_group
from training.errors import RunError
from training.expert_parallel import every_expert

log = logging.getLogger(__name__)


class SnapshotEngine(CheckpointEngine):
    """DeepSpeed's checkpoint-engine interface, for the length of one `save_checkpoint`: `save` copies the state
    into host buffers and records (path, copy); loading is never asked of it."""

    def __init__(self, snapshot: HostSnapshot):
        super().__init__()
        self.snapshot, self.jobs = snapshot, []

    def create(self, info) -> None:
        pass

    def save(self, state_dict, path: str) -> None:
        self.jobs.append((path, self.snapshot.copy(state_dict, (os.path.basename(path),))))

    def load(self, path: str, map_location=None):
        raise RuntimeError("SnapshotEngine only saves")

    def commit(self, info) -> bool:
        return True

    def preserves_storage_sharing(self) -> bool:
        return False  # DeepSpeed need not clone layer states first: the snapshot copies them


class Saver:
    """The run's saves (one per Trainer): `save(step, data_state)` returns the seconds the loop was blocked."""

    def __init__(self, engine, cfg: TrainConfig, coords, layout: dict):
        self.engine, self.cfg, self.coords, self.layout = engine, cfg, coords, layout
        self.snapshot, self.writer = HostSnapshot(), BackgroundWriter()
        self.in_flight: dict | None = None  # tag, step, staging, blocked seconds

    def save(self, step: int, data_state: dict) -> float:
        """The seconds the loop stood still: waiting for the previous save to commit (a disk slower than the saves
        come), then this one's snapshot; with `async_save=false`, the whole save."""
        start = time.perf_counter()
        self.finish()  # one save in flight at most
        tag = step_tag(step)
        staging = os.path.join(self.cfg.output_dir, staging_tag(tag))
        jobs = self._snapshot(staging, tag, {**data_state, "step": step})
        self.in_flight = {"tag": tag, "step": step, "staging": staging, "blocked": time.perf_counter() - start}
        marker = os.path.join(staging, written_marker(self.coords.rank))
        if self.cfg.checkpoint.async_save:
            self.writer.write(jobs, describe=self.cfg.save_manifest, marker=marker)
            return self.in_flight["blocked"]
        self.writer.run_jobs(jobs, self.cfg.save_manifest, marker)
        self._agree_and_commit()
        return time.perf_counter() - start

    def _snapshot(self, staging: str, tag: str, data: dict) -> list[tuple[str, object]]:
        """Phase 1: the files of this rank, as (path, state in host buffers); directories made, nothing written."""
        engine, coords = self.engine, self.coords
        with agreed():  # rank 0 prepares the directory; a failure there stops every rank with its line
            if coords.rank == 0:
                try:
                    remove_tree(staging)
                    write_layout(staging, self.layout)
                except OSError as e:
                    where = e.filename or staging
                    raise RunError(f"saving checkpoint {tag} failed: {where}: {e.strerror}") from None
        client = {"data": data}
        names = optimizer_param_names(engine.module, engine.optimizer)
        if names is not None:  # lets a ZeRO-0 checkpoint move to another layout
            client[OPTIMIZER_NAMES] = names
        ep = engine.module._ep
        snapshotter = SnapshotEngine(self.snapshot)
        own, engine.checkpoint_engine = engine.checkpoint_engine, snapshotter
        try:
            with every_expert(engine, ep) if ep.size > 1 else contextlib.nullcontext():  # files hold every expert
                engine.save_checkpoint(
                    self.cfg.output_dir,
                    tag=os.path.basename(staging),
                    client_state=client,
                    save_latest=False,  # `latest` moves when the save commits, after the rename
                    exclude_frozen_parameters=self.cfg.lora.enabled,  # LoRA: layer files hold the adapter only
                )
        except BaseException:
            with contextlib.suppress(Exception):  # no copy may still be landing in a buffer the failure frees
                self.snapshot.ready()
            raise
        finally:
            engine.checkpoint_engine = own
        snapshotter.save(rng_state(), os.path.join(staging, rng_file(coords.rank)))
        self.snapshot.ready()
        return snapshotter.jobs

    def poll_flags(self) -> list[int]:
        """[still writing, failed] for this rank's save in flight: the step's all-reduce (MAX) carries them."""
        if self.in_flight is None:
            return [0, 0]
        done = self.writer.done()
        return [0 if done else 1, 1 if done and self.writer.error else 0]

    def after_flags(self, writing: int, failed: int) -> None:
        """The step's agreed flags: commit once no rank is writing; stop on every rank if one failed."""
        if self.in_flight is not None and (failed or not writing):
            self.writer.wait()
            self._agree_and_commit()

    def finish(self) -> None:
        """Wait for the save in flight and commit it (every rank calls this at the same point)."""
        if self.in_flight is not None:
            self.writer.wait()
            self._agree_and_commit()

    def _agree_and_commit(self) -> None:
        """Phase 3, every rank's writer done: rank 0 publishes unless a rank failed; every rank learns how it went."""
        errors: list = [None] * self.coords.world
        dist.all_gather_object(errors, self.writer.error, group=control_group())
        problem = next((f"{e} (rank {rank})" for rank, e in enumerate(errors) if e), None)
        tag, staging = self.in_flight["tag"], self.in_flight["staging"]
        if self.coords.rank == 0:
            try:
                if problem is None:
                    publish(staging, tag, self.coords.world, self.cfg)
            except Exception as e:  # noqa: BLE001 - every rank waits for this rank's word below
                problem = f"{getattr(e, 'filename', None) or staging}: {getattr(e, 'strerror', None) or e}"
            if problem is not None:
                remove_tree(staging)  # never published
        problem = broadcast_object(problem, group=control_group())
        step, blocked = self.in_flight["step"], self.in_flight["blocked"]
        self.in_flight = None
        if problem is not None:
            raise RunError(f"saving checkpoint {tag} failed: {problem}; 'latest' unchanged")
        log.info(
            "saved step %d: blocked %.2f s, written in %.2f s (%s)",
            step,
            blocked,
            self.writer.seconds,
            os.path.join(self.cfg.output_dir, tag),
        )

    def salvage(self, seconds: float = 60.0) -> None:
        """After a failure (no collectives): the save in flight is published if every rank finished writing it within
        `seconds` (each rank's marker file says so), else left for the next start (which publishes it once every
        marker is there, or removes it)."""
        if self.in_flight is None:
            return
        self.writer.wait(timeout=seconds)
        tag, staging = self.in_flight["tag"], self.in_flight["staging"]
        self.in_flight = None
        if self.coords.rank != 0:
            return
        deadline = time.monotonic() + seconds
        while not every_rank_wrote(staging, self.coords.world) and time.monotonic() < deadline:
            time.sleep(0.1)
        try:
            if every_rank_wrote(staging, self.coords.world):
                publish(staging, tag, self.coords.world, self.cfg)
                log.info("saved %s after the failure: every rank had written it", tag)
        except OSError as e:
            log.warning("%s not published after the failure: %s", tag, e)


def publish(staging: str, tag: str, world: int, cfg: TrainConfig) -> None:
    """Rank 0, every rank's files durable (its marker written): the manifest (each rank's entries as described when
    written; the layout file rank 0 wrote itself described here), then publish-by-rename and retention.

    The markers stay until the directory is published: a kill before that leaves a staging directory the next start
    publishes (`written_saves`); a kill just after leaves them in the checkpoint, where verification ignores dotfiles
    and the manifest does not list them."""
    markers = [written_marker(rank) for rank in range(world)]
    known = {}
    for marker in markers:
        with open(os.path.join(staging, marker)) as f:
            known.update(json.load(f)["entries"])
    for name in os.listdir(staging):  # a manifest whose writing a kill cut short (`write_text_atomic`'s temporary)
        if name.startswith(f"{MANIFEST}.tmp-"):
            os.remove(os.path.join(staging, name))
    if cfg.save_manifest:
        names = [n for n in checkpoint_files(staging) if n not in markers]
        write_manifest(staging, {n: known.get(n) or describe_file(os.path.join(staging, n), sync=True) for n in names})
    publish_checkpoint(cfg.output_dir, tag)
    for marker in markers:
        with contextlib.suppress(OSError):
            os.remove(os.path.join(cfg.output_dir, tag, marker))
    try:  # published and `latest` moved: a failing deletion of an older checkpoint no longer fails the save
        for old in prune(cfg.output_dir, cfg.keep_last_n, keep=tag):
            log.info("keep_last_n=%d: deleted %s", cfg.keep_last_n, os.path.join(cfg.output_dir, old))
    except OSError as e:
        log.warning("keep_last_n=%d: could not delete an older checkpoint: %s", cfg.keep_last_n, e)
