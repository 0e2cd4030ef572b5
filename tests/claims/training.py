from tests.claims.held import PLANNER, REFERENCE, SAME_RUN
from tests.claims.kinds import Claim, NotAClaim

PACKING = "tests/packing_reference.py::assert_packing_report"

CLAIMS = (
    # 1
    Claim(
        says="an fp32 run with the optimizer offloaded now trains on CPU ranks, its losses within 1e-5 (relative) of "
        "the ZeRO-0 run's.",
        test="tests/test_training.py::test_optimizer_offload_trains_as_zero0",
        holds='b["loss"] == pytest.approx(a["loss"], rel=1e-5)',
        bound=1e-5,
    ),
    Claim(
        says="PP=2 x DP=2, and gets the single-node run's losses bit for bit",
        test="tests/test_multinode.py::test_hostfile_launch_over_ssh_equals_a_single_node_run",
        holds='assert [(m["loss"], m["grad_norm"], m["lr"]) for m in a] == [(m["loss"], m["grad_norm"], m["lr"]) for m in b]',
        bound=0,
    ),
    # 2
    Claim(
        says="every step and the evaluation equal the run from the converted directory and the local file",
        test="tests/test_hub.py::test_hub_ids_train_like_local_directories",
        holds='assert json.load(open(direct / "eval_results.json")) == json.load(open(out / "eval_results.json"))',
        bound=0,
    ),
    # 3
    Claim(
        says="`python -m data.prepare` builds the same store, byte for byte, from the ids",
        test="tests/test_hub.py::test_tokenizer_and_dataset_ids_in_data_prepare",
        holds='assert "tokens.bin" in stores["hub"] and stores["hub"] == stores["local"]',
        bound=None,
    ),
    # 4
    Claim(
        says="the other job stops within 60 s (6.3 s",
        test="tests/test_rendezvous.py::refused",
        holds="within: float = 60",
        bound=60,
        figure=6.3,
    ),
    Claim(
        says="or within 150 s when both start at once (15.2 s measured; 74 s on a loaded machine)",
        test="tests/test_rendezvous.py::test_two_jobs_started_at_the_same_moment_on_one_port",
        holds="assert ended[loser] < 150",
        bound=150,
        figure=74,
    ),
    Claim(
        says="the first (or winning) job's losses and weights equal the same run's launched alone, bit for bit",
        test=SAME_RUN,
        holds="all(torch.equal(a[k], b[k]) for k in a)",
        bound=0,
    ),
    # 5
    Claim(
        says="`srun -n 4` of PP=2 x DP=2 gets the deepspeed launcher's losses bit for bit",
        test="tests/test_slurm.py::test_srun_launch_equals_the_deepspeed_launcher",
        holds='assert [(m["loss"], m["grad_norm"], m["lr"]) for m in a] == [(m["loss"], m["grad_norm"], m["lr"]) for m in b]',
        bound=0,
    ),
    Claim(
        says="runs every step once and ends with an uninterrupted run's losses and weights",
        test="tests/test_slurm.py::test_requeued_batch_job_runs_every_step_once",
        holds="assert_same_run(reference, out)",
        bound=0,
    ),
    # 6
    Claim(
        says="Each such row gives exactly the tokens and targets of the same conversation written as `messages`",
        test="tests/test_formats.py::test_rows_equal_the_same_conversations_written_as_messages",
        holds="assert samples(ours) == samples(expected) and len(ours) == len(rows)",
        bound=0,
    ),
    Claim(
        says="(or as a conversational pair)",
        test="tests/test_formats.py::test_ranking_rows_equal_conversational_pairs",
        holds="assert samples(ours) == samples(theirs) and len(ours) == 1",
        bound=0,
    ),
    # 7
    Claim(
        says="eager: losses bit-identical in fp32 in `tests/test_packing.py`",
        test="tests/test_packing.py::test_packed_rows_give_the_losses_and_gradients_of_unpacked_rows",
        holds="assert torch.equal(losses[0], losses[1])",
        bound=0,
    ),
    Claim(
        says="SDPA, which attends each packed document alone with its causal kernel and builds no [S, S] mask: within 1e-6",
        test="tests/test_packing.py::test_packed_rows_give_the_losses_and_gradients_of_unpacked_rows",
        holds="torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=1e-6)",
        bound=1e-6,
    ),
    Claim(
        says="losses and gradients equal the unfused path within fp32 rounding",
        test="tests/test_head_loss.py::test_the_fused_head_and_loss_equal_the_unfused_ones",
        holds="torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)",
        bound=1e-6,
    ),
    Claim(
        says="matches the single-process HF reference trained on the same rows unpacked, eval loss and token count included",
        test=REFERENCE,
        holds='torch.tensor([m["loss"] for m in metrics]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6',
        bound=1e-5,
    ),
    # 8
    Claim(
        says="packing put 3.0 rows in each row",
        test=PACKING,
        holds='assert (report["tokens"], report["packed_rows"]) == (sum(lengths), packed), (report, sum(lengths), packed)',
        bound=0,
    ),
    Claim(
        says="cut padding from 69% to 8%",
        test=PACKING,
        holds='assert report["padding_share_unpacked"] == pytest.approx(1 - sum(lengths) / (rows * seq_length))',
        bound=None,
    ),
    # 9
    Claim(
        says="a batch of blocks gives each piece's per-token losses run as a row of its own (within 1e-6",
        test="tests/test_store.py::test_concatenated_blocks_cover_the_stream_and_equal_unpacked_documents",
        holds="torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=1e-6)",
        bound=1e-6,
    ),
    # 10
    Claim(
        says="checks its logits and tokens equal transformers' own on the HF original",
        test="tests/test_tools.py::test_generation_from_pipeline_checkpoint_matches_hf",
        holds="torch.testing.assert_close(ours(ids).logits, reference(ids).logits, rtol=0, atol=0)",
        bound=0,
    ),
    # 11
    NotAClaim(
        says="add 10-20% for the CUDA context and fragmentation",
        why="advice on headroom over the estimate (the CUDA context and allocator are not modelled), not a result",
    ),
    # 12
    Claim(
        says="the prediction is within 0.5% (measured: 0.0% to +0.1%",
        test=PLANNER,
        holds="assert abs(kept / measured - 1) <= tolerance.get(layout, 0.05 if routed else 0.005)",
        bound=0.005,
        figure=0.001,
    ),
    # 13
    Claim(
        says="experts' layouts within 1-5%",
        test=PLANNER,
        holds="assert abs(kept / measured - 1) <= tolerance.get(layout, 0.05 if routed else 0.005)",
        bound=0.05,
    ),
    # 14
    Claim(
        says="(1F1B bubble at most 20%)",
        test="tests/test_memory_estimate.py::test_planner_follows_each_schedules_micro_batches_in_flight",
        holds="assert 3 / (m + 3) <= 0.2, lines",
        bound=0.2,
    ),
    # 15
    Claim(
        says="equal to the byte for a block with and without LoRA",
        test="tests/test_memory_estimate.py::test_deferred_weight_gradient_bytes_match_measurement",
        holds="assert predicted == measured",
        bound=0,
    ),
    Claim(
        says="one over 90% of the GPU's memory (or over the host memory) is never proposed.",
        test="tests/test_memory_estimate.py::test_the_layout_planner_proposes_what_fits_as_the_planner_counts_it",
        holds="assert HEADROOM == 0.9 and all(p.gib <= 0.9 * 80 for p in found)",
        bound=0.9,
    ),
    # Muon
    Claim(
        says="In one process, on the same gradients, the weights equal torch.optim.Muon's on transformers' model bit "
        "for bit",
        test="tests/test_muon.py::test_muon_equals_torch_muon_in_one_process",
        holds="assert torch.equal(p, ref_state[name]), name",
        bound=0,
    ),
    Claim(
        says="hold each weight within 1e-5 of its tensor's scale of torch's Muon after 4 steps",
        test="tests/test_muon_training.py::test_muon_matches_torch_muon",
        holds="layout=layout, scale=1e-5)",
        bound=1e-5,
    ),
    Claim(
        says="stays within 1e-5 of the unmoved run",
        test="tests/test_muon_training.py::test_muon_resumes_exactly_and_moves_with_its_momentum",
        holds="assert worst < 1e-5, (name, worst)",
        bound=1e-5,
    ),
    Claim(
        says="PP=2 x DP=2's and Phi-3's losses follow their fp32 runs within 2e-3 (relative)",
        test="tests/test_muon_training.py::test_muon_under_bf16_zero1_follows_the_fp32_run",
        holds='b["loss"] == pytest.approx(a["loss"], rel=2e-3)',
        bound=2e-3,
    ),
    Claim(
        says="LoRA's adapters at PP=2 x TP=2 equal torch's Muon on them within 0.1% of lr",
        test="tests/test_muon_training.py::test_lora_with_muon_matches_torch_muon_on_the_adapters",
        holds="share_of_lr=1e-3)",
        bound=1e-3,
    ),
)
