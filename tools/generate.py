"""Greedy generation from a checkpoint, to check a fine-tune by eye.

    python -m tools.generate --checkpoint OUTPUT_DIR --prompt "12+30=" [--max-new-tokens 32] [--tag global_stepN]
    python -m tools.generate --checkpoint OUTPUT_DIR --chat --prompt "What is 12+30?" [--system "..."] \\
        [--chat-template FILE] [--chat-template-kwargs '{"enable_thinking": false}'] [--device cuda] [--dtype bf16]

`--checkpoint` is a pipeline checkpoint (what the trainer saves or convert2ckpt.py writes; a LoRA run's adapters
are merged in on load) or a Hugging Face directory (what `--to-hf` exports). The weights are read one layer file at
a time into the family's transformers model (`AutoModelForCausalLM`), which generates. `--chat` renders each prompt
as a user turn through the tokenizer's chat template (or `--chat-template`) with the generation prompt, as
`data.chat_template` and `data.chat_template_kwargs` render training rows; without it the prompt is plain text.
`--dtype auto` (the default) is the model's own (config.json's `dtype`); `--device auto` a GPU where there is one.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def load_model(path: str, tag: str | None = None, dtype: torch.dtype = torch.float32):
    """A transformers causal LM with the weights of `path` (pipeline checkpoint or HF directory)."""
    from checkpoint.hf_model import load_causal_lm

    return load_causal_lm(path, tag, dtype)


def model_dtype(path: str) -> torch.dtype:
    """The dtype config.json names (`dtype`, or the older `torch_dtype`); fp32 where it names none."""
    from checkpoint.hf_model import read_model_config

    named = getattr(read_model_config(path), "dtype", None)
    named = named if isinstance(named, torch.dtype) else getattr(torch, str(named or "float32"), torch.float32)
    return named if named in DTYPES.values() else torch.float32


def prompt_ids(tokenizer, prompt: str, chat: bool, system: str | None = None, kwargs: dict | None = None):
    """[1, T] ids of `prompt`: plain text as the tokenizer encodes it, or (`chat`) a user turn (after `system`)
    rendered with the chat template and its generation prompt, tokenized as training tokenizes renderings."""
    if not chat:
        return tokenizer(prompt, return_tensors="pt")["input_ids"]
    from data.chat import apply_template

    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    text = apply_template(tokenizer, messages, "prompt", tokenize=False, add_generation_prompt=True, **(kwargs or {}))
    return tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]


def generate(model, tokenizer, ids: torch.Tensor, max_new_tokens: int) -> str:
    """Greedy continuation of `ids` ([1, T]), decoded without special tokens."""
    ids = ids.to(model.device)
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
    parser.add_argument("--chat", action="store_true", help="each prompt a user turn through the chat template")
    parser.add_argument("--system", help="with --chat: a system turn before it")
    parser.add_argument("--chat-template", help="with --chat: a Jinja file or template instead of the tokenizer's")
    parser.add_argument("--chat-template-kwargs", default="{}", help='with --chat: JSON: {"enable_thinking": false}')
    parser.add_argument("--device", default="auto", help="auto (cuda where there is one), cpu, cuda, cuda:1 ...")
    parser.add_argument("--dtype", choices=["auto", *DTYPES], default="auto", help="auto: the model's own")
    args = parser.parse_args(argv)
    from checkpoint.errors import CheckpointError
    from data.chat import configure_chat_template
    from models.tokenizer import load_tokenizer
    from schema.data import DataConfig

    try:
        kwargs = json.loads(args.chat_template_kwargs)
        if not isinstance(kwargs, dict):
            raise ValueError(f"--chat-template-kwargs {args.chat_template_kwargs}: not a JSON object")
        device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
        dtype = model_dtype(args.checkpoint) if args.dtype == "auto" else DTYPES[args.dtype]
        model = load_model(args.checkpoint, args.tag, dtype).to(device)
        tokenizer = load_tokenizer(args.tokenizer or args.checkpoint, setting="--tokenizer")
        configure_chat_template(tokenizer, DataConfig(chat_template=args.chat_template))
        inputs = [prompt_ids(tokenizer, p, args.chat, args.system, kwargs) for p in args.prompt]
    except (CheckpointError, ValueError, KeyError, RuntimeError) as e:
        message = e.args[0] if isinstance(e, KeyError) else str(e)
        print(f"generate: error: {str(message).splitlines()[0]}", file=sys.stderr)
        return 2
    for prompt, ids in zip(args.prompt, inputs, strict=True):
        print(f"{prompt}{generate(model, tokenizer, ids, args.max_new_tokens)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
