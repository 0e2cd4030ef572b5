"""Mixture-of-experts pieces in one process: the load-balancing loss over stages, the hub's keys in layer files,
stage balancing of mixed sparse and dense layers, and the one-line refusals (fast)."""

from __future__ import annotations

import os

import pytest
import torch

from models.key_table import all_layer_keys
from models.layer_kinds import is_sparse_layer
from models.layers import DecoderOptions, build_layer, decoder_layer_class
from models.moe import add_stats, aux_loss, empty_stats, layer_stats, token_mask
from models.partition import layer_param_counts, stage_bounds
from models.pipe_layout import pipe_layers
from tests.conftest import spawn_ranks
from tools.tiny_models import tiny_config


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_aux_loss_summed_over_stages_equals_transformers(model_type):
    """Router statistics added layer by layer (as stages do, in any grouping) give transformers'
    `load_balancing_loss_func` over all layers at once, padding masked, and the same gradient to every router."""
    import importlib

    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    torch.manual_seed(0)
    batch, seq, experts, top_k = 3, 7, 4, 2
    logits = [torch.randn(batch * seq, experts, requires_grad=True) for _ in range(3)]
    lengths = torch.tensor([7, 4, 1])
    mask = token_mask(lengths, seq)
    attention_mask = mask.view(batch, seq).long()
    ref = module.load_balancing_loss_func(tuple(logits), experts, top_k, attention_mask)
    ref_grads = torch.autograd.grad(ref, logits)
    stage0 = add_stats(empty_stats(tiny_config(model_type)), layer_stats(logits[0], top_k, mask))
    stage1 = add_stats(add_stats(stage0, layer_stats(logits[1], top_k, mask)), layer_stats(logits[2], top_k, mask))
    ours = aux_loss(stage1)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-7)
    for got, want in zip(torch.autograd.grad(ours, logits), ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-8)


