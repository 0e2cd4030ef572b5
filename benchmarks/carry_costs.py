"""What Gemma 4's carried tensors cost at each cut of a real model, against recomputing them on the stage that reads
them (docs/families.md, "State that crosses layers").

    python -m benchmarks.carry_costs [--tokens 4096]

For Gemma 4 E2B and E4B in bf16 (their text models' shapes: E4B's preset conf/model/gemma4_e4b.yaml, E2B's below),
per token and per cut after decoder block k: the bytes the carry sends besides the hidden states
(`models.carry.carried_bytes`: the per-layer inputs of the blocks still to come, the shared K/V alive there) and
what recomputing each on the reading stage would need instead:

- the per-layer inputs: the embeddings they are projected from (2H bytes a token, with a gradient back), and on each
  stage the rows of the per-layer table and the projection of its own layers, the projection's norm tied across
  stages;
- the shared K/V: the hidden states of the layer that makes them (2H bytes a token) and its k/v projections.

Also measured here, on this machine's CPU (one thread, medians of 3): the time to make every layer's per-layer inputs
of `--tokens` tokens (transformers' own modules, models/carry.py `PerLayerInputs`; its table cut to 32,768 rows to fit
memory, which a lookup does not feel), against one decoder layer's forward on the same tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

E2B = dict(  # google/gemma-4-E2B-it's text_config, as public configs of it transcribe it
    vocab_size=262144,
    hidden_size=1536,
    intermediate_size=6144,
    num_hidden_layers=35,
    num_attention_heads=8,
    num_key_value_heads=1,
    head_dim=256,
    global_head_dim=512,
    sliding_window=512,
    hidden_size_per_layer_input=256,
    vocab_size_per_layer_input=262144,
    num_kv_shared_layers=20,
    use_double_wide_mlp=True,
    attention_k_eq_v=False,
    final_logit_softcapping=30.0,
    layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 7,
)


def configs() -> dict:
    from transformers import AutoConfig

    from models.config import config_from_preset
    from schema.compose import compose_config

    return {
        "E2B": AutoConfig.for_model("gemma4_text", **E2B),
        "E4B": config_from_preset(compose_config(["model=gemma4_e4b"]).model),
    }


def cut_table(name: str, config) -> None:
    from models.carry import PER_LAYER_INPUTS, carried_bytes, layout

    hidden = 2 * config.hidden_size
    print(f"{name}: {config.num_hidden_layers} layers, hidden {config.hidden_size} ({hidden} bytes a token in bf16)")
    print("  cut after block   carried   recomputed instead   (bytes a token, besides the hidden states)")
    for block in range(0, config.num_hidden_layers - 1, 4):
        names = layout(config).carried(block + 1)
        # recomputed: the embeddings the per-layer inputs are projected from, each K/V maker's input hidden states
        instead = hidden * ((PER_LAYER_INPUTS in names) + len([n for n in names if n.endswith(".k")]))
        print(f"  {block:15d}   {carried_bytes(config, block + 1, 1, 1, 2):7d}   {instead:18d}")
    ple_table = config.vocab_size_per_layer_input * config.hidden_size_per_layer_input * 2
    print(f"  per-layer table rows of one layer on its stage if recomputed: {ple_table / 2**20:.0f} MiB (bf16)")


def timing(config, tokens: int, repeats: int = 3) -> None:
    from models.carry import PerLayerInputs, carried_tensors
    from models.layers import decoder_layer_class

    small = config.__class__.from_dict(config.to_dict() | {"vocab_size_per_layer_input": 32768})  # CPU memory
    small._attn_implementation = "sdpa"
    torch.manual_seed(0)
    ple, layer = PerLayerInputs(small), decoder_layer_class("gemma4_text")(small, 1)  # block 1 reads its slice
    ids = torch.randint(0, 32768, (1, tokens))
    x = torch.randn(1, tokens, config.hidden_size)
    positions = torch.arange(tokens)[None]
    carried = {
        k: v.normal_() for k, v in carried_tensors(small, 1, 1, tokens, tokens, torch.float32, device="cpu").items()
    }

    def median(fn) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    with torch.no_grad():
        t_ple = median(lambda: ple(ids, x))
        t_layer = median(lambda: layer._block(x, positions, carried))
    print(f"  per-layer inputs of {tokens} tokens: {t_ple * 1e3:.0f} ms; a decoder layer {t_layer * 1e3:.0f} ms (CPU)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.carry_costs", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    for name, config in configs().items():
        config._attn_implementation = "sdpa"
        cut_table(name, config)
        timing(config, args.tokens)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
