"""Build the demo inputs: arithmetic data, a sentencepiece tokenizer trained on it, a tiny HF LLaMA.

python -m demo.prepare OUT_DIR
"""

from __future__ import annotations

import argparse
import os

from demo.arithmetic import addition_rows, write_splits
from tools.tiny_models import make_hf_model, make_sp_tokenizer, tiny_config


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("out_dir")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    data_dir = os.path.join(args.out_dir, "data")
    train, evals = write_splits(data_dir, seed=args.seed)
    tok_dir = make_sp_tokenizer(
        os.path.join(args.out_dir, "tokenizer"), [r["prompt"] + r["response"] for r in addition_rows()]
    )
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(tok_dir))
    config = tiny_config(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    hf_dir = make_hf_model(os.path.join(args.out_dir, "hf_model"), config, seed=args.seed, tokenizer_dir=tok_dir)
    print(f"data: {train} {evals}\ntokenizer: {tok_dir} ({vocab} tokens)\nHF model: {hf_dir}")


if __name__ == "__main__":
    main()
