"""Where rows come from, streamed: JSONL, JSON and Parquet files, directories of such shards, directories
saved with Hugging Face `datasets` (`Dataset.save_to_disk`) and Hub datasets (`hf://datasets/ORG/NAME`, with an
optional `:CONFIG` and `@SPLIT`, default the `train` split), alone or several mixed with weights.

A Hub dataset is read by `datasets.load_dataset(ORG/NAME, CONFIG, split=SPLIT)` online (only that config's files are
fetched); offline, or when the Hub cannot be reached (and only then: a wrong split or config is one line), from the
repository's snapshot already in the hub cache (`huggingface_hub`: HF_HUB_OFFLINE, HF_TOKEN; never code or
pickles). Its rows then take the same path as a local file's (format detection, the tokenized store, keyed by the id
and datasets' fingerprint).

Rows are read one chunk at a time (JSONL line by line, Parquet and `datasets` by record batches), so a corpus
larger than RAM is tokenized shard by shard; only a `.json` file (one JSON list) is parsed whole.

`train_file` is one path or a list of paths; with `data.train_weights` (one weight per path) the
training set is a mixture: it keeps the total row count of the sources (so an epoch is as long as
the data), and source i provides round(total x w_i / sum(w)) of those rows, drawn without
replacement and reshuffled before any row repeats. The mixture is an index array, a function of the
row counts, the weights and the seed only, so every rank builds the same one.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator

import numpy as np

from data.errors import DataError

FORMATS = (".jsonl", ".json", ".parquet")
BATCH_ROWS = 1024  # Parquet / datasets record batches


def paths_of(spec) -> list[str]:
    """`train_file`/`eval_file` as a list of paths."""
    if spec is None:
        return []
    paths = [spec] if isinstance(spec, str) else list(spec)
    if not paths or not all(isinstance(p, str) and p for p in paths):
        raise DataError(f"data files {spec!r}: expected a path or a list of paths")
    return paths


HUB_DATASET = re.compile(r"hf://datasets/([\w.-]+/[\w.-]+)(?::([\w.-]+))?(?:@([\w.-]+))?")
_HUB_LOADED: dict = {}  # spec -> datasets.Dataset, once per process


def is_hub_dataset(path: str) -> bool:
    return path.startswith("hf://")


def hub_dataset(spec: str):
    """The `datasets.Dataset` of a Hub dataset spec (module docstring). Raises DataError (one line)."""
    if spec in _HUB_LOADED:
        return _HUB_LOADED[spec]
    m = HUB_DATASET.fullmatch(spec)
    if m is None:
        raise DataError(f"{spec}: a Hub dataset is hf://datasets/ORG/NAME, optionally :CONFIG and @SPLIT")
    import datasets

    from common.hub import HubError, datasets_cache_dir, offline, snapshot, unreachable

    config, split = m[2], m[3] or "train"
    ds = None
    if not offline():  # online: datasets fetches only the files of this config and split
        try:
            ds = datasets.load_dataset(m[1], config, split=split, cache_dir=datasets_cache_dir())
        except Exception as e:  # noqa: BLE001 - datasets raises many types (unknown split or config, bad files)
            if not unreachable(e):  # only an unreachable Hub falls back to the cache's snapshot (never a download)
                why = (str(e).splitlines() or [""])[0]
                raise DataError(f"{spec}: datasets cannot load it ({type(e).__name__}: {why})") from None
    if ds is None:
        try:
            local = snapshot(m[1], "dataset", repo_type="dataset", local_only=True)
        except HubError as e:
            raise DataError(f"{spec}: {e}") from None
        try:
            ds = datasets.load_dataset(local, config, split=split, cache_dir=datasets_cache_dir())
        except Exception as e:  # noqa: BLE001 - datasets raises many types (unknown split or config, bad files)
            why = (str(e).splitlines() or [""])[0]
            raise DataError(f"{spec}: datasets cannot load it ({type(e).__name__}: {why})") from None
    _HUB_LOADED[spec] = ds
    return ds


def _is_datasets_dir(path: str) -> bool:
    return any(os.path.exists(os.path.join(path, n)) for n in ("dataset_info.json", "state.json"))


def shard_files(path: str) -> list[str]:
    """The files one source reads: itself, or a directory's data shards (sorted), or a datasets directory's files.

    Raises:
        DataError: an unknown format, a missing file, a DatasetDict, a directory without data files.
    """
    if os.path.isdir(path):
        names = sorted(os.listdir(path))
        if _is_datasets_dir(path):
            return [os.path.join(path, n) for n in names if os.path.isfile(os.path.join(path, n))]
        if "dataset_dict.json" in names:
            raise DataError(f"{path}: a DatasetDict; name one split's directory (e.g. {path}/train)")
        shards = [os.path.join(path, n) for n in names if n.endswith(FORMATS) and not n.startswith(".")]
        if not shards:
            raise DataError(f"{path}: no {', '.join(FORMATS)} files and not a directory saved with datasets")
        return shards
    if not path.endswith(FORMATS):
        raise DataError(
            f"{path}: unknown data format (expected {', '.join(FORMATS)}, a directory of such "
            "shards, or a datasets directory)"
        )
    if not os.path.exists(path):
        raise DataError(f"{path}: cannot read data file (No such file or directory)")
    return [path]


def parse_jsonl_line(raw: bytes, path: str, lineno: int) -> dict | None:
    """One JSONL line (bytes) as a row, None when blank; DataError naming file and line otherwise.
    A UTF-8 byte-order mark (Windows tools write one) at the start of the file is skipped."""
    if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        where = f"byte 0x{raw[e.start]:02x} at column {e.start + 1}"
        raise DataError(f"{path}:{lineno}: not UTF-8 text ({where}); save the file as UTF-8") from None
    if not line.strip():
        return None
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
    if not isinstance(row, dict):
        raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
    return row


def _json_rows(path: str) -> Iterator[tuple[str, dict]]:
    try:
        with open(path, encoding="utf-8-sig") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        msg = f"{path}: not valid JSON ({e.msg} at line {e.lineno}); JSON lines go in a .jsonl file"
        raise DataError(msg) from None
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start})") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read data file ({e.strerror})") from None
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list):
        raise DataError(f'{path}: expected a JSON list of row objects (or {{"data": [...]}})')
    yield from _checked(path, data, 0)


def _checked(path: str, rows: list, first: int) -> Iterator[tuple[str, dict]]:
    for i, row in enumerate(rows, first):
        if not isinstance(row, dict):
            raise DataError(f"{path}[row {i}]: expected an object, got {type(row).__name__}")
        yield f"{path}[row {i}]", row


def _parquet_rows(path: str) -> Iterator[tuple[str, dict]]:
    import pyarrow.parquet as pq

    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=BATCH_ROWS)
        first = 0
        for batch in batches:
            rows = batch.to_pylist()
            yield from _checked(path, rows, first)
            first += len(rows)
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - pyarrow's several error types
        raise DataError(f"{path}: not a readable Parquet file ({type(e).__name__})") from None


def _datasets_rows(path: str) -> Iterator[tuple[str, dict]]:
    import datasets

    if is_hub_dataset(path):
        ds = hub_dataset(path)
    else:
        try:
            ds = datasets.load_from_disk(path)  # memory-mapped Arrow
        except Exception as e:  # noqa: BLE001 - datasets raises several types
            raise DataError(f"{path}: not a dataset saved with datasets.save_to_disk ({type(e).__name__})") from None
    if not isinstance(ds, datasets.Dataset):
        raise DataError(f"{path}: a DatasetDict; name one split's directory (e.g. {path}/train)")
    first = 0
    for batch in ds.iter(batch_size=BATCH_ROWS):
        keys = list(batch)
        rows = [dict(zip(keys, values, strict=True)) for values in zip(*(batch[k] for k in keys), strict=True)]
        yield from _checked(path, rows, first)
        first += len(rows)


class JsonlLines:
    """A chunk of one JSONL file's raw lines: parsed where it is tokenized (a worker process), not where it is
    read, so the reading process only splits lines."""

    def __init__(self, path: str, lines: list[tuple[int, bytes]]):
        self.path, self.lines = path, lines

    def __len__(self) -> int:
        return len(self.lines)

    def rows(self) -> list[tuple[str, dict]]:
        return [
            (f"{self.path}:{n}", row)
            for n, raw in self.lines
            if (row := parse_jsonl_line(raw, self.path, n)) is not None
        ]


def iter_chunks(path: str, size: int) -> Iterator[list[tuple[str, dict]] | JsonlLines]:
    """The rows of one source in chunks of `size` rows (the last chunk of each file may be shorter): JSONL files
    as raw lines (`JsonlLines`), other formats as parsed (location, row) pairs."""
    if is_hub_dataset(path) or (os.path.isdir(path) and _is_datasets_dir(path)):
        yield from _chunked(_datasets_rows(path), size)
        return
    for file in shard_files(path):
        if not file.endswith(".jsonl"):
            yield from _chunked(_json_rows(file) if file.endswith(".json") else _parquet_rows(file), size)
            continue
        try:
            with open(file, "rb") as f:
                lines = []
                for n, raw in enumerate(f, 1):
                    if raw.strip():
                        lines.append((n, raw))
                        if len(lines) == size:
                            yield JsonlLines(file, lines)
                            lines = []
                if lines:
                    yield JsonlLines(file, lines)
        except OSError as e:
            raise DataError(f"{file}: cannot read data file ({e.strerror})") from None


def _chunked(rows: Iterator[tuple[str, dict]], size: int) -> Iterator[list[tuple[str, dict]]]:
    chunk = []
    for item in rows:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def iter_rows(path: str) -> Iterator[tuple[str, dict]]:
    """(location for messages, row) of one source, in order, streamed (see the module docstring)."""
    for chunk in iter_chunks(path, BATCH_ROWS):
        yield from chunk.rows() if isinstance(chunk, JsonlLines) else chunk


def count_source(path: str) -> int:
    """Row count of one source, cheaply: JSONL lines, Parquet metadata, the datasets' own count."""
    if is_hub_dataset(path):
        return hub_dataset(path).num_rows
    if os.path.isdir(path) and _is_datasets_dir(path):
        import datasets

        try:
            return datasets.load_from_disk(path).num_rows
        except Exception as e:  # noqa: BLE001 - datasets raises several types
            raise DataError(f"{path}: not a dataset saved with datasets.save_to_disk ({type(e).__name__})") from None
    total = 0
    for file in shard_files(path):
        if file.endswith(".jsonl"):
            try:
                with open(file, "rb") as f:
                    total += sum(1 for line in f if line.strip())
            except OSError as e:
                raise DataError(f"{file}: cannot read data file ({e.strerror})") from None
        elif file.endswith(".parquet"):
            import pyarrow.parquet as pq

            try:
                total += pq.ParquetFile(file).metadata.num_rows
            except Exception as e:  # noqa: BLE001 - pyarrow's several error types
                raise DataError(f"{file}: not a readable Parquet file ({type(e).__name__})") from None
        else:
            total += sum(1 for _ in _json_rows(file))
    return total


