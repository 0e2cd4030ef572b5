"""docs/families.md, its section on state that crosses layers (Gemma 4, GLM-5) and their rows."""

from tests.claims.held import PARITY, PARITY_EXACT, REFERENCE, ROUND_TRIP, ROUND_TRIP_EXACT
from tests.claims.kinds import Benchmark, Claim, NotAClaim

CUTS = "tests/test_shared_state.py::test_every_cut_gives_transformers_logits_and_gradients"
CASE_ATOL = "torch.testing.assert_close(logits, ref_logits, rtol=0, atol=2e-6)"  # TP, CP, packed rows
MULTIMODAL = "tests/test_convert.py::test_multimodal_checkpoint_converts_its_text_model"
MULTIMODAL_EXACT = (
    "assert all(torch.equal(exported[k].view(torch.uint8), v.view(torch.uint8)) for k, v in source.items())"
)

CLAIMS = (
    Claim(
        says="yes (and the container with its vision and audio towers bit for bit)",
        test=MULTIMODAL,
        holds=MULTIMODAL_EXACT,
        bound=0,
    ),
    Claim(
        says="Gemma 4: logits bit-identical to transformers at PP=1, 2, 4 (the PP=2 cut separates the local K/V's maker "
        "from its reader, not the global one's",
        test=PARITY,
        holds=PARITY_EXACT,
        bound=0,
    ),
    Claim(
        says="at TP=2 with and without SP, at CP=2 (the carried K/V are each CP rank's positions: Ulysses regathers "
        "them in the reader) and on packed rows within 2e-6 (max 6.11e-7)",
        test=PARITY,
        holds=CASE_ATOL,
        bound=2e-6,
        figure=6.11e-7,
    ),
    Claim(
        says="GLM-5 bit-identical at PP=1, 2, 4, within 2.1e-7 at TP=2 and on packed rows, equal at EP=2",
        test=PARITY,
        holds="torch.testing.assert_close(logits, ref_logits, rtol=0, atol=2e-6)",
        bound=2e-6,
        figure=2.09e-7,
    ),
    Claim(
        says="cut into two stages after each block in turn, and into a stage per block, on one process with each "
        "stage's output handed on and its gradient sent back as DeepSpeed does: logits and the gradient of every "
        "weight bit-identical to transformers' own backward",
        test=CUTS,
        holds="assert torch.equal(grad, reference[key]), (key, cuts, float((grad - reference[key]).abs().max()))",
        bound=0,
    ),
    Claim(
        says="Gemma 4 at PP=2 x DP=2 (max weight difference 1.29e-5)",
        test=REFERENCE,
        holds="atol, rtol = wider.get(layout, 0.01) * cfg.learning_rate, 1e-5",
        bound=3e-5,
        figure=1.29e-5,
    ),
    Claim(
        says="PP=2 x TP=2 with SP (5.97e-5, one element at 1.99% of lr, held at 3%: its fp32 reference against the "
        "same training in fp64 moves one element 2.79% of lr)",
        test=REFERENCE,
        holds='wider |= {"gemma4-pp2-tp2": 0.03, "gemma4_moe-pp2-tp2": 0.05}',
        bound=0.03,
        figure=0.0199,
    ),
    Claim(
        says="GLM-5 at PP=2 x DP=2 x EP=2 (1.32e-6) and PP=2 x TP=2 (2.16e-5)",
        test=REFERENCE,
        holds="atol, rtol = wider.get(layout, 0.01) * cfg.learning_rate, 1e-5",
        bound=3e-5,
        figure=2.16e-5,
    ),
    Claim(
        says="the stage-to-stage bytes DeepSpeed's p2p.send carries equal the hidden states' plus `carried_bytes` in "
        "every layout of the parity launch",
        test="tests/test_parity.py::test_forward_parity_pp_and_tp",
        holds='assert t["sent_float_bytes"] == t["hidden_bytes"] // split + extra, t',
        bound=0,
    ),
    Claim(
        says="move the logits by 0.358, the per-layer inputs dropped by 0.658",
        test="tests/test_shared_state.py::test_dropping_a_carried_tensor_changes_the_logits",
        holds="assert recomputed > 1e-2 and dropped > 1e-2",
        bound=None,
        figure=None,
    ),
    Claim(
        says="by 0.185 (`test_dropping_a_carried_tensor_changes_the_logits`, "
        "`test_dropping_the_shared_index_changes_the_logits`)",
        test="tests/test_shared_state.py::test_dropping_the_shared_index_changes_the_logits",
        holds="assert dense > 1e-3",
        bound=None,
        figure=None,
    ),
    Claim(
        says="conversion, export bit for bit (the reusing layers' k/v projections and norms that Gemma 4's hub "
        "checkpoints keep and transformers skips at load carried aside and written back)",
        test=ROUND_TRIP,
        holds=ROUND_TRIP_EXACT,
        bound=0,
    ),
    Claim(
        says="the planner within 1.2% (Gemma 4) and 2.3% (GLM-5) of the bytes autograd saves on both stages",
        test="tests/test_memory_estimate.py::test_every_familys_stages_match_measurement",
        holds="assert abs(kept / measured - 1) <= tolerance, (stage, kept / measured - 1)",
        bound=0.03,
        figure=0.023,
    ),
    Claim(
        says="presets at real size held to transformers' parameter counts (Gemma 4 31B 30.70B, E4B 7.46B)",
        test="tests/test_convert.py::test_layer_modules_match_hf_at_preset_shapes",
        holds="assert round(total / 1e9, 2) == billions",
        bound=0,
    ),
    Benchmark(says="equal near block 29 of 35", by="benchmarks/carry_costs.py"),
    Benchmark(
        says="making every layer's per-layer inputs took 35% of one decoder layer's time on this CPU (1.98 s against "
        "5.68 s at E2B's width)",
        by="benchmarks/carry_costs.py",
    ),
    Claim(
        says="Proven: logits bit-identical at PP=1, 2, 4, equal at EP=2 and within 2e-6 at TP=2 with and without SP (max "
        "5.74e-7) and CP=2",
        test=PARITY,
        holds=CASE_ATOL,
        bound=2e-6,
        figure=5.74e-7,
    ),
    Claim(
        says="one step's gradient of every parameter of the TP=2 model, with and without SP, within 6.66e-6 of the "
        "whole model's",
        test="tests/test_shared_state.py::test_tp2_gives_the_whole_models_gradients_through_the_moe_block",
        holds="assert worst < 1e-5",
        bound=1e-5,
        figure=6.66e-6,
    ),
    Claim(
        says="every cut's gradients bit-identical to transformers';",
        test=CUTS,
        holds="assert torch.equal(grad, reference[key])",
        bound=0,
    ),
    Claim(
        says="training at PP=2 x DP=2 x EP=2 (max weight difference 7.0e-6) and PP=2 x TP=2 with SP (one element up to "
        "4.22% of lr in one suite and 1.31% in another",
        test=REFERENCE,
        holds='wider |= {"gemma4-pp2-tp2": 0.03, "gemma4_moe-pp2-tp2": 0.05}',
        bound=0.05,
        figure=0.0422,
    ),
    Claim(
        says="measured -1.7% to +2.7%, GLM-4.5 +3.0% in one suite run",
        test="tests/test_memory_estimate.py::test_every_familys_stages_match_measurement",
        holds="assert abs(kept / measured - 1) <= tolerance, (stage, kept / measured - 1)",
        bound=0.04,
        figure=0.03,
    ),
    Claim(
        says="held at 5%: Adam turns the fp32 rounding of nearly cancelling gradients into steps near lr",
        test=REFERENCE,
        holds='wider |= {"gemma4-pp2-tp2": 0.03, "gemma4_moe-pp2-tp2": 0.05}',
        bound=0.05,
    ),
    NotAClaim(
        says="its fp32 reference against fp64 moves one element 1.02%",
        why="measured by hand once (the reference run in fp64), to say why the bound is 5%; no test runs it",
    ),
)
