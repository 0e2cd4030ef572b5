from tests.claims.held import (
    EP_ZERO1,
    FAMILIES,
    FAMILIES_EXACT,
    MEASURED_WEIGHT_DIFF,
    ONE_PCT_OF_LR,
    PARITY,
    PARITY_EXACT,
    PEFT,
    PLANNER,
    REFERENCE,
    ROUND_TRIP,
    ROUND_TRIP_EXACT,
    SAME_RUN,
    TP_BLOCK,
)
from tests.claims.kinds import Benchmark, Claim, NotAClaim

_CP_LOGITS = (
    "if cp > 1: # attention over the whole row after the all-to-all; the same kernel, other strides "
    "torch.testing.assert_close(logits, ref_logits, rtol=0, atol=2e-6)"
)
_TP_LOGITS = (
    "else: # row-parallel sums add the same terms in another order "
    "torch.testing.assert_close(logits, ref_logits, rtol=0, atol=2e-6)"
)
_LOSS = "torch.testing.assert_close(torch.tensor(loss_sum / tokens), ref_loss, rtol=1e-6, atol=1e-6)"
_AUX = "torch.testing.assert_close(aux_loss(stats), ref_aux, rtol=1e-6, atol=1e-6)"
_REF_LOSSES = 'torch.tensor([m["loss"] for m in metrics]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6'
_REF_NORMS = 'torch.tensor([m["grad_norm"] for m in metrics]), torch.tensor(ref_norms), rtol=1e-4, atol=1e-6'
_MEM_TP = "tests/test_memory_estimate.py::test_tp_and_sequence_parallel_activation_estimates_match_measurement"
_TP_TOL = 'assert abs(kept / measured - 1) <= (0.05 if "eager" in name else 0.005), (name, sp)'
_SAME_METRICS = '(a["loss"], a["lr"], a["grad_norm"]) == (b["loss"], b["lr"], b["grad_norm"])'
_SAME_WEIGHTS = "all(torch.equal(a[k], b[k]) for k in a)"
_THROUGHPUT = "benchmarks/train_throughput.py"

PACKING = "tests/packing_reference.py::assert_packing_report"

