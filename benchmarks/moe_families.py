"""One sparse decoder block of each family, ours against transformers' own (`python -m benchmarks.moe --families ...`,
which documents the options): transformers' layer gets the very keyword arguments ours hands it (recorded from ours),
the two alternate run by run. On the CPU user CPU time is the figure (wall time adds page faults that follow the
allocator); on a GPU (`--device cuda --dtype bf16`) wall time to `torch.cuda.synchronize`, with each layer's peak
memory and the host synchronisations one forward and backward makes (`torch.cuda.set_sync_debug_mode`).
"""

from __future__ import annotations

import resource
import statistics
import time
import warnings

import torch


def _time_pair(first, second, repeat: int, cuda: bool) -> list[tuple[float, float]]:
    """(wall, user CPU) seconds, medians of `repeat` runs of each, alternated after one warm-up of each. User CPU
    leaves out the kernel's page-fault time, which follows the allocator's pattern more than the work."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    first(), second()
    times: tuple[list, list] = ([], [])
    for _ in range(repeat):
        for run, out in ((first, times[0]), (second, times[1])):
            sync()
            start, cpu = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_utime
            run()
            sync()
            out.append((time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_utime - cpu))
    return [tuple(statistics.median(column) for column in zip(*t, strict=True)) for t in times]


def _gpu_facts(run) -> tuple[int, float]:
    """(host synchronisations, peak GiB allocated) of one run on the GPU."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    return syncs, torch.cuda.max_memory_allocated() / 2**30


def family_block(args, family: str) -> None:
    """One family's first sparse block: transformers' decoder layer against ours (a subclass of it) on the same
    tokens, forward and backward; transformers' layer gets the keyword arguments ours passes it."""
    from models.families import family_of, resolve_attention
    from models.layer_kinds import is_sparse_layer
    from models.layers import decoder_layer_class
    from models.moe import DEFAULT_EXPERTS_IMPLEMENTATION, empty_stats
    from tools.tiny_models import tiny_config

    device, dtype = torch.device(args.device), getattr(torch, {"bf16": "bfloat16", "fp32": "float32"}[args.dtype])
    probe = tiny_config(family)
    moe = family_of(probe).moe
    expert_size = args.expert_size or 2 * args.hidden
    fields = {moe.num_experts: args.experts, moe.expert_size: expert_size, "num_experts_per_tok": args.top_k}
    grouped = probe.num_key_value_heads < probe.num_attention_heads  # latent attention (DeepSeek-V3's) is not
    heads = max(8, args.hidden // 128)
    shape = {
        "hidden_size": args.hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": heads // 2 if grouped else heads,
    }
    config = tiny_config(family, **shape | fields)
    config._attn_implementation = resolve_attention(config, None)
    # transformers' models run their experts by `grouped_mm` unless told otherwise (a layer built alone, with the
    # config's None, runs its per-expert loop, with host syncs on a GPU): both layers get the models' default.
    config._experts_implementation = args.hf_experts or DEFAULT_EXPERTS_IMPLEMENTATION
    index = next(i for i in range(config.num_hidden_layers) if is_sparse_layer(config, i))
    ours_class = decoder_layer_class(family)
    hf_class = next(c for c in ours_class.__mro__ if c.__module__.startswith("transformers.models."))
    ours = ours_class(config, index)
    torch.manual_seed(0)
    hf = hf_class(config, index)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.02)
    ours.load_state_dict(hf.state_dict())  # the same modules, the same names
    hf.to(device, dtype), ours.to(device, dtype)
    b, s = 2, args.tokens // 2
    x = torch.randn(b, s, config.hidden_size, device=device, dtype=dtype)
    position_ids = torch.arange(s, device=device).expand(b, s)
    weight = torch.randn_like(x)
    inputs = (position_ids, torch.full((b,), s, device=device), empty_stats(config, device).requires_grad_())
    passed, forward = {}, hf_class.forward

    def spy(layer, hidden, **kwargs):
        passed.update(kwargs)
        return forward(layer, hidden, **kwargs)

    hf_class.forward = spy  # what ours hands transformers' layer, recorded once
    try:
        ours((x, *inputs))
    finally:
        hf_class.forward = forward

    def run_hf():
        h = x.clone().requires_grad_()
        out = hf(h, **passed)
        ((out[0] if isinstance(out, tuple) else out) * weight).sum().backward()

    def run_ours():
        h = x.clone().requires_grad_()
        (ours((h, *inputs))[0] * weight).sum().backward()

    cuda = device.type == "cuda"
    (wall_hf, cpu_hf), (wall_ours, cpu_ours) = _time_pair(run_hf, run_ours, args.repeat, cuda)
    head = (
        f"block ({family} layer {index}, hidden {args.hidden}, {args.experts} experts of {expert_size}, "
        f"top-{args.top_k}, {args.tokens} tokens, {config._attn_implementation}, experts "
        f"{config._experts_implementation}, {args.dtype} on {args.device}, "
        f"forward+backward, median of {args.repeat}): "
    )
    if cuda:
        (sync_hf, peak_hf), (sync_ours, peak_ours) = _gpu_facts(run_hf), _gpu_facts(run_ours)
        print(
            head + f"wall transformers {wall_hf * 1e3:.2f} ms, ours {wall_ours * 1e3:.2f} ms (ours / transformers = "
            f"{wall_ours / wall_hf:.3f}); host syncs {sync_hf} and {sync_ours}; peak {peak_hf:.2f} and "
            f"{peak_ours:.2f} GiB",
            flush=True,
        )
        return
    print(
        head + f"user CPU transformers {cpu_hf * 1e3:.1f} ms, ours {cpu_ours * 1e3:.1f} ms (ours / transformers = "
        f"{cpu_ours / cpu_hf:.3f}); wall {wall_hf * 1e3:.1f} and {wall_ours * 1e3:.1f} ms ({wall_ours / wall_hf:.3f})",
        flush=True,
    )
