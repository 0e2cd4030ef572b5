"""Data at scale: building the tokenized store and launching on it, against the tokenizer alone.

    python -m benchmarks.data_scale --work /tmp/datascale [--rows 200000,1000000] [--workers 2] [--seq 256]

Generates its corpus (no downloads): English-like text from a seeded Zipf draw over a word list, half
`{"text"}` rows and half `{"prompt", "response"}` rows, about 1.3 KB a row (200,000 rows: 250 MiB). Trains a
sentencepiece tokenizer on a sample and writes a tiny 2-layer model with it. Then, for each row count:

- the tokenizer alone: the same texts in batches of 4,096 through `tokenizer(texts)` in `--workers`
  processes (the parent reading the file and handing out chunks, as the store's builder does);
- `python -m data.prepare` building the store with `data.tokenize_workers=--workers`: rows/s and tokens/s
  (tokens before truncation, as the tokenizer alone counts them), and the ratio to the tokenizer alone;
- launches of `deepspeed --num_gpus 2 trainer.py num_stages=2 max_steps=1` (PP=2, 2 ranks): one that builds
  the store and one that finds it (a shared `data.cache_dir`, a fresh `output_dir` each), with the peak private
  memory (RssAnon, polled every 20 ms from /proc) of every rank and of the builder's worker processes, and the
  time from the launch to the first step's metrics line. Memory and time are reported above the same two
  launches on a 2,000-row corpus.

Not a test: timings on a shared machine are noisy; compare figures from one run of this script.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = (
    "the of and to in a is that for it as was with be by on not he this are or his from at which but have "
    "an had they you were their one all we can her has there been if more when will would who so no model "
    "pipeline parallel training data token memory layer stage gradient batch rank tensor sequence length "
    "corpus shard store language large fast slow people time year way day man thing woman life child world "
    "school state family student group country problem hand part place case week company system program "
    "question work government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father power hour "
    "game line end member law car city community name president team minute idea kid body information"
).split()


def corpus(path: str, rows: int, seed: int = 0) -> str:
    """`rows` JSONL rows, half text and half prompt/response, seeded (written once)."""
    if os.path.exists(path):
        return path
    rng = random.Random(seed)
    weights = [1 / (i + 1) for i in range(len(WORDS))]  # Zipf-like, as in real text

    def sentence(n: int) -> str:
        words = rng.choices(WORDS, weights, k=n)
        return " ".join(words).capitalize() + "."

    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        for i in range(rows):
            body = " ".join(sentence(rng.randint(8, 24)) for _ in range(rng.randint(12, 24)))
            if i % 2:
                row = {"prompt": f"Question {i}: {sentence(rng.randint(6, 14))}\nAnswer:", "response": " " + body}
            else:
                row = {"text": body}
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, path)
    return path


def model_dir(work: str) -> str:
    """A tiny 2-layer LLaMA with an 8,000-token sentencepiece tokenizer trained on the corpus's words."""
    from tools.tiny_models import make_hf_model, make_sp_tokenizer, tiny_config

    out = os.path.join(work, "ckpt")
    if os.path.exists(os.path.join(out, "latest")):
        return out
    sample = []
    with open(corpus(os.path.join(work, "rows_2000.jsonl"), 2000)) as f:
        for line in f:
            row = json.loads(line)
            sample.append(row.get("text") or row["prompt"] + row["response"])
    tok = make_sp_tokenizer(os.path.join(work, "tokenizer"), sample, vocab_size=2000, byte_fallback=True)
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(tok))
    hf = make_hf_model(os.path.join(work, "hf"), tiny_config(num_hidden_layers=2, vocab_size=vocab), tokenizer_dir=tok)
    subprocess.run(
        [sys.executable, "convert2ckpt.py", "--input", hf, "--output", out],
        check=True,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
    )
    return out


_TOK = {}


