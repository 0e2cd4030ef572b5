"""DeepSpeed engine config per preset; the LR schedule."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from tests.conftest import REPO
from training.config import TrainConfig, register_configs
from training.engine import WarmupDecay, deepspeed_config

register_configs()


def load(*overrides: str) -> TrainConfig:
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return OmegaConf.to_object(compose(config_name="config", overrides=list(overrides)))


def test_presets_give_the_documented_engine_configs():
    bf16 = deepspeed_config(load("deepspeed=bf16_zero1", "micro_batch_size=2", "gradient_accumulation_steps=4"), 2)
    assert bf16["bf16"] == {"enabled": True} and bf16["data_types"] == {"grad_accum_dtype": "fp32"}
    assert bf16["zero_optimization"]["stage"] == 1 and bf16["train_batch_size"] == 16
    assert bf16["pipeline"] == {"use_reentrant": False}
    fp16 = deepspeed_config(load("deepspeed=fp16_offload"), 1)
    assert fp16["fp16"]["enabled"] and fp16["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    cpu = deepspeed_config(load("deepspeed=fp32"), 1)
    assert "bf16" not in cpu and "fp16" not in cpu and cpu["zero_optimization"]["stage"] == 0
    assert deepspeed_config(load("optim.max_grad_norm=0"), 1)["gradient_clipping"] == float("inf")
    with pytest.raises(ValueError, match="issue 3866"):
        deepspeed_config(load("deepspeed=bf16_zero1", "deepspeed.offload_optimizer=true"), 1)


@pytest.mark.parametrize(
    "name,stages,world,precision,max_gib",
    [
        ("llama2_7b_8gpu", 4, 8, "bf16", 24),
        ("llama2_13b_2node", 4, 16, "bf16", 32),
        ("llama2_70b_2node", 8, 16, "fp16", 40),
        ("llama2_70b_4node", 8, 32, "bf16", 66),
        ("llama3_8b_2node", 2, 16, "bf16", 44),
    ],
)
def test_experiment_recipes_resolve_and_fit_80gb(name, stages, world, precision, max_gib):
    """Every recipe composes, and its estimated memory per GPU (tools/memory_estimate.py) fits an 80 GB GPU."""
    from tools.memory_estimate import GIB, estimate
    from training.setup import load_model_config

    cfg = load(f"experiment={name}")
    assert cfg.num_stages == stages and cfg.deepspeed.precision == precision
    rows = estimate(cfg, load_model_config(cfg), world)
    busiest = max(r.total for r in rows) / GIB
    assert busiest < max_gib <= 72, busiest  # 72: 80 GB less CUDA context and fragmentation headroom
    stage0 = rows[0]
    assert stage0.weights == stage0.params * 2 and stage0.params > 0  # bf16/fp16 weights: 2 bytes each
    assert stage0.optimizer == (0 if cfg.deepspeed.offload_optimizer else stage0.params * 12 / (world // stages))


def test_warmup_then_cosine_to_min_ratio():
    s = WarmupDecay(total_steps=110, warmup_steps=10, kind="cosine", min_ratio=0.1)
    assert s(0) == pytest.approx(1 / 11) and s(9) == pytest.approx(10 / 11)
    assert s(10) == pytest.approx(1.0) and s(110) == pytest.approx(0.1) and s(60) == pytest.approx(0.55)
    assert WarmupDecay(100, 0, "linear", 0.0)(50) == pytest.approx(0.5)
    assert WarmupDecay(100, 0, "constant", 0.0)(99) == 1.0
