"""DeepSeek-V4's claims: docs/families.md (its row and its part of the section on state that crosses layers) and
docs/measured.md (its rows); LFM2's (its section on short convolutions); Nemotron-H's (its part of the section on
Mamba-2); Kimi Linear's (its part of the section on linear attention)."""

from tests.claims.held import (
    PARITY,
    PARITY_2E6,
    PARITY_EP,
    PARITY_EXACT,
    PEFT,
    REFERENCE,
    ROUND_TRIP,
    ROUND_TRIP_EXACT,
    SCHED,
    SCHED_BOUND,
)
from tests.claims.kinds import Claim

CUTS = "tests/test_shared_state.py::test_every_cut_gives_transformers_logits_and_gradients"
CUTS_EXACT = "assert torch.equal(grad, reference[key]), (key, cuts, float((grad - reference[key]).abs().max()))"
ONE_PCT_OF_LR = "atol, rtol = wider.get(layout, 0.01) * cfg.learning_rate, 1e-5"
STAGES = "tests/test_memory_estimate.py::test_every_familys_stages_match_measurement"
STAGES_HOLD = "assert abs(kept / measured - 1) <= tolerance, (stage, kept / measured - 1)"
RELEASE = "tests/test_release_layouts.py::test_the_release_layout_converts_as_transformers_reads_it"
RELEASE_EXACT = "assert set(ours) == set(saved) and all(torch.equal(ours[k], saved[k]) for k in saved)"
DEQUANTIZED = "tests/test_release_layouts.py::test_fp8_attention_and_fp4_experts_are_dequantized_as_transformers_does"
DEQUANTIZED_EXACT = "assert torch.equal(ours[saved[key]], want), key"

FAMILIES = (
    Claim(
        says="logits bit-identical to transformers at PP=1, 2, 4 in the parity launch",
        test=PARITY,
        holds=PARITY_EXACT,
        bound=0,
    ),
    Claim(says="at EP=2 within 1e-6 (0 measured)", test=PARITY, holds=PARITY_EP, bound=1e-6),
    Claim(
        says="within 2.12e-7 at TP=2 and PP=2 x TP=2, with and without sequence parallelism (held at 2e-6)",
        test=PARITY,
        holds=PARITY_2E6,
        bound=2e-6,
        figure=2.12e-7,
    ),
    Claim(
        says="every cut's (and every block recomputed's) logits and gradients bit-identical to transformers'",
        test=CUTS,
        holds=CUTS_EXACT,
        bound=0,
    ),
    Claim(
        says="training at PP=2 x DP=2 x EP=2 with its top-k routers' score biases balanced (max weight difference "
        "1.42e-5, in a hyper-connection's `fn`: 0.47% of lr) and PP=2 x TP=2 with sequence parallelism (2.84e-5, 0.95% "
        "of lr)",
        test=REFERENCE,
        holds=ONE_PCT_OF_LR,
        bound=3e-5,
        figure=2.84e-5,
    ),
    Claim(says="under zero-bubble its weights within 1e-6 of 1F1B's", test=SCHED, holds=SCHED_BOUND, bound=1e-6),
    Claim(
        says="LoRA at PP=2 x DP=2 x EP=2 within 1% of lr of PEFT's training",
        test=PEFT,
        holds="torch.testing.assert_close(ours[key], ref[key], rtol=1e-5, atol=0.01 * cfg.learning_rate)",
        bound=3e-5,
    ),
    Claim(
        says="the planner within 3.1% on both stages (held at 5%)",
        test=STAGES,
        holds=STAGES_HOLD,
        bound=0.05,
        figure=0.031,
    ),
    Claim(
        says="converts to the same layer files as transformers' layout, bit for bit",
        test=RELEASE,
        holds=RELEASE_EXACT,
        bound=0,
    ),
    Claim(
        says="V4-Flash's FP8 attention (ue8m0 scales under `.scale`) and FP4 experts are dequantized as transformers' "
        "`Fp8Dequantize` computes them, bit for bit",
        test=DEQUANTIZED,
        holds=DEQUANTIZED_EXACT,
        bound=0,
    ),
)

LFM2 = (
    Claim(says="Tested: logits bit-identical to transformers at PP=1, 2, 4", test=PARITY, holds=PARITY_EXACT, bound=0),
    Claim(says="LFM2-MoE's at EP=2 within 1e-6 (0 measured)", test=PARITY, holds=PARITY_EP, bound=1e-6),
    Claim(
        says="LFM2's and LFM2-MoE's at TP=2 and PP=2 x TP=2 (LFM2-MoE's at TP=2 x EP=2 too), with and without SP, "
        "within 2.68e-7 (held at 2e-6)",
        test=PARITY,
        holds=PARITY_2E6,
        bound=2e-6,
        figure=2.68e-7,
    ),
)