def _tokenize_chunk(lines: list[bytes]) -> tuple[int, int]:
    tok = _TOK["tok"]
    rows = [json.loads(line) for line in lines]
    texts = [r["text"] for r in rows if "text" in r]
    prompts = [r["prompt"] for r in rows if "prompt" in r]
    responses = [r["response"] for r in rows if "prompt" in r]
    n = 0
    for batch, special in ((texts, True), (prompts, True), (responses, False)):
        if batch:
            ids = tok(batch, add_special_tokens=special, return_attention_mask=False)["input_ids"]
            n += sum(len(x) for x in ids)
    return len(rows), n


def tokenizer_alone(path: str, tokenizer_dir: str, workers: int) -> dict:
    """The tokenizer's own batch throughput on the corpus's texts, `workers` processes, chunks of 4,096 rows."""
    import multiprocessing

    from transformers import AutoTokenizer

    _TOK["tok"] = AutoTokenizer.from_pretrained(tokenizer_dir)

    def chunks():
        with open(path, "rb") as f:
            chunk = []
            for line in f:
                chunk.append(line)
                if len(chunk) == 4096:
                    yield chunk
                    chunk = []
            if chunk:
                yield chunk

    start = time.perf_counter()
    if workers <= 1:
        results = [_tokenize_chunk(c) for c in chunks()]
    else:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            results = list(pool.imap(_tokenize_chunk, chunks(), chunksize=1))
    seconds = time.perf_counter() - start
    rows, tokens = sum(r for r, _ in results), sum(t for _, t in results)
    return {"seconds": seconds, "rows": rows, "tokens": tokens, "rows_s": rows / seconds, "tokens_s": tokens / seconds}


