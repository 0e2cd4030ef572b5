"""Where rows come from: JSONL, JSON, Parquet files and directories saved with Hugging Face
`datasets` (`Dataset.save_to_disk`), alone or several mixed with weights.

`train_file` is one path or a list of paths; with `data.train_weights` (one weight per path) the
training set is a mixture: it keeps the total row count of the sources (so an epoch is as long as
the data), and source i provides round(total x w_i / sum(w)) of those rows, drawn without
replacement and reshuffled before any row repeats. The mixture is a function of the row counts, the
weights and the seed only, so every rank builds the same one.
"""

from __future__ import annotations

import json
import os
import random

from data.errors import DataError

FORMATS = (".jsonl", ".json", ".parquet")


def paths_of(spec) -> list[str]:
    """`train_file`/`eval_file` as a list of paths."""
    if spec is None:
        return []
    paths = [spec] if isinstance(spec, str) else list(spec)
    if not paths or not all(isinstance(p, str) and p for p in paths):
        raise DataError(f"data files {spec!r}: expected a path or a list of paths")
    return paths


def _check_format(path: str) -> None:
    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, "dataset_info.json")) and os.path.exists(
            os.path.join(path, "dataset_dict.json")
        ):
            raise DataError(f"{path}: a DatasetDict; name one split's directory (e.g. {path}/train)")
        return
    if not path.endswith(FORMATS):
        raise DataError(f"{path}: unknown data format (expected {', '.join(FORMATS)} or a datasets directory)")
    if not os.path.exists(path):
        raise DataError(f"{path}: cannot read data file (No such file or directory)")


def read_jsonl(path: str) -> list[tuple[int, dict]]:
    """[(line number, row)] for every non-blank line. A UTF-8 byte-order mark (Windows tools write one) is skipped."""
    rows = []
    try:
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                row = parse_jsonl_line(raw, path, lineno)
                if row is not None:
                    rows.append((lineno, row))
    except OSError as e:
        raise DataError(f"{path}: cannot read data file ({e.strerror})") from None
    if not rows:
        raise DataError(f"{path}: empty dataset (no rows)")
    return rows


def parse_jsonl_line(raw: bytes, path: str, lineno: int) -> dict | None:
    """One JSONL line (bytes) as a row, None when blank; DataError naming file and line otherwise."""
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


def write_jsonl(path: str, rows: list[dict]) -> str:
    """Write rows as a JSONL data file (one JSON object per line); returns `path`."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def count_source(path: str) -> int:
    """Row count of one source, cheaply: JSONL lines, Parquet metadata, the datasets' own count."""
    _check_format(path)
    if path.endswith(".jsonl"):
        try:
            with open(path, "rb") as f:
                return sum(1 for line in f if line.strip())
        except OSError as e:
            raise DataError(f"{path}: cannot read data file ({e.strerror})") from None
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(path).metadata.num_rows
        except Exception as e:  # noqa: BLE001 - pyarrow's several error types
            raise DataError(f"{path}: not a readable Parquet file ({type(e).__name__})") from None
    if os.path.isdir(path):
        import datasets

        try:
            return datasets.load_from_disk(path).num_rows
        except Exception as e:  # noqa: BLE001 - datasets raises several types
            raise DataError(f"{path}: not a dataset saved with datasets.save_to_disk ({type(e).__name__})") from None
    return len(read_source(path))


def read_source(path: str) -> list[tuple[str, dict]]:
    """[(location for messages, row)] of one source."""
    _check_format(path)
    if path.endswith(".jsonl"):
        return [(f"{path}:{lineno}", row) for lineno, row in read_jsonl(path)]
    if path.endswith(".json"):
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
        rows = data
    elif path.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:  # noqa: BLE001
            raise DataError(f"{path}: not a readable Parquet file ({type(e).__name__})") from None
    else:
        import datasets

        try:
            rows = datasets.load_from_disk(path).to_list()
        except Exception as e:  # noqa: BLE001 - datasets raises several types
            raise DataError(f"{path}: not a dataset saved with datasets.save_to_disk ({type(e).__name__})") from None
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(f"{path}[row {i}]: expected an object, got {type(row).__name__}")
        out.append((f"{path}[row {i}]", row))
    if not out:
        raise DataError(f"{path}: empty dataset (no rows)")
    return out


def mixture(counts: list[int], weights: list[float] | None, seed: int) -> list[tuple[int, int]]:
    """(source, row) pairs: the sources concatenated, or mixed by `weights` (see the module docstring)."""
    if weights is None:
        return [(s, i) for s, n in enumerate(counts) for i in range(n)]
    if len(weights) != len(counts) or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise DataError(f"data.train_weights={weights}: need one weight >= 0 per train file, not all 0")
    total, norm = sum(counts), sum(weights)
    quotas = [round(total * w / norm) for w in weights]
    quotas[max(range(len(quotas)), key=lambda s: weights[s])] += total - sum(quotas)  # rounding remainder
    picks = []
    for s, (n, quota) in enumerate(zip(counts, quotas, strict=True)):
        if quota and not n:
            raise DataError(f"data.train_weights: source {s} has weight {weights[s]} but no rows")
        rng, drawn = random.Random(seed * 1_000_003 + s), []
        while len(drawn) < quota:
            order = list(range(n))
            rng.shuffle(order)
            drawn.extend(order[: quota - len(drawn)])
        picks.extend((s, i) for i in drawn)
    return picks


def count_rows(spec) -> int:
    """Rows of `train_file`/`eval_file` (one path or several; a mixture keeps the total)."""
    return sum(count_source(p) for p in paths_of(spec))


def read_rows(spec, weights: list[float] | None = None, seed: int = 0) -> list[tuple[str, dict]]:
    """The rows of `spec` in dataset order (concatenated, or mixed by `weights`)."""
    paths = paths_of(spec)
    sources = [read_source(p) for p in paths]
    return [sources[s][i] for s, i in mixture([len(r) for r in sources], weights, seed)]
