"""Memory and step time of one long row through `trainer.py`, one rank: one document against packed documents.

    python -m benchmarks.row_memory --work /tmp/rowbench [--lengths 4096,16384] [--fused true,false] [--check 16384]

The model of issue 61: a random LLaMA (hidden 64, 4 layers, 4 heads, vocabulary 49,152; a small SentencePiece
tokenizer, so the ids stay below its 200 pieces while the head keeps 49,152 rows), every block recomputed, fp32,
micro-batch 1, 2 steps (`--steps`). For each row length L: a file of identical documents longer than L (each row:
the first L tokens of one), and a file of documents of about L/16 tokens packed into rows of L
(`data.packing=true`). Each launch reports, from metrics.jsonl, the resident memory before the last step (weights,
AdamW's state, the data: what the process holds between steps), the peak resident memory of the process
(ru_maxrss), and the last step's time.

`--check L`: step 1's loss on the one-document rows against transformers' model on the trainer's own first batch
(benchmarks/plain_loop.py, fp32, the whole logits: about 10 GB at 16,384 tokens).

Not a test: timings on a shared machine are noisy; compare figures from one run of this script.
"""

from __future__ import annotations

import argparse
import os
import random
import sys

from benchmarks.train_throughput import REPO, trainer_run

VOCAB, HIDDEN, LAYERS, HEADS = 49_152, 64, 4, 4
WORDS = "the quick brown fox jumps over a lazy dog while pipelines train language models fast".split()


def build(work: str, longest: int) -> str:
    """The model (with its tokenizer) under `work`, built once."""
    from tools.tiny_models import make_hf_model, make_sp_tokenizer, tiny_config

    hf = os.path.join(work, "hf")
    if not os.path.exists(os.path.join(hf, "config.json")):
        rng = random.Random(0)
        texts = [" ".join(rng.choice(WORDS) for _ in range(200)) for _ in range(200)]
        tokenizer = make_sp_tokenizer(os.path.join(work, "tokenizer"), texts, vocab_size=200)
        fields = dict(num_hidden_layers=LAYERS, hidden_size=HIDDEN, intermediate_size=HIDDEN * 8 // 3)
        fields |= dict(num_attention_heads=HEADS, num_key_value_heads=HEADS, vocab_size=VOCAB)
        positions = max(longest, 1 << 17)  # one model for every length measured
        make_hf_model(hf, tiny_config("llama", **fields, max_position_embeddings=positions), tokenizer_dir=tokenizer)
    return hf


def data_file(work: str, length: int, packed: bool) -> str:
    """Rows of `length` tokens: 4 copies of one long document, or documents of about length / 16 tokens."""
    from data.sources import write_jsonl

    path = os.path.join(work, f"{'packed' if packed else 'document'}-{length}.jsonl")
    if not os.path.exists(path):
        rng = random.Random(length)
        if packed:  # 16 documents a row, 4 rows' worth (the tokenizer gives about 1.3 tokens a word)
            texts = [" ".join(rng.choice(WORDS) for _ in range(length // 24)) for _ in range(64)]
        else:
            texts = [" ".join(rng.choice(WORDS) for _ in range(length))] * 4
        write_jsonl(path, [{"text": t} for t in texts])
    return path


def run(hf: str, work: str, length: int, packed: bool, fused: bool, steps: int = 2) -> dict:
    args = argparse.Namespace(seq=length, mbs=1, steps=steps, packing=packed, threads=1, precision="fp32")
    extra = ["model.activation_checkpointing=true", f"model.fused_head_loss={str(fused).lower()}"]
    out = os.path.join(work, "run")
    steps = trainer_run(hf, data_file(work, length, packed), out, 1, args, 1, extra=extra)
    return {
        "loss": steps[0]["loss"],
        "before": steps[-1]["rss_before_step_gib"],
        "peak": steps[-1]["peak_rss_gib"],
        "seconds": steps[-1]["step_seconds"],
    }


def reference_loss(hf: str, work: str, length: int) -> float:
    from benchmarks.plain_loop import plain_run

    return plain_run(hf, data_file(work, length, False), seq=length, mbs=1, ga=1, steps=1, packing=False).losses[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", required=True)
    p.add_argument("--lengths", default="4096,16384")
    p.add_argument("--fused", default="true", help="comma-separated model.fused_head_loss values")
    p.add_argument("--packed", default="false,true", help="comma-separated: one document (false), packed (true)")
    p.add_argument("--check", type=int, default=0, help="a length whose step-1 loss is checked against transformers")
    p.add_argument("--steps", type=int, default=2, help="1: the figures of the first step (no AdamW state yet)")
    args = p.parse_args()
    sys.path.insert(0, REPO)
    os.makedirs(args.work, exist_ok=True)
    lengths = [int(x) for x in args.lengths.split(",")]
    hf = build(args.work, max(lengths))
    flags = lambda text: [x.strip() == "true" for x in text.split(",")]  # noqa: E731
    print(
        f"{'tokens':>7} {'rows':>9} {'fused':>6} {'before GiB':>11} {'peak GiB':>9} {'peak/before':>12} {'step s':>7}"
    )
    results = {}
    for length in lengths:
        for fused in flags(args.fused):
            for packed in flags(args.packed):
                r = results[length, fused, packed] = run(hf, args.work, length, packed, fused, args.steps)
                kind = "packed" if packed else "document"
                print(
                    f"{length:>7} {kind:>9} {str(fused):>6} {r['before']:>11.3f} {r['peak']:>9.3f} "
                    f"{r['peak'] / r['before']:>12.2f} {r['seconds']:>7.1f}",
                    flush=True,
                )
    for fused in flags(args.fused):
        points = sorted((n, r["peak"]) for (n, f, packed), r in results.items() if f == fused and not packed)
        if len(points) > 1:
            (x0, y0), (x1, y1) = points[-2:]
            print(f"fused={fused}: peak RSS slope {(y1 - y0) * 2**30 / (x1 - x0):,.0f} bytes per token ({x0}-{x1})")
    if args.check:
        ours = next(r["loss"] for (n, _, packed), r in results.items() if n == args.check and not packed)
        ref = reference_loss(hf, args.work, args.check)
        print(f"step 1 loss at {args.check} tokens: trainer {ours:.6f}, transformers {ref:.6f}, diff {ours - ref:.2e}")


if __name__ == "__main__":
    main()