def test_layer_files_hold_the_hubs_per_expert_keys():
    """A sparse layer's state dict has one key per expert (Mixtral's w1/w3/w2 under block_sparse_moe), exactly the
    table's, and loading them back rebuilds transformers' fused experts."""
    config = tiny_config("mixtral", num_hidden_layers=2)
    layer = pipe_layers(2, False)[1]
    module = build_layer(layer, config)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()
    state = module.state_dict()
    assert set(state) == set(all_layer_keys(config)[layer.index])
    assert state["block_sparse_moe.experts.3.w3.weight"].shape == (config.intermediate_size, config.hidden_size)
    again = build_layer(layer, config)
    again.load_state_dict(state)
    for (name, a), (_, b) in zip(module.named_parameters(), again.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    gate_up = again.mlp.experts.gate_up_proj  # [E, 2I, H]: expert 1's gate rows, then its up rows
    assert torch.equal(gate_up[1, : config.intermediate_size], state["block_sparse_moe.experts.1.w1.weight"])
    assert torch.equal(gate_up[1, config.intermediate_size :], state["block_sparse_moe.experts.1.w3.weight"])


def test_stages_balance_sparse_and_dense_layers():
    """Qwen3-MoE with every 2nd layer sparse: sparse and dense blocks are counted apart; "compute" counts the
    top-k experts a token uses, "parameters" all of them, and each balances its own measure; one EP rank of 2 holds
    half the experts."""
    config = tiny_config("qwen3_moe", num_hidden_layers=8, decoder_sparse_step=2, num_experts=8)
    params, active = layer_param_counts(config), layer_param_counts(config, active=True)
    blocks = [b for b in range(8)]
    sparse = [is_sparse_layer(config, b) for b in blocks]
    assert sparse == [False, True] * 4
    dense_count, sparse_count = params[1], params[2]  # pipeline layer b + 1 is block b
    assert sparse_count > dense_count and active[2] < sparse_count and active[1] == dense_count
    experts = sum(p.numel() for p in decoder_layer_class("qwen3_moe")(config, 1).mlp.experts.parameters())
    assert sparse_count - active[2] == experts - experts * 2 // 8
    shard = layer_param_counts(config, ep=2)  # the planner's share of one of expert_parallel_size=2 ranks
    assert shard[2] == sparse_count - experts // 2 and shard[1] == dense_count
    held = layer_param_counts(config, ep=2, experts_only=True)  # the planner's count of the experts alone
    assert held[2] == experts // 2 and held[1] == 0 and held[0] == 0
    for method, weights in (("parameters", params), ("compute", active)):
        bounds = stage_bounds(config, 2, method)
        parts = [sum(weights[bounds[s] : bounds[s + 1]]) for s in range(2)]
        assert max(parts) - min(parts) <= max(weights), (method, bounds)


def test_router_jitter_and_a_negative_coefficient_are_refused(tmp_path):
    """One line each, before any data or weight is read."""
    from tests.catalogue import config_error

    tiny_config("mixtral", router_jitter_noise=0.01).save_pretrained(tmp_path / "jitter")
    tiny_config("mixtral").save_pretrained(tmp_path / "plain")
    base = [f"train_file={tmp_path}/t.jsonl", f"output_dir={tmp_path}/out", "seq_length=64"]
    message = config_error([*base, f"model_name_or_path={tmp_path}/jitter"])
    assert message.startswith("router_jitter_noise=0.01 in the model's config.json") and "\n" not in message
    message = config_error([*base, f"model_name_or_path={tmp_path}/plain", "moe.aux_loss_coef=-1"])
    assert message == "moe.aux_loss_coef=-1.0 must be >= 0"


def test_tp_must_divide_the_expert_width():
    from models.sharding import tp_indivisible

    config = tiny_config("qwen3_moe", moe_intermediate_size=66)
    assert tp_indivisible(config, 4) == ("moe_intermediate_size", 66)
    assert tp_indivisible(config, 2) is None


def test_decoder_layer_options_apply_to_sparse_blocks():
    """Recompute (checkpointed sparse block) gives the same output, statistics, input gradient and parameter
    gradients as running it plainly, bit for bit, and keeps fewer saved tensors (it is really on)."""
    config = tiny_config("qwen2_moe", num_hidden_layers=2)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    plain = decoder_layer_class("qwen2_moe")(config, 0, DecoderOptions())
    with torch.no_grad():
        for p in plain.parameters():
            p.normal_(0, 0.1)
    again = decoder_layer_class("qwen2_moe")(config, 0, DecoderOptions(checkpoint_every=1))
    again.load_state_dict(plain.state_dict())
    x = torch.randn(2, 5, config.hidden_size)
    inputs = (x, torch.arange(5).expand(2, 5), torch.tensor([5, 3]), empty_stats(config))

    def run(layer):
        x, saved = inputs[0].clone().requires_grad_(), []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            out = layer((x, *inputs[1:]))
        out[0].square().sum().backward()
        return out, x.grad, {n: p.grad for n, p in layer.named_parameters()}, sum(saved)

    (a, a_dx, a_grads, a_saved), (b, b_dx, b_grads, b_saved) = run(plain), run(again)
    assert torch.equal(a[0], b[0]) and torch.equal(a[3], b[3]) and torch.equal(a_dx, b_dx)
    assert a_grads.keys() == b_grads.keys() and all(torch.equal(a_grads[n], b_grads[n]) for n in a_grads)
    assert b_saved < a_saved / 2, (a_saved, b_saved)


def test_training_from_scratch_initialises_experts_and_routers():
    """`init_weights` (no checkpoint) draws the fused experts and the routers as transformers does: N(0, std)."""
    from models.initialization import init_weights

    config = tiny_config("qwen3_moe", num_hidden_layers=1)
    layer = decoder_layer_class("qwen3_moe")(config, 0)
    with torch.no_grad():
        for p in layer.parameters():
            p.fill_(float("nan"))
    init_weights(layer, 0.02)
    for name, p in layer.named_parameters():
        assert torch.isfinite(p).all(), name
    for p in (layer.mlp.experts.gate_up_proj, layer.mlp.gate.weight):
        assert 0.015 < float(p.detach().std()) < 0.025


def _ep_block(config):
    from models.families import family_of

    family = family_of(config)
    return family.hf_class("Moe" if family.moe.hub_fused else "SparseMoeBlock")


def _ep_out(block, x):
    """The block's output as [B, S, H] (Llama 4's returns ([B * S, H], router logits))."""
    y = block(x)
    return (y[0] if isinstance(y, tuple) else y).view_as(x)


def _ep_inputs(config, rank: int):
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(2, 5 + 2 * rank, config.hidden_size, generator=g)  # the ranks send different token counts
    return x, torch.randn(x.shape, generator=g)


def _ep_worker(rank: int, store: str, model_type: str, out: str) -> None:
    """Rank `rank` of 2: experts 2r, 2r + 1 of a sparse block, its own tokens; saves output, input gradient and
    the parameter gradients."""
    import torch.distributed as dist

    from models.expert_parallel import ExpertParallel, dispatch_to_experts, local_experts_config

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        config = _ep_config(model_type)
        whole = _ep_whole(config)
        ep = ExpertParallel(2, rank, dist.new_group([0, 1]))
        local_config = local_experts_config(config, ep)
        block = _ep_block(config)(local_config)
        dispatch_to_experts(block, config, ep)
        mine = ep.local_experts(4)
        state = whole.state_dict()
        for name in ("experts.gate_up_proj", "experts.down_proj"):
            state[name] = state[name][mine.start : mine.stop]
        block.load_state_dict(state)
        x, weight = _ep_inputs(config, rank)
        x.requires_grad_()
        y = _ep_out(block, x)
        (y * weight).sum().backward()
        grads = {k: p.grad for k, p in block.named_parameters()}
        torch.save({"y": y.detach(), "x_grad": x.grad, "grads": grads}, out)
    finally:
        dist.destroy_process_group()
    # NOTE: exit at once: gloo's threads can abort the interpreter's teardown ("terminate called without an
    # active exception", SIGABRT) after the work is done and saved.
    os._exit(0)


def _ep_config(model_type: str):
    config = tiny_config(model_type)
    config._experts_implementation = "grouped_mm"
    return config


def _ep_whole(config):
    torch.manual_seed(0)
    whole = _ep_block(config)(config)
    with torch.no_grad():
        for p in whole.parameters():
            p.normal_(0, 0.2)
    return whole


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "llama4_text"])
def test_experts_split_over_two_ranks_equal_the_whole_block(model_type, tmp_path):
    """Expert parallelism, 2 ranks with 2 of the 4 experts each and their own tokens (different counts): every
    rank's output and input gradient equal transformers' whole block on its tokens, each expert's gradient sums
    both ranks' tokens as the whole block's does, and the replicated router's gradient is the one of the rank's
    own tokens; all within 1e-6 of the largest value (the experts' matmuls run on other sets of rows: fp32
    rounding of another blocking, measured 2.7e-7). Llama 4's whole block runs every expert on every token (inputs
    scaled by 0 outside the top-k): the split one sends only the top-k pairs."""

    def close(got, want):
        assert float((got - want).abs().max()) <= 1e-6 * float(want.abs().max()), float((got - want).abs().max())

    ranks = [torch.load(o, weights_only=True) for o in spawn_ranks(_ep_worker, tmp_path, model_type)]
    config = _ep_config(model_type)
    expert_grads = {}
    for rank in (0, 1):
        whole = _ep_whole(config)
        x, weight = _ep_inputs(config, rank)
        x.requires_grad_()
        y = _ep_out(whole, x)
        (y * weight).sum().backward()
        close(ranks[rank]["y"], y.detach())
        close(ranks[rank]["x_grad"], x.grad)
        for name, p in whole.named_parameters():
            if name.startswith("experts."):
                expert_grads[name] = expert_grads.get(name, 0) + p.grad
            else:  # router, shared expert: replicated, this rank's tokens only
                close(ranks[rank]["grads"][name], p.grad)
    for name, grad in expert_grads.items():
        got = torch.cat([ranks[0]["grads"][name], ranks[1]["grads"][name]])  # experts 0-1, then 2-3
        close(got, grad)