def count_rows(spec) -> int:
    """Rows of `train_file`/`eval_file` (one path or several; a mixture keeps the total)."""
    return sum(count_source(p) for p in paths_of(spec))


def write_jsonl(path: str, rows: list[dict]) -> str:
    """Write rows as a JSONL data file (one JSON object per line); returns `path`."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def mixture_index(counts: list[int], weights: list[float] | None, seed: int) -> np.ndarray | None:
    """Rows of the sources concatenated (source i's row j is row sum(counts[:i]) + j) that a mixture by
    `weights` takes, in order (int64 array); None without weights (the concatenation itself)."""
    if weights is None:
        return None
    if len(weights) != len(counts) or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise DataError(f"data.train_weights={weights}: need one weight >= 0 per train file, not all 0")
    total, norm = sum(counts), sum(weights)
    quotas = [round(total * w / norm) for w in weights]
    quotas[max(range(len(quotas)), key=lambda s: weights[s])] += total - sum(quotas)  # rounding remainder
    starts = np.concatenate([[0], np.cumsum(counts)])
    picks = []
    for s, (n, quota) in enumerate(zip(counts, quotas, strict=True)):
        if quota and not n:
            raise DataError(f"data.train_weights: source {s} has weight {weights[s]} but no rows")
        if not quota:
            continue
        rng = np.random.default_rng([seed, s])
        rounds = -(-quota // n)  # whole shuffles of the source, the last one cut: no row repeats early
        drawn = np.concatenate([rng.permutation(n) for _ in range(rounds)])[:quota]
        picks.append(starts[s] + drawn)
    return np.concatenate(picks).astype(np.int64) if picks else np.zeros(0, dtype=np.int64)
