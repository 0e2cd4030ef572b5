"""Each supported family's pipeline layers, on transformers' own classes, give transformers' logits bit for bit
(single process, fast); the key table covers each family's keys exactly; other model types are refused."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

from checkpoint.expert_layouts import fuse_per_expert
from models.config import ConfigFields, differing_field, load_hf_config, read_config_fields
from models.families import FAMILIES, family_of, resolve_attention
from models.head import split_stats, tied_lm_head_forward
from models.hub_names import memory_key
from models.key_table import all_layer_keys
from models.layer_kinds import is_sparse_layer
from models.layers import DecoderOptions, build_layer, decoder_layer_class
from models.pipe_layout import pipe_layers
from tests.conftest import hf_state
from tests.family_cases import FAMILY_CONFIGS
from tests.hub_extras import perturb
from tools.tiny_models import hub_named, tiny_config


def pipeline_logits(config, state: dict, ids: torch.Tensor, device="cpu", dtype=None) -> torch.Tensor:
    layers = pipe_layers(config.num_hidden_layers, config.tie_word_embeddings)
    keys = all_layer_keys(config)
    modules = []
    for layer in layers:
        if layer.has_file:
            module = build_layer(layer, config, DecoderOptions())
            module.load_state_dict({ours: state[hf] for ours, hf in keys[layer.index].items()})
            modules.append(module.to(device=device, dtype=dtype).eval())
    x = (ids, torch.arange(ids.shape[1], device=ids.device).expand_as(ids))
    with torch.no_grad():
        for module in modules:
            x = module(x)
        x = tied_lm_head_forward(modules[0], x) if config.tie_word_embeddings else x
        return split_stats(x)[0]


BASE = {"num_hidden_layers": 3, "num_key_value_heads": 2}  # (a case's own overrides win)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", list(FAMILY_CONFIGS))
def test_family_layers_equal_transformers_bit_for_bit(name, attn, tmp_path):
    from transformers import AutoModelForCausalLM

    model_type, overrides = FAMILY_CONFIGS[name]
    config = tiny_config(model_type, **BASE | overrides)
    if resolve_attention(config, None) != "sdpa" and attn == "sdpa":  # gpt-oss's sinks: transformers runs eager
        with pytest.raises(ValueError, match=f"^model.attn_implementation=sdpa: transformers runs {model_type} "):
            resolve_attention(config, attn)
        return
    config._attn_implementation = attn
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config).eval()
    perturb(hf)
    hf.save_pretrained(tmp_path)  # the hub's keys: one per expert where transformers fuses them in memory
    hub_named(str(tmp_path), config)  # (where transformers' save names a key otherwise: Kimi Linear's dense MLP)
    state = fuse_per_expert(hf_state(str(tmp_path)), config)  # (or fused, as Qwen3.5-MoE's hub checkpoints)
    # The table's keys are exactly the checkpoint's (the tied head's weight lives in the embedding's file).
    table = {hf_key for keys in all_layer_keys(config).values() for hf_key in keys.values()}
    assert table == set(state)
    ids = torch.randint(0, config.vocab_size, (2, 12))
    with torch.no_grad():
        reference = hf(input_ids=ids).logits
    assert torch.equal(pipeline_logits(config, state, ids), reference)
    # The soft-cap and the local layers' window matter at this size and length: ignoring either would show.
    for word, ignored in {"softcap": dict(final_logit_softcapping=None), "local": dict(sliding_window=64)}.items():
        if word in name:
            other = tiny_config(model_type, **BASE | overrides | ignored)
            other._attn_implementation = attn
            assert not torch.equal(pipeline_logits(other, state, ids), reference), ignored
    if "window" in name or "sliding" in name:  # the window matters at this length: ignoring it would show
        full = tiny_config(
            model_type,
            num_hidden_layers=3,
            num_key_value_heads=2,
            **{k: v for k, v in overrides.items() if "window" not in k},
        )
        full._attn_implementation = attn
        assert not torch.equal(pipeline_logits(full, state, ids), reference)
    block_biases = [k for k in state if k.endswith(".feed_forward.expert_bias")]  # (LFM2-MoE's, on the block)
    biased = family_of(config).keeps_fp32("e_score_correction_bias") and "rope_interleave" not in overrides
    if block_biases or biased and any(is_sparse_layer(config, b) for b in range(config.num_hidden_layers)):
        # The routers' score biases change the choice of experts at this size: dropping them would show.
        biases = [k for k in state if memory_key(config, k).endswith("e_score_correction_bias")] + block_biases
        assert biases
        unbiased = state | {k: torch.zeros_like(state[k]) for k in biases}
        assert not torch.equal(pipeline_logits(config, unbiased, ids), reference)
    if "mamba" in name:  # Mamba-2's D skip (each head's input added to its scan's output): dropping it shows
        skips = [k for k in state if k.endswith(("mamba.D", "mixer.D"))]  # (Nemotron-H's Mamba is a `mixer`)
        assert skips
        assert not torch.equal(pipeline_logits(config, state | {k: 0 * state[k] for k in skips}, ids), reference)
    if "multipliers" in name:  # Falcon-H1's embedding, head and mup_vector multipliers: each left out would show
        for ignored in (dict(embedding_multiplier=1.0), dict(lm_head_multiplier=1.0), dict(ssm_multipliers=[1.0] * 5)):
            other = tiny_config(model_type, **BASE | overrides | ignored)
            other._attn_implementation = attn
            assert not torch.equal(pipeline_logits(other, state, ids), reference), ignored
    if "with-rope" in name:  # Granite 4's attention with RoPE: run without it (as its NoPE models), it shows
        other = tiny_config(model_type, **BASE | overrides | dict(position_embedding_type="nope"))
        other._attn_implementation = attn
        assert not torch.equal(pipeline_logits(other, state, ids), reference)
    if "conv" in name:  # LFM2's convolutions read the 2 tokens before each: without those taps (no state) it shows
        taps = [k for k in state if k.endswith(("conv.conv.weight", "_conv1d.weight"))]  # (and Kimi Linear's q/k/v)
        assert taps
        stateless = state | {k: torch.cat([torch.zeros_like(state[k][..., :-1]), state[k][..., -1:]], -1) for k in taps}
        assert not torch.equal(pipeline_logits(config, stateless, ids), reference)
    if "clip" in name:  # OLMoE's clipped q/k/v: unclipped would show
        other = tiny_config(model_type, **BASE | overrides | dict(clip_qkv=None))
        other._attn_implementation = attn
        assert not torch.equal(pipeline_logits(other, state, ids), reference)
    if "mup" in name:  # Granite's embedding and logit multipliers matter: either left out would show
        for ignored in (dict(embedding_multiplier=1.0), dict(logits_scaling=1.0)):
            other = tiny_config(model_type, **BASE | overrides | ignored)
            other._attn_implementation = attn
            assert not torch.equal(pipeline_logits(other, state, ids), reference), ignored
    if "chunked" in name:  # the chunk and the temperature matter at this length: ignoring either would show
        for ignored in (dict(attention_chunk_size=64), dict(attn_temperature_tuning=False)):
            other = tiny_config(model_type, **BASE | overrides | ignored)
            other._attn_implementation = attn
            assert not torch.equal(pipeline_logits(other, state, ids), reference)


@pytest.mark.parametrize("model_type", ["deepseek_v32", "gpt_oss"])
def test_fp16_keeps_fp32_what_transformers_keeps(model_type, tmp_path):
    """In fp16 transformers keeps its `_keep_in_fp32_modules` in fp32 (DeepSeek-V3.2's indexer `weights_proj`,
    gpt-oss's norms) beside what it keeps in fp16 and bf16 (score biases), from a bf16 checkpoint too. Conversion to
    fp16 keeps the same tensors fp32, our layers cast to fp16 give transformers' fp16 logits bit for bit, and after
    DeepSpeed's cast of every parameter to fp16 (its `_cast_module_mixed_precision`, run here on a stage of two
    layers) the frozen ones are fp32 again (`frozen_weights_kept_fp32`): V3.2's indexer, and under LoRA gpt-oss's
    norms, the final one included. fp16 passes validation for V3.2 and for gpt-oss with LoRA (without, its trained
    norms are refused: tests/test_moe.py)."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from torch import nn
    from transformers import AutoModelForCausalLM

    from checkpoint.convert import convert_hf_to_pipeline
    from checkpoint.pipeline_reader import load_hf_state_dict
    from models.pipe_layout import NORM
    from tests.catalogue import config_error
    from training.engine import frozen_weights_kept_fp32

    config = tiny_config(model_type, num_hidden_layers=3)
    config._attn_implementation = resolve_attention(config, None)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config)
    perturb(hf)
    hf.to(torch.bfloat16).save_pretrained(tmp_path / "hf")  # as the hub keeps them
    fp16 = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float16).eval()
    kept = {k for k, t in fp16.state_dict().items() if t.dtype == torch.float32}
    if model_type == "gpt_oss":
        norms = ("input_layernorm", "post_attention_layernorm")
        assert kept == {"model.norm.weight"} | {f"model.layers.{i}.{n}.weight" for i in range(3) for n in norms}
    else:
        biases = {f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in range(3) if is_sparse_layer(config, i)}
        assert kept == {f"model.layers.{i}.self_attn.indexer.weights_proj.weight" for i in range(3)} | biases
    convert_hf_to_pipeline(str(tmp_path / "hf"), str(tmp_path / "ckpt"), dtype="fp16", log=lambda *_: None)
    assert {k for k, t in load_hf_state_dict(str(tmp_path / "ckpt")).items() if t.dtype == torch.float32} == kept
    ids = torch.randint(0, config.vocab_size, (2, 12))
    state = fuse_per_expert(hf_state(str(tmp_path / "hf")), config)
    with torch.no_grad():
        assert torch.equal(pipeline_logits(config, state, ids, dtype=torch.float16), fp16(input_ids=ids).logits)
    layers = pipe_layers(3, config.tie_word_embeddings)
    block, norm = layers[1], next(layer for layer in layers if layer.kind == NORM)  # decoder block 0, the norm
    half = build_layer(block, config).half()
    block_kept = {k.removeprefix("model.layers.0.") for k in kept if k.startswith("model.layers.0.")}
    assert {k for k, t in half.state_dict().items() if t.dtype == torch.float32} == block_kept
    for lora in (False, True):  # LoRA: every base weight frozen, gpt-oss's norms too
        stage = nn.Sequential(build_layer(block, config), build_layer(norm, config))  # named as a stage's layers
        if lora:
            stage.requires_grad_(False)
        with frozen_weights_kept_fp32(stage, "fp16"):
            engine = dataclasses.make_dataclass("Engine", ["module"])(stage)
            DeepSpeedEngine._cast_module_mixed_precision(engine, torch.half, None, False)
        norms = {"0.input_layernorm.weight", "0.post_attention_layernorm.weight", "1.weight"} if lora else set()
        want = {"deepseek_v32": {"0.self_attn.indexer.weights_proj.weight"}, "gpt_oss": norms}[model_type]
        assert {n for n, p in stage.named_parameters() if p.dtype == torch.float32} == want
    config.save_pretrained(tmp_path / "m")
    run = [f"train_file={tmp_path}/t.jsonl", f"output_dir={tmp_path}/out", f"model_name_or_path={tmp_path}/m"]
    run += ["seq_length=64", "deepspeed=fp32", "deepspeed.precision=fp16"]
    run += ["lora.enabled=true", "lora.target_modules=[q_proj,v_proj]"] if model_type == "gpt_oss" else []
    with pytest.raises(AssertionError, match="no error for"):
        config_error(run, world_size=4)


