"""docs/moe.md, continued (under the line budget): fp16's fp32 tensors, DualPipeV's `A_log`, moved optimizer state."""

from tests.claims.held import SCHED
from tests.claims.kinds import Claim

EP = "tests/test_expert_parallel_training.py"
FP16 = "tests/test_families.py::test_fp16_keeps_fp32_what_transformers_keeps"
FP16_EXACT = "assert torch.equal(pipeline_logits(config, state, ids, dtype=torch.float16), fp16(input_ids=ids).logits)"

CLAIMS = (
    Claim(
        says="in our layers cast to fp16 (logits bit-identical to transformers' fp16 model)",
        test=FP16,
        holds=FP16_EXACT,
        bound=0,
    ),
    Claim(
        says="our layers cast to fp16 give transformers' fp16 logits bit for bit",
        test=FP16,
        holds=FP16_EXACT,
        bound=0,
    ),
    Claim(
        says="Qwen3.5-MoE's within 2% of lr (`A_log`: 1.67e-5)",
        test=SCHED,
        holds='bound = 6e-5 if schedule == "dualpipev" and layout.startswith("qwen3_5_moe") else bound',
        bound=6e-5,
        figure=1.67e-5,
    ),
    Claim(
        says="the optimizer state reshaped by parameter name (losses within 1e-5, grad norms within 1e-4)",
        test=f"{EP}::test_expert_parallel_checkpoint_resumes_with_any_ep",
        holds='assert b["lr"] == a["lr"] and b["loss"] == pytest.approx(a["loss"], rel=1e-5), (a, b)',
        bound=1e-5,
    ),
    Claim(
        says="losses after the first step (within 3e-3, under a bf16 ulp: 1.32e-3 at step 3 when the test runs alone)",
        test=f"{EP}::BF16_LOSS_BOUNDS",
        holds='BF16_LOSS_BOUNDS = {("bf16_zero1_gpt_oss", step): 3e-3 for step in (2, 3, 4)}',
        bound=3e-3,
        figure=1.32e-3,
    ),
    Claim(
        says="a K2.5 container with INT4 experts too, to what compressed-tensors' decompressor computes, its export the "
        "container in bf16 with its vision tower byte for byte",
        test="tests/test_quantized_sources.py::test_kimi_k25_container_with_int4_experts",
        holds="assert value.dtype == dtype and torch.equal(value, expected.to(dtype)), key",
        bound=0,
    ),
    Claim(
        says="within 1.6% of the peak transformers' indexer allocates",
        test="tests/test_memory_estimate.py::test_a_lightning_indexers_scores_are_planned_as_they_peak",
        holds="assert peak == pytest.approx(planned, rel=0.03), (b, peak, planned)",
        bound=0.03,
        figure=0.016,
    ),
    Claim(
        says="eager single process and at PP=1, 2, 4 on unpacked rows",
        test="tests/workers/forward_parity.py::main",
        holds="assert torch.equal(logits, ref_logits)",
        bound=0,
    ),
    Claim(
        says="every score bias fp32 and equal to the fp32 run's",
        test=f"{EP}::test_expert_parallel_under_zero1_and_bf16",
        holds="assert all(ours[k].dtype == torch.float32 and torch.equal(ours[k], reference[k]) for k in biases), name",
        bound=0,
    ),
)
