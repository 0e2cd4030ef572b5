"""The assertions that hold many claims, named once for the page modules: the test (a function, or the worker's
`main`) and the text of its assertion."""

PARITY = "tests/workers/forward_parity.py::main"  # the forward parity launch (tests/test_parity.py runs it)
PARITY_EXACT = "assert torch.equal(logits, ref_logits)"
PARITY_2E6 = "torch.testing.assert_close(logits, ref_logits, rtol=0, atol=2e-6)"  # TP, CP, packed rows
PARITY_EP = "torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-6)"
FAMILIES = "tests/test_families.py::test_family_layers_equal_transformers_bit_for_bit"
FAMILIES_EXACT = "assert torch.equal(pipeline_logits(config, state, ids), reference)"
REFERENCE = "tests/test_training.py::assert_matches_reference"  # training parity against single-process HF
ONE_PCT_OF_LR = "atol, rtol = wider.get(layout, 0.01) * cfg.learning_rate, 1e-5"
MEASURED_WEIGHT_DIFF = "tests/test_training.py::MEASURED_WEIGHT_DIFF"
ROUND_TRIP = "tests/test_export.py::test_round_trip_is_bit_identical"
ROUND_TRIP_EXACT = "torch.equal( exported[key].reshape(-1).view(torch.uint8), value.reshape(-1).view(torch.uint8) )"
PLANNER = "tests/test_memory_estimate.py::test_activation_and_parameter_estimates_match_measurement"
EP_ZERO1 = "tests/test_expert_parallel_training.py::test_expert_parallel_under_zero1_and_bf16"
TP_BLOCK = "tests/test_tensor_parallel.py::test_tp_block_equals_the_whole_block_with_biases_and_qk_norms"
SAME_RUN = "tests/test_faults.py::assert_same_run"
PEFT = "tests/test_lora.py::assert_matches_peft"
SCHED = "tests/test_schedules.py::test_schedule_trains_as_1f1b_and_the_reference"
SCHED_BOUND = 'bound = 1e-6 if schedule != "dualpipev" or "-ep2" not in layout else 1e-5'  # its weights
DPO_REFERENCE = "tests/test_dpo.py::assert_matches_dpo_reference"