@pytest.mark.parametrize(
    "extra,world,message",
    [
        (["expert_parallel_size=3"], 4, "expert_parallel_size=3 does not divide the data-parallel size 4"),
        (["expert_parallel_size=8"], 8, "expert_parallel_size=8 does not divide the model's 4 experts"),
        (["expert_parallel_size=2", "deepspeed=fp16_offload"], 4, "expert_parallel_size=2 runs with fp32 or bf16"),
        (
            ["expert_parallel_size=2", "deepspeed.zero_stage=1", "deepspeed.offload_optimizer=true"],
            4,
            "expert_parallel_size=2 with deepspeed.offload_optimizer=true is not supported",
        ),
        (["moe.bias_update_rate=0.001"], 4, "moe.bias_update_rate=0.001: mixtral's router has no score bias"),
        (["moe.bias_update_rate=-1"], 4, "moe.bias_update_rate=-1.0 must be >= 0"),
    ],
)
def test_expert_parallel_settings_that_cannot_run_are_refused(extra, world, message, tmp_path):
    """One line naming the key, before any data or weight is read."""
    from tests.catalogue import config_error

    tiny_config("mixtral").save_pretrained(tmp_path / "m")
    base = [f"train_file={tmp_path}/t.jsonl", f"output_dir={tmp_path}/out", "seq_length=64"]
    got = config_error([*base, f"model_name_or_path={tmp_path}/m", "deepspeed=fp32", *extra], world_size=world)
    assert got.startswith(message) and "\n" not in got, got
    tiny_config("llama").save_pretrained(tmp_path / "dense")
    got = config_error([*base, f"model_name_or_path={tmp_path}/dense", "expert_parallel_size=2"], world_size=4)
    assert got == "expert_parallel_size=2: the model (llama) has no experts"
    got = config_error([*base, f"model_name_or_path={tmp_path}/dense", "moe.bias_update_rate=0.001"], world_size=4)
    assert got == "moe.bias_update_rate=0.001: the model (llama) has no experts"


