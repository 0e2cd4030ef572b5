"""The tokenized store: one data source tokenized once into flat arrays on disk that every rank memory-maps.

    <cache_dir>/store-<key>/        complete: it appears only by rename, after meta.json is written
        meta.json                   rows, tokens, dtypes, fingerprint, report counts, the key it was built for
        tokens.bin                  every row's token ids end to end (uint16, or uint32 for vocabularies > 65,536)
        targets.bin                 one bit per token: is it a target (np.packbits, little bit order)
        offsets.npy                 int64 [rows + 1]: row r is tokens[offsets[r]:offsets[r + 1]]
        lengths.npy                 int32 [rows]: tokens kept per row (after truncation)
        full_lengths.npy            int32 [rows]: tokens before truncation (the report's truncated rows)
        row_targets.npy             int32 [rows]: target tokens per row that the loss sees (positions >= 1)
    <cache_dir>/store-<key>.partial/  while building: part-NNNNNN/ per chunk of CHUNK_ROWS rows
    <cache_dir>/store-<key>.lock      held while building (a second builder waits, then opens the result)

Megatron-style arrays rather than Arrow through `datasets`: reading a row is two slices of memory-mapped
files (a few microseconds, no Python objects per row), the per-row arrays the samplers, packing and the
report need are one memory-mapped array each, and nothing else is imported at run time. The key is what
the tokenized rows depend on (the source files' paths, sizes and modification times, the tokenizer, the
data settings, the truncation); the data order (mixture, shuffle) is not part of it.

Building streams rows in chunks of CHUNK_ROWS (data/sources.py; JSONL as raw lines, parsed by whoever
tokenizes them), tokenizes each chunk in batches
(data/encode.py), inline or in `workers` forked processes that write their own part, and finally
concatenates the parts, one at a time, into the arrays above. Memory is bounded by the chunks in flight,
never by the corpus. An interrupted build leaves only `.partial`; the next build reuses its complete parts
(continues by chunk). A full disk is a one-line DataError.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable

import numpy as np

from data.config import DataConfig
from data.encode import encode_rows
from data.errors import DataError
from data.sources import JsonlLines, count_source, iter_chunks, shard_files

VERSION = 2
CHUNK_ROWS = 4096
NO_TARGET_EXAMPLES = 5
META = "meta.json"
ARRAYS = ("offsets", "lengths", "full_lengths", "row_targets")


def tokenizer_identity(tokenizer) -> dict:
    """What the ids depend on: the vocabulary and rules, the special tokens, the chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocab = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    return {
        "tokenizer": hashlib.sha256(vocab.encode()).hexdigest(),
        "special": {k: str(v) for k, v in tokenizer.special_tokens_map.items()},
        "chat_template": getattr(tokenizer, "chat_template", None),
        "size": len(tokenizer),
    }


def store_key(path: str, tokenizer, cfg: DataConfig, truncate: int | None, concat: bool) -> tuple[str, dict]:
    """(name, description) of the store for `path` tokenized with these settings."""
    files = [(os.path.abspath(f), os.path.getsize(f), os.stat(f).st_mtime_ns) for f in shard_files(path)]
    key = {
        "version": VERSION,
        "chunk_rows": CHUNK_ROWS,
        "source": os.path.abspath(path),
        "files": files,
        "data": {
            k: getattr(cfg, k)
            for k in ("text_key", "prompt_key", "response_key", "messages_key", "add_eos_to_response")
        },  # fmt: skip
        "truncate": truncate,
        "concat": concat,  # documents end with EOS (data.concatenate)
        **tokenizer_identity(tokenizer),
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]
    return f"store-{digest}", key


