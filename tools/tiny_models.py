"""Tiny random Hugging Face models and tokenizers built on the fly: smoke tests and demos without downloads.

    python -m tools.tiny_models OUT_DIR [--layers 4] [--hidden 64] [--tokenizer sentencepiece|bpe]

Writes a randomly initialised LLaMA (`save_pretrained`, sharded safetensors) with a tokenizer trained
on a few sentences, ready for `convert2ckpt.py` or `trainer.py model_name_or_path=OUT_DIR`. Two kinds of
tokenizer, the two that LLaMA-family checkpoints ship:

- sentencepiece BPE saved as a LLaMA tokenizer (LLaMA 1/2, Mistral): BOS added by default, digits split;
  `byte_fallback=True` adds the 256 byte tokens (any text round-trips) and keeps newlines and spaces.
- byte-level BPE in a `tokenizer.json` (the Llama-3 / Qwen kind), built with the `tokenizers` library.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch

from models.families import DEFAULT_MODEL_TYPE, FAMILIES

SAMPLE_TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "pipeline parallel training of language models",
    "tensor parallelism splits every layer across the GPUs of a node",
    "12+30=42 5+8=13 99+1=100",
]


def make_sp_tokenizer(out_dir: str, texts: list[str], vocab_size: int = 32, byte_fallback: bool = False) -> str:
    """Train a sentencepiece BPE model on `texts` and save it as a Hugging Face LLaMA tokenizer.

    Digits are split into single tokens (as LLaMA's tokenizer does). BOS is added by default, EOS not.
    Without `byte_fallback` the vocabulary is as small as the texts allow (characters outside them, and
    newlines, are dropped by the tokenizer); with it, every byte has a token (vocab_size >= 260 + pieces).
    """
    import sentencepiece as spm
    from transformers import AutoTokenizer

    options = {}
    if byte_fallback:  # keep whitespace as written: newlines and repeated spaces are part of chat templates
        vocab_size = max(vocab_size, 260 + len(set("".join(texts))) + 16)  # bytes + every character + merges
        options = dict(
            byte_fallback=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True,
        )
    with tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, "sp")
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(texts),
            model_prefix=prefix,
            vocab_size=vocab_size,
            model_type="bpe",
            character_coverage=1.0,
            split_digits=True,
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=-1,
            hard_vocab_limit=False,  # small corpora may not support vocab_size pieces
            minloglevel=2,
            **options,
        )
        os.makedirs(out_dir, exist_ok=True)
        with open(prefix + ".model", "rb") as src, open(os.path.join(out_dir, "tokenizer.model"), "wb") as dst:
            dst.write(src.read())
    config = {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    AutoTokenizer.from_pretrained(out_dir).save_pretrained(out_dir)  # adds tokenizer.json
    return out_dir


def make_bpe_tokenizer(
    out_dir: str,
    texts: list[str],
    vocab_size: int = 400,
    special_tokens: list[str] = (),
    bos_token: str = "<|begin_of_text|>",
    eos_token: str = "<|end_of_text|>",
    add_bos: bool = True,
) -> str:
    """A byte-level BPE `tokenizer.json` tokenizer (the Llama-3 / Qwen kind) trained on `texts`.

    Args:
        out_dir: where to save it (`tokenizer.json`, `tokenizer_config.json`).
        texts: training texts.
        vocab_size: at least 256 + the special tokens (every byte is a token).
        special_tokens: added tokens that are never split (chat markers such as `<|im_end|>`).
        bos_token, eos_token: also added as special tokens.
        add_bos: prepend BOS when encoding with special tokens (Llama-3 does, Qwen does not).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = list(dict.fromkeys([bos_token, eos_token, *special_tokens]))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    if add_bos:
        bos_id = tok.token_to_id(bos_token)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos_token} $A", pair=f"{bos_token} $A {bos_token} $B", special_tokens=[(bos_token, bos_id)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos_token, eos_token=eos_token)
    fast.save_pretrained(out_dir)
    return out_dir


