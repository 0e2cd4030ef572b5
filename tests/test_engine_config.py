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


def test_experiment_recipes_resolve():
    for name, stages, hidden in [
        ("llama2_7b_8gpu", 4, 4096),
        ("llama2_70b_2node", 8, 8192),
        ("llama3_8b_2node", 2, 4096),
    ]:
        cfg = load(f"experiment={name}")
        assert cfg.num_stages == stages and cfg.model.hidden_size == hidden and cfg.deepspeed.precision == "bf16"


def test_warmup_then_cosine_to_min_ratio():
    s = WarmupDecay(total_steps=110, warmup_steps=10, kind="cosine", min_ratio=0.1)
    assert s(0) == pytest.approx(1 / 11) and s(9) == pytest.approx(10 / 11)
    assert s(10) == pytest.approx(1.0) and s(110) == pytest.approx(0.1) and s(60) == pytest.approx(0.55)
    assert WarmupDecay(100, 0, "linear", 0.0)(50) == pytest.approx(0.5)
    assert WarmupDecay(100, 0, "constant", 0.0)(99) == 1.0
