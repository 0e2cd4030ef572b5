"""Conversion and export time and peak memory on a model of a few GB, against `cp` of the same files.

    python -m benchmarks.convert_memory --work /tmp/convbench [--layers 16 --hidden 2048 --dtype bf16 --repeat 5]
    python -m benchmarks.convert_memory --work /tmp/conv7b --layers 32 --hidden 4096 --intermediate 11008 \
        --kv-heads 32 --repeat 3 --cold        # LLaMA-2-7B's shapes, 12.6 GiB, nothing in the page cache
    python -m benchmarks.convert_memory --work /tmp/verbench --layers 16 --hidden 1024 --intermediate 2816 \
        --repeat 1 --verify                    # also `--verify --against`'s peak RSS, each side streamed

Builds (once) a random LLaMA checkpoint with save_pretrained (sharded safetensors), then runs
`convert2ckpt.py` in a child process and reports its wall time and peak RSS (getrusage of the
child), next to the RSS of a child that only imports the same libraries and `cp -r` of the shards; the
export back (`--to-hf`) is timed the same way, after each conversion.
`--cold` empties the page cache before every timed run (root only): each run reads the model, and
its own code, from disk, as the first conversion of a downloaded model does.
`--verify` adds the peak RSS of `convert2ckpt.py --verify` (the manifest alone), of `--verify --against` the
HF directory (both models streamed a layer at a time: checkpoint/compare.py) and of transformers loading the
whole model in fp32 for one forward of the same probe (what `--against` did before).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

from checkpoint.dtypes import DTYPES
from checkpoint.names import CONVERTED_TAG

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_peak_rss(cmd: list[str]) -> tuple[float, float]:
    """(seconds, peak RSS in MiB) of a child process. Runs in a fresh process so peaks don't mix."""
    probe = (
        "import resource, subprocess, sys, time; t = time.perf_counter(); "
        "subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL); "
        "print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)"
    )
    out = subprocess.run([sys.executable, "-c", probe, *cmd], check=True, capture_output=True, text=True, cwd=REPO)
    seconds, rss = out.stdout.split()
    return float(seconds), float(rss)


def settle(cold: bool) -> None:
    """Flush what earlier runs wrote; with `cold`, also empty the page cache (timed runs then read from disk)."""
    subprocess.run(["sync"], check=True)
    if cold:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")


def build_model(
    path: str, layers: int, hidden: int, intermediate: int, vocab: int, dtype: str, heads: int, kv_heads: int
) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    torch.set_default_dtype(DTYPES[dtype])  # built in the stored dtype: a 7B model fits in RAM once
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(torch.float32)
    model.save_pretrained(path, max_shard_size="500MB")


def child_peak_anon(cmd: list[str]) -> tuple[float, float]:
    """(seconds, peak anonymous RSS in MiB) of a child, sampled every 5 ms from /proc: the memory it cannot give
    back, without the pages of the files it maps (safetensors are mmapped; the kernel reclaims those)."""
    t = time.perf_counter()
    child = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL)
    peak = 0
    while child.poll() is None:
        try:
            with open(f"/proc/{child.pid}/status") as f:
                peak = max([peak] + [int(line.split()[1]) for line in f if line.startswith("RssAnon:")])
        except (OSError, ValueError):
            pass
        time.sleep(0.005)
    if child.returncode:
        raise subprocess.CalledProcessError(child.returncode, cmd)
    return time.perf_counter() - t, peak / 1024


