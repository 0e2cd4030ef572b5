"""Greedy generation from a checkpoint, to check a fine-tune by eye.

    python -m tools.generate --checkpoint OUTPUT_DIR --prompt "12+30=" [--max-new-tokens 32] [--tag global_stepN]

`--checkpoint` is a pipeline checkpoint (what the trainer saves or convert2ckpt.py writes; a LoRA
run's adapters are merged in on load) or a Hugging Face directory (what `--to-hf` exports). The
weights are read one layer file at a time into a transformers `LlamaForCausalLM`, which generates.
"""

from __future__ import annotations

import argparse
import sys

import torch


def load_model(path: str, tag: str | None = None, dtype: torch.dtype = torch.float32):
    """A transformers causal LM with the weights of `path` (pipeline checkpoint or HF directory)."""
    from checkpoint.hf_model import load_causal_lm

    return load_causal_lm(path, tag, dtype)


def generate(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id or 0
        )
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="pipeline checkpoint / trainer output_dir, or HF dir")
    parser.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--tag", help="checkpoint tag (default: the one in `latest`)")
    parser.add_argument("--tokenizer", help="default: --checkpoint")
    args = parser.parse_args(argv)
    from checkpoint.errors import CheckpointError
    from models.tokenizer import load_tokenizer

    try:
        model = load_model(args.checkpoint, args.tag)
        tokenizer = load_tokenizer(args.tokenizer or args.checkpoint, setting="--tokenizer")
    except (CheckpointError, ValueError) as e:
        print(f"generate: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    for prompt in args.prompt:
        print(f"{prompt}{generate(model, tokenizer, prompt, args.max_new_tokens)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
