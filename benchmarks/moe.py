"""Mixture-of-experts on this machine: one sparse decoder block, ours against transformers' own, and the all-to-all
traffic of expert parallelism.

    python -m benchmarks.moe [--hidden 512] [--experts 8] [--top-k 2] [--tokens 2048] [--repeat 7]
    python -m benchmarks.moe --step --work /tmp/moebench [--steps 12] [--step-repeat 3]
    python -m benchmarks.moe --families gpt_oss,deepseek_v3 [--hidden 512] [--tokens 2048] [--device cuda --dtype bf16]

- block: forward and backward of one Mixtral decoder block on the same tokens, transformers'
  `MixtralDecoderLayer` (with its default experts implementation, grouped_mm) against our pipeline layer
  (the same module, plus the router statistics of the load-balancing loss and the state-dict hooks); medians of
  `--repeat` runs after one warm-up, and their ratio.
- `--families gpt_oss,deepseek_v3,...`: the same for each family's first sparse decoder block (the family's own
  router, experts, attention implementation and, for DeepSeek-V3, latent attention), transformers' layer given the
  very arguments ours hands it (mask, rotary angles: recorded from ours), so the ratio is our layer's own cost; the
  two alternate run by run, and user CPU time is the figure (wall time adds page faults that follow the allocator).
- all-to-all: 2 processes (gloo), experts split over EP=2 (models/expert_parallel.py): the bytes each rank hands
  to `all_to_all_single` for the hidden rows of the dispatch (rows kept on the rank count as sent to itself and
  are reported apart), counted on the collective, per token, against k x H x bytes x (EP - 1) / EP (what uniform
  routing sends to other ranks).

- Llama 4 block: forward and backward of transformers' `Llama4TextDecoderLayer` (its block runs every expert on
  every token, inputs outside the top-k scaled by 0) against ours at EP=1 (the same module), ours with
  `moe.routed_experts` (each expert on its routed tokens, one grouped matmul) and, on 2 processes, ours at EP=2
  (only the top-k pairs travel and run, one grouped matmul per rank), each rank on its own `--tokens` tokens;
  16 experts, top-1 as Llama 4 Scout.
- `--step`: training steps of the trainer on 2 ranks (DP=2, fp32) of a Mixtral (4 layers, `--hidden`, `--experts`,
  `--top-k`) at expert_parallel_size 1 and 2 on the same batches: the median step seconds after 2 warm-up steps
  (median of `--step-repeat` launches).

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
    counts = _spawn(_dispatch_worker, args)
    per_token = [c["other"] / args.tokens for c in counts]
    expected = args.top_k * args.hidden * 4 * (2 - 1) / 2
    print(
        f"all-to-all (EP=2, fp32, hidden {args.hidden}, top-{args.top_k}, {args.tokens} tokens per rank): bytes per "
        f"token sent to the other rank {per_token[0]:.0f} and {per_token[1]:.0f}; uniform routing would send "
        f"k x H x 4 x (EP-1)/EP = {expected:.0f}; kept on the rank {counts[0]['self'] / args.tokens:.0f} and "
        f"{counts[1]['self'] / args.tokens:.0f}"
    )


def _llama4_config(args, experts: int = 16):
    from tools.tiny_models import tiny_config

    config = tiny_config(
        "llama4_text",
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        intermediate_size_mlp=4 * args.hidden,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=args.hidden // 8,
        num_local_experts=experts,
        num_experts_per_tok=1,
        num_hidden_layers=1,
        interleave_moe_layer_step=1,
        attention_chunk_size=8192,
        floor_scale=8192,
    )
    config._attn_implementation = "sdpa"
    return config


def _llama4_layers(config, ep=None, routed: bool = False):
    from transformers.models.llama4.modeling_llama4 import Llama4TextDecoderLayer

    from models.layers import DecoderOptions, decoder_layer_class

    torch.manual_seed(0)
    hf = Llama4TextDecoderLayer(config, 0)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.02)
    ours = decoder_layer_class("llama4_text")(config, 0, DecoderOptions(routed_experts=routed), ep)
    state = hf.state_dict()
    if ep is not None and ep.size > 1:
        mine = ep.local_experts(config.num_local_experts)
        for name in ("feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"):
            state[name] = state[name][mine.start : mine.stop]
    ours.load_state_dict(state)
    return hf, ours


def _llama4_run(layer, config, x, hf: bool):
    from models.moe import empty_stats

    b, s = x.shape[:2]
    position_ids = torch.arange(s).expand(b, s)
    weight = torch.ones_like(x)

    def run():
        h = x.clone().requires_grad_()
        if hf:
            freqs = layer.rotary_emb(h, position_ids)
            out = layer(h, position_embeddings=freqs, position_ids=position_ids)
        else:
            out = layer((h, position_ids, torch.full((b,), s), empty_stats(config).requires_grad_()))[0]
        (out * weight).sum().backward()

    return run


def _llama4_ep_worker(rank: int, store: str, args, out: str) -> None:
    import torch.distributed as dist

    from models.expert_parallel import ExpertParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        config = _llama4_config(args)
        _, ours = _llama4_layers(config, ExpertParallel(2, rank, dist.new_group([0, 1])))
        x = torch.randn(1, args.tokens, config.hidden_size, generator=torch.Generator().manual_seed(rank))
        run = _llama4_run(ours, config, x, hf=False)
        run()
        times = []
        for _ in range(args.repeat):
            dist.barrier()
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        torch.save(torch.tensor(statistics.median(times)), out)
    finally:
        dist.destroy_process_group()
    os._exit(0)


def llama4_block(args) -> None:
    from transformers.models.llama4.modeling_llama4 import Llama4TextRotaryEmbedding

    config = _llama4_config(args)
    hf, ours = _llama4_layers(config)
    hf.rotary_emb = Llama4TextRotaryEmbedding(config)
    x = torch.randn(1, args.tokens, config.hidden_size, generator=torch.Generator().manual_seed(0))
    t_hf = _time(_llama4_run(hf, config, x, hf=True), args.repeat)
    t_ours = _time(_llama4_run(ours, config, x, hf=False), args.repeat)
    _, routed = _llama4_layers(config, routed=True)
    t_routed = _time(_llama4_run(routed, config, x, hf=False), args.repeat)
    t_ep = float(max(_spawn(_llama4_ep_worker, args)))
    print(
        f"block (Llama 4, hidden {args.hidden}, 16 experts, top-1, shared expert, {args.tokens} tokens per rank, "
        f"forward+backward, median of {args.repeat}): transformers {t_hf * 1e3:.1f} ms, ours at EP=1 "
        f"{t_ours * 1e3:.1f} ms ({t_ours / t_hf:.3f}x), with moe.routed_experts {t_routed * 1e3:.1f} ms "
        f"({t_routed / t_hf:.3f}x), ours at EP=2 (2 processes, the slower rank) {t_ep * 1e3:.1f} ms "
        f"({t_ep / t_hf:.3f}x)"
    )


def _spawn(worker, args) -> list:
    """`worker(rank, store, args, out)` on 2 spawned processes; what each saved to `out` (tensors and plain
    containers of them: read with weights_only=True)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, f"rank{r}.pt") for r in range(2)]
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=worker, args=(r, f"{tmp}/store", args, outs[r])) for r in (0, 1)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(600)
        return [torch.load(o, weights_only=True) for o in outs]