def test_other_model_types_are_refused(tmp_path):
    from models.config import SUPPORTED_MODEL_TYPES

    assert {"llama", "minimax_m2", "gemma3", "kimi_k2"} <= set(SUPPORTED_MODEL_TYPES)  # a family, container, alias
    for model_type in ("jamba", "zamba2"):  # what we do not build (Jamba's, Zamba 2's Mamba hybrids)
        (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
        # The registry's model types (one module each in models/families/), families, containers and aliases.
        supported = re.escape("supported: " + ", ".join(SUPPORTED_MODEL_TYPES))
        with pytest.raises(ValueError, match=f"model_type='{model_type}' is not supported \\({supported}\\)"):
            load_hf_config(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "sliding_window": 4096}))
    with pytest.raises(ValueError, match="model_type='llama' with sliding_window=4096"):
        load_hf_config(str(tmp_path))


@pytest.mark.parametrize(
    "model_type",
    ["llama", "mistral", "qwen2", "qwen3", "helium", "smollm3", "ministral3", "phi3", "olmo2", "glm4", "gemma4_text"],
)
def test_config_fields_read_without_transformers_equal_transformers_reading(model_type, tmp_path):
    """What conversion reads of config.json before transformers is imported equals transformers' own reading,
    for every family, with each key that has a default left out of the file (the defaults are transformers')."""
    config = tiny_config(model_type, num_key_value_heads=2, tie_word_embeddings=True)
    config.save_pretrained(tmp_path)
    full = json.loads((tmp_path / "config.json").read_text())
    optional = [f.name for f in dataclasses.fields(ConfigFields) if f.default is not dataclasses.MISSING]
    for left_out in [None, *optional]:
        (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in full.items() if k != left_out}))
        light = read_config_fields(str(tmp_path))
        assert light is not None and differing_field(light, load_hf_config(str(tmp_path))) is None, left_out
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in full.items() if k != "num_hidden_layers"}))
    assert read_config_fields(str(tmp_path)) is None  # no default: only transformers knows (it assumes 32)