class Store:
    """A complete store, memory-mapped: nothing is read until a row is."""

    def __init__(self, directory: str):
        self.directory = directory
        with open(os.path.join(directory, META)) as f:
            self.meta = json.load(f)
        self.rows, self.num_tokens = self.meta["rows"], self.meta["tokens"]
        self.tokens = np.memmap(os.path.join(directory, "tokens.bin"), dtype=self.meta["token_dtype"], mode="r",
                                shape=(self.num_tokens,)) if self.num_tokens else np.zeros(0, np.uint16)  # fmt: skip
        nbytes = (self.num_tokens + 7) // 8
        self.target_bits = np.memmap(os.path.join(directory, "targets.bin"), dtype=np.uint8, mode="r",
                                     shape=(nbytes,)) if nbytes else np.zeros(0, np.uint8)  # fmt: skip
        for name in ARRAYS:
            setattr(self, name, np.load(os.path.join(directory, f"{name}.npy"), mmap_mode="r"))

    def span(self, row: int, start: int = 0, end: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Token ids (int64) and target flags (bool) of tokens [start, end) of `row`."""
        base = int(self.offsets[row])
        stop = int(self.offsets[row + 1]) if end is None else base + end
        lo, hi = base + start, stop
        ids = np.asarray(self.tokens[lo:hi], dtype=np.int64)
        bits = np.unpackbits(self.target_bits[lo // 8 : (hi + 7) // 8], bitorder="little")
        return ids, bits[lo % 8 : lo % 8 + (hi - lo)].astype(bool)

    @property
    def fingerprint(self) -> str:
        return self.meta["fingerprint"]


def part_name(index: int) -> str:
    return f"part-{index:06d}"


# Set in the builder before worker processes fork (they inherit it; nothing is pickled per chunk but rows).
_WORK: dict = {}


def _encode_part(partial: str, index: int, chunk) -> dict:
    """Tokenize one chunk and write it as part `index` of `partial`; returns its summary."""
    w = _WORK
    rows = chunk.rows() if isinstance(chunk, JsonlLines) else chunk
    encoded = encode_rows(rows, w["tokenizer"], w["cfg"])
    eos, truncate = w["eos"], w["truncate"]
    if w["concat"] and eos is not None:  # documents end with EOS, so the stream separates them
        encoded = [(ids + [eos], targets + [True]) if not ids or ids[-1] != eos else (ids, targets)
                   for ids, targets in encoded]  # fmt: skip
    full = np.array([len(ids) for ids, _ in encoded], dtype=np.int32)
    lengths = np.minimum(full, truncate) if truncate else full
    total = int(lengths.sum())
    kept = lengths.tolist()
    tokens = np.concatenate([np.zeros(0, w["dtype"])] + [np.asarray(ids[:n], dtype=w["dtype"])
                                                         for (ids, _), n in zip(encoded, kept)])  # fmt: skip
    flags = [np.asarray(tg[:n], dtype=bool) for (_, tg), n in zip(encoded, kept)]
    targets = np.concatenate([np.zeros(0, bool)] + flags)
    row_targets = np.array([int(f[1:].sum()) for f in flags], dtype=np.int32)
    no_target = [where for (where, _), n in zip(rows, row_targets) if n == 0]
    digest = hashlib.sha256()
    for array in (lengths, tokens, targets):
        digest.update(array.tobytes())
    tmp = os.path.join(partial, f".{part_name(index)}.tmp-{os.getpid()}")
    os.makedirs(tmp)
    for name, array in (("tokens", tokens), ("targets", targets), ("lengths", lengths), ("full_lengths", full),
                        ("row_targets", row_targets)):  # fmt: skip
        np.save(os.path.join(tmp, f"{name}.npy"), array)
    summary = {"rows": len(rows), "tokens": total, "digest": digest.hexdigest(), "no_target": len(no_target),
               "no_target_examples": no_target[:NO_TARGET_EXAMPLES], "truncated": int((full > lengths).sum()),
               "target_tokens": int(row_targets.sum())}  # fmt: skip
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


class Progress:
    """Rows/s and tokens/s of a build: a tqdm bar on a terminal, else a log line every 30 s."""

    def __init__(self, what: str, total: int | None, log: Callable[[str], None]):
        import sys

        self.what, self.log, self.start, self.last = what, log, time.perf_counter(), 0.0
        self.rows = self.tokens = 0
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="rows", desc=f"tokenizing {os.path.basename(what)}", mininterval=1.0)

    def update(self, rows: int, tokens: int) -> None:
        self.rows, self.tokens = self.rows + rows, self.tokens + tokens
        seconds = max(time.perf_counter() - self.start, 1e-9)
        if self.bar is not None:
            self.bar.update(rows)
            self.bar.set_postfix(tokens_s=f"{self.tokens / seconds:,.0f}", refresh=False)
        elif seconds - self.last >= 30:
            self.last = seconds
            self.log(f"tokenizing {self.what}: {self.rows:,} rows, {self.rows / seconds:,.0f} rows/s, "
                     f"{self.tokens / seconds:,.0f} tokens/s")  # fmt: skip

    def close(self) -> float:
        if self.bar is not None:
            self.bar.close()
        return time.perf_counter() - self.start


def _build_parts(path: str, partial: str, workers: int, beat: Callable[[], None], progress: Progress) -> int:
    """Write every part not already complete in `partial`. Returns the number of parts."""
    count = 0
    if workers <= 1:
        for index, chunk in enumerate(iter_chunks(path, CHUNK_ROWS)):
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

    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        try:
            for index, chunk in enumerate(iter_chunks(path, CHUNK_ROWS)):
                count = index + 1
                summary = _read_summary(partial, index)
                if summary is not None:
                    progress.update(summary["rows"], summary["tokens"])
                    continue
                pending.add(pool.submit(_encode_part, partial, index, chunk))
                drain(block=False)
            drain(block=True)
        except BaseException:
            for future in pending:
                future.cancel()
            raise
    return count


def _finalize(partial: str, parts: int, key: dict, dtype: str, start: float, beat: Callable[[], None]) -> dict:
    """Concatenate the parts into the store's arrays (one part in memory at a time, each deleted once
    copied) and write meta.json last."""
    summaries = [_read_summary(partial, i) for i in range(parts)]
    rows, tokens = sum(s["rows"] for s in summaries), sum(s["tokens"] for s in summaries)
    from numpy.lib.format import open_memmap

    arrays = {name: open_memmap(os.path.join(partial, f"{name}.npy"), mode="w+", shape=(rows + (name == "offsets"),),
                                dtype=np.int64 if name == "offsets" else np.int32) for name in ARRAYS}  # fmt: skip
    row = token = 0
    carry = np.zeros(0, dtype=bool)  # target bits not yet a whole byte
    with open(os.path.join(partial, "tokens.bin"), "wb") as tok_f, open(os.path.join(partial, "targets.bin"),
                                                                         "wb") as tgt_f:  # fmt: skip
        for i in range(parts):
            part = os.path.join(partial, part_name(i))
            lengths = np.load(os.path.join(part, "lengths.npy"))
            n = len(lengths)
            arrays["offsets"][row + 1 : row + n + 1] = token + np.cumsum(lengths, dtype=np.int64)
            for name in ("lengths", "full_lengths", "row_targets"):
                arrays[name][row : row + n] = np.load(os.path.join(part, f"{name}.npy"))
            tok_f.write(np.load(os.path.join(part, "tokens.npy")).astype(dtype, copy=False).tobytes())
            bits = np.concatenate([carry, np.load(os.path.join(part, "targets.npy"))])
            whole = len(bits) // 8 * 8
            tgt_f.write(np.packbits(bits[:whole], bitorder="little").tobytes())
            carry = bits[whole:]
            row, token = row + n, token + int(lengths.sum())
            shutil.rmtree(part)
            beat()
        tgt_f.write(np.packbits(carry, bitorder="little").tobytes())
        for f in (tok_f, tgt_f):
            f.flush()
            os.fsync(f.fileno())
    for array in arrays.values():
        array.flush()
    fingerprint = hashlib.sha256("\n".join(s["digest"] for s in summaries).encode()).hexdigest()
    meta = {
        "version": VERSION,
        "rows": rows,
        "tokens": tokens,
        "token_dtype": dtype,
        "fingerprint": fingerprint,
        "target_tokens": sum(s["target_tokens"] for s in summaries),
        "truncated_rows": sum(s["truncated"] for s in summaries),
        "rows_without_targets": sum(s["no_target"] for s in summaries),
        "no_target_examples": [w for s in summaries for w in s["no_target_examples"]][:NO_TARGET_EXAMPLES],
        "build_seconds": time.perf_counter() - start,  # tokenizing and concatenating (this launch's share)
        "key": key,
    }
    with open(os.path.join(partial, META), "w") as f:
        json.dump(meta, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    return meta


@contextlib.contextmanager
def _locked(path: str):
    import fcntl

    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _no_beat() -> None:
    pass


def open_or_build(path: str, tokenizer, cfg: DataConfig, truncate: int | None, concat: bool, cache_dir: str,
                  workers: int = 0, beat: Callable[[], None] = _no_beat, log: Callable[[str], None] = print,
                  build: bool = True) -> tuple[Store, bool]:  # fmt: skip
    """The store of `path` under `cache_dir`, built first if it is not there (unless `build` is False).

    Returns:
        (the store, whether it was built now).
    Raises:
        DataError: a bad row (named), an empty source, a store that cannot be written (disk full, permissions).
    """
    name, key = store_key(path, tokenizer, cfg, truncate, concat)
    final = os.path.join(cache_dir, name)
    if os.path.exists(os.path.join(final, META)):
        return Store(final), False
    if not build:
        raise DataError(f"{path}: its tokenized store {final} is missing")
    try:
        os.makedirs(cache_dir, exist_ok=True)
        with _locked(f"{final}.lock"):
            if os.path.exists(os.path.join(final, META)):  # another process built it meanwhile
                return Store(final), False
            _build(path, final, key, tokenizer, cfg, truncate, concat, workers, beat, log)
    except OSError as e:
        where = e.filename or cache_dir
        raise DataError(f"{where}: cannot write the tokenized store of {path} ({e.strerror or e}); "
                        "free space or set data.cache_dir") from None  # fmt: skip
    return Store(final), True


def _build(path, final, key, tokenizer, cfg, truncate, concat, workers, beat, log) -> None:
    partial = f"{final}.partial"
    os.makedirs(partial, exist_ok=True)
    for name in os.listdir(partial):  # a part an interrupted build was writing
        if name.startswith("."):
            shutil.rmtree(os.path.join(partial, name), ignore_errors=True)
    dtype = "uint16" if len(tokenizer) <= 2**16 else "uint32"
    _WORK.update(tokenizer=tokenizer, cfg=cfg, truncate=truncate, concat=concat, dtype=dtype,
                 eos=tokenizer.eos_token_id)  # fmt: skip
    start = time.perf_counter()
    progress = Progress(path, count_source(path), log)
    try:
        parts = _build_parts(path, partial, workers, beat, progress)
    except DataError:
        shutil.rmtree(partial, ignore_errors=True)  # bad data: nothing to continue from
        raise
    finally:
        progress.close()
    if parts == 0:
        shutil.rmtree(partial, ignore_errors=True)
        raise DataError(f"{path}: empty dataset (no rows)")
    meta = _finalize(partial, parts, key, dtype, start, beat)
    seconds = meta["build_seconds"]
    os.rename(partial, final)
    log(f"tokenized {path}: {meta['rows']:,} rows, {meta['tokens']:,} tokens in {seconds:.1f}s "
        f"({meta['rows'] / max(seconds, 1e-9):,.0f} rows/s, {meta['tokens'] / max(seconds, 1e-9):,.0f} tokens/s) "
        f"with {max(workers, 1)} process(es) -> {final}")  # fmt: skip
