"""`optim.name=muon`: the decoder layers' matrices by Muon, the rest by AdamW, equal to torch.optim.Muon.

In one process: our optimizer (training/muon.py) against torch's (tests/muon_reference.py) on transformers' models,
bit for bit, fused projections and fused experts included; the tensor-parallel rule (whole matrices) against its
negative control. Trained through the launcher under PP x TP x EP x DP: tests/test_muon_training.py.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch

from schema.train import DeepSpeedConfig, OptimConfig, TrainConfig
from tests.muon_reference import TorchMuon
from tools.tiny_models import tiny_config
from training.engine import make_optimizer
from training.muon import adjusted_lr, layer_plan, newton_schulz, pieces

_LAYER = re.compile(r"model\.layers\.\d+\.(.+)")


def muon_cfg(**optim) -> TrainConfig:
    settings = dict(name="muon", weight_decay=0.1, lr_scheduler="constant", muon_momentum=0.9, **optim)
    return TrainConfig(learning_rate=2e-2, optim=OptimConfig(**settings))


def hf_plan(name: str, p: torch.Tensor, config):
    """`training.muon.muon_plan` for transformers' own names (model.layers.N.<key>)."""
    layer = _LAYER.fullmatch(name)
    return layer_plan(layer.group(1), p, config) if layer else None


def model_of(**overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(**overrides), dtype=torch.float32)


@pytest.mark.parametrize(
    "variant",
    [
        dict(num_attention_heads=4, num_key_value_heads=2),  # Llama: every matrix as it is
        dict(model_type="phi3", num_key_value_heads=2),  # fused q/k/v and gate/up: one matrix per part
        dict(model_type="mixtral", num_key_value_heads=2),  # fused experts [E, 2I, H]: each expert's gate, up, down
    ],
    ids=["llama", "phi3", "mixtral"],
)
@pytest.mark.parametrize("adjust,ns", [("match_rms_adamw", "bf16"), ("original", "bf16"), ("match_rms_adamw", "fp32")])
def test_muon_equals_torch_muon_in_one_process(variant, adjust, ns):
    """Three steps on the same gradients (clipped at 1.0, a constant LR): every weight equal to torch.optim.Muon on
    the decoder matrices + torch.optim.AdamW on the rest, bit for bit (with fp32 Newton-Schulz: torch's iteration
    in fp32); AdamW alone differs."""
    cfg = muon_cfg(muon_adjust_lr=adjust, max_grad_norm=1.0, muon_ns_dtype=ns)
    ours_model, ref_model, adamw_model = model_of(**variant), model_of(**variant), model_of(**variant)
    config = ours_model.config
    ours, _ = make_optimizer(cfg, ours_model.named_parameters(), 3, lambda n, p: hf_plan(n, p, config))
    ref = TorchMuon(ref_model, cfg, 3)
    adamw_cfg = copy.deepcopy(cfg)
    adamw_cfg.optim.name = "adamw"
    adamw, _ = make_optimizer(adamw_cfg, adamw_model.named_parameters(), 3)
    muon_params = {n for n, p in ours_model.named_parameters() if hf_plan(n, p, config)}
    # The split: every decoder matrix (and fused expert tensor) by Muon; embeddings, head and norms by AdamW.
    assert muon_params and all(".layers." in n and not n.endswith("norm.weight") for n in muon_params)
    assert not {n for n in muon_params if "embed" in n or "lm_head" in n}
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        grads = {n: torch.randn(p.shape, generator=generator) * 0.1 for n, p in ours_model.named_parameters()}
        for model, optimizer in ((ours_model, ours), (ref_model, ref), (adamw_model, adamw)):
            for name, p in model.named_parameters():
                p.grad = grads[name].clone()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
    ref_state = dict(ref_model.named_parameters())
    for name, p in ours_model.named_parameters():
        assert torch.equal(p, ref_state[name]), name
    adamw_state = dict(adamw_model.named_parameters())
    moved = max(
        float((p - adamw_state[n]).detach().abs().max()) for n, p in ours_model.named_parameters() if n in muon_params
    )
    assert moved > 1e-3, moved  # the control: Muon's run is not AdamW's


