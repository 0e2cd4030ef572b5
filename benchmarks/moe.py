"""Mixture-of-experts on this machine: one sparse decoder block, ours against transformers' own, and the all-to-all
traffic of expert parallelism.

    python -m benchmarks.moe [--hidden 512] [--experts 8] [--top-k 2] [--tokens 2048] [--repeat 7]

- block: forward and backward of one Mixtral decoder block on the same tokens, transformers'
  `MixtralDecoderLayer` (with its default experts implementation, grouped_mm) against our pipeline layer
  (the same module, plus the router statistics of the load-balancing loss and the state-dict hooks); medians of
  `--repeat` runs after one warm-up, and their ratio.
- all-to-all: 2 processes (gloo), experts split over EP=2 (models/expert_parallel.py): the bytes each rank hands
  to `all_to_all_single` for the hidden rows of the dispatch (rows kept on the rank count as sent to itself and
  are reported apart), counted on the collective, per token, against k x H x bytes x (EP - 1) / EP (what uniform
  routing sends to other ranks).

Not a test: timings on a shared machine are noisy, compare figures from one run of this script.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch


def _config(args):
    from tools.tiny_models import tiny_config

    config = tiny_config(
        "mixtral",
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_local_experts=args.experts,
        num_experts_per_tok=args.top_k,
        num_hidden_layers=1,
    )
    config._attn_implementation = "sdpa"
    config._experts_implementation = "grouped_mm"
    return config


def _time(run, repeat: int) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def block(args) -> None:
    from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer, MixtralRotaryEmbedding

    from models.layers import decoder_layer_class
    from models.moe import empty_stats

    config = _config(args)
    torch.manual_seed(0)
    hf = MixtralDecoderLayer(config, 0)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.02)
    ours = decoder_layer_class("mixtral")(config, 0)
    weights = dict(hf.named_parameters())
    with torch.no_grad():
        for name, p in ours.named_parameters():  # the same modules: the same parameter names in memory
            p.copy_(weights[name])
    b, s = 2, args.tokens // 2
    x = torch.randn(b, s, config.hidden_size)
    position_ids = torch.arange(s).expand(b, s)
    cos_sin = MixtralRotaryEmbedding(config)(x, position_ids)
    weight = torch.randn_like(x)

    def run_hf():
        h = x.clone().requires_grad_()
        (hf(h, position_embeddings=cos_sin, position_ids=position_ids) * weight).sum().backward()

    def run_ours():
        h = x.clone().requires_grad_()
        out = ours((h, position_ids, torch.full((b,), s), empty_stats(config).requires_grad_()))
        (out[0] * weight).sum().backward()

    t_hf, t_ours = _time(run_hf, args.repeat), _time(run_ours, args.repeat)
    print(
        f"block (Mixtral, hidden {args.hidden}, {args.experts} experts, top-{args.top_k}, {args.tokens} tokens, "
        f"forward+backward, median of {args.repeat}): transformers {t_hf * 1e3:.1f} ms, ours {t_ours * 1e3:.1f} ms "
        f"(ours / transformers = {t_ours / t_hf:.3f})"
    )


def _dispatch_worker(rank: int, store: str, args, out: str) -> None:
    import torch.distributed as dist
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    from models.expert_parallel import ExpertParallel, dispatch_to_experts, local_experts_config

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    sent = {"other": 0, "self": 0}
    real = dist.all_to_all_single

    def counting(output, inp, output_split_sizes=None, input_split_sizes=None, group=None, **kw):
        if inp.is_floating_point() and inp.dim() == 2 and input_split_sizes is not None and not sent.get("done"):
            row = inp.shape[1] * inp.element_size()
            sent["self"] += input_split_sizes[rank] * row
            sent["other"] += (sum(input_split_sizes) - input_split_sizes[rank]) * row
            sent["done"] = True  # the first float all-to-all of a forward is the dispatch
        return real(output, inp, output_split_sizes, input_split_sizes, group=group, **kw)

    dist.all_to_all_single = counting
    try:
        config = _config(args)
        torch.manual_seed(0)
        ep = ExpertParallel(2, rank, dist.new_group([0, 1]))
        block = MixtralSparseMoeBlock(local_experts_config(config, ep))
        dispatch_to_experts(block, config, ep)
        with torch.no_grad():
            for p in block.parameters():
                p.normal_(0, 0.02)
        x = torch.randn(1, args.tokens, config.hidden_size, generator=torch.Generator().manual_seed(rank))
        with torch.no_grad():
            block(x)
        torch.save({k: sent[k] for k in ("self", "other")}, out)
    finally:
        dist.destroy_process_group()


def dispatch(args) -> None:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, f"rank{r}.pt") for r in range(2)]
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_dispatch_worker, args=(r, f"{tmp}/store", args, outs[r])) for r in (0, 1)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(300)
        counts = [torch.load(o, weights_only=True) for o in outs]
    per_token = [c["other"] / args.tokens for c in counts]
    expected = args.top_k * args.hidden * 4 * (2 - 1) / 2
    print(
        f"all-to-all (EP=2, fp32, hidden {args.hidden}, top-{args.top_k}, {args.tokens} tokens per rank): bytes per "
        f"token sent to the other rank {per_token[0]:.0f} and {per_token[1]:.0f}; uniform routing would send "
        f"k x H x 4 x (EP-1)/EP = {expected:.0f}; kept on the rank {counts[0]['self'] / args.tokens:.0f} and "
        f"{counts[1]['self'] / args.tokens:.0f}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--repeat", type=int, default=7)
    args = p.parse_args()
    torch.set_num_threads(1)
    block(args)
    dispatch(args)


if __name__ == "__main__":
    main()
