"""Hugging Face Hub ids wherever a model, checkpoint or tokenizer directory is taken.

`convert2ckpt.py --input Qwen/Qwen3-8B`, `--against`, `model_name_or_path=`, `tokenizer_name_or_path=` and
`dpo.reference_model=` accept `ORG/NAME` where no such local path exists (a local directory always wins, as in
transformers). The id is resolved by `huggingface_hub` itself: its cache (`HF_HOME`, `HF_HUB_CACHE`), offline mode
(`HF_HUB_OFFLINE=1`: the cache only), token (`HF_TOKEN`, `hf auth login`), a revision, and its progress bars. Only
what conversion and tokenizers read is fetched, by file kind (`FETCHED`): JSON, safetensors, tokenizer models and
vocabularies, chat templates; never pickled weights (`*.bin`, `*.pt`) and never code (`*.py`). A repository without
safetensors weights, a gated, private or missing one, and an id not in the cache offline are one line naming the id.

A training run resolves each id once per hub cache: the first rank to take the cache's lock downloads, the others
then reuse its answer (training/assembly.py), if that answer is a snapshot inside the cache. Dataset ids
(`hf://datasets/...`) are read in data/sources.py.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import re

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9_]")  # ORG/NAME, as the Hub names repositories
# What a model or tokenizer fetch takes, by file kind only (never a prefix such as `tokenizer*`, which a repository's
# `tokenizer.py` matches): configs, weights, tokenizer models (sentencepiece `.model`, Mistral's `tokenizer.model.v3`)
# and vocabularies (`vocab.json`, `vocab.txt`, `merges.txt`, `.tiktoken`, sentencepiece `.vocab`), chat templates.
FETCHED = ["*.json", "*.safetensors", "*.model", "*.model.v[0-9]", "*.txt", "*.tiktoken", "*.vocab", "*.jinja"]
CODE = ("*.py", "*.pyc", "*.so", "*.sh")  # never fetched, whatever the allow-list says
PICKLES = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")


class HubError(Exception):
    """An id the Hub or its cache cannot give: one line naming it."""


def is_hub_id(value: str | None) -> bool:
    """`ORG/NAME` that names no local path."""
    return bool(value) and HUB_ID.fullmatch(value) is not None and not os.path.exists(value)


def offline() -> bool:
    """HF_HUB_OFFLINE, read when called."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def _home() -> str:
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return os.path.expanduser(os.path.expandvars(home))


def _cache_dir() -> str:
    """The hub cache as huggingface_hub computes it, read when called (not when the library was imported)."""
    path = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE") or os.path.join(_home(), "hub")
    return os.path.expanduser(os.path.expandvars(path))


def datasets_cache_dir() -> str:
    """The `datasets` Arrow cache as that library computes it, read when called."""
    return os.path.expanduser(
        os.path.expandvars(os.environ.get("HF_DATASETS_CACHE") or os.path.join(_home(), "datasets"))
    )


def resolve(value: str | None, what: str, revision: str | None = None, weights: bool = True):
    """The local directory of `value`: itself, or the Hub snapshot of the id `value` (downloaded if needed).

    Args:
        what: the key or flag that named it, for messages (`model_name_or_path`, `--input`).
        weights: fetch safetensors weights and require them (a model); False: the tokenizer and configs only.
    Raises:
        HubError: one line naming the id (missing, gated, offline and not cached, pickled weights only).
    """
    if not is_hub_id(value):
        return value
    patterns = FETCHED if weights else [p for p in FETCHED if p != "*.safetensors"]
    path = snapshot(value, what, revision, allow=patterns)
    if weights and not _has(path, "*.safetensors"):
        at = f"{what} {value}" + (f"@{revision}" if revision else "")
        pickled = [] if offline() else _pickled_weights(value, revision)
        found = f" (it has {', '.join(pickled[:3])}: pickled weights are never loaded)" if pickled else ""
        raise HubError(f"{at}: no safetensors weights in the repository{found}")
    return path


