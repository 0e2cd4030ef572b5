"""Tiny LLaMA checkpoints and sentencepiece tokenizers built on the fly (demo and tests; no downloads)."""

from __future__ import annotations

import json
import os
import tempfile

import sentencepiece as spm
import torch


def make_tokenizer(out_dir: str, texts: list[str], vocab_size: int = 32) -> str:
    """Train a sentencepiece BPE model on `texts` and save it as a Hugging Face LLaMA tokenizer.

    Digits are split into single tokens (as LLaMA's tokenizer does). BOS is added by default, EOS not.
    """
    from transformers import AutoTokenizer

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


def tiny_config(**overrides):
    """A small LlamaConfig; override any field (e.g. num_key_value_heads, tie_word_embeddings)."""
    from transformers import LlamaConfig

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
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def make_hf_model(
    out_dir: str,
    config=None,
    seed: int = 0,
    max_shard_size: str | int = "200KB",
    dtype: torch.dtype = torch.float32,
    tokenizer_dir: str | None = None,
) -> str:
    """Save a randomly initialised `LlamaForCausalLM` with `save_pretrained` (sharded safetensors).

    Args:
        out_dir: where to write.
        config: a LlamaConfig (default `tiny_config()`).
        seed: weights seed.
        max_shard_size: small by default so tiny models are still split into several shards.
        dtype: stored dtype.
        tokenizer_dir: copy its tokenizer files in too.
    """
    from transformers import AutoTokenizer, LlamaForCausalLM

    config = config or tiny_config()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(out_dir, max_shard_size=max_shard_size, safe_serialization=True)
    if tokenizer_dir:
        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out_dir)
    return out_dir