CLAIMS = (
    # 1-2 forward parity, pipeline vs transformers
    Claim(
        says="logits bit-identical (the test asserts equality)",
        test=PARITY,
        holds=PARITY_EXACT,
        bound=0,
    ),
    Claim(says="loss within 1e-6 (HF divides in fp32, we in fp64)", test=PARITY, holds=_LOSS, bound=1e-6),
    # 3 training parity PP=2 x DP=2
    Claim(says="losses within rtol 1e-5", test=REFERENCE, holds=_REF_LOSSES, bound=1e-5),
    Claim(says="grad norms within 1e-4, max weight difference", test=REFERENCE, holds=_REF_NORMS, bound=1e-4),
    Claim(says="max weight difference 3.3e-6 (GQA)", test=REFERENCE, holds=ONE_PCT_OF_LR, bound=3e-5, figure=3.3e-6),
    Claim(
        says="1.9e-6 (tied) with lr 3e-3",
        test=MEASURED_WEIGHT_DIFF,
        holds='"tied-pp2-dp2": 1.9e-6',
        bound=1.9e-5,
        figure=1.9e-6,
    ),
    # 4 what the test holds
    Claim(says="every layout's weights are held at 1% of lr (3e-5", test=REFERENCE, holds=ONE_PCT_OF_LR, bound=3e-5),
    Claim(
        says="2-3% for the three layouts named in the test",
        test=REFERENCE,
        holds='"glm4_moe-tp2-dp2-ep2": 0.03',
        bound=9e-5,
    ),
    Claim(
        says="the sixteen layouts whose figure here is below 2.5e-6 at 10x that figure",
        test=REFERENCE,
        holds="atol, rtol = 10 * MEASURED_WEIGHT_DIFF[layout], 0.0",
        bound=None,
    ),
    # 5 forward parity with TP, TP=1
    Claim(says="TP=1: bit-identical (63 checks)", test=PARITY, holds=PARITY_EXACT, bound=0),
    # 6 packed layout
    Claim(
        says="packed PP2xDP2 (recompute every 2nd block, loss in chunks of 5) 1.44e-6",
        test=MEASURED_WEIGHT_DIFF,
        holds='"gqa-pp2-dp2-packed-recompute2-chunked": 1.44e-6',
        bound=10 * 1.44e-6,
        figure=1.44e-6,
    ),
    Claim(
        says="with eval loss within 1e-5",
        test=REFERENCE,
        holds='assert results["eval_loss"] == pytest.approx(ref_loss, rel=1e-5)',
        bound=1e-5,
    ),
    Claim(says="token count equal", test=REFERENCE, holds='assert results["eval_tokens"] == ref_tokens', bound=0),
    # 7 Qwen3 PP2xTP2 3.07e-5
    Claim(
        says="this layout's bound is 2% of lr, the others 1%",
        test=REFERENCE,
        holds='"qwen3-pp2-tp2": 0.02',
        bound=6e-5,
        figure=3.07e-5,
    ),
    # 8 sequence parallelism, forward
    Claim(
        says="logits equal the same layout without it within 1e-6",
        test=PARITY,
        holds="torch.testing.assert_close(logits, without_sp[key], rtol=1e-6, atol=1e-6)",
        bound=1e-6,
    ),
    Claim(says="transformers' within 2e-6 (max 2.98e-7)", test=PARITY, holds=_TP_LOGITS, bound=2e-6, figure=2.98e-7),
    # 9-10 SP saved bytes vs the planner (fractions)
    Claim(says="planner within -3.6% to +0.0%", test=_MEM_TP, holds=_TP_TOL, bound=0.05, figure=0.036),
    Claim(says="held at 5% there", test=_MEM_TP, holds=_TP_TOL, bound=0.05, figure=0.036),
    Claim(says="0.5% on the three other layouts, at +0.0%", test=_MEM_TP, holds=_TP_TOL, bound=0.005, figure=0.0),
    # 11-12 one row of 32,768 tokens
    Claim(
        says="both losses equal transformers' on the whole row (4.17207, within 1e-5)",
        test="tests/test_memory_estimate.py::test_one_32k_token_row_through_sequence_and_context_parallelism",
        holds='assert r["loss"] == pytest.approx(float(ref), rel=1e-5), (r, float(ref))',
        bound=1e-5,
    ),
    Claim(
        says="peak bytes saved per rank, planner +0.0% on every rank",
        test="tests/test_memory_estimate.py::test_one_32k_token_row_through_sequence_and_context_parallelism",
        holds="assert abs(kept / measured - 1) <= 0.002, (r, kept)",
        bound=0.002,
        figure=0.0,
    ),
    # 13-14 context parallelism, forward
    Claim(
        says="logits within 2e-6 of transformers' on each rank's positions (454 checks with every family of the launch today, max 5.07e-7",
        test=PARITY,
        holds=_CP_LOGITS,
        bound=2e-6,
        figure=5.07e-7,
    ),
    Claim(says="the load-balancing loss within 1e-6), the row's", test=PARITY, holds=_AUX, bound=1e-6),
    Claim(says="the row's loss within 1e-6", test=PARITY, holds=_LOSS, bound=1e-6),
    # 15 LoRA under PP=2 x CP=2
    Claim(
        says="equal to PEFT's training within the LoRA tests' bounds, as under 1F1B, zero_bubble and DualPipeV",
        test=PEFT,
        holds="torch.testing.assert_close(ours[key], ref[key], rtol=1e-5, atol=0.01 * cfg.learning_rate)",
        bound=3e-5,
    ),
    # 16 resume across a change of C
    Claim(
        says="PP=2 x CP=2 -> PP=2 x CP=1: weights after 4 steps within 5.96e-8 of the unmoved run",
        test="tests/test_context_parallel.py::test_resume_across_a_change_of_context_parallel_size",
        holds="assert worst < 5e-7, (layout, worst)",
        bound=5e-7,
        figure=5.96e-8,
    ),
    # 17 PP=2 x TP=2 x CP=2 on 8 ranks (the worker's CP branch)
    Claim(
        says="logits within 2e-6 of transformers' (24 checks, max 2.98e-7)",
        test=PARITY,
        holds=_CP_LOGITS,
        bound=2e-6,
        figure=2.98e-7,
    ),
    # 18-19 one row of 131,072 tokens: a by-hand run of the worker, no test at this length
    Benchmark(
        says="loss 4.172164, equal to transformers' on the whole row (difference 0.0 in fp32), with and without tiled MLPs",
        by="tests/workers/long_rows.py",
    ),
    Benchmark(
        says="stage 0 17.50 MiB, stage 1 65.25 MiB, both equal to the planner's to the byte",
        by="tests/workers/long_rows.py",
    ),
    # 20 DPO under CP
    Claim(
        says="the evaluation within 1e-4",
        test="tests/test_dpo.py::test_dpo_training_matches_single_process_reference",
        holds='assert got[f"eval_{key}"] == pytest.approx(expected[key], rel=1e-4, abs=1e-6), key',
        bound=1e-4,
    ),
    # 21 MoE under CP
    Claim(
        says="its experts split over the 2 CP ranks (EP=2): max weight difference 1.49e-6",
        test=MEASURED_WEIGHT_DIFF,
        holds='"mixtral-pp2-cp2-ep2-recompute": 1.49e-6',
        bound=10 * 1.49e-6,
        figure=1.49e-6,
    ),
    Claim(
        says="under fp32 ZeRO-1 within 2.12e-7 of it",
        test="tests/test_expert_parallel_training.py::FP32_WEIGHT_BOUNDS",
        holds='"fp32_zero1_cp2": 1e-6',
        bound=1e-6,
        figure=2.12e-7,
    ),
    Claim(
        says="`bf16_zero1` 0.0125",
        test=EP_ZERO1,
        holds="assert worst < (FP32_WEIGHT_BOUNDS[name] if exact else 0.03), (name, worst)",
        bound=0.03,
        figure=0.0125,
    ),
    # 22 packing: the report equal to what the test finds from the data itself (its own best-fit decreasing)
    Claim(
        says="3.01 rows per packed row",
        test=PACKING,
        holds='assert (report["tokens"], report["packed_rows"]) == (sum(lengths), packed), (report, sum(lengths), packed)',
        bound=0,
    ),
    Claim(
        says="padding 69.3% -> 7.7% of positions",
        test=PACKING,
        holds='assert report["padding_share_packed"] == pytest.approx(1 - sum(lengths) / (packed * seq_length))',
        bound=None,
    ),
    # 23-24 memory planner vs saved bytes (fractions)
    Claim(
        says="prediction 0.0% to +0.1% of measured",
        test=PLANNER,
        holds="assert abs(kept / measured - 1) <= tolerance.get(layout, 0.05 if routed else 0.005)",
        bound=0.005,
        figure=0.001,
    ),
    Claim(
        says="the test holds 0.5% for these",
        test=PLANNER,
        holds="assert abs(kept / measured - 1) <= tolerance.get(layout, 0.05 if routed else 0.005)",
        bound=0.005,
        figure=0.001,
    ),
    Claim(
        says="1% for Mixtral (-0.3%)",
        test=PLANNER,
        holds='"mixtral-pp2-stage1": 0.01',
        bound=0.01,
        figure=0.003,
    ),
    Claim(
        says="Qwen2-MoE (-0.2%)",
        test=PLANNER,
        holds='"qwen2_moe-sparse-step-bf16": 0.01',
        bound=0.01,
        figure=0.002,
    ),
    Claim(says="2% for Llama 4 (+0.2%)", test=PLANNER, holds='"llama4-pp2-stage1": 0.02', bound=0.02, figure=0.002),
    Claim(
        says="5% with Llama 4's routed experts (-2.5%)",
        test=PLANNER,
        holds="tolerance.get(layout, 0.05 if routed else 0.005)",
        bound=0.05,
        figure=0.025,
    ),
    NotAClaim(
        says="bf16 eager with GQA -46% before eager attention was measured on the meta device",
        why="how far the replaced count was off (measured once, by hand; the test's layout comment keeps it)",
    ),
    # 25 resume at step 2 of 4
    Claim(
        says="losses, LR, grad norms, weights and Adam moments identical (bitwise",
        test="tests/resumes.py::assert_resumed_exactly",
        holds='assert (a["loss"], a["lr"], a["grad_norm"]) == (b["loss"], b["lr"], b["grad_norm"]), (a, b)',
        bound=0,
    ),
    Claim(
        says="weights and Adam moments identical",
        test="tests/test_training.py::test_resume_matches_uninterrupted",
        holds="assert all(torch.equal(a[key], b[key]) for key in a)",
        bound=0,
    ),
    Claim(
        says="Adam moments identical (bitwise; both Adam moments of every stage)",
        test="tests/resumes.py::assert_resumed_exactly",
        holds="assert all(torch.equal(a[k], b[k]) for k in a), (name,",
        bound=0,
    ),
    # 26 demo
    Benchmark(says="99 s on 2 cores", by="scripts/demo.sh"),
    Claim(
        says="96.5% exact match on held-out sums",
        test="tests/test_demo.py::test_demo_script_end_to_end",
        holds="assert match and int(match.group(2)) >= 0.9 * int(match.group(1))",
        bound=None,
        figure=0.965,
    ),
    # 27-29 fault survival
    Claim(
        says="final losses and weights bit-identical to an uninterrupted run.",
        test=SAME_RUN,
        holds=_SAME_WEIGHTS,
        bound=0,
    ),
    Claim(says="final losses and weights", test=SAME_RUN, holds=_SAME_METRICS, bound=0),
    Claim(
        says="each run ends bit-identical to the uninterrupted one (losses, LR, grad norms, weights)",
        test=SAME_RUN,
        holds=_SAME_METRICS,
        bound=0,
    ),
    Claim(says="resumed run bit-identical to an uninterrupted one", test=SAME_RUN, holds=_SAME_WEIGHTS, bound=0),
    # 30-35 throughput and schedules
    NotAClaim(
        says="target was within 15%",
        why="the issue's goal; the measured 0.95x beside it is benchmarks/train_throughput.py's, reported",
    ),
    Benchmark(says="PP=2 on 2 ranks: 1.113 s/step, x0.72 of PP=1", by=_THROUGHPUT),
    Benchmark(says="m=4: 1f1b 0.849 s/step (bubble 30.3%", by=_THROUGHPUT),
    Claim(
        says="theory 20.0%",
        test="tests/test_schedules.py::test_1f1b_timeline_has_the_theoretical_bubble",
        holds="assert tl.bubble == pytest.approx((stages - 1) / (micro_batches + stages - 1))",
        bound=None,
    ),
    Benchmark(says="bubble 24.7%", by=_THROUGHPUT),
    Benchmark(says="bubble 20.4%", by=_THROUGHPUT),
    Benchmark(says="m=8: 1f1b 1.426 s (16.1%, theory 11.1%)", by=_THROUGHPUT),
    # 36 saves off the critical path
    # 37-39 families, forward
    Claim(
        says="single process: logits bit-identical to transformers under SDPA and eager (`torch.equal`",
        test=FAMILIES,
        holds=FAMILIES_EXACT,
        bound=0,
    ),
    Claim(
        says="PP=1, 2, 4 bit-identical (packed rows within 2e-6",
        test=PARITY,
        holds=PARITY_EXACT,
        bound=0,
    ),
    Claim(
        says="packed rows within 2e-6: transformers runs their documents one at a time",
        test=PARITY,
        holds=_TP_LOGITS,
        bound=2e-6,
    ),
    Claim(
        says="within 1e-5 of each gradient's scale, at most 1.1e-6 measured",
        test=TP_BLOCK,
        holds="assert worst < 1e-5",
        bound=1e-5,
        figure=1.1e-6,
    ),
    Claim(
        says="TP=2 x CP=2 within 2e-6 (the whole launch, 35 cases of every family: TP=2 max 5.07e-7 over 324 checks",
        test=PARITY,
        holds=_TP_LOGITS,
        bound=2e-6,
        figure=5.07e-7,
    ),
    Claim(says="CP=2 max 5.07e-7 over 402", test=PARITY, holds=_CP_LOGITS, bound=2e-6, figure=5.07e-7),
    # 40-42 round trip, PEFT merge, LoRA on Phi-3 under TP
    Claim(
        says="HF -> pipeline -> HF bit-identical",
        test=ROUND_TRIP,
        holds=ROUND_TRIP_EXACT,
        bound=0,
    ),
    Claim(
        says="PEFT adapters merge to PEFT's logits within 1e-5",
        test="tests/test_lora.py::test_merge_peft_adapter_directory_into_checkpoint_or_hf",
        holds="torch.testing.assert_close(merged(ids).logits, expected, rtol=1e-5, atol=1e-5)",
        bound=1e-5,
    ),
    Claim(
        says="trained at PP=2 x TP=2 equals PEFT (losses 1e-5",
        test=PEFT,
        holds='torch.tensor([m["loss"] for m in metrics]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6',
        bound=1e-5,
    ),
    Claim(
        says="grad norms 1e-4, adapters",
        test=PEFT,
        holds='torch.tensor([m["grad_norm"] for m in metrics]), torch.tensor(ref_norms), rtol=1e-4, atol=1e-6',
        bound=1e-4,
    ),
    Claim(
        says="adapters, merged export",
        test="tests/test_lora.py::assert_merged_export_is_peft",
        holds="peft_model(hf_dir, adapters, targets)(ids).logits, rtol=1e-5, atol=1e-5",
        bound=1e-5,
    ),
    # 43 training parity of the registry families
    Claim(
        says="Gemma 3 PP=2 x TP=2 1.8e-5 (the bound is 1% of lr, 3e-5)",
        test=REFERENCE,
        holds=ONE_PCT_OF_LR,
        bound=3e-5,
        figure=1.8e-5,
    ),
    Claim(says="Helium PP=2 x TP=2 4.98e-6", test=REFERENCE, holds=ONE_PCT_OF_LR, bound=3e-5, figure=4.98e-6),
    Claim(
        says="Seed-OSS PP=2 x TP=2 1.14e-6",
        test=MEASURED_WEIGHT_DIFF,
        holds='"seed_oss-pp2-tp2": 1.14e-6',
        bound=10 * 1.14e-6,
        figure=1.14e-6,
    ),
    Claim(
        says="SmolLM3 PP=2 x DP=2 1.52e-6",
        test=MEASURED_WEIGHT_DIFF,
        holds='"smollm3-pp2-dp2": 1.52e-6',
        bound=10 * 1.52e-6,
        figure=1.52e-6,
    ),
    Claim(
        says="Ministral 3 6.11e-7",
        test=MEASURED_WEIGHT_DIFF,
        holds='"ministral3-pp2-dp2": 6.11e-7',
        bound=10 * 6.11e-7,
        figure=6.11e-7,
    ),
    Claim(
        says="ERNIE 4.5 1.01e-6",
        test=MEASURED_WEIGHT_DIFF,
        holds='"ernie4_5-pp2-dp2": 1.01e-6',
        bound=10 * 1.01e-6,
        figure=1.01e-6,
    ),
    Claim(
        says="Phi-3 9.02e-7",
        test=MEASURED_WEIGHT_DIFF,
        holds='"phi3-pp2-dp2": 9.02e-7',
        bound=10 * 9.02e-7,
        figure=9.02e-7,
    ),
    Claim(says="GLM-4 3.07e-6", test=REFERENCE, holds=ONE_PCT_OF_LR, bound=3e-5, figure=3.07e-6),
    Claim(
        says="OLMo 3 2.02e-6 (PP=2 x DP=2)",
        test=MEASURED_WEIGHT_DIFF,
        holds='"olmo3-pp2-dp2": 2.02e-6',
        bound=2.02e-5,
        figure=2.02e-6,
    ),
    # 44-45 Phi-3 and the other TP layouts
    Claim(
        says="Phi-3 PP=2 x TP=2 6.23e-5 (one element of o_proj's 4,096 at 2.08% of lr, the test holds 3%",
        test=REFERENCE,
        holds='"phi3-pp2-tp2": 0.03',
        bound=9e-5,
        figure=6.23e-5,
    ),
    Claim(says="losses within 1e-5, grad norms within 1e-4), GLM-4", test=REFERENCE, holds=_REF_LOSSES, bound=1e-5),
    Claim(says="grad norms within 1e-4), GLM-4", test=REFERENCE, holds=_REF_NORMS, bound=1e-4),
    Claim(says="GLM-4 PP=2 x TP=2 1.5e-5", test=REFERENCE, holds=ONE_PCT_OF_LR, bound=3e-5, figure=1.5e-5),
    Claim(says="OLMo 2 PP=2 x TP=2 5.29e-6", test=REFERENCE, holds=ONE_PCT_OF_LR, bound=3e-5, figure=5.29e-6),
    # 46 fused projections split part by part; Phi-3 moves
    Claim(
        says="Phi-3 HF -> TP 2 -> 3 -> 6 -> 1 bit-identical to HF -> TP 1 (12 heads, 6 KV heads)",
        test="tests/test_convert.py::test_tp_split_and_merge_between_any_degrees_round_trip_bit_identical",
        holds="assert all(torch.equal(a[f][k], b[f][k]) for f in a for k in a[f])",
        bound=0,
    ),
    Claim(
        says="(fp32: weights within 5.4e-8 of the unmoved run, held at 1e-6)",
        test="tests/test_tp_training.py::test_resume_moves_across_tp_and_pp",
        holds="assert worst < 1e-6, (name, worst)",
        bound=1e-6,
        figure=5.4e-8,
    ),
    Claim(
        says="(bf16 ZeRO-1: losses within 2e-3)",
        test="tests/test_tp_training.py::test_resume_moves_across_tp_and_pp",
        holds='rel = (1e-5, 1e-4) if precision == "fp32" else (2e-3, 2e-2)',
        bound=2e-3,
    ),
)
