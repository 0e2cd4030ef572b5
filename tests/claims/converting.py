from tests.claims.held import ROUND_TRIP, ROUND_TRIP_EXACT
from tests.claims.kinds import Benchmark, Claim

INT4_TEST = "tests/test_quantized_sources.py::test_int4_experts_are_dequantized_as_transformers_loads_them"
INT4_HOLDS = "assert value.dtype == torch.bfloat16 and torch.equal(value, want), key"

STREAMED = "tests/test_export.py::test_the_hf_side_of_verify_holds_one_layer_at_a_time"
STREAMED_EQUAL = "assert torch.equal(logits, expected)"
CLAIMS = (
    Claim(
        says="Each triple becomes the weight as compressed-tensors' decompressor computes it (values times their "
        "group's scale in the scale's dtype), which is what transformers loads from such a directory: bit for bit in "
        "bf16 (tests/test_quantized_sources.py).",
        test=INT4_TEST,
        holds=INT4_HOLDS,
        bound=0,
    ),
    Claim(
        says="an id converts to the same layer files as its directory, bit for bit",
        test="tests/test_hub.py::test_a_hub_id_converts_and_verifies_like_its_directory",
        holds="hub.keys() == local.keys() and all(torch.equal(hub[k], local[k]) for k in hub)",
        bound=0,
        figure=None,
    ),
    Claim(
        says="`--verify --against` the id gives 0",
        test="tests/test_hub.py::test_a_hub_id_converts_and_verifies_like_its_directory",
        holds='verify.stdout.rstrip().endswith(": 0")',
        bound=0,
        figure=0.0,
    ),
    Claim(
        says="the missing and pickled-only cases are one line",
        test="tests/test_hub.py::test_an_id_not_in_the_cache_offline_or_without_safetensors_is_one_line",
        holds="proc.returncode == 2 and len(lines) == 1",
        bound=None,
        figure=None,
    ),
    Claim(
        says="at most a dozen progress lines, the last at 100%",
        test="tests/test_progress.py::test_converter_progress_on_a_pipe_and_on_a_terminal",
        holds='LINE.match(lines[-1])[1] == "100"',
        bound=None,
        figure=None,
    ),
    Claim(
        says="(the bar, 19/19 pipeline layers)",
        test="tests/test_progress.py::test_converter_progress_on_a_pipe_and_on_a_terminal",
        holds='"\\r" in text and "19/19" in text',
        bound=None,
        figure=None,
    ),
    Claim(
        says="refuses, in one line and before touching anything",
        test="tests/catalogue.py::run_case",
        holds="line = one_error_line(proc, fragment)",
        bound=None,
        figure=None,
    ),
    Claim(
        says="`--input H --output H --force` and `--to-hf --input RUN --output RUN --force` leave H and RUN byte-identical",
        test="tests/catalogue.py::run_case",
        holds='assert digest(inputs) == before, "inputs changed"',
        bound=None,
        figure=None,
    ),
    Claim(
        says="HF -> pipeline -> HF gives bit-identical tensors, tied embeddings included (`tests/test_export.py`)",
        test=ROUND_TRIP,
        holds=ROUND_TRIP_EXACT,
        bound=0,
        figure=None,
    ),
    Claim(
        says="a model trained with PP=2 x DP=2 exports to exactly the weights the trainer saved (`tests/test_training.py`)",
        test="tests/test_training.py::test_training_matches_single_process_reference",
        holds="torch.equal(exported[key].reshape(-1).view(torch.uint8), ours[key].reshape(-1).view(torch.uint8))",
        bound=0,
        figure=None,
    ),
    Benchmark(
        says="at a 7B model's size from a cold cache the export took 0.80x the time of `cp -r`",
        by="benchmarks/convert_memory.py",
    ),
    Benchmark(
        says="On a 48-layer model (hidden 1024, 1,157 MiB in bf16) `--verify --against` peaks at 635 MiB of anonymous "
        "memory (253 MiB of it the imports) against 2,743 MiB for transformers' whole fp32 model",
        by="benchmarks/convert_memory.py",
    ),
    Benchmark(
        says="at 16 layers 583 against 1,263: about 1.6 MiB more a layer instead of 46",
        by="benchmarks/convert_memory.py",
    ),
    Claim(
        says="holds that no more than the modules outside the layer lists plus the largest layer are ever in memory",
        test=STREAMED,
        holds="assert resident < max(held) <= resident + largest",
        bound=None,
    ),
    Claim(says="and the logits bit-identical to the whole model's", test=STREAMED, holds=STREAMED_EQUAL, bound=0),
    Benchmark(says="(1,887 MiB at 48 layers)", by="benchmarks/convert_memory.py"),
)