def tiny_config(model_type: str = DEFAULT_MODEL_TYPE, **overrides):
    """A small config of a supported family (transformers' own config class, with the family's `tiny` fields:
    4 experts, top-2, for the mixture-of-experts families); override any field (e.g. num_key_value_heads,
    tie_word_embeddings, head_dim)."""
    from transformers import AutoConfig

    kwargs = dict(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    kwargs |= FAMILIES[model_type].tiny  # the family's own test-size fields (models/families/)
    kwargs.update(overrides)
    return AutoConfig.for_model(model_type, **kwargs)


def hub_named(hf_dir: str, config) -> None:
    """Rename the keys a `save_pretrained` writes otherwise than the family's hub checkpoints (Kimi Linear's dense
    MLP, saved under the sparse block's hub name `block_sparse_moe`): each as models/hub_names.py `hub_key` names it."""
    from safetensors.torch import load_file, save_file

    from models.families import family_of
    from models.hub_names import hub_key, memory_key

    if not family_of(config).hub_renames:
        return
    renamed = {}
    for name in [n for n in os.listdir(hf_dir) if n.endswith(".safetensors")]:
        shard = load_file(os.path.join(hf_dir, name))
        names = {key: hub_key(config, memory_key(config, key)) for key in shard}
        if any(key != new for key, new in names.items()):
            save_file({names[k]: v for k, v in shard.items()}, os.path.join(hf_dir, name), metadata={"format": "pt"})
            renamed |= names
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if renamed and os.path.exists(index):
        with open(index) as f:
            data = json.load(f)
        data["weight_map"] = {renamed.get(k, k): v for k, v in data["weight_map"].items()}
        with open(index, "w") as f:
            json.dump(data, f, indent=2)


def as_on_the_hub(hf_dir: str, config) -> None:
    """Rewrite a saved model whose family keeps its experts fused on the hub while transformers saves them one key
    per expert (Qwen3.5-MoE) in the hub's layout, each fused tensor in the shard of its first expert's piece
    (checkpoint/expert_layouts.py)."""
    from safetensors.torch import load_file, save_file

    from checkpoint.expert_layouts import fuse_per_expert, has_expert_parts, per_expert_sources

    if not has_expert_parts(config):
        return
    shards = {n: load_file(os.path.join(hf_dir, n)) for n in os.listdir(hf_dir) if n.endswith(".safetensors")}
    where = {key: name for name, shard in shards.items() for key in shard}
    state = {key: tensor for shard in shards.values() for key, tensor in shard.items()}
    fused = fuse_per_expert(state, config)
    if fused is state:
        return
    where |= {key: where[per_expert_sources(key, config, state)[0]] for key in fused.keys() - state.keys()}
    for name in shards:
        kept = {k: v for k, v in fused.items() if where[k] == name}
        if kept:
            save_file(kept, os.path.join(hf_dir, name), metadata={"format": "pt"})
        else:  # every piece it held went into a fused tensor elsewhere
            os.remove(os.path.join(hf_dir, name))
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            data = json.load(f)
        data["weight_map"] = {k: where[k] for k in fused}
        with open(index, "w") as f:
            json.dump(data, f, indent=2)


def make_hf_model(
    out_dir: str,
    config=None,
    seed: int = 0,
    max_shard_size: str | int = "200KB",
    dtype: torch.dtype = torch.float32,
    tokenizer_dir: str | None = None,
) -> str:
    """Save a randomly initialised causal LM with `save_pretrained` (sharded safetensors).

    Args:
        out_dir: where to write.
        config: a transformers config (default `tiny_config()`).
        seed: weights seed.
        max_shard_size: small by default so tiny models are still split into several shards.
        dtype: stored dtype.
        tokenizer_dir: copy its tokenizer files in too.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = config or tiny_config()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    model.save_pretrained(out_dir, max_shard_size=max_shard_size, safe_serialization=True)
    hub_named(out_dir, config)
    as_on_the_hub(out_dir, config)
    if tokenizer_dir:
        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.tiny_models", description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--tokenizer", choices=("sentencepiece", "bpe"), default="sentencepiece")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    tok_dir = os.path.join(args.out_dir, "tokenizer")
    if args.tokenizer == "bpe":
        make_bpe_tokenizer(tok_dir, SAMPLE_TEXTS * 10, vocab_size=300)
    else:
        make_sp_tokenizer(tok_dir, SAMPLE_TEXTS * 10, vocab_size=300, byte_fallback=True)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    config = tiny_config(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    make_hf_model(args.out_dir, config, seed=args.seed, tokenizer_dir=tok_dir)
    print(f"{args.out_dir}: {args.layers}-layer LLaMA, hidden {args.hidden}, {len(tokenizer)}-token {args.tokenizer}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
