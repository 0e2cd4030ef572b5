"""Hugging Face Hub ids for models, tokenizers and datasets (common/hub.py, data/sources.py), without network: each
test writes a hub cache in huggingface_hub's own layout (blobs, snapshots of links, refs/main) and runs offline."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from checkpoint.layer_files import load_layer_state
from tests.conftest import check, launch, read_jsonl, run_cmd
from tests.test_training import layout_args, layout_run


def write_hub_cache(home: Path, repo: str, files: dict[str, bytes], repo_type: str = "model") -> str:
    """`files` (name -> bytes) as huggingface_hub caches a download of `repo` under HF_HOME=`home`; returns the
    snapshot directory."""
    root = home / "hub" / f"{repo_type}s--{repo.replace('/', '--')}"
    commit = hashlib.sha1(repo.encode()).hexdigest()
    for name, data in files.items():
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = root / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    return str(root / "snapshots" / commit)


def directory_files(path: str) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in Path(path).iterdir() if p.is_file()}


@pytest.fixture
def offline_hub(tmp_path, monkeypatch, hf_models) -> Path:
    """HF_HOME with `org/tiny` (the gqa test model with its tokenizer) in its cache; HF_HUB_OFFLINE=1."""
    home = tmp_path / "hf_home"
    write_hub_cache(home, "org/tiny", directory_files(hf_models["gqa"]))
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    return home


def layer_tensors(ckpt: str) -> dict:
    step = Path(ckpt) / (Path(ckpt) / "latest").read_text().strip()
    return {f"{f.name}:{k}": v for f in sorted(step.glob("layer_*")) for k, v in load_layer_state(str(f)).items()}


def test_a_hub_id_converts_and_verifies_like_its_directory(offline_hub, converted, tmp_path):
    out = tmp_path / "from_hub"
    check(run_cmd([sys.executable, "convert2ckpt.py", "--input", "org/tiny", "--output", str(out)]))
    hub, local = layer_tensors(str(out)), layer_tensors(converted["gqa"])
    assert hub.keys() == local.keys() and all(torch.equal(hub[k], local[k]) for k in hub)
    verify = check(run_cmd([sys.executable, "convert2ckpt.py", "--verify", str(out), "--against", "org/tiny"]))
    assert "max |logit difference| against" in verify.stdout and verify.stdout.rstrip().endswith(": 0")


def test_an_id_not_in_the_cache_offline_or_without_safetensors_is_one_line(offline_hub, hf_models, tmp_path):
    proc = run_cmd([sys.executable, "convert2ckpt.py", "--input", "org/absent", "--output", str(tmp_path / "x")])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("convert2ckpt: error: --input org/absent: not in the Hugging Face cache (")
    assert "HF_HUB_OFFLINE=1" in lines[0] and not (tmp_path / "x").exists()
    pickled = {n: b for n, b in directory_files(hf_models["gqa"]).items() if not n.startswith("model")}
    write_hub_cache(offline_hub, "org/pickled", {**pickled, "pytorch_model.bin": b"not loaded"})
    proc = run_cmd([sys.executable, "convert2ckpt.py", "--input", "org/pickled", "--output", str(tmp_path / "y")])
    assert proc.returncode == 2 and "--input org/pickled: no safetensors weights in the repository" in proc.stderr


def test_tokenizer_and_dataset_ids_in_data_prepare(offline_hub, hf_models, sft_data, tmp_path):
    """`python -m data.prepare` with a tokenizer id and a dataset id builds the store that the local tokenizer
    directory and the same rows as a local file build: the same arrays, byte for byte."""
    from training.prepare import main

    write_hub_cache(offline_hub, "org/adds", {"train.jsonl": Path(sft_data[0]).read_bytes()}, repo_type="dataset")
    stores = {}
    for name, tok, data in (
        ("hub", "org/tiny", "hf://datasets/org/adds@train"),
        ("local", hf_models["gqa"], sft_data[0]),
    ):
        cache = tmp_path / f"cache_{name}"
        args = [f"model_name_or_path={tok}", f"train_file={data}", f"data.cache_dir={cache}", "seq_length=16"]
        assert main(args) == 0
        stores[name] = {p.name: p.read_bytes() for p in cache.rglob("*") if p.suffix in (".bin", ".npy")}
    assert "tokens.bin" in stores["hub"] and stores["hub"] == stores["local"]
    with pytest.raises(Exception, match="hf://datasets/org/adds@test: datasets cannot load it"):
        from data.sources import count_source

        count_source("hf://datasets/org/adds@test")


@pytest.mark.slow
def test_hub_ids_train_like_local_directories(offline_hub, converted, sft_data, tmp_path, tmp_path_factory):
    """PP=2 x DP=2 with model_name_or_path=org/tiny (converted at load; its tokenizer) and
    train_file=hf://datasets/org/adds: every step and the evaluation equal the run from convert2ckpt.py's checkpoint
    of the same model on the same rows as a local file (test_training.py's gqa-pp2-dp2 layout run)."""
    write_hub_cache(offline_hub, "org/adds", {"train.jsonl": Path(sft_data[0]).read_bytes()}, repo_type="dataset")
    direct, out = Path(layout_run("gqa-pp2-dp2", converted, sft_data, tmp_path_factory)), tmp_path / "hub"
    more = {"model_name_or_path": "org/tiny", "train_file": "hf://datasets/org/adds"}
    proc = check(launch(4, *layout_args("gqa-pp2-dp2", converted, sft_data, str(out), **more)))
    assert "model_name_or_path org/tiny: " in proc.stderr and (out / "hf_converted" / "conversion.json").exists()
    timing = ("tokens_per_second", "padded_tokens_per_second", "step_seconds", "save_seconds", "rss_before_step_gib")
    timing += ("peak_rss_gib",)  # host memory: measured, not reproduced
    a, b = read_jsonl(direct / "metrics.jsonl"), read_jsonl(out / "metrics.jsonl")
    assert a and [{k: v for k, v in m.items() if k not in timing} for m in a] == [
        {k: v for k, v in m.items() if k not in timing} for m in b
    ]
    assert json.load(open(direct / "eval_results.json")) == json.load(open(out / "eval_results.json"))


def test_one_id_as_tokenizer_and_model_is_fetched_with_its_weights(offline_hub, hf_models):
    """The resolution a job records for a tokenizer (no weights fetched) is not reused for the same id as a model:
    a cached snapshot without safetensors is refused for the model, with its one line."""
    from common.hub import HubError, resolve_once

    tokenizer_only = {n: b for n, b in directory_files(hf_models["gqa"]).items() if not n.startswith("model")}
    snapshot = write_hub_cache(offline_hub, "org/tok", tokenizer_only)
    assert resolve_once("org/tok", "tokenizer_name_or_path", "job", weights=False) == snapshot
    with pytest.raises(HubError, match="model_name_or_path org/tok: no safetensors weights in the repository"):
        resolve_once("org/tok", "model_name_or_path", "job", weights=True)
    assert resolve_once("org/tiny", "model_name_or_path", "job") == resolve_once("org/tiny", "x", "job", weights=False)


def test_fetches_take_data_files_by_kind_never_code():
    """The allow-list names file kinds, so a repository's `tokenizer.py` (or `vocab.py`, `merges.py`) is never fetched;
    every file conversion and tokenizers read is."""
    import fnmatch

    from common.hub import CODE, FETCHED

    def fetched(name):
        return any(fnmatch.fnmatch(name, p) for p in FETCHED) and not any(fnmatch.fnmatch(name, p) for p in CODE)

    data = ["config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "tokenizer.model.v3"]
    data += ["vocab.json", "vocab.txt", "merges.txt", "spiece.model", "qwen.tiktoken", "chat_template.jinja"]
    data += ["model-00001-of-00002.safetensors", "model.safetensors.index.json", "special_tokens_map.json"]
    code = ["tokenizer.py", "tokenization_evil.py", "vocab.py", "merges.py", "modeling_x.py", "tokenizer.pyc"]
    assert all(fetched(n) for n in data) and not any(fetched(n) for n in code)


def test_a_tokenizer_needing_the_repositorys_code_is_one_line_and_never_run(offline_hub, hf_models, tmp_path):
    """A snapshot with a `tokenizer.py` that its tokenizer_config.json's `auto_map` points at: loading it is refused
    in one line and the file never runs (it would write a marker)."""
    from common.hub import resolve
    from models.tokenizer import load_tokenizer

    marker = tmp_path / "ran"
    files = {n: b for n, b in directory_files(hf_models["gqa"]).items() if not n.startswith("model")}
    config = json.loads(files["tokenizer_config.json"])
    config["auto_map"] = {"AutoTokenizer": ["tokenizer.EvilTokenizer", None]}
    config.pop("tokenizer_class", None)
    files["tokenizer_config.json"] = json.dumps(config).encode()
    files["tokenizer.py"] = f"open({str(marker)!r}, 'w').write('ran')\n".encode()
    write_hub_cache(offline_hub, "org/code", files)
    path = resolve("org/code", "tokenizer_name_or_path", weights=False)
    with pytest.raises(ValueError) as refused:
        load_tokenizer(path)
    assert str(refused.value).startswith(f"tokenizer_name_or_path {path}: cannot load the tokenizer (")
    assert "\n" not in str(refused.value) and not marker.exists()


def test_a_resolution_marker_pointing_outside_the_cache_is_not_followed(offline_hub, hf_models, tmp_path):
    """Whoever can write the cache's `.locks` cannot redirect a run: a marker naming a directory outside the hub
    cache (with weights in it) is ignored and the id resolved again to its snapshot."""
    import glob

    from common.hub import resolve_once

    snapshot = resolve_once("org/tiny", "model_name_or_path", "job")
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(hf_models["mha"], elsewhere)
    (marker,) = glob.glob(str(offline_hub / "hub" / ".locks" / "trainer-*.resolved"))
    Path(marker).write_text(str(elsewhere))
    assert resolve_once("org/tiny", "model_name_or_path", "job") == snapshot


def test_a_dataset_falls_back_to_the_cache_only_when_the_hub_cannot_be_reached(monkeypatch):
    """Online, a wrong split (any error but an unreachable Hub) is one line; it never falls back to the repository's
    snapshot, which would download all of it. An unreachable Hub reads the snapshot already cached, downloading
    nothing."""
    import datasets

    import common.hub
    from data import sources
    from data.errors import DataError

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    taken = []
    monkeypatch.setattr(common.hub, "snapshot", lambda *a, **k: taken.append(k) or "/nonexistent")

    def wrong_split(*_args, **_kwargs):
        raise ValueError("Unknown split \"tset\". Should be one of ['train'].\nmore lines")

    monkeypatch.setattr(datasets, "load_dataset", wrong_split)
    with pytest.raises(DataError, match=r"^hf://datasets/org/x@tset: datasets cannot load it \(ValueError: Unknown"):
        sources.hub_dataset("hf://datasets/org/x@tset")
    assert taken == []

    def unreachable(*_args, **_kwargs):
        raise ConnectionError("Couldn't reach 'org/y' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", lambda name, *a, **k: unreachable() if name == "org/y" else "rows")
    assert sources.hub_dataset("hf://datasets/org/y") == "rows"
    assert taken == [{"repo_type": "dataset", "local_only": True}]
