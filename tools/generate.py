"""Greedy generation from a checkpoint, to check a fine-tune by eye.

    python -m tools.generate --checkpoint OUTPUT_DIR --prompt "12+30=" [--max-new-tokens 32] [--tag global_stepN]

`--checkpoint` is a pipeline checkpoint (what the trainer saves or convert2ckpt.py writes; a LoRA
run's adapters are merged in on load) or a Hugging Face directory (what `--to-hf` exports). The
weights are read one layer file at a time into a transformers `LlamaForCausalLM`, which generates.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch


def load_model(path: str, tag: str | None = None, dtype: torch.dtype = torch.float32):
    """A transformers LlamaForCausalLM with the weights of `path` (pipeline checkpoint or HF directory)."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from checkpoint.lora_merge import LORA_FILE, adapters_from_checkpoint
    from checkpoint.pipeline_reader import iter_hf_tensors, read_tag
    from training.hf_source import is_hf_dir

    if is_hf_dir(path):
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    config = AutoConfig.from_pretrained(path)
    tag = read_tag(path, tag)
    weights_dir, adapters, scale = path, None, 1.0
    if os.path.exists(os.path.join(path, LORA_FILE)):  # a LoRA run: base weights + its adapters
        weights_dir, adapters, scale = adapters_from_checkpoint(path, tag, config)
        tag = None
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    state = {k: v.to(dtype) for k, v in iter_hf_tensors(weights_dir, config, tag, adapters, scale)}
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"{path}: no weights for {missing[0]}")
    model.model.rotary_emb = LlamaRotaryEmbedding(config)  # its inv_freq is a computed buffer, not in the files
    return model.eval()


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
    from transformers import AutoTokenizer

    from checkpoint.hf_reader import CheckpointError

    try:
        model = load_model(args.checkpoint, args.tag)
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.checkpoint)
    except (CheckpointError, OSError, ValueError) as e:
        print(f"generate: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    for prompt in args.prompt:
        print(f"{prompt}{generate(model, tokenizer, prompt, args.max_new_tokens)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