@pytest.mark.parametrize("rule", ["column", "row", "parts:2,1,1", "gate_up"])
def test_whole_matrix_differs_from_its_shards_orthogonalised_alone(rule):
    """The negative control of the TP rule: each TP rank's shard orthogonalised alone is not the whole matrix's
    orthogonalisation split (by far more than the training tests' bounds), so a rank that skipped the gather fails
    them; the whole matrix's split is what every rank applies."""
    from models.sharding import shard

    torch.manual_seed(0)
    whole = torch.randn(4, 64, 32) if rule == "gate_up" else torch.randn(64, 32)
    right = torch.cat([newton_schulz(m, 5).float().flatten() for m in pieces(whole, rule)])
    split = [shard(whole, rule, r, 2) for r in range(2)]
    alone = [torch.cat([newton_schulz(m, 5).float().flatten() for m in pieces(s, rule)]) for s in split]
    whole_split = [
        torch.cat(
            [newton_schulz(m, 5).float().chunk(2, 0 if rule != "row" else 1)[r].flatten() for m in pieces(whole, rule)]
        )
        for r in range(2)
    ]
    assert right.numel() == sum(a.numel() for a in alone)
    worst = max(float((a - w).abs().max()) for a, w in zip(alone, whole_split, strict=True))
    # Times the step size of such a matrix at the training tests' lr: a weight moved by 100x their largest measured
    # difference (2.38e-7) in one step.
    assert worst * adjusted_lr(3e-3, "match_rms_adamw", whole.shape[-2:]) > 100 * 2.38e-7, worst


def test_lora_adapters_are_matrices_and_the_rest_is_adamw():
    """With LoRA every trainable parameter is an adapter's A or B (a matrix): Muon takes them all, AdamW none."""
    from models.lora import add_lora

    model = model_of(num_attention_heads=4, num_key_value_heads=2)
    model.requires_grad_(False)
    add_lora(model, 4, 8, 0.0, ["q_proj", "v_proj", "gate_proj"], 0)
    config = model.config
    optimizer, _ = make_optimizer(muon_cfg(), model.named_parameters(), 3, lambda n, p: hf_plan(n, p, config))
    assert [g["muon"] for g in optimizer.param_groups] == [True]
    assert all(p.ndim == 2 for g in optimizer.param_groups for p in g["params"])


def test_planner_counts_one_buffer_per_matrix_and_the_gathered_step():
    """tools.memory_estimate with optim.name=muon: Adam's two fp32 moments of every Muon element become one buffer,
    and the step's transient (one matrix's update in fp32 and the bf16 Newton-Schulz of its largest piece) is added;
    the Muon elements counted from transformers' model, not the planner's tables."""
    from tools.memory_model import estimate

    overrides = dict(num_attention_heads=4, num_key_value_heads=2)
    model = model_of(**overrides)
    matrices = [p for n, p in model.named_parameters() if hf_plan(n, p, model.config)]
    adamw, muon = (TrainConfig(deepspeed=DeepSpeedConfig(precision="fp32", zero_stage=0)) for _ in range(2))
    muon.optim.name = "muon"
    (a,), (m,) = (estimate(cfg, model.config, 1) for cfg in (adamw, muon))
    largest = max(matrices, key=lambda p: p.numel())
    small, large = sorted(largest.shape)
    transient = 4 * largest.numel() + (2 * small * large + 2 * small * small) * 2
    assert a.optimizer - m.optimizer == 4 * sum(p.numel() for p in matrices) - transient


@pytest.mark.parametrize(
    "deepspeed",
    [
        ["deepspeed=fp16_offload"],
        ["deepspeed=fp32", "deepspeed.zero_stage=1"],
        ["deepspeed=bf16_zero1", "deepspeed.grad_accum_dtype=bf16"],
    ],
    ids=["fp16", "fp32-zero1", "bf16-grads"],
)
def test_muon_where_matrices_are_not_whole_is_refused_in_one_line(deepspeed):
    """DeepSpeed's fp16 and fp32 ZeRO optimizers, and its bf16 one without fp32 gradients, step flat partitions
    without the group's whole gradients: refused before anything is read."""
    from schema.compose import compose_config
    from training.precision import resolve
    from training.validate import validate

    cfg = compose_config([*deepspeed, "optim.name=muon", "model_name_or_path=m", "train_file=a.jsonl"])
    resolve(cfg)
    with pytest.raises(
        ValueError, match=r"^optim.name=muon runs with deepspeed=fp32 \(fp32, ZeRO-0\) or deepspeed=bf16"
    ):
        validate(cfg)
    validate(compose_config(["deepspeed=bf16_zero1", "optim.name=muon", "model_name_or_path=m", "train_file=a.jsonl"]))
