"""Instrumented multi-rank runs of the real Trainer: who builds, reads and trains what."""

from __future__ import annotations

import json
import os

import pytest

from checkpoint.names import layer_file_name
from data.dataset import TokenizedDataset
from schema.data import DataConfig
from tests.conftest import built_once, check, shared_path, torchrun

pytestmark = pytest.mark.slow  # launches the trainer on several ranks


def run(tmp_path, ckpt, data, num_stages, extra=()):
    out = tmp_path / "records"
    out.mkdir(parents=True, exist_ok=True)
    overrides = [
        f"model_name_or_path={ckpt}",
        f"output_dir={tmp_path / 'run'}",
        f"num_stages={num_stages}",
        f"train_file={data[0]}",
        f"eval_file={data[1]}",
        "max_steps=3",
        "seq_length=16",
        "micro_batch_size=2",
        "gradient_accumulation_steps=2",
        "eval_micro_batch_size=3",
        "deepspeed=fp32",
        *extra,
    ]
    check(torchrun("tests/workers/instrumented_run.py", 4, str(out), *overrides))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


LAYOUTS = {4: "uniform", 2: "[1,3]"}  # num_stages -> model.partition


@pytest.fixture
def records(converted, sft_data, tmp_path_factory):
    """num_stages -> (per-rank records, run directory): one instrumented 4-rank launch per layout for the whole
    session (by whichever pytest worker needs it first), shared by the tests below (each asserts other things
    about the same run)."""

    def get(num_stages: int):
        tmp = shared_path(tmp_path_factory, f"instrumented_pp{num_stages}")
        partition = LAYOUTS[num_stages]
        built_once(tmp, lambda: run(tmp, converted["gqa"], sft_data, num_stages, [f"model.partition={partition}"]))
        return [json.loads((tmp / "records" / f"rank{r}.json").read_text()) for r in range(4)], tmp

    return get


@pytest.mark.parametrize("num_stages", list(LAYOUTS))
def test_each_rank_builds_and_reads_only_its_stage(num_stages, records, sft_data, tokenizer_dir):
    recs, tmp_path = records(num_stages)
    dp = 4 // num_stages
    per_stage = [1, 1, 1, 1] if num_stages == 4 else [1, 3]
    for r in recs:
        blocks = list(range(sum(per_stage[: r["stage"]]), sum(per_stage[: r["stage"] + 1])))
        assert r["decoder_built"] == blocks, r
        files = {layer_file_name(i) for i in r["local_layers"]}
        assert set(r["files_loaded"]) == files, r  # its own layer files, each once, nothing else
        assert len(r["files_loaded"]) == len(files)
        assert r["steps"] == 3 and r["shm_op"] is False  # (training/distributed.py `_without_shm_all_reduce`)
        middle = 0 < r["stage"] < num_stages - 1
        if middle:
            assert r["data_opens"] == [] and r["rows"] == {} and r["dataset"] == "PlaceholderDataset", r
        elif r["rank"] == 0:  # tokenizes and fills output_dir/data_cache
            assert set(r["data_opens"]) == {"train.jsonl", "eval.jsonl"} and r["dataset"] == "TokenizedDataset"
            assert r["from_cache"] is False
        else:  # the other first/last-stage ranks load rank 0's cache: the data files are not read again
            assert r["data_opens"] == [] and r["dataset"] == "TokenizedDataset" and r["from_cache"] is True, r
    # Outputs: metrics for every step, eval over every target token of the eval file.
    from transformers import AutoTokenizer

    metrics = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all({"loss", "lr", "grad_norm", "tokens_per_second"} <= set(m) for m in metrics)
    results = json.load(open(tmp_path / "run" / "eval_results.json"))
    eval_set = TokenizedDataset(sft_data[1], AutoTokenizer.from_pretrained(tokenizer_dir), 16, DataConfig())
    assert results["eval_tokens"] == eval_set.target_tokens()
    assert results["perplexity"] == pytest.approx(2.718281828 ** results["eval_loss"])
    # Every (stage, DP rank) of the PP x DP grid is held by exactly one rank.
    assert sorted((r["stage"], r["dp_rank"]) for r in recs) == [(s, d) for s in range(num_stages) for d in range(dp)]


def test_dp_ranks_see_disjoint_rows_and_eval_sees_every_row_once(records):
    recs, tmp_path = records(2)  # PP=2 x DP=2
    by = {(r["stage"], r["dp_rank"]): r["rows"] for r in recs}
    for d in range(2):  # first and last stage of a replica read the same rows in the same order
        assert by[(0, d)] == by[(1, d)]
    train0, train1 = by[(0, 0)]["train.jsonl"], by[(0, 1)]["train.jsonl"]
    assert len(train0) == len(train1) == 3 * 2 * 2 and not set(train0) & set(train1)
    evals = [i for d in range(2) for i in by[(0, d)]["eval.jsonl"] if i != -1]
    assert sorted(evals) == list(range(37))  # 37 rows, each exactly once across DP ranks
    assert len(by[(0, 0)]["eval.jsonl"]) == len(by[(0, 1)]["eval.jsonl"])
    assert os.path.exists(tmp_path / "run" / "global_step3")