def step(args) -> None:
    from benchmarks.train_throughput import build, trainer_run

    hf, data = build(
        args.work,
        4,
        args.hidden,
        8,
        2000,
        model_type="mixtral",
        intermediate_size=2 * args.hidden,  # (grouped_mm needs rows of a multiple of 16 bytes)
        num_key_value_heads=4,
        num_local_experts=args.experts,
        num_experts_per_tok=args.top_k,
    )
    args.seq, args.mbs, args.packing, args.threads = 256, 4, False, 1
    seconds = {}
    for ep in (1, 2):
        runs = []
        for i in range(args.step_repeat):
            out = os.path.join(args.work, f"run_ep{ep}_{i}")
            metrics = trainer_run(hf, data, out, 1, args, 4, ranks=2, extra=[f"expert_parallel_size={ep}"])
            runs.append(statistics.median(m["step_seconds"] for m in metrics[2:]))
        seconds[ep] = statistics.median(runs)
    print(
        f"training step (Mixtral, 4 layers, hidden {args.hidden}, {args.experts} experts, top-{args.top_k}, 2 ranks "
        f"DP=2, 4 micro-batches of 4 x 256 tokens per rank, fp32, median after 2 warm-up steps of "
        f"{args.step_repeat} launches): EP=1 {seconds[1]:.3f} s, EP=2 {seconds[2]:.3f} s "
        f"(EP=2 / EP=1 = {seconds[2] / seconds[1]:.3f})"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--step", action="store_true", help="training steps at EP=1 and EP=2 instead")
    p.add_argument("--work", default=None, help="--step: where the model, data and runs go")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--step-repeat", type=int, default=3)
    p.add_argument("--llama4-only", action="store_true", help="only the Llama 4 block")
    p.add_argument("--families", default=None, help="comma-separated families: their sparse blocks only")
    p.add_argument("--expert-size", type=int, default=None, help="--families: each expert's width (2 x hidden)")
    p.add_argument("--hf-experts", default=None, help="--families: experts implementation of both (grouped_mm)")
    p.add_argument("--device", default="cpu", help="--families: cpu or cuda")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="--families: the layers' dtype")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.step:
        if not args.work:
            p.error("--step needs --work")
        step(args)
        return
    if args.llama4_only:
        llama4_block(args)
        return
    if args.families:
        from benchmarks.moe_families import family_block

        for family in args.families.split(","):
            try:
                family_block(args, family)
            except Exception as e:  # one family's failure (say, a kernel a GPU lacks) leaves the others measured
                print(f"block ({family}): failed: {type(e).__name__}: {e}", flush=True)
        return
    block(args)
    dispatch(args)
    llama4_block(args)


if __name__ == "__main__":
    main()