def test_tensor_parallelism_is_refused_in_one_line_where_its_split_is_not_built(monkeypatch):
    """A family whose split is not built (`Family.tp_refused`; none of today's: a registry entry patched for the
    test): training and conversion at TP > 1 stop with one line naming the family and the way out, before anything
    is read or written; TP=1 passes."""
    from checkpoint.errors import CheckpointError
    from checkpoint.writer import check_tp
    from schema.train import TrainConfig
    from training.precision import resolved
    from training.validate import validate_layout

    model_type = "olmo2"
    monkeypatch.setitem(FAMILIES, model_type, dataclasses.replace(FAMILIES[model_type], tp_refused="a reason"))
    config = tiny_config(model_type, num_key_value_heads=2)
    ds = resolved(TrainConfig().deepspeed)  # as the trainer holds it (training/precision.py)
    line = (
        rf"model_type='{model_type}' is not split over tensor-parallel ranks \([^)]+\); use pipeline, context and data"
    )
    with pytest.raises(CheckpointError, match=rf"^--tp 2: {line} parallelism$"):
        check_tp(config, 2, None)
    with pytest.raises(ValueError, match=rf"^tensor_parallel_size=2: {line} parallelism$"):
        validate_layout(TrainConfig(num_stages=2, tensor_parallel_size=2, deepspeed=ds), 4, config)
    check_tp(config, 1, None)
    validate_layout(TrainConfig(num_stages=2, tensor_parallel_size=1, deepspeed=ds), 4, config)