def verify_memory(hf: str, ckpt: str, size: float) -> None:
    """Peak memory of `--verify`, of `--verify --against` (streamed) and of the whole fp32 HF model's forward."""
    whole = (
        "import sys, torch; from transformers import AutoModelForCausalLM; "
        "m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32, attn_implementation='eager'); "
        "m(torch.zeros(2, 16, dtype=torch.long))"
    )
    runs = {
        "imports alone": [sys.executable, "-c", "import checkpoint.compare, torch, transformers, accelerate"],
        "convert2ckpt.py --verify (manifest only)": [sys.executable, "convert2ckpt.py", "--verify", ckpt],
        "convert2ckpt.py --verify --against (both streamed)": [
            *[sys.executable, "convert2ckpt.py", "--verify", ckpt, "--against", hf]
        ],
        "the whole HF model in fp32, one forward (--against before)": [sys.executable, "-c", whole, hf],
    }
    for what, cmd in runs.items():
        _, rss = child_peak_rss(cmd)
        seconds, anon = child_peak_anon(cmd)
        print(f"{what}: {seconds:.1f}s, peak anonymous RSS {anon:.0f} MiB, peak RSS {rss:.0f} MiB (with mapped files)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--work", required=True)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--heads", type=int, default=None, help="attention heads (default hidden / 128)")
    p.add_argument("--kv-heads", type=int, default=None, help="KV heads (default hidden / 512)")
    p.add_argument("--repeat", type=int, default=5, help="runs of cp and of each conversion (medians reported)")
    p.add_argument("--cold", action="store_true", help="drop the page cache before every timed run (root)")
    p.add_argument("--verify", action="store_true", help="also measure --verify and --verify --against")
    p.add_argument("--workers", default="1", help="comma-separated worker counts to time, e.g. 1,2,4")
    p.add_argument(
        "--tp",
        default="",
        help="comma-separated tensor-parallel degrees to time (HF -> --tp T, and "
        "the converted TP=1 checkpoint resharded to T), e.g. 2,8",
    )
    args = p.parse_args()
    hf = os.path.join(args.work, "hf")
    if not os.path.exists(os.path.join(hf, "config.json")):
        build_model(
            hf,
            args.layers,
            args.hidden,
            args.intermediate,
            args.vocab,
            args.dtype,
            args.heads or args.hidden // 128,
            args.kv_heads or args.hidden // 512,
        )
    size = sum(os.path.getsize(os.path.join(hf, f)) for f in os.listdir(hf)) / 2**20
    out = os.path.join(args.work, "ckpt")
    copy = os.path.join(args.work, "copy")
    imports = "import checkpoint.convert, torch, transformers, safetensors"
    import_seconds, import_rss = child_peak_rss([sys.executable, "-c", imports])
    exported = os.path.join(args.work, "exported")
    runs, cp_times, exports = {}, [], []
    for _ in range(args.repeat):  # cp and conversion interleaved, each timed to its data on disk (sync)
        shutil.rmtree(copy, ignore_errors=True)
        settle(args.cold)
        t = time.perf_counter()
        subprocess.run(["cp", "-r", hf, copy], check=True)
        subprocess.run(["sync"])
        cp_times.append(time.perf_counter() - t)
        for workers in [int(w) for w in args.workers.split(",")]:
            shutil.rmtree(out, ignore_errors=True)
            settle(args.cold)
            cmd = [sys.executable, "convert2ckpt.py", "--input", hf, "--output", out, "--workers", str(workers)]
            t = time.perf_counter()
            seconds, rss = child_peak_rss(cmd)
            subprocess.run(["sync"])
            runs.setdefault(workers, []).append((time.perf_counter() - t, rss))
        shutil.rmtree(exported, ignore_errors=True)  # export back, from the last conversion, timed the same way
        settle(args.cold)
        t = time.perf_counter()
        _, rss = child_peak_rss([sys.executable, "convert2ckpt.py", "--to-hf", "--input", out, "--output", exported])
        subprocess.run(["sync"])
        exports.append((time.perf_counter() - t, rss))
    cp_seconds = statistics.median(cp_times)
    runs = {w: (statistics.median(s for s, _ in r), max(m for _, m in r)) for w, r in runs.items()}
    step = os.path.join(out, CONVERTED_TAG)
    largest_layer = max(os.path.getsize(os.path.join(step, f)) for f in os.listdir(step)) / 2**20
    with open(os.path.join(hf, "config.json")) as f:
        conf = json.load(f)
    shape = f"{conf['num_hidden_layers']} layers, hidden {conf['hidden_size']}, vocab {conf['vocab_size']}"
    print(f"model on disk: {size:.0f} MiB ({shape}, {conf.get('dtype') or conf.get('torch_dtype')})")
    print(
        f"largest layer file: {largest_layer:.0f} MiB; imports alone: {import_seconds:.1f}s, "
        f"peak RSS {import_rss:.0f} MiB"
    )
    cache = "page cache emptied before each run" if args.cold else "page cache warm"
    print(f"medians of {args.repeat} runs, each timed until its files are on disk (sync), {cache}:")
    for workers, (seconds, rss) in runs.items():
        speedup = runs[min(runs)][0] / seconds
        print(
            f"convert2ckpt.py --workers {workers}: {seconds:.1f}s ({size / seconds:.0f} MiB/s, x{speedup:.2f}), "
            f"{seconds / cp_seconds:.2f}x cp, peak RSS {rss:.0f} MiB (largest process)"
        )
    for tp in [int(t) for t in args.tp.split(",") if t]:
        split = os.path.join(args.work, f"tp{tp}")
        for what, source in (("HF", hf), ("the TP=1 checkpoint", out)):
            times = []
            for _ in range(args.repeat):  # timed like the conversions above: until the files are on disk
                shutil.rmtree(split, ignore_errors=True)
                settle(args.cold)
                t = time.perf_counter()
                _, rss = child_peak_rss(
                    [sys.executable, "convert2ckpt.py", "--input", source, "--output", split, "--tp", str(tp)]
                )
                subprocess.run(["sync"])
                times.append((time.perf_counter() - t, rss))
            seconds, rss = statistics.median(t for t, _ in times), max(r for _, r in times)
            print(
                f"convert2ckpt.py --tp {tp} from {what}: {seconds:.1f}s ({size / seconds:.0f} MiB/s), "
                f"{seconds / cp_seconds:.2f}x cp, peak RSS {rss:.0f} MiB"
            )
        shutil.rmtree(split, ignore_errors=True)
    seconds, rss = statistics.median(t for t, _ in exports), max(r for _, r in exports)
    print(
        f"convert2ckpt.py --to-hf (export back): {seconds:.1f}s ({size / seconds:.0f} MiB/s), "
        f"{seconds / cp_seconds:.2f}x cp, peak RSS {rss:.0f} MiB"
    )
    print(f"cp -r of the same shards: {cp_seconds:.1f}s ({size / cp_seconds:.0f} MiB/s)")
    if args.verify:
        verify_memory(hf, out, size)
    shutil.rmtree(exported, ignore_errors=True)
    shutil.rmtree(copy, ignore_errors=True)


if __name__ == "__main__":
    main()
