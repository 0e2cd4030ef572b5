"""DeepSpeed engine config per preset; the LR schedule."""

from __future__ import annotations

import os
import re

import pytest
import torch

from models.partition import stage_bounds
from schema.compose import CONF_DIR, compose_config
from schema.train import TrainConfig
from training.engine import WarmupDecay, deepspeed_config
from training.precision import resolve
from training.topology import Coords
from training.validate import validate


def dp(size: int) -> Coords:
    """Rank 0 of a run with `size` data-parallel ranks and one stage."""
    return Coords(rank=0, world=size, num_stages=1)


def _recipe_table() -> dict[str, tuple[int, str]]:
    """docs/training.md's recipe table: recipe -> (GPUs, the planner's GiB per GPU as printed)."""
    import re

    text = open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "docs", "training.md")).read()
    rows = re.findall(r"^\| `(\w+)` \|.*\| (\d+) \| ([\d.]+) GiB \|$", text, re.M)
    return {name: (int(gpus), gib) for name, gpus, gib in rows}


RECIPE_TABLE = _recipe_table()


def test_the_recipe_table_lists_every_recipe():
    recipes = {f[:-5] for f in os.listdir(os.path.join(CONF_DIR, "experiment")) if f.endswith(".yaml")}
    assert set(RECIPE_TABLE) == recipes - {"demo"}


def test_a_recipe_takes_the_checkpoints_shape_and_plans_with_its_own(tmp_path):
    """Recipes describe layouts: with model_name_or_path the shape is the checkpoint's (no model=from_checkpoint
    needed, no refusal for another size); without one, the recipe's plan_model preset; model= still wins."""
    from tools.tiny_models import make_hf_model, tiny_config
    from training.assembly import load_model_config

    planned = load("experiment=llama2_70b_4node")
    assert planned.plan_model == "llama2_70b" and planned.model.hidden_size == 8192
    assert planned.model.activation_checkpointing  # the recipe's own model settings stay
    hf = make_hf_model(str(tmp_path / "llama3"), tiny_config(vocab_size=96, max_position_embeddings=4096))
    cfg = load("experiment=llama2_70b_4node", f"model_name_or_path={hf}")
    assert cfg.model.name == "from_checkpoint" and cfg.model.hidden_size is None
    assert load_model_config(cfg).vocab_size == 96
    assert load("experiment=llama2_70b_4node", "model=llama3_70b").model.vocab_size == 128256
    with pytest.raises(ValueError, match="plan_model=nope: unknown preset"):
        load("experiment=llama2_70b_4node", "plan_model=nope")


def load(*overrides: str) -> TrainConfig:
    """The config as the trainer holds it: composed, its precision and ZeRO stage resolved (training/precision.py)."""
    cfg = compose_config(list(overrides))
    resolve(cfg)
    return cfg


