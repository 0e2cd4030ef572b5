"""Summarise a demo run: loss at the start and end, eval results, and exact-match accuracy.

    python -m demo.report RUN_DIR EVAL_JSONL [--limit N]

Accuracy loads the trained pipeline checkpoint into a transformers `LlamaForCausalLM` and answers
held-out sums with greedy decoding.
"""

from __future__ import annotations

import argparse
import json
import os

import torch


def exact_match(run_dir: str, eval_file: str, limit: int) -> tuple[int, int, list[str]]:
    from transformers import AutoTokenizer

    from checkpoint.hf_model import load_causal_lm

    tokenizer = AutoTokenizer.from_pretrained(run_dir)
    model = load_causal_lm(run_dir)
    rows = [json.loads(line) for line in open(eval_file)][:limit]
    correct, examples = 0, []
    with torch.inference_mode():
        for row in rows:
            ids = torch.tensor([tokenizer(row["prompt"])["input_ids"]])
            out = model.generate(
                ids,
                max_new_tokens=6,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.eos_token_id,
            )
            answer = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()
            correct += answer == row["response"]
            if len(examples) < 5:
                examples.append(f"{row['prompt']}{answer}  (expected {row['response']})")
    return correct, len(rows), examples


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("run_dir")
    p.add_argument("eval_file")
    p.add_argument("--limit", type=int, default=200)
    args = p.parse_args()
    metrics = [json.loads(line) for line in open(os.path.join(args.run_dir, "metrics.jsonl"))]
    first, last = metrics[0], metrics[-1]
    tail = metrics[-10:]
    print(
        f"train loss: step {first['step']} {first['loss']:.3f} -> step {last['step']} "
        f"{sum(m['loss'] for m in tail) / len(tail):.3f} (mean of the last {len(tail)} steps)"
    )
    with open(os.path.join(args.run_dir, "eval_results.json")) as f:
        ev = json.load(f)
    print(f"eval: loss {ev['eval_loss']:.3f} over {ev['eval_tokens']} answer tokens, perplexity {ev['perplexity']:.3f}")
    correct, total, examples = exact_match(args.run_dir, args.eval_file, args.limit)
    print(f"exact match on {total} held-out sums (greedy): {correct}/{total} = {correct / total:.1%}")
    for line in examples:
        print(f"  {line}")


if __name__ == "__main__":
    main()
