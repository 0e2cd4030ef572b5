"""The memory planner against measurement: bytes autograd saves per micro-batch, and parameter bytes, per stage."""

from __future__ import annotations

import os
import re

import pytest
import torch

from models.families import FAMILIES
from models.layer_kinds import residual_streams
from models.layers import DecoderOptions, build_layer
from models.loss import HeadOutput
from models.moe import empty_stats, is_moe
from models.partition import layer_param_counts, stage_bounds
from models.pipe_layout import pipe_layers
from tests.conftest import spawn_ranks
from tools.activation_bytes import stage_activation_bytes
from tools.tiny_models import tiny_config


def measured_stage(config, layers: range, b: int, s: int, options: DecoderOptions, dtype, tp=None) -> tuple[int, int]:
    """(bytes of distinct tensors saved for backward in a micro-batch's forward, parameters): a stage, its TP shard."""
    from models.carry import carried_tensors
    from models.head import tied_lm_head_forward
    from models.tensor_parallel import tp_layer_class_and_args, tp_tied_head_forward

    torch.manual_seed(0)
    specs = pipe_layers(config.num_hidden_layers, config.tie_word_embeddings)
    if tp is None:
        modules = [build_layer(specs[i], config, options).to(dtype) for i in layers]
    else:
        modules = [
            cls(*args).to(dtype)
            for cls, args in (tp_layer_class_and_args(specs[i], config, tp, options) for i in layers)
        ]
    params = {p.untyped_storage().data_ptr() for m in modules for p in m.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    position_ids = torch.arange(s).repeat(b, 1)
    if options.packed:  # two documents per row
        position_ids = torch.cat([torch.arange(s // 2), torch.arange(s - s // 2)]).repeat(b, 1)
    x = (torch.randint(0, config.vocab_size, (b, s)), position_ids)
    if layers[0] != 0:  # a later stage receives hidden states (this rank's positions under sequence parallelism)
        shard = s // tp.size if tp is not None and tp.sp else s
        streams = (residual_streams(config),) if residual_streams(config) > 1 else ()  # DeepSeek-V4's [B, S, N, H]
        x = (torch.randn(b, shard, *streams, config.hidden_size, dtype=dtype, requires_grad=True), position_ids)
        if is_moe(config):  # and each row's length and the router statistics so far
            x = (*x, torch.full((b,), s), empty_stats(config).requires_grad_())
        # and what the family's layers carry across the cut (models/carry.py: Gemma 4's K/V and per-layer inputs)
        width = tp.size if tp is not None else 1
        carried = carried_tensors(config, layers[0] - 1, b, s, shard, dtype, width, device="cpu")
        x = (*x, *(t.normal_().requires_grad_() if t.is_floating_point() else t for t in carried.values()))
    tied_head = config.tie_word_embeddings and layers[-1] == len(specs) - 1
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for i, module in zip(layers, modules):
            if tied_head and i == layers[-1]:  # DeepSpeed's TiedLayerSpec: the embedding's module, the head's forward
                x = tp_tied_head_forward(config, tp)(module, x) if tp is not None else tied_lm_head_forward(module, x)
            else:
                x = module(x)
    head = x[0] if isinstance(x, tuple) else x
    if isinstance(head, HeadOutput):  # the head's input, which the pipeline holds with the output until backward
        pack(head.hidden)
    return sum(saved.values()), sum(p.numel() for m in modules for p in m.parameters())


LLAMA4 = {
    "model_type": "llama4_text",
    "num_local_experts": 8,
    "intermediate_size_mlp": 344,
    "head_dim": 32,
    "attention_chunk_size": 32,
    "floor_scale": 8192,
}
LAYOUTS = {  # (config overrides, attention, stages, stage, packed, checkpoint every k, dtype)
    "mha-pp1": ({}, "sdpa", 1, 0, False, 0, torch.float32),
    "gqa-pp2-stage0": ({"num_key_value_heads": 2}, "sdpa", 2, 0, False, 0, torch.float32),
    "gqa-pp2-stage1": ({"num_key_value_heads": 2}, "sdpa", 2, 1, False, 0, torch.float32),
    "eager-pp1": ({}, "eager", 1, 0, False, 0, torch.float32),
    # bf16 eager attention keeps its fp32 softmax and its bf16 copy, and GQA's repeated keys and values: -46% when
    # the planner counted 2 bytes a probability (eager attention is measured on the meta device since).
    "eager-gqa-bf16-pp2-stage0": ({"num_key_value_heads": 2}, "eager", 2, 0, False, 0, torch.bfloat16),
    "packed-sdpa-pp1": ({}, "sdpa", 1, 0, True, 0, torch.float32),
    "recompute2-pp1": ({}, "sdpa", 1, 0, False, 2, torch.float32),
    "tiled-mlp-pp2-stage1": ({}, "sdpa", 2, 1, False, 0, torch.float32),  # model.mlp_tiles=4
    "wide-bf16-pp2-stage1": ({"hidden_size": 256, "intermediate_size": 688}, "sdpa", 2, 1, False, 0, torch.bfloat16),
    # Sparse blocks: Mixtral's 8 experts top-2 (expert width 344); Qwen2-MoE's shared expert in every 2nd layer.
    "mixtral-pp2-stage1": ({"model_type": "mixtral", "num_local_experts": 8}, "sdpa", 2, 1, False, 0, torch.float32),
    "qwen2_moe-sparse-step-bf16": (
        {"model_type": "qwen2_moe", "decoder_sparse_step": 2, "moe_intermediate_size": 96},
        "sdpa",
        1,
        0,
        False,
        0,
        torch.bfloat16,
    ),
    # Llama 4 (8 experts, top-2, chunks of 32, every 2nd layer sparse): transformers' block runs every expert on every
    # token (E copies kept); with `moe.routed_experts` only the k routed ones.
    "llama4-pp2-stage1": (LLAMA4, "sdpa", 2, 1, False, 0, torch.float32),
    "llama4-routed-pp2-stage1": (LLAMA4, "sdpa", 2, 1, False, 0, torch.float32),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_activation_and_parameter_estimates_match_measurement(layout):
    overrides, attn, stages, stage, packed, every, dtype = LAYOUTS[layout]
    config = tiny_config(**{"hidden_size": 128, "intermediate_size": 344, "num_attention_heads": 4, **overrides})
    if is_moe(config):
        config.output_router_logits = False
    config._attn_implementation = attn
    b, s = 2, 96
    bounds = stage_bounds(config, stages, "uniform")
    layers = range(bounds[stage], bounds[stage + 1])
    routed = "routed" in layout
    tiled = "tiled" in layout
    options = DecoderOptions(packed, every, routed, mlp_tiles=4 if tiled else 0)
    measured, params = measured_stage(config, layers, b, s, options, dtype)
    act_bytes = 4 if dtype == torch.float32 else 2
    kept, live = stage_activation_bytes(
        config, layers, b, s, 1, act_bytes, attn, packed, every, routed=routed, tiled=tiled
    )
    print(
        f"{layout}: predicted {kept / 2**20:.2f} MiB, measured {measured / 2**20:.2f} MiB ({kept / measured - 1:+.1%})"
    )
    # measured: the dense layouts +0.0% or +0.1%, Mixtral -0.3%, Qwen2-MoE -0.2%, Llama 4 +0.2%, routed -2.5%
    tolerance = {"mixtral-pp2-stage1": 0.01, "qwen2_moe-sparse-step-bf16": 0.01, "llama4-pp2-stage1": 0.02}
    assert abs(kept / measured - 1) <= tolerance.get(layout, 0.05 if routed else 0.005)
    assert params == sum(layer_param_counts(config)[bounds[stage] : bounds[stage + 1]])


# What the planner's measured blocks count beyond the two stand-ins (attention's fused kernel, the experts' gate),
# measured on the families' tiny models: every dense family +0.0% but Gemma 3's last stage -1.7% (its final
# (1 + w) norm, counted as LLaMA's) and Qwen3.5 +0.1%; the sparse ones -0.6% (gpt-oss, Mixtral) to +2.7% (GLM-4.5,
# DeepSeek-V3: the router's tensors, counted as a softmax router's). Before measured blocks (LLaMA's block counted
# for all): Qwen3 -47%, Qwen3.5 -72%, DeepSeek-V3 -32% (with SDPA's math path), Gemma 3 -31%, gpt-oss -17%.
# GLM-4.5's last stage measured +2.7% to +3.0% by what ran before it in the process (held at 4%).
FAMILY_TOLERANCE = 0.03
# DeepSeek-V4: -3.1% and -2.9% (its compressed sparse layers keep 6% more than predicted, its others 8% less: the
# sparse-block formula over-counts its routers, the meta device over-counts its attention's copies by 9%)
# MiMo-V2-Flash: +11.6%, +18.7% (over: values at the keys' width, every layer at the widest one's key/value heads)
WIDER_FAMILY_TOLERANCE = {"glm4_moe": 0.04, "deepseek_v4": 0.05, "mimo_v2_flash": 0.2}


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_every_familys_stages_match_measurement(model_type):
    """Each family's tiny model (tools/tiny_models.py: every layer kind on both stages of PP=2): the planner's
    bytes per stage against the tensors autograd saves on the CPU, attention run by the planner's stand-in for a
    fused kernel (what flash-attn and SDPA keep on a GPU; the CPU's SDPA takes its math path for MLA)."""
    from tools.activation_bytes import FUSED_KERNEL, register_fused_kernel

    register_fused_kernel()
    config = tiny_config(model_type=model_type)
    if is_moe(config):
        config.output_router_logits = False
    config._attn_implementation = FUSED_KERNEL
    bounds = stage_bounds(config, 2, "uniform")
    for stage in (0, 1):
        layers = range(bounds[stage], bounds[stage + 1])
        measured, params = measured_stage(config, layers, 2, 96, DecoderOptions(), torch.float32)
        kept, _ = stage_activation_bytes(config, layers, 2, 96, 1, 4, "sdpa", False, 0)
        print(f"{model_type} stage {stage}: predicted {kept / 2**20:.3f} MiB, measured {measured / 2**20:.3f} MiB")
        tolerance = WIDER_FAMILY_TOLERANCE.get(model_type, FAMILY_TOLERANCE)
        assert abs(kept / measured - 1) <= tolerance, (stage, kept / measured - 1)
        assert params == sum(layer_param_counts(config)[bounds[stage] : bounds[stage + 1]])


def deferred_bytes(config, b: int, s: int, lora: bool) -> int:
    """Bytes of the distinct tensors (not parameters) the deferred weight-gradient work of one decoder block's
    backward holds: what stays alive from its B pass to its W pass under zero_bubble."""
    from models.lora import add_lora
    from models.weight_grad import WeightGradStore, defer_weight_gradients

    torch.manual_seed(0)
    block = build_layer(pipe_layers(config.num_hidden_layers, False)[1], config, DecoderOptions())
    if lora:
        add_lora(block, 4, 8.0, 0.0, ["q_proj", "v_proj", "down_proj"], seed=0)
    store = WeightGradStore()
    defer_weight_gradients([block], store)
    store.active = True
    x = torch.randn(b, s, config.hidden_size, requires_grad=True)
    block((x, torch.arange(s).repeat(b, 1)))[0].square().sum().backward()
    store.close_backward()
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    held: dict[int, int] = {}
    for work in store._groups[0]:
        for cell in work.__closure__ or ():
            t = cell.cell_contents
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in params:
                held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(held.values())


@pytest.mark.parametrize("lora", [False, True])
def test_deferred_weight_gradient_bytes_match_measurement(lora):
    """zero_bubble keeps each linear layer's input and output gradient from B to W: the planner's count of them
    against the tensors the store's queued work holds."""
    from tools.activation_bytes import deferred_weight_grad_bytes

    config = tiny_config(hidden_size=128, intermediate_size=344, num_attention_heads=4, num_key_value_heads=2)
    config._attn_implementation = "sdpa"
    b, s = 2, 96
    measured = deferred_bytes(config, b, s, lora)
    targets = ["q_proj", "v_proj", "down_proj"] if lora else []
    predicted = deferred_weight_grad_bytes(config, b, s, 1, 4, targets, 4 if lora else 0)
    print(f"lora={lora}: predicted {predicted / 2**20:.2f} MiB, measured {measured / 2**20:.2f} MiB")
    assert predicted == measured  # to the byte (docs/training.md)


def test_planner_follows_each_schedules_micro_batches_in_flight():
    """1F1B: stage s holds p - s micro-batches; zero_bubble the same activations plus the deferred weight
    gradients of at most two backwards; dualpipev: two half stages per rank and the loss on rank 0. The
    suggestion for a GPU size names the schedule."""
    from schema.train import TrainConfig
    from tools.memory_estimate import estimate, suggest
    from training.schedules import memory_states

    for p, m in ((2, 4), (4, 8), (4, 16)):
        for stage in range(p):
            one = memory_states("1f1b", m, p, stage)
            zero = memory_states("zero_bubble", m, p, stage)
            assert max(h for h, _, _ in one) == p - stage and all(w == 0 and c == 0 for _, c, w in one)
            assert max(h for h, _, _ in zero) == p - stage and max(w for _, _, w in zero) == 2
            assert zero[-1] == (0, 0, 0) and one[-1] == (0, 0, 0)
            dual = memory_states("dualpipev", m, p, stage)
            assert dual[-1] == (0, 0, 0) and min(min(state) for state in dual) >= 0
    config = tiny_config(hidden_size=128, intermediate_size=344, num_attention_heads=4, num_hidden_layers=8)
    cfg = TrainConfig(num_stages=4, seq_length=512, micro_batch_size=2, gradient_accumulation_steps=8)
    rows = {
        s: estimate(TrainConfig(**{**cfg.__dict__, "pipeline_schedule": s}), config, 4)
        for s in ("1f1b", "zero_bubble", "dualpipev")
    }
    for a, b in zip(rows["1f1b"], rows["zero_bubble"], strict=True):
        assert b.activations > a.activations and (a.params, a.logits) == (b.params, b.logits)
    assert rows["dualpipev"][0].logits > 0 and all(r.logits == 0 for r in rows["dualpipev"][1:])
    total = {s: sum(r.params for r in rows[s]) for s in rows}
    assert rows["1f1b"][-1].logits > 0 and total["dualpipev"] == total["1f1b"] == total["zero_bubble"]
    # Tied embeddings: 1F1B's last stage holds a copy of the embedding as its head; DualPipeV's rank 0 holds both
    # ends of the model and one module for them.
    tied = tiny_config(
        hidden_size=128, intermediate_size=344, num_attention_heads=4, num_hidden_layers=8, tie_word_embeddings=True
    )
    one, dual = (
        estimate(TrainConfig(**{**cfg.__dict__, "pipeline_schedule": s}), tied, 4) for s in ("1f1b", "dualpipev")
    )
    assert sum(r.params for r in one) - sum(r.params for r in dual) == tied.vocab_size * tied.hidden_size
    lines = suggest(cfg, config, 4, gpu_gib=1.0)
    assert {line.split()[0] for line in lines} == {f"pipeline_schedule={s}" for s in rows}, lines
    # Each suggested micro-batch count keeps the 1F1B bubble (p - 1) / (m + p - 1) at or under 20% (docs/training.md).
    for m in (int(re.search(r"gradient_accumulation_steps=(\d+)", line).group(1)) for line in lines):
        assert 3 / (m + 3) <= 0.2, lines


def test_planner_counts_context_parallelism_and_finds_the_c_a_row_needs():
    """CP=2 holds half the positions per rank (activations and logits halve; ZeRO-1 shards the optimizer over DP x CP)
    while the weights stay whole; `context_for` names the smallest C whose busiest stage fits, keeping PP and DP."""
    from schema.train import DeepSpeedConfig, TrainConfig
    from tools.memory_estimate import GIB, context_for, estimate, loss_bytes

    config = tiny_config(hidden_size=128, intermediate_size=344, num_attention_heads=4, max_position_embeddings=65536)
    cfg = TrainConfig(num_stages=2, seq_length=32768, micro_batch_size=1, gradient_accumulation_steps=4)
    cfg.deepspeed = DeepSpeedConfig(zero_stage=1)
    for fused in (False, True):
        cfg.model.fused_head_loss, cfg.context_parallel_size = fused, 1
        one = estimate(cfg, config, 2)
        cfg.context_parallel_size = 2
        two = estimate(cfg, config, 4)
        for a, b in zip(one, two, strict=True):
            assert a.weights == b.weights and b.optimizer == a.optimizer / 2
            assert b.activations == pytest.approx(a.activations / 2, rel=0.05)
            # unfused, the logits halve; fused, the weight's gradient and one tile (at most the rank's tokens)
            tokens = cfg.seq_length // 2
            fused_bytes = loss_bytes(cfg.model, tokens, config.hidden_size, config.vocab_size, 2) if b.logits else 0
            assert b.logits == (fused_bytes if fused else a.logits / 2)
    cfg.context_parallel_size = 1
    fits = max(r.total for r in two) / GIB / 0.9 + 1e-3  # C=2's busiest stage, with the planner's 10% kept free
    assert "needs context_parallel_size=2 (world_size=4" in context_for(cfg, config, 2, fits)
    assert "needs context_parallel_size=1 (world_size=2" in context_for(cfg, config, 2, 100.0)
    assert "no context_parallel_size up to 4" in context_for(cfg, config, 2, 1e-3)


def _tp_stage_worker(rank: int, store: str, out: str) -> None:
    """Rank `rank` of TP=2: saved bytes of each stage of a PP=2 model, without and with sequence parallelism."""
    import json

    import torch.distributed as dist

    from models.tensor_parallel import TensorParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        group, results = dist.new_group([0, 1]), {}
        for name, (overrides, attn, stage, every) in TP_LAYOUTS.items():
            config = tiny_config(**{**TP_MODEL, **overrides})
            config._attn_implementation = attn
            bounds = stage_bounds(config, 2, "uniform")
            for sp in (False, True):
                tp = TensorParallel(2, rank, group=group, sequence_parallel=sp)
                layers = range(bounds[stage], bounds[stage + 1])
                results[f"{name}-sp{int(sp)}"] = measured_stage(
                    config, layers, 2, 96, DecoderOptions(False, every), torch.float32, tp
                )[0]
        with open(out, "w") as f:
            json.dump(results, f)
    finally:
        dist.destroy_process_group()
    # NOTE: exit at once: gloo's threads can abort the interpreter's teardown ("terminate called without an
    # active exception", SIGABRT) after the work is done and saved.
    os._exit(0)


TP_MODEL = {"hidden_size": 128, "intermediate_size": 344, "num_attention_heads": 4, "num_key_value_heads": 2}
TP_LAYOUTS = {  # (config overrides, attention, stage of PP=2, checkpoint every k)
    "stage0": ({}, "sdpa", 0, 0),
    "stage1": ({}, "sdpa", 1, 0),
    "stage1-tied-recompute": ({"tie_word_embeddings": True}, "sdpa", 1, 1),
    "stage0-eager": ({}, "eager", 0, 0),
    # Measured blocks under TP: linear attention split by heads (Qwen3.5), q/k norms over the whole projection
    # with their statistics summed over the ranks (OLMo 2).
    "qwen3_5-stage0": ({"model_type": "qwen3_5_text"}, "sdpa", 0, 0),
    "olmo2-stage1": ({"model_type": "olmo2"}, "sdpa", 1, 0),
}


def test_tp_and_sequence_parallel_activation_estimates_match_measurement(tmp_path):
    """TP=2 ranks' stages of a PP=2 model, with and without sequence parallelism: the planner's bytes per rank
    against the tensors autograd saves (within 0.5%, 5% for eager attention's mask); sequence parallelism saves less
    on every stage."""
    import json

    ranks = [json.load(open(o)) for o in spawn_ranks(_tp_stage_worker, tmp_path, suffix="json")]
    assert ranks[0] == ranks[1]
    for name, (overrides, attn, stage, every) in TP_LAYOUTS.items():
        config = tiny_config(**{**TP_MODEL, **overrides})
        bounds = stage_bounds(config, 2, "uniform")
        layers = range(bounds[stage], bounds[stage + 1])
        for sp in (False, True):
            measured = ranks[0][f"{name}-sp{int(sp)}"]
            kept, _ = stage_activation_bytes(config, layers, 2, 96, 2, 4, attn, False, every, sp)
            print(
                f"TP=2 {name} sp={sp}: predicted {kept / 2**20:.3f} MiB, measured {measured / 2**20:.3f} MiB "
                f"({kept / measured - 1:+.1%})"
            )
            # measured +0.0% on every stage but the eager one (-3.1% / -3.6%: the planner's attention bytes)
            assert abs(kept / measured - 1) <= (0.05 if "eager" in name else 0.005), (name, sp)
        assert ranks[0][f"{name}-sp1"] < ranks[0][f"{name}-sp0"]


@pytest.mark.slow
def test_one_32k_token_row_through_sequence_and_context_parallelism(tmp_path):
    """One row of 32,768 tokens, PP=2 x TP=2 with sequence parallelism, and PP=2 x CP=2 (Ulysses) with the MLPs in
    4 tiles, every block recomputed, the loss 4,096 tokens at a time: each step's loss equals transformers' on the
    whole row (1e-5 relative), and each rank's peak bytes saved for backward match the planner's (within 0.2%)."""
    import json

    from transformers import AutoModelForCausalLM

    from tests.conftest import check, convert_in_process, torchrun
    from tests.workers.long_rows import LONG_SEQ, long_row
    from tools.tiny_models import make_hf_model

    config = tiny_config(num_hidden_layers=2, num_key_value_heads=2, max_position_embeddings=LONG_SEQ)
    hf_dir, ckpt = str(tmp_path / "hf"), str(tmp_path / "ckpt")
    make_hf_model(hf_dir, config)
    check(convert_in_process(["--input", hf_dir, "--output", ckpt]))
    runs = {}
    for mode, flags in (("sp", []), ("cp", ["--context-parallel", "--mlp-tiles", "4"])):
        (tmp_path / mode).mkdir()
        check(torchrun("tests/workers/long_rows.py", 4, ckpt, str(tmp_path / mode), *flags))
        runs[mode] = [json.load(open(tmp_path / mode / f"rank{r}.json")) for r in range(4)]

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="sdpa")
    ids, _, labels = long_row(config.vocab_size)
    with torch.no_grad():
        logits = hf(input_ids=ids).logits
    ref = torch.nn.functional.cross_entropy(logits[0], labels[0], ignore_index=-100)
    bounds = stage_bounds(config, 2, "uniform")
    for mode, r in [(mode, r) for mode, ranks in runs.items() for r in ranks]:
        assert r["loss"] == pytest.approx(float(ref), rel=1e-5), (r, float(ref))
        assert r["live_after_step"] == 0, r  # everything saved was released by the backward
        # 1F1B with one micro-batch: each stage holds one micro-batch's kept tensors (the planner adds the one
        # block being recomputed, which torch keeps outside the hooks).
        layers = range(bounds[r["stage"]], bounds[r["stage"] + 1])
        if mode == "sp":
            kept, live = stage_activation_bytes(config, layers, 1, LONG_SEQ, 2, 4, "sdpa", False, 1, True)
        else:  # this rank's S/C positions of the row
            kept, live = stage_activation_bytes(
                config, layers, 1, LONG_SEQ // 2, 1, 4, "sdpa", False, 1, row=LONG_SEQ, tiled=True
            )
        measured = r["peak_saved_bytes"]
        print(
            f"32k row, {mode}, rank {r['rank']} (stage {r['stage']}): peak saved {measured / 2**20:.2f} MiB, planner "
            f"{kept / 2**20:.2f} MiB ({kept / measured - 1:+.1%}); + the recomputed block {live / 2**20:.2f} MiB"
        )
        assert abs(kept / measured - 1) <= 0.002, (r, kept)  # measured +0.0% on every rank


@pytest.mark.parametrize("model_type", ["llama", "qwen2_moe", "gemma4_text"])
def test_planner_adapters_are_peft_adapters_on_each_tp_rank(model_type):
    """The planner's LoRA parameters per pipeline layer (models/lora.py `adapter_param_counts`) equal what PEFT
    injects into one tensor-parallel rank's decoder layer, at TP=1 and TP=2: a column layer's A whole and B split, a
    row layer's A split and B whole (dense and sparse layers; experts take none; Gemma 4's layers of their own
    shape: global ones with wider heads and no v_proj, K/V-reusing ones with no k/v projections and MLPs twice as
    wide)."""
    from peft import LoraConfig, inject_adapter_in_model

    from models.lora import adapter_param_counts
    from models.pipe_layout import DECODER
    from models.tensor_parallel import TensorParallel, tp_layer_class_and_args

    config = tiny_config(model_type, num_key_value_heads=2)
    targets = ["q_proj", "v_proj", "o_proj"] + (["gate_proj", "down_proj"] if model_type != "qwen2_moe" else [])
    targets += ["k_proj"] if model_type == "gemma4_text" else []
    for tp_size in (1, 2):
        counts = adapter_param_counts(config, targets, 4, tp_size)
        for layer in pipe_layers(config.num_hidden_layers, config.tie_word_embeddings):
            if layer.kind != DECODER:
                assert counts[layer.index] == 0
                continue
            with torch.device("meta"):
                if tp_size == 1:
                    module = build_layer(layer, config)
                else:
                    cls, args = tp_layer_class_and_args(layer, config, TensorParallel(tp_size, 0))
                    module = cls(*args)
                inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8.0, target_modules=targets), module)
            peft = sum(p.numel() for name, p in module.named_parameters() if ".lora_" in name)
            assert counts[layer.index] == peft > 0, (tp_size, layer)


def test_a_lightning_indexers_scores_are_planned_as_they_peak():
    """DeepSeek-V3.2's indexer scores every key of the row for each query and head in fp32 while its layer runs,
    nothing of it kept for backward: the planner's transient bytes (`transient_bytes`, added to every stage's
    activations) within 3% of the peak transformers' indexer allocates (torch's profiler, its allocations and frees
    replayed in order, CPU, rows of 512; one row a micro-batch and two, where matmul copies the keys to every query,
    with head_dim 32 > 2 x 8 heads); a family without an indexer has none."""
    import transformers.models.deepseek_v32.modeling_deepseek_v32 as v32
    from torch.profiler import ProfilerActivity, profile

    from tools.activation_bytes import transient_bytes

    config = tiny_config("deepseek_v32", num_hidden_layers=2, index_head_dim=32, index_n_heads=8)
    indexer = v32.DeepseekV32DecoderLayer(config, 1).self_attn.indexer
    for b, s in ((1, 512), (2, 512)):
        hidden, q_resid = torch.randn(b, s, config.hidden_size), torch.randn(b, s, config.q_lora_rank)
        positions = torch.arange(s)[None].expand(b, s)
        rotary = v32.DeepseekV32RotaryEmbedding(config)(hidden, positions)
        mask = torch.ones(b, s, s, dtype=torch.bool).tril()
        with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            indexer(hidden, q_resid, rotary, mask, positions)
        records = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
        held = peak = 0  # every allocation (+) and free (-) in the order it happened
        for record in sorted(records, key=lambda e: e.start_ns()):
            held += record.nbytes()
            peak = max(peak, held)
        planned = transient_bytes(config, b, s)
        print(f"indexer peak {peak} bytes, planned {planned:.0f} (rows {b})")
        assert peak == pytest.approx(planned, rel=0.03), (b, peak, planned)
    assert transient_bytes(tiny_config("deepseek_v3"), 2, 512) == 0


@pytest.mark.slow
def test_the_layout_planner_proposes_what_fits_as_the_planner_counts_it(capsys):
    """16 GPUs of 80 GB, a 70B shape (the llama2_70b_4node recipe's settings): the proposals fit, each one's
    figure is what `python -m tools.memory_estimate` prints for its overrides, a layout over the limit (GPU or host)
    is never proposed, and the step-time model prefers the smaller bubble at equal parallel degrees."""
    from schema.compose import compose_config
    from tools import memory_estimate
    from tools.layout_plan import HEADROOM, propose, step_seconds
    from tools.memory_estimate import for_gpu
    from training.assembly import load_model_config

    base = ["experiment=llama2_70b_4node"]
    cfg = for_gpu(compose_config(base))
    config = load_model_config(cfg)
    found, too_big = propose(cfg, config, 16, 80)
    assert found and too_big > 0  # PP=1 x DP=16 and the like are valid layouts that do not fit
    assert HEADROOM == 0.9 and all(p.gib <= 0.9 * 80 for p in found)
    assert [p.seconds for p in found] == sorted(p.seconds for p in found)
    for p in found[:3]:  # the planner's own figure for those overrides, as it prints it
        assert memory_estimate.main([*base, "world_size=16", *p.overrides.split()]) == 0
        printed = capsys.readouterr().out
        assert f"busiest stage: {p.gib:.1f} GiB per GPU" in printed, (p.overrides, printed[-300:])
    assert not any("num_stages=1 " in p.overrides and "tensor_parallel_size=1 " in p.overrides for p in found)
    # the top one printed as overrides to paste
    assert memory_estimate.main([*base, "gpus=16", "gpu_memory_gib=80"]) == 0
    assert f"paste: world_size=16 {found[0].overrides}" in capsys.readouterr().out
    # host memory: a node's limit below what the saves' snapshots need removes every layout
    lowest = min(p.host_gib for p in found)
    assert propose(cfg, config, 16, 80, host_gib=lowest - 1)[0] == []
    # the model: more micro-batches, a smaller bubble and a shorter step
    few, many = for_gpu(compose_config([*base, "gradient_accumulation_steps=8"])), cfg
    assert step_seconds(many, config, 32, 8)[1] < step_seconds(few, config, 32, 8)[1]