def test_lora_targets_are_the_familys_own_linear_layers():
    """Phi-3 fuses q/k/v and gate/up: `q_proj` names nothing there (one line naming its layers), `qkv_proj` does."""
    from models.lora import check_target_modules

    phi3, llama = tiny_config("phi3", num_key_value_heads=2), tiny_config("llama", num_key_value_heads=2)
    with pytest.raises(ValueError, match=r"^lora.target_modules: 'q_proj' is not a linear layer of the decoder \("):
        check_target_modules(["q_proj"], phi3)
    check_target_modules(["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], phi3)
    check_target_modules(["q_proj", "v_proj", "down_proj"], llama)
    with pytest.raises(ValueError, match="'qkv_proj' is not a linear layer"):
        check_target_modules(["qkv_proj"], llama)
    # LFM2: its MLP's w1/w2/w3 and its short convolutions' in_proj/out_proj besides attention's; no o_proj
    lfm2 = tiny_config("lfm2", num_key_value_heads=2)
    check_target_modules(["q_proj", "out_proj", "in_proj", "w1", "w2", "w3"], lfm2)
    with pytest.raises(ValueError, match=r"'o_proj' is not a linear layer of the decoder \(in_proj, out_proj, w1, "):
        check_target_modules(["o_proj"], lfm2)
    # Granite 4 (experts in every layer): Mamba's in_proj and out_proj, the shared MLP's, attention's; not the experts'
    granite4 = tiny_config("granitemoehybrid", num_key_value_heads=2)
    check_target_modules(["in_proj", "out_proj", "input_linear", "output_linear", "q_proj", "o_proj"], granite4)
    with pytest.raises(ValueError, match="'router' is not a linear layer"):
        check_target_modules(["router"], granite4)
    # Nemotron-H (one mixer a block, all named `mixer`): attention's, Mamba's, the MLP's and shared expert's up/down
    nemotron = tiny_config("nemotron_h")
    check_target_modules(["q_proj", "o_proj", "in_proj", "out_proj", "up_proj", "down_proj"], nemotron)
    with pytest.raises(ValueError, match="'in_proj_qkv' is not a linear layer"):
        check_target_modules(["in_proj_qkv"], nemotron)
    # Kimi Linear: its delta attention's (a `self_attn` too: k_proj, b_proj, the forget gate's) and latent attention's
    kimi = tiny_config("kimi_linear")
    check_target_modules(["q_proj", "k_proj", "v_proj", "b_proj", "f_a_proj", "g_b_proj", "kv_b_proj", "o_proj"], kimi)


# transformers' tensor-parallel styles and the split each means for our keys (models/sharding.py): a column split
# of x @ W experts [E, I, H] is our EXPERT_IN, a row split of W x experts [E, H, I] our EXPERT_ROW.
PLAN_STYLES = {
    "colwise": {"column", "expert_in"},
    "rowwise": {"row", "expert_row"},
    "replicated_with_grad_allreduce": {"replica"},
    "packed_colwise": {"gate_up"},
    "packed_rowwise": {"gate_up_out"},
    "mla_kv_a_proj": {"replica"},  # DeepSeek-V3.2's plan: MLA's compressed keys/values, whole on every rank
}


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_tp_rules_agree_with_transformers_tp_plan(model_type):
    """Every entry of the family's `base_model_tp_plan` names a module or parameter of its decoder layer (a sparse one
    for experts), and our split of it is the one the plan's style means; every weight our rules split is in the
    plan. Families whose split is not built (`tp_refused`) only have their plan's modules checked."""
    from models.pipe_layout import DECODER
    from models.tp_rules import tp_split

    config = tiny_config(model_type, num_key_value_heads=2)
    names = {}
    with torch.device("meta"):
        for block in range(config.num_hidden_layers):  # sparse and dense layers
            names |= dict(decoder_layer_class(model_type)(config, block).named_parameters())
    plan = config.base_model_tp_plan or {}  # gpt-oss has none
    # (module-level styles: the experts' dispatch, MiMo-V2-Flash's attention holding its rank's own head counts)
    plan = {k.removeprefix("layers.*."): v for k, v in plan.items() if v not in ("moe_tp_experts", "local_params")}
    plan = {k: v for k, v in plan.items() if v != "embedding_rowwise"}  # (the model's, Nemotron-H's: not a layer's)
    dense_mlp = any(not is_sparse_layer(config, b) for b in range(config.num_hidden_layers))
    if getattr(config, "enable_moe_block", None) is False:  # Gemma 4's experts beside the MLP: refused, not built
        plan = {k: v for k, v in plan.items() if not k.startswith("experts.")}
    for module, style in plan.items():
        name = module if module in names else f"{module}.weight"
        # A model with experts in every layer of the tiny config has no dense MLP for the plan's dense entries.
        absent_dense = FAMILIES[model_type].moe is not None and not dense_mlp and module.count(".") == 1
        assert name in names or absent_dense, (module, sorted(names))
        if not FAMILIES[model_type].tp_refused:  # a fused projection splits as a column layer, part by part
            rule = tp_split(DECODER, name, config)
            rule = "column" if rule.startswith("parts:") else rule
            # transformers gathers linear attention's projections (every rank runs every head, out_proj's output
            # columns split); we split it by heads as attention is: out_proj by its input columns.
            if name == "linear_attn.out_proj.weight":
                style = "rowwise"
            assert rule in PLAN_STYLES[style.removesuffix("_gather_output").removesuffix("_split_input")], (name, style)
    if not FAMILIES[model_type].tp_refused:
        split = {n for n in names if n.endswith("weight") or ".experts." in n} - {f"{m}.weight" for m in plan}
        # Beyond the plan: transformers leaves Qwen2-MoE's shared expert whole on every rank, and gathers OLMo's q/k/v
        # outputs so that its q/k norms see whole projections; we split the shared expert as a dense MLP, and OLMo's
        # q/k norms with the heads, their statistics summed over TP (tests/test_tensor_parallel.py holds both split
        # blocks to the whole ones).
        beyond = {
            "qwen2_moe": {f"mlp.shared_expert.{p}_proj.weight" for p in ("gate", "up", "down")},
            "olmo2": {"self_attn.q_norm.weight", "self_attn.k_norm.weight"},
            "olmo3": {"self_attn.q_norm.weight", "self_attn.k_norm.weight"},
            "olmoe": {"self_attn.q_norm.weight", "self_attn.k_norm.weight"},
            "flex_olmo": {"self_attn.q_norm.weight", "self_attn.k_norm.weight"},
            "minimax_m2": {"self_attn.q_norm.weight", "self_attn.k_norm.weight"},
            # transformers' plan leaves DeepSeek's attention whole; we split MLA by heads.
            "deepseek_v3": {f"self_attn.{p}.weight" for p in ("q_b_proj", "kv_b_proj", "o_proj")},
            "mistral4": {f"self_attn.{p}.weight" for p in ("q_b_proj", "kv_b_proj", "o_proj")},
            # GLM-4.7-Flash's plan splits MLA by heads as we do, and leaves its shared experts whole.
            "glm4_moe_lite": {f"mlp.shared_experts.{p}_proj.weight" for p in ("gate", "up", "down")},
            "exaone_moe": {f"mlp.shared_experts.{p}_proj.weight" for p in ("gate", "up", "down")},
            # transformers 5.23 has no plan for gpt-oss: every split is ours (its sinks with the heads, not weights)
            "gpt_oss": {f"self_attn.{p}_proj.weight" for p in "qkvo"}
            | {f"mlp.experts.{p}" for p in ("gate_up_proj", "gate_up_proj_bias", "down_proj")},
            # transformers leaves DeepSeek-V4's shared expert whole too ("too small to be worth sharding")
            "deepseek_v4": {f"mlp.shared_experts.{p}_proj.weight" for p in ("gate", "up", "down")},
            # transformers 5.23 has no plan for LFM2: its short convolution by channels, its attention by heads, its MLP
            "lfm2": {f"conv.{p}.weight" for p in ("in_proj", "conv", "out_proj")}
            | {f"self_attn.{p}_proj.weight" for p in ("q", "k", "v", "out")}
            | {f"feed_forward.w{i}.weight" for i in (1, 2, 3)},
            # ... and LFM2-MoE's plan its experts only
            "lfm2_moe": {f"conv.{p}.weight" for p in ("in_proj", "conv", "out_proj")}
            | {f"self_attn.{p}_proj.weight" for p in ("q", "k", "v", "out")}
            | {f"feed_forward.w{i}.weight" for i in (1, 2, 3)},
        }.get(model_type, set())
        # Linear attention's depthwise convolution splits with its heads (transformers' plan leaves it whole).
        beyond |= {n for n in names if n == "linear_attn.conv1d.weight"}
        assert {n for n in split - set(plan) if tp_split(DECODER, n, config) != "replica"} == beyond


# The dense families that DPO launches do not train (test_dpo.py trains LLaMA and the mixtures of experts Mixtral,
# DeepSeek-V3, gpt-oss, GLM-4.5, Qwen3-Next and Mistral 4 under PP x DP (x EP, x CP)): one case each, every layer
# kind of the family in its three or four layers.
DPO_CASES = [
    "mistral-window",
    "qwen2-tied",
    "qwen3",
    "helium-biases",
    "smollm3-nope-biases",
    "ministral3-scaled-window",
    "seed_oss-biases",
    "ernie4_5-biases",
    "gemma3-local-softcap",
    "phi3-window",
    "glm4",
    "olmo2-biases",
    "olmo3-local",
    "qwen3_5-hybrid",
    "gemma4-ple-shared-kv",  # its per-layer inputs and shared K/V
    "lfm2-conv-biases",  # its short convolutions
    "granitemoehybrid-with-rope-dense",  # Mamba-2
    "nemotron_h-mamba-dense",  # one mixer a block
    "kimi_linear-kda-conv-mla",  # Kimi Delta Attention, latent attention, experts
]


@pytest.mark.parametrize("name", DPO_CASES)
def test_dpo_through_each_familys_layers_equals_transformers(name, tmp_path):
    """DPO (sigmoid with the sft term) on two pairs of right-padded rows through the family's pipeline layers, in one
    process: the last stage's `PreferenceLoss` equals the same loss on transformers' model (`preference_losses`,
    held to TRL in tests/test_preference.py) against a reference of other weights, and every weight's gradient equals
    transformers' within 1e-5 of its scale. With the launches of test_dpo.py (the pipeline, its schedules and DP around
    the loss, which no family changes) this is each family's DPO."""
    from transformers import AutoModelForCausalLM

    from models.preference import PreferenceLoss, PreferenceSettings, preference_losses, sft_loss

    model_type, overrides = FAMILY_CONFIGS[name]
    config = tiny_config(model_type, **{"num_hidden_layers": 3, "num_key_value_heads": 2} | overrides)
    config._attn_implementation = resolve_attention(config, None)
    models = []
    for seed in (0, 1):  # the policy, then the reference
        torch.manual_seed(seed)
        models.append(AutoModelForCausalLM.from_config(config).eval())
        perturb(models[-1])
    policy, reference = models
    policy.save_pretrained(tmp_path)
    hub_named(str(tmp_path), config)
    state = hf_state(str(tmp_path))
    # Pairs 0 and 1: rows 0, 1 chosen, rows 2, 3 rejected; prompts of 5 and 4 tokens, rows right-padded with 0.
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(1, config.vocab_size, (4, 12), generator=generator)
    targets = torch.zeros(4, 12, dtype=torch.bool)
    for row, (prompt, length) in enumerate([(5, 12), (4, 10), (5, 11), (4, 9)]):
        ids[row, length:] = 0
        targets[row, prompt:length] = True
    labels = torch.roll(ids, -1, 1).masked_fill(~torch.roll(targets, -1, 1), -100)
    labels[:, -1] = -100

    def completion_logps(logits):  # summed log-probs of each row's completion tokens, and their count
        per_token = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        return (per_token * targets[:, 1:]).sum(-1), targets[:, 1:].sum(-1)

    settings = PreferenceSettings("sigmoid", beta=0.2, sft_weight=0.5)
    with torch.no_grad():
        ref, _ = completion_logps(reference(input_ids=ids).logits)
    logps, tokens = completion_logps(policy(input_ids=ids).logits)
    losses, *_ = preference_losses(settings, logps[:2], logps[2:], tokens[:2], tokens[2:], ref[:2], ref[2:])
    expected = losses.mean() + settings.sft_weight * sft_loss(logps[:2], tokens[:2])
    expected.backward()

    keys = all_layer_keys(config)
    modules = {}
    for layer in pipe_layers(config.num_hidden_layers, config.tie_word_embeddings):
        if layer.has_file:
            modules[layer.index] = build_layer(layer, config, DecoderOptions()).eval()
            modules[layer.index].load_state_dict({ours: state[hf] for ours, hf in keys[layer.index].items()})
    x = (ids, torch.arange(12).expand_as(ids))
    for module in modules.values():
        x = module(x)
    x = tied_lm_head_forward(modules[0], x) if config.tie_word_embeddings else x
    loss_fn = PreferenceLoss(settings)
    loss = loss_fn(split_stats(x)[0], (labels, ref, torch.tensor(0.5), 1.0 / targets[:2, 1:].sum()))
    loss.backward()
    loss, expected = float(loss.detach()), float(expected.detach())
    assert loss == pytest.approx(expected, rel=1e-6)
    hf_params = dict(policy.named_parameters())
    worst = 0.0
    for index, module in modules.items():
        for ours, param in module.named_parameters():
            # (renamed on the hub: Nemotron-H's; kept in parts or per expert there: transformers' whole, in memory)
            hf_name = memory_key(config, keys[index].get(ours, f"model.layers.{index - 1}.{ours}"))
            theirs = hf_params[hf_name].grad
            scale = float(theirs.abs().max())
            worst = max(worst, float((param.grad - theirs).abs().max()) / scale)
            torch.testing.assert_close(param.grad, theirs, rtol=0, atol=1e-5 * scale, msg=hf_name)
    print(f"{name}: DPO loss {loss:.6f} (transformers {expected:.6f}), gradients within {worst:.2g}")


def test_a_containers_head_is_tied_by_the_containers_config():
    """transformers ties a multimodal model's head by the container's config, whatever its text config says; a
    config.json without the key (transformers 4 left defaults out) takes the container class's default
    (Mistral3Config's: tied; Qwen3_5Config's: untied)."""
    from models.config import text_config_json

    text = {"model_type": "mistral4", "tie_word_embeddings": False}
    assert text_config_json({"model_type": "mistral3", "text_config": text})["tie_word_embeddings"] is True
    untied = {
        "model_type": "mistral3",
        "text_config": text | {"tie_word_embeddings": True},
        "tie_word_embeddings": False,
    }
    assert text_config_json(untied)["tie_word_embeddings"] is False
    qwen = {"model_type": "qwen3_5", "text_config": {"model_type": "qwen3_5_text", "tie_word_embeddings": True}}
    assert text_config_json(qwen)["tie_word_embeddings"] is False


def test_deepseek_v32_attention_is_really_sparse(tmp_path):
    """The tiny DeepSeek-V3.2's indexer keeps 4 keys of rows of 12: keeping every key changes the logits (so the
    bit-identical cases above compare sparse attention), and our layers equal transformers' either way."""
    from transformers import AutoModelForCausalLM

    logits = []
    for topk in (4, 64):
        config = tiny_config("deepseek_v32", num_hidden_layers=3, num_key_value_heads=4, index_topk=topk)
        config._attn_implementation = "sdpa"
        torch.manual_seed(0)
        hf = AutoModelForCausalLM.from_config(config).eval()
        hf.save_pretrained(tmp_path / str(topk))
        ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            reference = hf(input_ids=ids).logits
        logits.append(pipeline_logits(config, hf_state(str(tmp_path / str(topk))), ids))
        assert torch.equal(logits[-1], reference), topk
    assert not torch.equal(*logits)