@pytest.mark.parametrize(
    "extra,message",
    [
        (["moe.aux_loss_coef=0.01"], "moe.aux_loss_coef=0.01: transformers trains llama4_text with no load-balancing"),
        (["model.attn_implementation=flash_attention_2"], "model.attn_implementation=flash_attention_2: transformers'"),
        (["data.packing=true", "seq_length=64"], "data.packing/concatenate with seq_length=64 > floor_scale=4"),
    ],
)
def test_llama4_settings_transformers_does_not_compute_are_refused(extra, message, tmp_path):
    """Llama 4: a load-balancing loss (transformers computes none for it), flash-attn (it has none), and packed rows
    longer than floor_scale (its temperature counts positions from the row's start): one line naming the key."""
    from tests.catalogue import config_error

    tiny_config("llama4_text").save_pretrained(tmp_path / "m")
    base = [f"train_file={tmp_path}/t.jsonl", f"output_dir={tmp_path}/out", f"model_name_or_path={tmp_path}/m"]
    got = config_error([*base, "seq_length=3", *extra], world_size=2)
    assert got.startswith(message) and "\n" not in got, got


def test_llama4_routed_experts_equal_transformers_dense_block():
    """`moe.routed_experts`: Llama 4's experts run on their routed tokens only (one grouped matmul) instead of every
    expert on every token as transformers runs them; the decoder layer's output, input gradient and every parameter
    gradient equal transformers' layer within 1e-6 of the largest value (fp32 rounding of other matmul blockings)."""
    from transformers.models.llama4.modeling_llama4 import Llama4TextDecoderLayer, Llama4TextRotaryEmbedding

    from models.layers import DecoderOptions, decoder_layer_class
    from models.moe import empty_stats

    # (one chunk: transformers' layer alone gets no chunked mask; the experts are what this compares)
    config = tiny_config("llama4_text", num_key_value_heads=2, interleave_moe_layer_step=1, attention_chunk_size=64)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    hf = Llama4TextDecoderLayer(config, 0)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2)
    ours = decoder_layer_class("llama4_text")(config, 0, DecoderOptions(routed_experts=True))
    ours.load_state_dict(hf.state_dict())
    assert ours.feed_forward.forward.__func__ is not type(ours.feed_forward).forward  # the routed dispatch runs
    x, weight = torch.randn(2, 10, config.hidden_size), torch.randn(2, 10, config.hidden_size)
    pos = torch.arange(10).expand(2, 10)

    def close(got, want):
        diff = float((got - want).detach().abs().max())
        assert diff <= 1e-6 * float(want.detach().abs().max()), diff

    h1, h2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    want = hf(h1, position_embeddings=Llama4TextRotaryEmbedding(config)(h1, pos), position_ids=pos)
    got = ours((h2, pos, torch.full((2,), 10), empty_stats(config).requires_grad_()))[0]
    (want * weight).sum().backward()
    (got * weight).sum().backward()
    close(got, want.detach())
    close(h2.grad, h1.grad)
    grads = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        close(p.grad, grads[name].grad)


