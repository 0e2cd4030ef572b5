"""Context parallelism (DeepSpeed-Ulysses, models/context_parallel.py): each CP rank's batch shard, resume across a
change of C, and the settings refused in one line. Forward parity is tests/test_parity.py's (CP=2, PP=2 x CP=2,
TP=2 x CP=2 with and without SP); training parity is tests/test_training.py's `-cp2` layouts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from data.collator import CausalLMCollator
from tests.catalogue import config_error
from tests.conftest import check, launch, read_jsonl


def test_collator_gives_each_cp_rank_its_positions():
    """The C ranks of a group read the same rows: their shards laid end to end are the whole batch, position_ids stay
    whole on each, and their token counts add up to the batch's (packed and unpacked)."""
    rows = [
        (torch.arange(3, 10), torch.ones(7, dtype=torch.bool)),
        (torch.arange(3, 16), torch.ones(13, dtype=torch.bool)),
    ]
    for packing, samples in ((False, rows), (True, [rows, rows[:1]])):
        whole_inputs, whole_labels, whole_tokens = CausalLMCollator(24, 0, packing)(samples)
        for c in (2, 4):
            shards = [CausalLMCollator(24, 0, packing, context=(r, c))(samples) for r in range(c)]
            assert torch.equal(torch.cat([s[0][0] for s in shards], 1), whole_inputs[0])
            assert torch.equal(torch.cat([s[1] for s in shards], 1), whole_labels)
            assert all(torch.equal(s[0][1], whole_inputs[1]) for s in shards)
            assert sum(int(s[2]) for s in shards) == int(whole_tokens)


@pytest.mark.parametrize(
    "variant, world, extra, expected",
    [
        (
            "gqa",
            3,
            {"context_parallel_size": 2},
            "num_stages=1 x context_parallel_size=2 does not divide the world size 3",
        ),
        ("gqa", 8, {"context_parallel_size": 8}, "context_parallel_size=8 must divide the model's 4 attention heads"),
        (
            "gqa",
            8,
            {"context_parallel_size": 4, "tensor_parallel_size": 2},
            "context_parallel_size=4 must divide the model's 2 attention heads per tensor-parallel rank",
        ),
        (
            "mixtral",
            4,
            {"context_parallel_size": 2, "expert_parallel_size": 4, "num_stages": 2},
            "expert_parallel_size=4 does not divide the 2 data ranks (DP=1 x CP=2) of each stage",
        ),
        ("gqa", 2, {"context_parallel_size": 0}, "context_parallel_size=0 must be >= 1"),
        ("gqa", 1, {"model.mlp_tiles": -1}, "model.mlp_tiles=-1 must be >= 0"),
        (
            "gqa",
            2,
            {"model.mlp_tiles": 4, "num_stages": 2, "pipeline_schedule": "zero_bubble"},
            "model.mlp_tiles=4 with pipeline_schedule=zero_bubble",
        ),
        ("gqa", 2, {"model.mlp_tiles": 4, "tensor_parallel_size": 2}, "model.mlp_tiles=4 with tensor_parallel_size=2"),
    ],
)
def test_context_parallel_refusals(variant, world, extra, expected, converted, sft_data, tmp_path):
    """One line naming the key, before any data or weight is read (the trainer's own checks, in-process)."""
    args = {
        "model_name_or_path": converted[variant],
        "train_file": sft_data[0],
        "output_dir": tmp_path,
        "seq_length": 64,
    }
    line = config_error([f"{k}={v}" for k, v in {**args, **extra}.items()], world_size=world)
    assert expected in line and "\n" not in line, line


@pytest.mark.slow
def test_resume_across_a_change_of_context_parallel_size(converted, sft_data, tmp_path, tmp_path_factory):
    """fp32 ZeRO-0 state reshaped by parameter name across C: step 2 of 4 saved with PP=2 x CP=2 continues with
    PP=2 x CP=1 (2 ranks), and step 2 of PP=2 x DP=2 continues with PP=2 x CP=2 (twice the micro-batches: the same
    global batch), each on its unmoved run's loss curve to fp32 reduction-order noise."""
    from transformers import AutoConfig

    from checkpoint.pipeline_reader import load_hf_state_dict
    from tests.resumes import interrupted_copy
    from tests.test_training import STEPS, layout_args, layout_run

    for layout, ranks, more in [
        ("gqa-pp2-cp2-packed-recompute-chunked-tiled", 2, {"context_parallel_size": 1}),
        ("gqa-pp2-dp2-packed-recompute2-chunked", 4, {"context_parallel_size": 2, "gradient_accumulation_steps": 8}),
    ]:
        full = Path(layout_run(layout, converted, sft_data, tmp_path_factory))
        expected = read_jsonl(full / "metrics.jsonl")
        config = AutoConfig.from_pretrained(full)
        part = tmp_path / layout
        interrupted_copy(full, part, 2)
        proc = check(launch(ranks, *layout_args(layout, converted, sft_data, str(part), resume="true", **more)))
        assert "optimizer state reshaped by parameter name" in proc.stdout + proc.stderr
        got = read_jsonl(part / "metrics.jsonl")
        assert [m["step"] for m in got] == list(range(1, STEPS + 1))
        for a, b in zip(expected[2:], got[2:], strict=True):
            assert a["lr"] == b["lr"] and a["input_tokens"] == b["input_tokens"], (a, b)
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (layout, a, b)
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), (layout, a, b)
        final, moved = load_hf_state_dict(str(full), config), load_hf_state_dict(str(part), config)
        worst = max(float((moved[k] - v).abs().max()) for k, v in final.items())
        print(f"CP move {layout} -> {more}: max |weight diff| after {STEPS} steps vs unmoved = {worst:.3g}")
        assert worst < 5e-7, (layout, worst)  # measured 5.96e-8 (CP=2 -> 1) and 9.31e-9 (1 -> 2)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tiled_mlp_block_equals_the_whole_block(family):
    """`model.mlp_tiles=4` (DeepSpeed's TiledMLP around the family's MLP): the block's output, its input's gradient
    and every parameter's gradient equal the untiled block's (each position's MLP is the same maths)."""
    from models.layers import DecoderOptions, decoder_layer_class
    from tools.tiny_models import tiny_config

    config = tiny_config(family, num_key_value_heads=2)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    whole = decoder_layer_class(family)(config, 0)
    tiled = decoder_layer_class(family)(config, 0, DecoderOptions(mlp_tiles=4))
    tiled.load_state_dict(whole.state_dict())
    x, pos = torch.randn(2, 30, config.hidden_size), torch.arange(30).expand(2, 30)  # 30: tiles of 8, 8, 8, 6
    outputs, grads = [], []
    for block in (whole, tiled):
        inp = x.clone().requires_grad_()
        out = block((inp, pos))[0]
        out.square().sum().backward()
        outputs.append(out.detach())
        grads.append([inp.grad] + [p.grad for p in block.parameters()])
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-6, atol=1e-6)
    for a, b in zip(grads[0], grads[1], strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
