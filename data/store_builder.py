"""Building a tokenized store (data/store.py describes the format): chunks, worker processes, parts, the final
arrays, the lock and the progress bar.

Rows are streamed in chunks of CHUNK_ROWS (data/sources.py; JSONL as raw lines, parsed by whoever tokenizes
them), each chunk tokenized in batches (data/encode.py), inline or in `workers` forked processes that write
their own part, and the parts concatenated at the end, one at a time, into the store's arrays. Memory is
bounded by the chunks in flight, never by the corpus. An interrupted build leaves only `.partial`; the next
build reuses its complete parts (continues by chunk). A full disk is a one-line DataError.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable

import numpy as np

from common.progress import Progress
from data import store as fmt
from data.encode import encode_rows, lossy_tokenizer
from data.errors import DataError
from data.formats import chunk_as_native
from data.pairs import encode_pairs
from data.sources import JsonlLines, count_source, iter_chunks
from data.store import ARRAYS, META, NO_TARGET_EXAMPLES, Store, store_key
from schema.data import DataConfig


class WorkerDied(DataError):
    """A worker process died mid-build (the finished parts stay for the next build)."""


def part_name(index: int) -> str:
    return f"part-{index:06d}"


# Set in the builder before worker processes fork (they inherit it; nothing is pickled per chunk but rows).
_WORK: dict = {}


def _encode_part(partial: str, index: int, chunk) -> dict:
    """Tokenize one chunk and write it as part `index` of `partial`; returns its summary."""
    w = _WORK
    rows = chunk.rows() if isinstance(chunk, JsonlLines) else chunk
    rows, form = chunk_as_native(rows, w["cfg"], w["pairs"], getattr(w["tokenizer"], "chat_template", None))
    lost: list[bool] | None = [] if w["lossy"] and not w["pairs"] else None
    if w["pairs"]:  # preference pairs: two store rows each, the chosen and the rejected sequence
        encoded = encode_pairs(rows, w["tokenizer"], w["cfg"])
        rows = [(f"{where} ({half})", row) for where, row in rows for half in ("chosen", "rejected")]
    else:
        encoded = encode_rows(rows, w["tokenizer"], w["cfg"], lost)
    lost_characters = np.array(lost if lost is not None else [False] * len(rows), dtype=np.uint8)
    eos, truncate = w["eos"], w["truncate"]
    if w["concat"] and eos is not None:  # documents end with EOS, so the stream separates them
        encoded = [
            (ids + [eos], targets + [True]) if not ids or ids[-1] != eos else (ids, targets) for ids, targets in encoded
        ]
    full = np.array([len(ids) for ids, _ in encoded], dtype=np.int32)
    lengths = np.minimum(full, truncate) if truncate else full
    total = int(lengths.sum())
    kept = lengths.tolist()
    tokens = np.concatenate(
        [np.zeros(0, w["dtype"])] + [np.asarray(ids[:n], dtype=w["dtype"]) for (ids, _), n in zip(encoded, kept)]
    )
    flags = [np.asarray(tg[:n], dtype=bool) for (_, tg), n in zip(encoded, kept)]
    targets = np.concatenate([np.zeros(0, bool)] + flags)
    row_targets = np.array([int(f[1:].sum()) for f in flags], dtype=np.int32)
    no_target = [where for (where, _), n in zip(rows, row_targets) if n == 0]
    lossy_rows = [where for (where, _), n in zip(rows, lost_characters) if n]
    digest = hashlib.sha256()
    for array in (lengths, tokens, targets):
        digest.update(array.tobytes())
    tmp = os.path.join(partial, f".{part_name(index)}.tmp-{os.getpid()}")
    os.makedirs(tmp)
    arrays = {
        "tokens": tokens,
        "targets": targets,
        "lengths": lengths,
        "full_lengths": full,
        "row_targets": row_targets,
        "lost_characters": lost_characters,
    }
    for name, array in arrays.items():
        np.save(os.path.join(tmp, f"{name}.npy"), array)
    summary = {
        "rows": len(rows),
        "tokens": total,
        "digest": digest.hexdigest(),
        "no_target": len(no_target),
        "no_target_examples": no_target[:NO_TARGET_EXAMPLES],
        "truncated": int((full > lengths).sum()),
        "target_tokens": int(row_targets.sum()),
        "lost": len(lossy_rows),
        "lost_examples": lossy_rows[:NO_TARGET_EXAMPLES],
        "format": form,
    }
    with open(os.path.join(tmp, "part.json"), "w") as f:
        json.dump(summary, f)
    os.rename(tmp, os.path.join(partial, part_name(index)))
    return summary


def _read_summary(partial: str, index: int) -> dict | None:
    try:
        with open(os.path.join(partial, part_name(index), "part.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _build_parts(path: str, partial: str, workers: int, beat: Callable[[], None], progress: Progress) -> int:
    """Write every part not already complete in `partial`. Returns the number of parts."""
    count = 0
    if workers <= 1:
        for index, chunk in enumerate(iter_chunks(path, fmt.CHUNK_ROWS)):
            count = index + 1
            summary = _read_summary(partial, index) or _encode_part(partial, index, chunk)
            progress.update(summary["rows"], summary["tokens"])
            beat()
        return count
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    pending: set = set()

    def drain(block: bool) -> None:
        while pending and (block or len(pending) >= 2 * workers):
            done, _ = wait(pending, timeout=5.0, return_when=FIRST_COMPLETED)
            beat()
            for future in done:
                pending.discard(future)
                summary = future.result()  # a worker's DataError surfaces here
                progress.update(summary["rows"], summary["tokens"])

    from concurrent.futures.process import BrokenProcessPool

    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        try:
            for index, chunk in enumerate(iter_chunks(path, fmt.CHUNK_ROWS)):
                count = index + 1
                summary = _read_summary(partial, index)
                if summary is not None:
                    progress.update(summary["rows"], summary["tokens"])
                    continue
                pending.add(pool.submit(_encode_part, partial, index, chunk))
                drain(block=False)
            drain(block=True)
        except BrokenProcessPool:
            raise WorkerDied(
                f"{path}: a tokenizer worker process died (out of memory?) while building {partial}; "
                "its finished parts are kept for the next launch"
            ) from None
        except BaseException:
            for future in pending:
                future.cancel()
            raise
    return count


def _finalize(partial: str, parts: int, key: dict, dtype: str, start: float, beat: Callable[[], None]) -> dict:
    """Concatenate the parts into the store's arrays (one part in memory at a time, each deleted once
    copied) and write meta.json last."""
    summaries = [_read_summary(partial, i) for i in range(parts)]
    formats = sorted({s.get("format", "native") for s in summaries})
    if len(formats) > 1:
        raise DataError(f"{key['source']}: rows of {' and '.join(formats)} formats; one source holds one format")
    rows, tokens = sum(s["rows"] for s in summaries), sum(s["tokens"] for s in summaries)
    # NOTE: plain appending writes, not np.memmap: a memory-mapped file on a full disk kills the process with
    # SIGBUS instead of raising ENOSPC.
    files = {
        name: _NpyAppender(os.path.join(partial, f"{name}.npy"), dtype, rows + (name == "offsets"))
        for name, dtype in ARRAYS.items()
    }
    files["offsets"].write(np.zeros(1, np.int64))
    token = 0
    carry = np.zeros(0, dtype=bool)  # target bits not yet a whole byte
    with (
        open(os.path.join(partial, "tokens.bin"), "wb") as tok_f,
        open(os.path.join(partial, "targets.bin"), "wb") as tgt_f,
    ):
        for i in range(parts):
            part = os.path.join(partial, part_name(i))
            lengths = np.load(os.path.join(part, "lengths.npy"))
            files["offsets"].write(token + np.cumsum(lengths, dtype=np.int64))
            for name in ARRAYS:
                if name != "offsets":
                    files[name].write(np.load(os.path.join(part, f"{name}.npy")))
            tok_f.write(np.load(os.path.join(part, "tokens.npy")).astype(dtype, copy=False).tobytes())
            bits = np.concatenate([carry, np.load(os.path.join(part, "targets.npy"))])
            whole = len(bits) // 8 * 8
            tgt_f.write(np.packbits(bits[:whole], bitorder="little").tobytes())
            carry = bits[whole:]
            token += int(lengths.sum())
            shutil.rmtree(part)  # NOTE: disk for one part at a time; a kill from here on tokenizes these again
            beat()
        tgt_f.write(np.packbits(carry, bitorder="little").tobytes())
        for f in (tok_f, tgt_f):
            f.flush()
            os.fsync(f.fileno())
    for f in files.values():
        f.close()
    fingerprint = hashlib.sha256("\n".join(s["digest"] for s in summaries).encode()).hexdigest()
    meta = {
        "version": fmt.VERSION,
        "rows": rows,
        "tokens": tokens,
        "token_dtype": dtype,
        "fingerprint": fingerprint,
        "target_tokens": sum(s["target_tokens"] for s in summaries),
        "truncated_rows": sum(s["truncated"] for s in summaries),
        "rows_without_targets": sum(s["no_target"] for s in summaries),
        "no_target_examples": [w for s in summaries for w in s["no_target_examples"]][:NO_TARGET_EXAMPLES],
        "rows_with_lost_characters": sum(s["lost"] for s in summaries),
        "lost_character_examples": [w for s in summaries for w in s["lost_examples"]][:NO_TARGET_EXAMPLES],
        "format": formats[0],  # how the rows were read (data/formats.py)
        "build_seconds": time.perf_counter() - start,  # tokenizing and concatenating (this launch's share)
        "key": key,
    }
    with open(os.path.join(partial, META), "w") as f:
        json.dump(meta, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    return meta


class _NpyAppender:
    """A `.npy` file of known length written by appending (header first), one part at a time."""

    def __init__(self, path: str, dtype, length: int):
        from numpy.lib import format as npy

        self.dtype, self.file = np.dtype(dtype), open(path, "wb")
        npy.write_array_header_1_0(
            self.file, {"descr": npy.dtype_to_descr(self.dtype), "fortran_order": False, "shape": (length,)}
        )

    def write(self, array: np.ndarray) -> None:
        self.file.write(np.ascontiguousarray(array, dtype=self.dtype).tobytes())

    def close(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()


@contextlib.contextmanager
def _locked(path: str, beat: Callable[[], None], log: Callable[[str], None]):
    """Hold an exclusive lock on `path` (another process building the same store waits here, beating)."""
    import fcntl

    with open(path, "a") as f:
        waited = False
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not waited:
                    log(f"waiting for another process building the same tokenized store ({path} is locked)")
                    waited = True
                beat()
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _no_beat() -> None:
    pass


def open_or_build(
    path: str,
    tokenizer,
    cfg: DataConfig,
    truncate: int | None,
    concat: bool,
    cache_dir: str,
    workers: int = 0,
    beat: Callable[[], None] = _no_beat,
    log: Callable[[str], None] = print,
    build: bool = True,
    pairs: bool = False,
) -> tuple[Store, bool]:
    """The store of `path` under `cache_dir`, built first if it is not there (unless `build` is False).
    `pairs`: the rows are preference pairs (data/pairs.py), each stored as two rows: chosen, then rejected.

    Returns:
        (the store, whether it was built now).
    Raises:
        DataError: a bad row (named), an empty source, a store that cannot be written (disk full, permissions).
    """
    name, key = store_key(path, tokenizer, cfg, truncate, concat, pairs)
    final = os.path.join(cache_dir, name)
    if os.path.exists(os.path.join(final, META)):
        return Store(final), False
    if not build:
        raise DataError(f"{path}: its tokenized store {final} is missing")
    try:
        os.makedirs(cache_dir, exist_ok=True)
        with _locked(f"{final}.lock", beat, log):
            if os.path.exists(os.path.join(final, META)):  # another process built it meanwhile
                return Store(final), False
            _build(path, final, key, tokenizer, cfg, truncate, concat, workers, beat, log, pairs)
    except OSError as e:
        import errno

        where = e.filename or cache_dir
        hint = "; free space or set data.cache_dir" if e.errno in (errno.ENOSPC, errno.EDQUOT) else ""
        raise DataError(f"{where}: cannot write the tokenized store of {path} ({e.strerror or e}){hint}") from None
    return Store(final), True


def _build(path, final, key, tokenizer, cfg, truncate, concat, workers, beat, log, pairs=False) -> None:
    partial = f"{final}.partial"
    os.makedirs(partial, exist_ok=True)
    for name in os.listdir(partial):  # a part an interrupted build was writing
        if name.startswith("."):
            shutil.rmtree(os.path.join(partial, name), ignore_errors=True)
    dtype = "uint16" if len(tokenizer) <= 2**16 else "uint32"
    _WORK.update(
        tokenizer=tokenizer,
        cfg=cfg,
        truncate=truncate,
        concat=concat,
        dtype=dtype,
        pairs=pairs,
        eos=tokenizer.eos_token_id,
        lossy=lossy_tokenizer(tokenizer),
    )
    start = time.perf_counter()
    # The rows are counted (one more read of the files) only for a terminal's bar; a log gets a line every 30 s.
    what = f"tokenizing {os.path.basename(path)}"
    total = count_source(path) if sys.stderr.isatty() else 0
    progress = Progress(what, total, unit="rows", amount="tokens", log=log, every=30.0)
    try:
        parts = _build_parts(path, partial, workers, beat, progress)
    except WorkerDied:
        raise
    except DataError:
        shutil.rmtree(partial, ignore_errors=True)  # bad data: nothing to continue from
        raise
    finally:
        progress.close()
    if parts == 0:
        shutil.rmtree(partial, ignore_errors=True)
        raise DataError(f"{path}: empty dataset (no rows)")
    try:
        meta = _finalize(partial, parts, key, dtype, start, beat)
    except DataError:  # rows of two formats: nothing to continue from
        shutil.rmtree(partial, ignore_errors=True)
        raise
    seconds = meta["build_seconds"]
    os.rename(partial, final)
    log(
        f"tokenized {path}: {meta['rows']:,} rows, {meta['tokens']:,} tokens in {seconds:.1f}s "
        f"({meta['rows'] / max(seconds, 1e-9):,.0f} rows/s, {meta['tokens'] / max(seconds, 1e-9):,.0f} tokens/s) "
        f"with {max(workers, 1)} process(es) -> {final}"
    )