MEASURED = (
    Claim(says="logits bit-identical to transformers at PP=1/2/4", test=PARITY, holds=PARITY_EXACT, bound=0),
    Claim(says="at EP=2 within 1e-6 (0 measured);", test=PARITY, holds=PARITY_EP, bound=1e-6),
    Claim(
        says="max 2.12e-7 at TP=2 with and without SP (its attention whole on each rank, held at 2e-6)",
        test=PARITY,
        holds=PARITY_2E6,
        bound=2e-6,
        figure=2.12e-7,
    ),
    Claim(says="every cut's logits and gradients bit-identical", test=CUTS, holds=CUTS_EXACT, bound=0),
    Claim(
        says="training against single-process transformers (4 AdamW steps), max weight difference 1.42e-5 "
        "(PP2xDP2xEP2, score biases balanced), 2.84e-5 (PP2xTP2 with SP, held at 1% of lr)",
        test=REFERENCE,
        holds=ONE_PCT_OF_LR,
        bound=3e-5,
        figure=2.84e-5,
    ),
    Claim(says="zero-bubble within 1e-6 of 1F1B", test=SCHED, holds=SCHED_BOUND, bound=1e-6),
    Claim(
        says="planner -3.1% / -2.9% of the bytes autograd saves (held at 5%)",
        test=STAGES,
        holds=STAGES_HOLD,
        bound=0.05,
        figure=0.031,
    ),
    Claim(
        says="DeepSeek's release layout with FP8 (ue8m0) attention and FP4 experts dequantized bit for bit as "
        "transformers' `Fp8Dequantize`",
        test=DEQUANTIZED,
        holds=DEQUANTIZED_EXACT,
        bound=0,
    ),
)

# Nemotron-H's and Kimi Linear's logits, each family's own sentence
PIPELINE_AND_EP = (
    Claim(
        says="Tested: logits bit-identical to transformers at PP=1, 2, 4 and at EP=2 (0 measured)",
        test=PARITY,
        holds=PARITY_EXACT,
        bound=0,
    ),
    Claim(says="and at EP=2 (0 measured)", test=PARITY, holds=PARITY_EP, bound=1e-6, figure=0),
)

NEMOTRON_H = (
    *PIPELINE_AND_EP,
    Claim(
        says="training parity at PP=2 x DP=2 x EP=2 (4 AdamW steps with clipping)",
        test=REFERENCE,
        holds=ONE_PCT_OF_LR,
        bound=3e-5,
    ),
    Claim(
        says="the planner's count within 3% of what autograd saves (+2.4% and +2.1% measured)",
        test=STAGES,
        holds=STAGES_HOLD,
        bound=0.03,
        figure=0.024,
    ),
)

KIMI_LINEAR = (
    *PIPELINE_AND_EP,
    Claim(says="export bit for bit in the hub's layout", test=ROUND_TRIP, holds=ROUND_TRIP_EXACT, bound=0),
    Claim(
        says="at PP=2 x DP=2 x EP=2 within 1% of lr of PEFT's training",
        test=PEFT,
        holds="torch.testing.assert_close(ours[key], ref[key], rtol=1e-5, atol=0.01 * cfg.learning_rate)",
        bound=3e-5,
    ),
    Claim(
        says="DPO in one process (with its experts: every gradient within 1e-5 of its scale, 0 measured)",
        test="tests/test_families.py::test_dpo_through_each_familys_layers_equals_transformers",
        holds="torch.testing.assert_close(param.grad, theirs, rtol=0, atol=1e-5 * scale, msg=hf_name)",
        bound=1e-5,
        figure=0,
    ),
    Claim(
        says="the planner within 0.4% of what autograd saves (held at 3%)",
        test=STAGES,
        holds=STAGES_HOLD,
        bound=0.03,
        figure=0.004,
    ),
)

CONTAINERS = (
    Claim(
        says="the container's own logits on text rows equal that family's model holding its text weights, bit for bit",
        test="tests/multimodal.py::text_rows_compute_as",
        holds="return torch.equal(ours(input_ids=ids).logits, model(input_ids=ids).logits)",
        bound=0,
    ),
)