def rss_anon(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def rank_of(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
    except OSError:
        return None
    if b"trainer.py" not in cmd or b"RANK" not in env:
        return None
    return env[b"RANK"].decode()


def launch(ckpt: str, data: str, out: str, cache: str, workers: int, seq: int) -> dict:
    """One PP=2 launch of 1 step; peak RssAnon per rank (and of the ranks' worker processes), time to step 1."""
    import psutil

    shutil.rmtree(out, ignore_errors=True)
    overrides = [
        f"model_name_or_path={ckpt}",
        f"output_dir={out}",
        f"train_file={data}",
        "num_stages=2",
        f"seq_length={seq}",
        "micro_batch_size=2",
        "gradient_accumulation_steps=2",
        "max_steps=1",
        "deepspeed=fp32",
        "save_steps=0",
        "save_manifest=false",
        "progress_bar=false",
        f"data.cache_dir={cache}",
        f"data.tokenize_workers={workers}",
    ]
    launcher = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, TOKENIZERS_PARALLELISM="false")
    start = time.perf_counter()
    proc = subprocess.Popen(
        [launcher, "--num_gpus", "2", "trainer.py", *overrides],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    peaks: dict[str, int] = {}
    first_step = [None]
    metrics = os.path.join(out, "metrics.jsonl")

    def watch():
        parent = psutil.Process(proc.pid)
        while proc.poll() is None:
            try:
                procs = parent.children(recursive=True)
            except psutil.Error:
                procs = []
            ranks = {p.pid: rank_of(p.pid) for p in procs}
            for p in procs:
                try:
                    parent_rank = ranks.get(p.ppid())
                except psutil.Error:
                    continue
                if parent_rank is not None:  # forked by a rank (it inherits RANK): a tokenizer worker
                    key = f"rank{parent_rank}_workers"
                elif ranks[p.pid] is not None:
                    key = f"rank{ranks[p.pid]}"
                else:
                    continue
                peaks[key] = max(peaks.get(key, 0), rss_anon(p.pid))
            if first_step[0] is None and os.path.exists(metrics) and os.path.getsize(metrics):
                first_step[0] = time.perf_counter() - start
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    _, stderr = proc.communicate()
    watcher.join()
    if proc.returncode != 0:
        raise RuntimeError(f"launch failed: {stderr[-3000:]}")
    return {"first_step_s": first_step[0], "wall_s": time.perf_counter() - start, "peak_rss_anon": peaks}


def prepare(ckpt: str, data: str, cache: str, workers: int, seq: int) -> float:
    """`python -m data.prepare`: the store's own build time (tokenizing and concatenating, from its meta.json)."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "data.prepare",
            f"model_name_or_path={ckpt}",
            f"train_file={data}",
            f"seq_length={seq}",
            f"data.cache_dir={cache}",
            f"data.tokenize_workers={workers}",
            "output_dir=/nonexistent",
        ],
        check=True,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        env=dict(os.environ, TOKENIZERS_PARALLELISM="false"),
    )
    (store,) = [n for n in os.listdir(cache) if n.startswith("store-") and "." not in n]
    with open(os.path.join(cache, store, "meta.json")) as f:
        return json.load(f)["build_seconds"]


def mib(n: int) -> str:
    return f"{n / 2**20:+,.0f} MiB"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", required=True)
    p.add_argument("--rows", default="200000,1000000")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    args = p.parse_args(argv)
    os.makedirs(args.work, exist_ok=True)
    ckpt = model_dir(args.work)
    results = {}
    base_data = corpus(os.path.join(args.work, "rows_2000.jsonl"), 2000)
    base_cache = os.path.join(args.work, "cache_2000")
    shutil.rmtree(base_cache, ignore_errors=True)
    base = {
        "build": launch(ckpt, base_data, os.path.join(args.work, "run"), base_cache, args.workers, args.seq),
        "cached": launch(ckpt, base_data, os.path.join(args.work, "run"), base_cache, args.workers, args.seq),
    }
    results["2000"] = base
    for rows in [int(r) for r in args.rows.split(",")]:
        data = corpus(os.path.join(args.work, f"rows_{rows}.jsonl"), rows)
        alone = tokenizer_alone(data, os.path.join(args.work, "tokenizer"), args.workers)
        cache = os.path.join(args.work, f"cache_{rows}")
        shutil.rmtree(cache, ignore_errors=True)
        seconds = prepare(ckpt, data, cache, args.workers, args.seq)
        built_rows_s, built_tokens_s = alone["rows"] / seconds, alone["tokens"] / seconds
        shutil.rmtree(cache, ignore_errors=True)
        build = launch(ckpt, data, os.path.join(args.work, "run"), cache, args.workers, args.seq)
        cached = launch(ckpt, data, os.path.join(args.work, "run"), cache, args.workers, args.seq)
        results[str(rows)] = {"tokenizer_alone": alone, "prepare_seconds": seconds, "build": build, "cached": cached}
        size = os.path.getsize(data) / 2**20
        print(
            f"== {rows:,} rows ({size:,.0f} MiB JSONL, {alone['tokens']:,} tokens before truncation), "
            f"{args.workers} process(es)"
        )
        print(f"tokenizer alone: {alone['rows_s']:,.0f} rows/s, {alone['tokens_s']:,.0f} tokens/s")
        print(
            f"data.prepare (store built): {built_rows_s:,.0f} rows/s, {built_tokens_s:,.0f} tokens/s "
            f"in {seconds:.1f}s = {built_rows_s / alone['rows_s']:.2f}x the tokenizer alone"
        )
        for what in ("build", "cached"):
            peaks, ref = results[str(rows)][what]["peak_rss_anon"], base[what]["peak_rss_anon"]
            above = ", ".join(f"{k} {mib(v - ref.get(k, 0))}" for k, v in sorted(peaks.items()))
            print(
                f"launch ({what}): first step {results[str(rows)][what]['first_step_s']:.1f}s "
                f"(2,000 rows: {base[what]['first_step_s']:.1f}s); peak RssAnon above the 2,000-row launch: "
                f"{above}"
            )
    print(
        f"2,000-row launches: peak RssAnon build {base['build']['peak_rss_anon']}, cached "
        f"{base['cached']['peak_rss_anon']} (bytes)"
    )
    with open(os.path.join(args.work, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