def test_presets_give_the_documented_engine_configs():
    bf16 = deepspeed_config(load("deepspeed=bf16_zero1", "micro_batch_size=2", "gradient_accumulation_steps=4"), dp(2))
    assert bf16["bf16"] == {"enabled": True} and bf16["data_types"] == {"grad_accum_dtype": "fp32"}
    assert bf16["zero_optimization"]["stage"] == 1 and bf16["train_batch_size"] == 16
    fp16 = deepspeed_config(load("deepspeed=fp16_offload"), dp(1))
    assert fp16["fp16"]["enabled"] and fp16["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    cpu = deepspeed_config(load("deepspeed=fp32"), dp(1))
    assert "bf16" not in cpu and "fp16" not in cpu and cpu["zero_optimization"]["stage"] == 0
    assert deepspeed_config(load("optim.max_grad_norm=0"), dp(1))["gradient_clipping"] == float("inf")
    with pytest.raises(ValueError, match="issue 3866"):  # refused by validate(), before data or weights are read
        validate(
            load(
                "deepspeed=bf16_zero1", "deepspeed.offload_optimizer=true", "model_name_or_path=m", "train_file=a.jsonl"
            )
        )
    # a recipe's bf16 accumulation under deepspeed=fp32 (DeepSpeed's NotImplementedError traceback before)
    with pytest.raises(ValueError, match="deepspeed.precision=fp32 with deepspeed.grad_accum_dtype=bf16"):
        validate(load("experiment=llama2_70b_4node", "deepspeed=fp32", "model_name_or_path=m", "train_file=a.jsonl"))


def stage0_parameters(config, layers: int, lora=None) -> tuple[int, int, int]:
    """(parameters but the routed experts', the routed experts', LoRA's adapters) of the embedding and the first
    `layers` decoder layers of transformers' model for `config`, built on the meta device (adapters: PEFT's,
    injected with `lora`'s settings)."""
    from peft import LoraConfig, inject_adapter_in_model
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
        if lora is not None:
            settings = LoraConfig(r=lora.r, lora_alpha=lora.alpha, target_modules=list(lora.target_modules))
            model = inject_adapter_in_model(settings, model)
    dense, experts, adapters = model.get_input_embeddings().weight.numel(), 0, 0
    # Gemma 4's per-layer embeddings, model-level modules block 0's layer holds (models/carry.py)
    dense += sum(
        p.numel() for n, p in model.model.named_parameters() if n.startswith(("embed_tokens_per", "per_layer"))
    )
    for layer in model.model.layers[:layers]:
        for name, p in layer.named_parameters():
            if ".lora_" in name:
                adapters += p.numel()
                continue
            routed = (".experts." in name or name.startswith("experts.")) and "shared" not in name
            experts, dense = experts + routed * p.numel(), dense + (not routed) * p.numel()
    return dense, experts, adapters


@pytest.mark.parametrize(
    "name,stages,world,precision,max_gib",
    [
        ("llama2_7b_8gpu", 4, 8, "bf16", 24),
        ("llama2_13b_2node", 4, 16, "bf16", 32),
        ("llama2_70b_2node", 8, 16, "fp16", 40),
        ("llama2_70b_4node", 8, 32, "bf16", 66),
        ("llama3_8b_2node", 2, 16, "bf16", 44),
        ("llama2_70b_tp8", 4, 32, "bf16", 44),
        ("llama3_8b_dpo", 2, 8, "bf16", 44),
        ("qwen3_30b_a3b_2node", 4, 16, "bf16", 42),
        ("mixtral_8x7b_2node", 4, 16, "bf16", 54),
        ("llama4_scout_4node", 8, 32, "bf16", 66),
        ("deepseek_v3_32node", 16, 256, "bf16", 66),
        ("deepseek_v32_32node", 16, 256, "bf16", 69),
        ("kimi_k2_48node", 16, 384, "bf16", 58),
        ("gpt_oss_120b_8node", 4, 64, "bf16", 50),
        ("glm4_5_air_4node", 8, 32, "bf16", 68),
        ("qwen3_next_80b_a3b_4node", 4, 32, "bf16", 56),
        ("gemma4_31b_2node", 4, 16, "bf16", 53),
        ("gemma4_e4b_8gpu", 4, 8, "bf16", 44),
        ("gemma4_26b_a4b_2node", 4, 16, "bf16", 48),
        ("glm5_32node", 16, 256, "bf16", 69),
        ("deepseek_v4_flash_16node", 16, 128, "bf16", 72),
        ("deepseek_v3_lora_4node", 8, 32, "bf16", 54),
        ("kimi_k2_lora_8node", 8, 64, "bf16", 44),
        ("llama3_1_70b_4node", 8, 32, "bf16", 60),
        ("qwen3_8b_lora_2node", 2, 16, "bf16", 15),
        ("qwen3_32b_2node", 8, 16, "bf16", 54),
        ("gpt_oss_20b_dpo_8gpu", 4, 8, "bf16", 54),
    ],
)
def test_experiment_recipes_resolve_and_fit_80gb(name, stages, world, precision, max_gib):
    """Every recipe composes, passes the trainer's layout checks at its world size, and its estimated memory per GPU
    (tools/memory_estimate.py) fits an 80 GB GPU."""
    from tools.memory_estimate import GIB, estimate
    from training.assembly import load_model_config
    from training.validate import validate_layout

    cfg = load(f"experiment={name}")
    assert cfg.num_stages == stages and cfg.deepspeed.precision == precision
    validate_layout(cfg, world, load_model_config(cfg))
    rows = estimate(cfg, load_model_config(cfg), world)
    busiest = max(r.total for r in rows) / GIB
    assert busiest < max_gib <= 72, busiest  # 72: 80 GB less CUDA context and fragmentation headroom
    # docs/training.md's recipe table: this recipe, its world size and the planner's figure as it prints it
    assert RECIPE_TABLE[name] == (world, f"{busiest:.1f}"), (RECIPE_TABLE.get(name), world, busiest)
    stage0 = rows[0]
    dp, ep, tp = world // (stages * cfg.tensor_parallel_size), cfg.expert_parallel_size, cfg.tensor_parallel_size
    # Stage 0's parameters counted on transformers' own model (not the planner's arithmetic): the embedding and
    # the decoder layers before the second stage; an EP rank holds 1/ep of the routed experts, a TP rank 1/tp of
    # the rest (norms replicated, the vocabulary padded: within 1% there).
    model_config = load_model_config(cfg)
    first = stage_bounds(model_config, stages, cfg.model.partition)[1] - 1
    lora = cfg.lora if cfg.lora.enabled else None
    dense, experts, adapters = stage0_parameters(model_config, first, lora)
    held = experts // ep // tp
    assert stage0.params == pytest.approx(dense / tp + held, rel=0 if tp == 1 else 1e-2)
    if lora is not None:  # base weights frozen: PEFT's adapters alone get gradients (fp32) and Adam's state over DP
        assert tp == 1 and adapters > 0
        assert stage0.weights == (stage0.params + adapters) * 2 and stage0.gradients == adapters * 4
        assert stage0.optimizer == pytest.approx(adapters * 12 / dp, rel=1e-12)
        return
    assert stage0.weights == stage0.params * 2 and stage0.params > 0  # bf16/fp16 weights: 2 bytes each
    # fp32 master weights and Adam's moments (12 bytes) sharded over DP; an EP rank's experts over the DP / ep ranks
    # holding them.
    optimizer = (stage0.params - held) * 12 / dp + held * 12 * ep / dp
    assert stage0.optimizer == pytest.approx(0 if cfg.deepspeed.offload_optimizer else optimizer, rel=1e-12)


def test_warmup_then_cosine_to_min_ratio():
    s = WarmupDecay(total_steps=110, warmup_steps=10, kind="cosine", min_ratio=0.1)
    assert s(0) == pytest.approx(1 / 11) and s(9) == pytest.approx(10 / 11)
    assert s(10) == pytest.approx(1.0) and s(110) == pytest.approx(0.1) and s(60) == pytest.approx(0.55)
    assert WarmupDecay(100, 0, "linear", 0.0)(50) == pytest.approx(0.5)
    assert WarmupDecay(100, 0, "constant", 0.0)(99) == 1.0


@pytest.mark.parametrize(
    "change,expected",
    [
        ({}, []),
        ({"max_steps": 5}, ["max_steps/num_train_epochs (total steps): 3 -> 5"]),
        ({"max_steps": -1, "num_train_epochs": 2}, ["max_steps/num_train_epochs (total steps): 3 -> 8"]),
        ({"optim.warmup_steps": 2}, ["warmup steps: 1 -> 2"]),
        ({"optim.warmup_ratio": 1.0, "optim.warmup_steps": 0}, ["warmup steps: 1 -> 3"]),
        ({"optim.lr_scheduler": "linear"}, ["optim.lr_scheduler: cosine -> linear"]),
        ({"optim.min_lr_ratio": 0.5}, ["optim.min_lr_ratio: 0.1 -> 0.5"]),
        ({"learning_rate": 1e-3}, ["learning_rate: 0.002 -> 0.001"]),
    ],
)
def test_resume_follows_the_new_schedule_settings(change, expected):
    """A checkpoint saved after 3 steps of a 3-step run, resumed with other schedule settings: the remaining
    steps use exactly the rates an uninterrupted run with the new settings uses (the restored schedule used to
    keep the old total and floor), and the changes are named."""
    from training.engine import follow_new_schedule, make_optimizer

    def configured(values: dict) -> TrainConfig:
        base = {"learning_rate": 2e-3, "max_steps": 3, "optim.warmup_steps": 1, **values}
        return compose_config([f"{k}={v}" for k, v in base.items()])

    def lrs(cfg: TrainConfig, total: int, steps: int, state=None):
        params = [torch.nn.Parameter(torch.zeros(2, 2))]
        optimizer, scheduler = make_optimizer(cfg, [("w", params[0])], total)
        if state is not None:  # what a resume restores: both state dicts, then our correction
            optimizer.load_state_dict(state[0])
            scheduler.load_state_dict(state[1])
            follow = follow_new_schedule(scheduler, cfg, total)
        out = []
        for _ in range(steps):
            out.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        return out, (optimizer.state_dict(), scheduler.state_dict()), follow if state is not None else None

    old = configured({})
    _, state, _ = lrs(old, 3, 3)
    new = configured(change)
    total = new.max_steps if new.max_steps > 0 else 4 * new.num_train_epochs  # 4 steps an epoch
    uninterrupted, _, _ = lrs(new, total, total)
    resumed, _, changes = lrs(new, total, total - 3, state)
    assert resumed == uninterrupted[3:] and changes == expected


@pytest.mark.parametrize("cuda,bf16,expected", [(True, True, "bf16"), (True, False, "fp16"), (False, False, "fp32")])
def test_auto_precision_follows_the_hardware(cuda, bf16, expected, monkeypatch):
    """deepspeed=auto: bf16 on a bf16 GPU, fp16 with dynamic loss scaling on a GPU without bf16 (V100, T4),
    fp32 on CPU; the choice is logged with its reason. The memory planner plans for a bf16 GPU by the same rule."""
    import torch

    from training.engine import describe_auto_precision
    from training.precision import resolve_precision

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    assert resolve_precision("auto") == expected and resolve_precision("fp32") == "fp32"
    assert resolve_precision("auto", auto="bf16") == "bf16"
    conf = deepspeed_config(load("deepspeed=auto"), dp(1))
    assert conf["zero_optimization"]["stage"] == (1 if cuda else 0)
    if expected == "fp16":
        assert conf["fp16"]["enabled"] and conf["fp16"]["loss_scale"] == 0  # 0: dynamic loss scaling
        assert "dynamic loss scaling" in describe_auto_precision("fp16") and "bf16" not in conf
    else:
        assert "fp16" not in conf and ("bf16" in conf) == (expected == "bf16")


def test_resume_refuses_a_different_data_order():
    from training.checkpointing import check_data_state
    from training.errors import RunError

    saved = {
        "seed": 1,
        "global_batch_size": 8,
        "seq_length": 16,
        "train_weights": None,
        "num_train_rows": 40,
        "train_data_fingerprint": "a" * 64,
    }
    check_data_state(saved, dict(saved), "global_step3")
    check_data_state({"seed": 1, "num_train_rows": 40}, dict(saved), "global_step3")  # older saves: fewer keys
    for key, value, message in [
        ("train_data_fingerprint", "b" * 64, "the tokenized training rows differ"),
        ("seq_length", 32, "seq_length=32 but the checkpoint global_step3 was saved with 16"),
        ("global_batch_size", 4, "global_batch_size=4"),
        ("train_weights", [1.0, 3.0], "train_weights=[1.0, 3.0]"),
    ]:
        with pytest.raises(RunError, match=message.replace("[", r"\[").replace("]", r"\]")):
            check_data_state(saved, {**saved, key: value}, "global_step3")


def test_a_layout_move_is_refused_naming_what_cannot_move():
    from checkpoint.errors import CheckpointError
    from checkpoint.universal import check_movable

    saved = {"global_batch_size": 12, "precision": "bf16", "zero_stage": 1}
    check_movable(saved, {"global_batch_size": 12, "precision": "bf16", "zero_stage": 1}, "ckpt")
    check_movable({**saved, "precision": "fp32", "zero_stage": 0}, {**saved, "precision": "fp32", "zero_stage": 0}, "c")
    for current, message in [
        ({**saved, "global_batch_size": 6}, "ckpt: saved with a global batch of 12 sequences, this run has 6"),
        ({**saved, "zero_stage": 0}, "ZeRO-1 optimizer state moves into ZeRO-1 runs only"),
    ]:
        with pytest.raises(CheckpointError, match=message):
            check_movable(saved, current, "ckpt")
    with pytest.raises(CheckpointError, match="ZeRO-0 optimizer state moves between fp32 ZeRO-0 runs only"):
        check_movable({**saved, "zero_stage": 0}, saved, "ckpt")


def test_checkpoint_types_deepspeed_writes_pass_the_pickle_scan(tmp_path):
    """ZeRO shards hold a few DeepSpeed objects (plain data): the scan `--verify` runs accepts exactly these,
    and our own loads the numpy RNG state; any other global is refused, named."""
    import numpy as np
    import torch
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    from checkpoint.errors import CheckpointError
    from checkpoint.safe_load import check_pickles, load_pt

    state = {
        "a": fragment_address(numel=4, start=8),
        "s": DynamicLossScaler(2**16, 1000, 1, 2, False),
        "z": ZeroStageEnum.optimizer_states,
        "t": torch.ones(3),
    }
    torch.save(state, tmp_path / "zero.pt")
    torch.save({"rng": np.random.get_state(), "t": torch.ones(3)}, tmp_path / "rng.pt")
    check_pickles(str(tmp_path), ["zero.pt", "rng.pt"])
    assert load_pt(str(tmp_path / "rng.pt"))["rng"][0] == "MT19937"
    torch.save({"x": print}, tmp_path / "code.pt")  # any other global: refused, named
    for refuse in (lambda: check_pickles(str(tmp_path), ["code.pt"]), lambda: load_pt(str(tmp_path / "code.pt"))):
        with pytest.raises(CheckpointError, match="code.pt: refused: it names builtins.print"):
            refuse()


@pytest.mark.parametrize(
    "field,message",
    [
        ("n_routed_experts=8", "model.config_fields.n_routed_experts: set it as model.num_experts"),
        ("hidden_size=8", "model.config_fields.hidden_size: set it as model.hidden_size"),
        ("to_dict=1", "model.config_fields.to_dict: not a field of DeepseekV3Config (deepseek_v3)"),
    ],
)
def test_config_fields_refuse_typed_keys_and_what_is_no_field(field, message):
    """`model.config_fields` takes the family's other config fields only: a typed key (under its own name or its
    transformers name) and a name that is no field of the config class (a method) are one-line errors."""
    from models.config import config_from_preset

    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        config_from_preset(load("model=deepseek_v3", f"+model.config_fields.{field}").model)


def test_the_resolved_config_is_frozen_and_still_pickles_copies_and_derives():
    """`schema.frozen.freeze` (training/assembly.py, once the precision, ZeRO stage and Hub ids are resolved): no
    assignment into the config or any config inside it; pickling, copying and `dataclasses.replace` work as before."""
    import copy
    import dataclasses
    import pickle

    from schema.frozen import FrozenConfigError, freeze, is_frozen

    cfg = compose_config(["deepspeed=bf16_zero1", "seq_length=32"])
    resolve(cfg)
    freeze(cfg)
    for owner, name, value in ((cfg, "seq_length", 64), (cfg.deepspeed, "precision", "fp32"), (cfg.lora, "r", 4)):
        with pytest.raises(FrozenConfigError, match=rf"^{type(owner).__mro__[1].__name__}\.{name}: the run's config"):
            setattr(owner, name, value)
    assert cfg.seq_length == 32 and str(cfg.deepspeed.precision) == "bf16" and isinstance(cfg, TrainConfig)
    for other in (pickle.loads(pickle.dumps(cfg)), copy.deepcopy(cfg)):
        assert other == cfg and is_frozen(other) and is_frozen(other.deepspeed)
    derived = dataclasses.replace(cfg, seq_length=64)
    assert derived.seq_length == 64 and not is_frozen(derived)
