"""The plain reference loop the GPU and throughput benchmarks hold the trainer against: transformers' own model and
torch's AdamW on the trainer's own batches (its sampler, collator and loss scaling), no DeepSpeed.

fp32: the model's parameters are AdamW's. bf16: what DeepSpeed's bf16 optimizer does, written out: bf16 weights for
forward and backward, each micro-batch's bf16 gradients added into fp32 ones, fp32 master weights clipped and stepped
by AdamW, then copied back into the bf16 weights.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class PlainRun:
    seconds: list[float] = field(default_factory=list)  # per step
    losses: list[float] = field(default_factory=list)  # the step's token-mean loss, as the trainer reports it
    grad_norms: list[float] = field(default_factory=list)  # before clipping
    max_memory_gib: float = 0.0  # torch.cuda.max_memory_allocated, on a GPU


def plain_attention(hf: str) -> str:
    """The attention the trainer runs for `hf`'s family when none is named: SDPA, eager for gpt-oss's sinks."""
    from models.config import load_hf_config
    from models.families import resolve_attention

    return resolve_attention(load_hf_config(hf), None)


def plain_batches(hf: str, data: str, seq: int, mbs: int, ga: int, packing: bool):
    """The trainer's micro-batches for one DP rank (seed 42, from step 0): ((ids, positions), labels, _)."""
    from transformers import AutoTokenizer

    from data.collator import CausalLMCollator
    from data.dataset import TokenizedDataset
    from data.packing import PackedDataset
    from data.sampling import TrainPlan, train_batches
    from schema.data import DataConfig

    tokenizer = AutoTokenizer.from_pretrained(hf)
    dataset = TokenizedDataset(data, tokenizer, seq, DataConfig())
    if packing:
        dataset = PackedDataset(dataset, seq)
    plan = TrainPlan(len(dataset), 1, mbs, ga)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return train_batches(dataset, plan, 0, 42, 0, CausalLMCollator(seq, pad, packing))


def plain_run(
    hf: str,
    data: str,
    *,
    seq: int,
    mbs: int,
    ga: int,
    steps: int,
    packing: bool = False,
    precision: str = "fp32",
    device: str = "cpu",
    lr: float = 1e-4,
    max_grad_norm: float = 1.0,
    threads: int = 1,
    profile: str | None = None,
) -> PlainRun:
    """`steps` optimizer steps; with `profile` (a file name) the last one runs under torch.profiler, whose table of
    the 20 costliest operators (by device time on a GPU) goes to that file."""
    import torch
    from transformers import AutoModelForCausalLM

    from models.loss import CausalLMLoss

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    batches = plain_batches(hf, data, seq, mbs, ga, packing)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=dtype, attn_implementation=plain_attention(hf)).to(device)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    master = [p.detach().float().clone() if dtype != torch.float32 else p for p in params]
    kwargs = {"lr": lr, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0}  # the trainer's OptimConfig
    optimizer = torch.optim.AdamW(master, fused=device != "cpu", **kwargs)
    loss_fn = CausalLMLoss()
    run = PlainRun()
    cuda = device != "cpu"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for i in range(steps):
        profiler = None
        if profile and i == steps - 1:
            activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] * cuda)
            profiler = torch.profiler.profile(activities=activities)
            profiler.__enter__()
        step = [next(batches) for _ in range(ga)]
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        scale = torch.tensor(ga / max(sum(int((lab != -100).sum()) for _, lab, _ in step), 1), device=device)
        total = torch.zeros((), device=device)
        for (ids, pos), labels, _ in step:
            ids, pos, labels = ids.to(device), pos.to(device), labels.to(device)
            # NOTE: packed rows get their boundaries from position_ids alone (transformers builds the block-diagonal
            # mask from them); exact for unpacked rows.
            logits = model(input_ids=ids, position_ids=pos).logits
            loss = loss_fn(logits, (labels, scale)) / ga
            loss.backward()
            total += loss.detach()
            if master[0] is not params[0]:  # bf16: each micro-batch's gradients added into fp32 ones
                for p, m in zip(params, master, strict=True):
                    m.grad = p.grad.float() if m.grad is None else m.grad.add_(p.grad)
                    p.grad = None
        norm = torch.nn.utils.clip_grad_norm_(master, max_grad_norm if max_grad_norm > 0 else float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if master[0] is not params[0]:
            with torch.no_grad():
                for p, m in zip(params, master, strict=True):
                    p.copy_(m)
        run.losses.append(float(total))
        run.grad_norms.append(float(norm))
        if cuda:
            torch.cuda.synchronize()
        run.seconds.append(time.perf_counter() - start)
        if profiler is not None:
            profiler.__exit__(None, None, None)
            key = "device_time_total" if cuda else "cpu_time_total"
            with open(profile, "w") as f:
                f.write(profiler.key_averages().table(sort_by=key, row_limit=20, max_name_column_width=60))
    if cuda:
        run.max_memory_gib = torch.cuda.max_memory_allocated() / 2**30
    return run
