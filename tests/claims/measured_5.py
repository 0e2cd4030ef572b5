"""docs/measured.md: the figures of its sentences beside the ones measured_1-4 hold (one entry per claim)."""

from tests.claims import held
from tests.claims.converting import STREAMED, STREAMED_EQUAL
from tests.claims.kinds import Benchmark, Claim, NotAClaim

EP_BF16 = "assert worst < (FP32_WEIGHT_BOUNDS[name] if exact else 0.03)"
CLAIMS = (
    Claim(says="plus 1e-5 relative", test=held.REFERENCE, holds="cfg.learning_rate, 1e-5", bound=1e-5),
    NotAClaim(
        says="SP stage 0 4.53 MiB, stage 1 20.31 MiB, plus the recomputed block (planner 80.4 MiB)",
        why="the sizes the planner's +0.0% beside them compares (its entry holds that)",
    ),
    NotAClaim(
        says="plus the recomputed block (planner 281.5 MiB, 153.5 MiB with tiles)",
        why="the planner's figure for the recomputed block, printed by the run beside what it compares",
    ),
    Claim(
        says="Llama 4 PP=2 x CP=2 (no load-balancing loss in transformers): 1.25e-6",
        test=held.MEASURED_WEIGHT_DIFF,
        holds='"llama4-pp2-cp2": 1.25e-6',
        bound=1.25e-5,
        figure=1.25e-6,
    ),
    NotAClaim(says="+2.3% before", why="the planner's error before a fix, history"),
    Claim(
        says="(the test requires 90%)",
        test="tests/test_demo.py::test_demo_script_end_to_end",
        holds="assert match and int(match.group(2)) >= 0.9 * int(match.group(1))",
        bound=None,
    ),
    NotAClaim(says="(theory with m=4: 0.625, bubble 20%)", why="arithmetic: the 1F1B bubble (p - 1) / (m + p - 1)"),
    NotAClaim(
        says="(one element of an MLP weight, 0.72% of lr)", why="where the figure before it lies, in units of lr"
    ),
    Claim(
        says="Qwen3.5-MoE TP=2 x DP=2 x EP=2 within 0.00889",
        test=held.EP_ZERO1,
        holds=EP_BF16,
        bound=0.03,
        figure=0.00889,
    ),
    Claim(says="gpt-oss TP=2 x DP=2 x EP=2 within 0.011", test=held.EP_ZERO1, holds=EP_BF16, bound=0.03, figure=0.011),
    Claim(
        says="with its first grad norm 3.1e-3 from fp32's",
        test=held.EP_ZERO1,
        holds='rel = 1e-6 if exact else BF16_NORM_BOUNDS.get((name, b["step"]), 5e-3)',
        bound=5e-3,
        figure=3.1e-3,
    ),
    NotAClaim(
        says="(each down bias, whole on both TP ranks, counted once per rank: 6.2e-2)",
        why="a negative control measured by hand once (the norm with the double count), not run by a test",
    ),
    Claim(
        says="(5.13e-7 of each gradient's scale measured, held at 1e-5 as every family's",
        test="tests/test_tensor_parallel.py::test_tp_block_equals_the_whole_block_with_biases_and_qk_norms",
        holds="assert worst < 1e-5",
        bound=1e-5,
        figure=5.13e-7,
    ),
    NotAClaim(says="(both with `moe.bias_update_rate` 2e-3", why="a setting of the runs"),
    Claim(says="(TP and CP held at 2e-6", test=held.PARITY, holds=held.PARITY_2E6, bound=2e-6),
    Claim(says="EP at 1e-6)", test=held.PARITY, holds=held.PARITY_EP, bound=1e-6),
    Claim(
        says="max weight difference 2.35e-6 (held at 1% of lr)",
        test=held.REFERENCE,
        holds="atol, rtol = wider.get(layout, 0.01) * cfg.learning_rate, 1e-5",
        bound=3e-5,
        figure=2.35e-6,
    ),
    NotAClaim(
        says="7.63e-6 on the test model's weights before Mistral 4's test model re-seeded it",
        why="history: the figure on the weights the model had before",
    ),
    Claim(
        says="Qwen3.5-MoE PP=2 x DP=2 x EP=2 with its load-balancing loss 1.17e-5 (in `A_log`, held at 1% of lr",
        test=held.REFERENCE,
        holds="atol, rtol = wider.get(layout, 0.01) * cfg.learning_rate, 1e-5",
        bound=3e-5,
        figure=1.17e-5,
    ),
    Claim(
        says="TP=2 x DP=2 x EP=2 with SP 4.47e-6, Qwen3.5 PP=2 x DP=2 7.04e-7",
        test=held.MEASURED_WEIGHT_DIFF,
        holds='"qwen3_5-pp2-dp2": 7.04e-7',
        bound=7.04e-6,
        figure=7.04e-7,
    ),
    NotAClaim(
        says="(without the TP sum of `in_proj_qkv`'s A gradient the grad norms are off by 1.7e-4, relative)",
        why="a negative control measured by hand once (the sum removed), not run by a test",
    ),
    NotAClaim(says="Qwen3.5 +0.1%)", why="its figure, under the 0.5% bound its sentence's entry holds"),
    Claim(
        says="its logits under TP=2 max 5.74e-7", test=held.PARITY, holds=held.PARITY_2E6, bound=2e-6, figure=5.74e-7
    ),
    Claim(
        says="one step's TP=2 gradients 6.66e-6 (relative) from the whole model's",
        test="tests/test_shared_state.py::test_tp2_gives_the_whole_models_gradients_through_the_moe_block",
        holds="assert worst < 1e-5",
        bound=1e-5,
        figure=6.66e-6,
    ),
    Benchmark(says="the trainer sits 40x closer to the bf16 loop than bf16 is to fp32", by="benchmarks/gpu_parity.py"),
    Benchmark(
        says="Losses of the saving and non-saving runs bit-identical in every case.", by="benchmarks/save_stall.py"
    ),
    Benchmark(
        says="48 layers (1,157 MiB): **635 MiB** of anonymous memory against 2,743 MiB for transformers' whole fp32 model "
        "(the comparison before)",
        by="benchmarks/convert_memory.py",
    ),
    Benchmark(
        says="16 layers (469 MiB): 583 against 1,263; the imports alone 253 MiB: about 1.6 MiB more a layer instead of 46",
        by="benchmarks/convert_memory.py",
    ),
    Benchmark(
        says="RSS with the mapped safetensors pages 1,887 / 1,127 MiB (the whole model's 3,819 / 1,751)",
        by="benchmarks/convert_memory.py",
    ),
    Claim(
        says="In the test: logits bit-identical to the whole model's",
        test=STREAMED,
        holds=STREAMED_EQUAL,
        bound=0,
    ),
    Claim(
        says="never more than the modules outside the layer lists plus the largest layer in memory",
        test=STREAMED,
        holds="assert resident < max(held) <= resident + largest",
        bound=None,
    ),
    Benchmark(
        says="16,384 tokens, one document: peak RSS **1.355 GiB** fused, 1.71x the 0.792 GiB the process held before "
        "the step (unfused 9.776 GiB, 12.6x)",
        by="benchmarks/row_memory.py",
    ),
    Benchmark(
        says="packed, 16 documents a row: 1.324 GiB (0.98x the one document's) in **16.5 s against 27.0 s**",
        by="benchmarks/row_memory.py",
    ),
    Benchmark(
        says="(unfused one document 43.9 s); 4,096 tokens: fused 1.140 GiB, 4.7 s (packed 1.155 GiB, 3.4 s), unfused "
        "2.829 GiB, 4.5 s",
        by="benchmarks/row_memory.py",
    ),
    Claim(
        says="in one process bit-identical to torch's (bf16 and fp32)",
        test="tests/test_muon.py::test_muon_equals_torch_muon_in_one_process",
        holds="assert torch.equal(p, ref_state[name]), name",
        bound=0,
    ),
    Benchmark(
        says="Muon with bf16 Newton-Schulz 4.602 s (14.5x; 4.209 s of it orthogonalising 210 matrices), fp32 8.983 s;",
        by="benchmarks/muon_step.py",
    ),
    Claim(
        says="LoRA's adapters at PP=2 x TP=2 held at 0.1% of lr",
        test="tests/test_muon_training.py::test_lora_with_muon_matches_torch_muon_on_the_adapters",
        holds="share_of_lr=1e-3)",
        bound=1e-3,
    ),
    Claim(
        says="the 4 losses follow the fp32 run within 5.0e-4 relative at PP=2 x DP=2",
        test="tests/test_muon_training.py::test_muon_under_bf16_zero1_follows_the_fp32_run",
        holds='b["loss"] == pytest.approx(a["loss"], rel=2e-3)',
        bound=2e-3,
        figure=5.0e-4,
    ),
    Claim(
        says="3.8e-4 for Phi-3 at PP=2 x TP=2",
        test="tests/test_muon_training.py::test_muon_under_bf16_zero1_follows_the_fp32_run",
        holds='b["loss"] == pytest.approx(a["loss"], rel=2e-3)',
        bound=2e-3,
        figure=3.8e-4,
    ),
    Claim(
        says="(the test holds 2e-3)",
        test="tests/test_muon_training.py::test_muon_under_bf16_zero1_follows_the_fp32_run",
        holds='b["loss"] == pytest.approx(a["loss"], rel=2e-3)',
        bound=2e-3,
    ),
    Claim(
        says="its same-layout resume is bit-identical",
        test="tests/test_muon_training.py::test_muon_under_bf16_zero1_follows_the_fp32_run",
        holds="assert_resumed_exactly(out, part, 2)",
        bound=0,
    ),
    Claim(
        says="the momentum carried as Adam's first moment, equal to the saved partitions' fragments joined",
        test="tests/test_muon_training.py::test_muon_under_bf16_zero1_follows_the_fp32_run",
        holds='assert whole.abs().max() > 0 and torch.equal(whole.flatten(), saved_momentum(out / "global_step2", name))',
        bound=0,
    ),
    Claim(
        says="its steps 3-4 follow the unmoved run to the same bound",
        test="tests/test_muon_training.py::test_muon_under_bf16_zero1_follows_the_fp32_run",
        holds='b["loss"] == pytest.approx(a["loss"], rel=2e-3)',
        bound=2e-3,
    ),
    Claim(
        says="Mixtral at PP=2 x DP=2 x EP=2 in bf16 follows its fp32 run within 4.0e-4",
        test="tests/test_muon_training.py::test_muon_momentum_of_experts_moves_under_bf16_zero1",
        holds='b["loss"] == pytest.approx(a["loss"], rel=2e-3)',
        bound=2e-3,
        figure=4.0e-4,
    ),
    Claim(
        says="moved to EP=1 (each expert's momentum assembled whole, equal to the saved fragments)",
        test="tests/test_muon_training.py::test_muon_momentum_of_experts_moves_under_bf16_zero1",
        holds='assert torch.equal(experts["param"].flatten(), saved_momentum(out / "global_step2", name))',
        bound=0,
    ),
    Claim(
        says="itself within 3.2e-5",
        test="tests/test_muon_training.py::test_muon_momentum_of_experts_moves_under_bf16_zero1",
        holds='b["loss"] == pytest.approx(a["loss"], rel=2e-4)',
        bound=2e-4,
        figure=3.2e-5,
    ),
)