def snapshot(
    repo: str, what: str, revision: str | None = None, allow=None, repo_type: str = "model", local_only: bool = False
) -> str:
    """The local snapshot directory of Hub repository `repo` (`huggingface_hub.snapshot_download`): `allow`ed
    files only (None: every file but code and pickles); `local_only`: the cache's, never a download. Raises HubError
    (one line naming the id)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f"{what} {repo}" + (f"@{revision}" if revision else "")
    try:
        return snapshot_download(
            repo,
            repo_type=repo_type,
            revision=revision,
            cache_dir=_cache_dir(),
            local_files_only=offline() or local_only,
            allow_patterns=allow,
            # (a consolidated copy of the sharded weights, e.g. Mistral's, and originals beside them: not read)
            ignore_patterns=[*CODE, *PICKLES, *(["consolidated*", "original/*"] if allow else [])],
        )
    except GatedRepoError:
        raise HubError(
            f"{at}: a gated repository; accept its terms on huggingface.co and log in (hf auth login, or HF_TOKEN)"
        ) from None
    except RepositoryNotFoundError:
        raise HubError(
            f"{at}: no such repository on the Hugging Face Hub (a private one needs HF_TOKEN), and no local path"
        ) from None
    except RevisionNotFoundError:
        raise HubError(f"{at}: no such revision on the Hugging Face Hub") from None
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE=1" if offline() else "the Hub could not be reached"
        raise HubError(
            f"{at}: not in the Hugging Face cache ({_cache_dir()}) and {why}: download it once online, "
            "or name a local directory"
        ) from None
    except Exception as e:  # noqa: BLE001 - HfHubHTTPError, OSError and the HTTP client's own transport errors
        why = (str(e).splitlines() or [type(e).__name__])[0]
        raise HubError(f"{at}: cannot download from the Hugging Face Hub ({type(e).__name__}: {why})") from None


def resolve_once(value: str | None, what: str, job: str, revision: str | None = None, weights: bool = True):
    """`resolve()` for the ranks of one job (`job`: its key): the first rank to take the cache's lock for the id
    resolves it (downloading), the others wait on the lock and reuse its answer, so a node downloads once."""
    if not is_hub_id(value):
        return value
    from filelock import FileLock

    locks = os.path.join(_cache_dir(), ".locks")
    name = hashlib.sha256(f"{job}\0{value}\0{revision}\0{weights}".encode()).hexdigest()[:16]
    marker = os.path.join(locks, f"trainer-{name}.resolved")
    try:
        os.makedirs(locks, exist_ok=True)
        lock = FileLock(marker + ".lock")
        lock.acquire()
    except OSError:  # a read-only cache (filled beforehand, HF_HUB_OFFLINE=1): every rank reads it itself
        return resolve(value, what, revision, weights)
    try:
        if os.path.exists(marker):
            with open(marker) as f:
                path = f.read()
            # a snapshot of the cache only: whoever can write the cache's .locks must not redirect a run elsewhere
            if in_cache(path) and os.path.isdir(path) and (not weights or _has(path, "*.safetensors")):
                return path
        path = resolve(value, what, revision, weights)
        with open(marker + ".tmp", "w") as f:
            f.write(path)
        os.replace(marker + ".tmp", marker)
        return path
    finally:
        lock.release()


def unreachable(error: BaseException) -> bool:
    """Whether `error` (or what it was raised from) says the Hub could not be reached: a connection or timeout
    error, offline mode, a file not in the cache; not a wrong split, config or file."""
    from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled

    kinds = (ConnectionError, TimeoutError, LocalEntryNotFoundError, OfflineModeIsEnabled)
    transport = ("ConnectError", "ConnectTimeout", "ReadTimeout", "TransportError", "Timeout", "gaierror")
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, kinds) or type(error).__name__ in transport:
            return True
        error = error.__cause__ or error.__context__
    return False


def snapshot_repository(path: str) -> str | None:
    """The repository directory of `path` (symlinks resolved) if it is a snapshot in huggingface_hub's cache layout
    (`<cache>/models--ORG--NAME/snapshots/<commit>`, whose files link into the repository's `blobs`), else None."""
    real = os.path.realpath(path)
    parent = os.path.dirname(real)
    return os.path.dirname(parent) if os.path.basename(parent) == "snapshots" else None


def snapshot_hub_id(path: str) -> str | None:
    """The hub id ORG/NAME of a snapshot directory in huggingface_hub's cache layout
    (`.../models--ORG--NAME/snapshots/<commit>`: the cache writes the id's "/" as "--", which ids never hold), else
    None. What a run that named a hub id records of it, since the ranks read the snapshot."""
    repository = snapshot_repository(path)
    kind, _, name = os.path.basename(repository or "").partition("--")
    return name.replace("--", "/") if kind == "models" and name else None


def in_cache(path: str) -> bool:
    """Whether `path` is a snapshot directory of a repository in the hub cache."""
    repository = snapshot_repository(path)
    return repository is not None and os.path.dirname(repository) == os.path.realpath(_cache_dir())


def _has(path: str, pattern: str) -> bool:
    return any(fnmatch.fnmatch(name, pattern) for _, _, names in os.walk(path) for name in names)


def _pickled_weights(repo: str, revision: str | None) -> list[str]:
    """The repository's pickled weight files (to say why it is refused); empty where the Hub cannot be asked."""
    try:
        from huggingface_hub import list_repo_files

        files = list_repo_files(repo, revision=revision)
    except Exception:  # noqa: BLE001 - only for the message
        return []
    return [f for f in files if any(fnmatch.fnmatch(f, p) for p in PICKLES)]