@pytest.mark.parametrize(
    "model_type,extra,message",
    [
        ("qwen3_next", ["data.packing=true"], "data.packing/concatenate: qwen3_next's linear-attention layers carry"),
        ("qwen3_next", ["context_parallel_size=2"], "context_parallel_size=2: qwen3_next's linear-attention layers"),
        ("gpt_oss", ["model.attn_implementation=sdpa"], "model.attn_implementation=sdpa: transformers runs gpt_oss"),
        ("deepseek_v32", ["context_parallel_size=2"], "context_parallel_size=2: deepseek_v32's indexer scores"),
        (
            "deepseek_v32",
            ["lora.enabled=true", "lora.target_modules=[q_a_proj,weights_proj]"],
            "lora.target_modules: 'weights_proj' is not a linear layer of the decoder",
        ),
        (
            "deepseek_v32",
            ["model.attn_implementation=flash_attention_2"],
            "model.attn_implementation=flash_attention_2: transformers' deepseek_v32 does not support it",
        ),
        (
            "gpt_oss",
            ["model.attn_implementation=flash_attention_2"],
            "model.attn_implementation=flash_attention_2: transformers' gpt_oss does not support it",
        ),
        (
            "gpt_oss",
            ["deepspeed.precision=fp16"],
            "deepspeed.precision=fp16: transformers keeps gpt_oss's input_layernorm, norm, post_attention_layernorm in "
            "fp32 under fp16",
        ),
        ("deepseek_v3", ["lora.enabled=true"], "lora.target_modules: 'q_proj' is not in deepseek_v3's attention (q_a_"),
        (
            "deepseek_v3",
            ["lora.enabled=true", "lora.target_modules=[kv_b_proj]", "tensor_parallel_size=2"],
            "lora.enabled with tensor_parallel_size=2: LoRA on deepseek_v3's latent attention",
        ),
        (
            "glm4_moe",
            ["lora.enabled=true", "moe.bias_update_rate=0.001"],
            "moe.bias_update_rate=0.001 with lora.enabled=true: --merge-lora exports the base model's score biases",
        ),
        # Mistral 4 chooses experts as DeepSeek-V3 does, from softmax scores with no score bias to balance with.
        ("mistral4", ["moe.bias_update_rate=0.001"], "moe.bias_update_rate=0.001: mistral4's router has no score bias"),
        # LFM2's short convolutions read the tokens before each across a document boundary; LFM2-MoE's score bias is
        # its block's, which the balancing does not move.
        ("lfm2", ["data.packing=true"], "data.packing/concatenate: lfm2's short-convolution layers carry a state"),
        ("lfm2_moe", ["moe.bias_update_rate=0.001"], "moe.bias_update_rate=0.001: lfm2_moe's router has no score"),
        # Granite 4's Mamba-2 state runs along the whole row too; its split over TP is not built
        ("granitemoehybrid", ["context_parallel_size=2"], "context_parallel_size=2: granitemoehybrid's linear-attent"),
        ("granitemoehybrid", ["tensor_parallel_size=2"], "tensor_parallel_size=2: model_type='granitemoehybrid' is n"),
        ("falcon_h1", ["data.packing=true"], "data.packing/concatenate: falcon_h1's Mamba-2 mixer in every layer carr"),
        ("nemotron_h", ["data.packing=true"], "data.packing/concatenate: nemotron_h's linear-attention layers carry"),
        ("kimi_linear", ["context_parallel_size=2"], "context_parallel_size=2: kimi_linear's linear-attention layers"),
    ],
)
def test_what_a_family_cannot_run_is_refused_in_one_line(model_type, extra, message, tmp_path):
    """Qwen3-Next's recurrence runs along the whole row (no packed documents, no context parallelism); LoRA on its
    MLP targets would adapt the shared experts; gpt-oss's sinks have no SDPA or flash-attn, its experts' down biases
    (whole on every TP rank) no norm that counts them once under TP x EP, and its norms, fp32 under fp16 in
    transformers, would be trained by DeepSpeed's fp16 optimizer. One line naming the key."""
    from tests.catalogue import config_error

    tiny_config(model_type).save_pretrained(tmp_path / "m")
    base = [f"train_file={tmp_path}/t.jsonl", f"output_dir={tmp_path}/out", "seq_length=64", "deepspeed=fp32"]
    got = config_error([*base, f"model_name_or_path={tmp_path}/m", *extra], world_size=4)
    assert got.startswith(message) and "\n" not in got, got
