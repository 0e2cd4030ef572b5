"""Shared fixtures: tiny HF LLaMA checkpoints and tokenizers built on the fly, and launchers."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from data.sources import write_jsonl  # noqa: E402
from demo.arithmetic import addition_rows  # noqa: E402, F401 - the demo's task, shared with the tests
from models.moe import is_moe  # noqa: E402
from tests.hub_extras import add_mtp_layer, add_unread_kv, hf_state, temper_attention  # noqa: E402, F401
from tests.zygote import Zygote  # noqa: E402
from tools.free_port import free_port  # noqa: E402, F401 - the tests' launches use it
from tools.tiny_models import make_hf_model, make_sp_tokenizer, tiny_config  # noqa: E402

# Llama 3.1's RoPE scaling, with the original context shrunk so short test sequences reach the scaled band.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8,
}
MOE_AUX = dict(output_router_logits=True, router_aux_loss_coef=0.1)
# name -> tiny_config arguments (model_type and overrides). vocab 64 >= every test tokenizer.
MODEL_VARIANTS = {
    "mha": dict(num_attention_heads=4, num_key_value_heads=4),
    "gqa": dict(num_attention_heads=4, num_key_value_heads=2),
    "tied": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    # Llama 3.1/3.2: llama3 RoPE scaling, explicit head_dim (q/k/v wider than hidden), q/k/v/o and MLP biases.
    "llama3": dict(
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        attention_bias=True,
        mlp_bias=True,
        rope_parameters=LLAMA3_ROPE,
    ),
    # The other families, each with its own transformers classes (models/families/).
    "qwen2": dict(model_type="qwen2", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    "mistral": dict(model_type="mistral", num_attention_heads=4, num_key_value_heads=2, sliding_window=6),
    # Mixture of experts (4 experts, top-2), the load-balancing loss on (coefficient 0.1): Mixtral with its window,
    # Qwen2-MoE's gated shared expert in every 2nd layer (tied embeddings), Qwen3-MoE with its first layer dense.
    "mixtral": dict(model_type="mixtral", num_key_value_heads=2, sliding_window=6, **MOE_AUX),
    "qwen2_moe": dict(model_type="qwen2_moe", num_key_value_heads=2, decoder_sparse_step=2, tie_word_embeddings=True)
    | MOE_AUX,
    "qwen3_moe": dict(
        model_type="qwen3_moe", num_key_value_heads=2, head_dim=32, norm_topk_prob=True, mlp_only_layers=[0]
    )
    | MOE_AUX,
    # Llama 4 (tools/tiny_models.py): chunks of 4, layer 3 NoPE, layers 1 and 3 sparse with a shared expert.
    "llama4": dict(model_type="llama4_text", num_key_value_heads=2),
    # Families built like LLaMA, one module each in models/families/ (their `tiny` fields: head_dim 16, ...):
    # Helium's q/k/v and MLP biases, SmolLM3's NoPE layers (1 and 3: one per stage at PP=2) with every bias,
    # Ministral 3's position-scaled queries under a window, Seed-OSS's separate o_proj bias, ERNIE 4.5's
    # interleaved RoPE with every bias.
    "helium": dict(model_type="helium", num_key_value_heads=2, attention_bias=True, mlp_bias=True),
    "smollm3": dict(model_type="smollm3", num_key_value_heads=2, attention_bias=True, mlp_bias=True),
    "ministral3": dict(model_type="ministral3", num_key_value_heads=2, sliding_window=6),
    "seed_oss": dict(
        model_type="seed_oss", num_key_value_heads=2, attention_bias=True, attention_out_bias=True, mlp_bias=True
    ),
    "ernie4_5": dict(model_type="ernie4_5", num_key_value_heads=2, use_bias=True, tie_word_embeddings=True),
    # Gemma 3: four norms per layer, scaled embeddings, logits soft-capped at 2, local (window 4) and global layers
    # alternating with their own RoPE bases, tied embeddings as Gemma ships them.
    "gemma3": dict(model_type="gemma3_text", num_key_value_heads=2, tie_word_embeddings=True),
    # Fused projections: Phi-3's q/k/v and gate/up (a window of 6), GLM-4's gate/up with its four norms and
    # half-head RoPE; norms after each sublayer and q/k norms over the whole projection: OLMo 2 (biases), OLMo 3
    # (local layers with a window of 4).
    "phi3": dict(model_type="phi3", num_key_value_heads=2, sliding_window=6),
    "glm4": dict(model_type="glm4", num_key_value_heads=2),
    "olmo2": dict(model_type="olmo2", num_key_value_heads=2, attention_bias=True),
    "olmo3": dict(model_type="olmo3", num_key_value_heads=2),
    # DeepSeek's router (sigmoid, score bias, 2 groups, top-2 scaled by 2.5), a dense first layer, shared experts:
    # GLM-4.5 with q/k norms and q/k/v biases, DeepSeek-V3 with multi-head latent attention.
    "glm4_moe": dict(model_type="glm4_moe", num_key_value_heads=2, use_qk_norm=True, attention_bias=True),
    "deepseek_v3": dict(model_type="deepseek_v3"),
    # Mistral 4: DeepSeek-V3's MLA with queries scaled by position (from position 8), a softmax router (2 groups, top-2
    # scaled by 2.5), a dense first layer, shared experts, its experts fused on the hub as transformers keeps them.
    "mistral4": dict(model_type="mistral4"),
    # gpt-oss: attention sinks, sliding (window 4) and full layers, every bias, interleaved gate/up experts with
    # biases, the clamped SwiGLU (clamping at 0.5), its load-balancing loss on.
    "gpt_oss": dict(model_type="gpt_oss", num_key_value_heads=2, swiglu_limit=0.5) | MOE_AUX,
    # Qwen3-Next: Gated DeltaNet linear attention in layers 0-2 and gated full attention in 3, sparse blocks with a
    # gated shared expert, its load-balancing loss on; `mtp.*` weights carried.
    "qwen3_next": dict(model_type="qwen3_next", num_key_value_heads=2) | MOE_AUX,
    # Qwen3.5's text model: the same hybrid with dense MLPs; Qwen3.5-MoE's with a sparse block and its gated shared
    # expert in every layer, its experts fused as its hub checkpoints keep them, its load-balancing loss on.
    "qwen3_5": dict(model_type="qwen3_5_text", num_key_value_heads=2),
    "qwen3_5_moe": dict(model_type="qwen3_5_moe_text", num_key_value_heads=2) | MOE_AUX,
    # DeepSeek-V3.2: DeepSeek-V3 with its sparse attention (an indexer keeping 4 keys a query). Last: each model's
    # weights are seeded by its place here (`hf_models`), and the measured figures of those above depend on theirs.
    "deepseek_v32": dict(model_type="deepseek_v32"),
    # Gemma 4 (after the others, for their seeds): per-layer inputs (PLE), the last two layers reusing the K/V of the
    # last local and global layers before them (models/carry.py), global layers of their own head width and K/V
    # heads (values = keys), tied embeddings and logits soft-capped at 2; its hub's unread k/v tensors carried.
    "gemma4": dict(model_type="gemma4_text", tie_word_embeddings=True),
    # GLM-5: DeepSeek-V3.2's sparse attention with the index of block 1 shared by blocks 2 and 3 (models/carry.py),
    # DeepSeek's router and shared experts after a dense first layer; a multi-token-prediction layer carried.
    "glm_moe_dsa": dict(model_type="glm_moe_dsa"),
    # Gemma 4 26B-A4B's shape: 4 experts (top-2) beside the dense MLP in every layer, on the tiny model above.
    "gemma4_moe": dict(model_type="gemma4_text", tie_word_embeddings=True, enable_moe_block=True)
    | dict(num_experts=4, top_k_experts=2, moe_intermediate_size=32),
    # DeepSeek-V4: 3 residual streams, sliding-window / compressed sparse / heavily compressed attention, hash routers
    # in layers 0, 1 and 3 (the tokens carried to them), top-k routers with score biases, its hub's own key names.
    "deepseek_v4": dict(model_type="deepseek_v4"),
    # One module each (after the others, for their seeds): EXAONE 4's post-sublayer norms with per-head q/k norms,
    # local layers (window 4) and global NoPE layers; Gemma 2's soft-capped attention (eager) and logits, tied
    # embeddings; Hunyuan's q/k norms after RoPE, biases; InternLM3 (LLaMA's layers); Granite's muP multipliers.
    "exaone4": dict(model_type="exaone4", num_key_value_heads=2),
    "gemma2": dict(model_type="gemma2", num_key_value_heads=2, tie_word_embeddings=True),
    "hunyuan": dict(model_type="hunyuan_v1_dense", num_key_value_heads=2, attention_bias=True),
    "internlm3": dict(model_type="internlm3", num_key_value_heads=2, attention_bias=True, mlp_bias=True),
    "granite": dict(
        model_type="granite", num_key_value_heads=2, attention_bias=True, mlp_bias=True, logits_scaling=2.0
    ),
    # OLMoE: whole-projection q/k norms, q/k/v clipped, a softmax router in every layer, its load-balancing loss on;
    # dots.llm1: Qwen3's attention with DeepSeek's router, a dense first layer and shared experts.
    "olmoe": dict(model_type="olmoe", num_key_value_heads=2, attention_bias=True) | MOE_AUX,
    "dots1": dict(model_type="dots1", num_key_value_heads=2),
    # FlexOlmo: OLMo 2's post-sublayer norms and whole-projection q/k norms with experts in every layer.
    "flex_olmo": dict(model_type="flex_olmo", num_key_value_heads=2, attention_bias=True) | MOE_AUX,
    # MiniMax-M2: whole-projection q/k norms, partial RoPE, a sigmoid router steered by the block's score bias.
    "minimax_m2": dict(model_type="minimax_m2", num_key_value_heads=2) | MOE_AUX,
    # GLM-4.7-Flash: DeepSeek-V3's MLA and router, dense and sparse layers by `mlp_layer_types`.
    "glm4_moe_lite": dict(model_type="glm4_moe_lite", num_key_value_heads=4, attention_bias=True),
    # Apertus: per-head q/k norms, a gateless MLP with the xIELU activation's trained scalars.
    "apertus": dict(model_type="apertus", num_key_value_heads=2, attention_bias=True),
    # K-EXAONE: EXAONE 4's attention with DeepSeek's router and shared experts, its score bias renamed on the hub.
    "exaone_moe": dict(model_type="exaone_moe", num_key_value_heads=2),
    # Hunyuan MoE: Hunyuan dense's attention, a softmax router in fp32 and a shared MLP in every layer.
    "hunyuan_moe": dict(model_type="hunyuan_v1_moe", num_key_value_heads=2, attention_bias=True),
    # MiMo-V2-Flash: sliding layers with sinks and twice the key/value heads, narrower values, DeepSeek's router.
    "mimo_v2_flash": dict(model_type="mimo_v2_flash", num_key_value_heads=2, attention_bias=True),
    # ERNIE 4.5 MoE: sparse layers 1 and 3 (by interval), its fp32 router's frozen score bias, shared experts.
    "ernie_moe": dict(model_type="ernie4_5_moe", num_key_value_heads=2) | MOE_AUX,
    # Cohere 2: the parallel block with LayerNorms, NoPE global layers, logits times logit_scale.
    "cohere2": dict(model_type="cohere2", num_key_value_heads=2, attention_bias=True),
    # LFM2: gated short convolutions with biases (layers 0 and 2) beside attention with per-head q/k norms (1 and 3).
    "lfm2": dict(model_type="lfm2", num_key_value_heads=2, num_hidden_layers=4),
    # LFM2-MoE: the same layers, a dense first layer, then sparse blocks chosen by score plus the block's expert_bias.
    "lfm2_moe": dict(model_type="lfm2_moe", num_key_value_heads=2, num_hidden_layers=4),
    # Granite 4: Mamba-2 beside NoPE attention, the shared MLP and experts in every layer, muP, its load-balancing loss.
    "granite4": dict(model_type="granitemoehybrid", num_key_value_heads=2, num_hidden_layers=4, logits_scaling=2.0)
    | MOE_AUX,
    # Falcon-H1: Mamba-2 beside attention in every layer, muP multipliers (the head's at 0.5), every bias.
    "falcon_h1": dict(
        model_type="falcon_h1", num_key_value_heads=2, lm_head_multiplier=0.5, attention_bias=True, mlp_bias=True
    ),
    # Nemotron-H: one mixer a block (Mamba-2, sparse with gateless experts, NoPE attention, a dense MLP), twice over.
    "nemotron_h": dict(model_type="nemotron_h"),
    # Kimi Linear: Kimi Delta Attention beside NoPE latent attention, a dense first layer, DeepSeek's router after it.
    "kimi_linear": dict(model_type="kimi_linear"),
}
NEW_FAMILY_VARIANTS = ["helium", "smollm3", "ministral3", "seed_oss", "ernie4_5", "gemma3", "phi3", "glm4", "olmo2"]
NEW_FAMILY_VARIANTS += ["olmo3", "glm4_moe", "deepseek_v3", "mistral4", "gpt_oss", "qwen3_next", "qwen3_5", "gemma4"]
NEW_FAMILY_VARIANTS += ["exaone4", "gemma2", "hunyuan", "internlm3", "granite", "olmoe", "dots1", "flex_olmo"]
NEW_FAMILY_VARIANTS += ["minimax_m2", "glm4_moe_lite", "apertus", "exaone_moe", "hunyuan_moe", "mimo_v2_flash"]
NEW_FAMILY_VARIANTS += ["ernie_moe"]
NEW_FAMILY_VARIANTS += ["cohere2", "lfm2", "lfm2_moe", "granite4", "falcon_h1", "nemotron_h", "kimi_linear"]
CARRYING_VARIANTS = {
    "deepseek_v3": "layers",
    "glm4_moe": "layers",
    "qwen3_next": "mtp",
    "gemma4": "unread_kv",
    "glm_moe_dsa": "layers",
    "gemma4_moe": "unread_kv",
}  # with a multi-token-prediction layer, or the unread k/v tensors of Gemma 4's reusing layers
# The variants with experts, as the registry says of their tiny configs (no list to extend per family).
MOE_VARIANTS = tuple(m for m, fields in MODEL_VARIANTS.items() if is_moe(tiny_config(**fields)))
FAMILY_VARIANTS = ["llama3", "qwen2", "qwen3", "mistral", "mixtral", "qwen2_moe", "qwen3_moe", "llama4"]
FAMILY_VARIANTS += NEW_FAMILY_VARIANTS


LAUNCHER = str(Path(sys.executable).parent / "deepspeed")  # the `deepspeed` launcher of this environment


def one_error_line(proc: subprocess.CompletedProcess, fragment: str, prefix: str = "") -> str:
    """The command failed with one error line holding `fragment` (and starting with `prefix`), no traceback.
    Returns that line."""
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if fragment in line]
    assert lines and all(line == lines[0] for line in lines), proc.stderr[-3000:]
    assert lines[0].startswith(prefix), lines[0]
    return lines[0]


def ensure_packages(packages: dict[str, str]) -> None:
    """Install the Debian packages (path that must exist -> package) that are missing; skip where apt-get is not."""
    missing = [pkg for path, pkg in packages.items() if not os.path.exists(path)]
    if not missing:
        return
    if shutil.which("apt-get") is None:
        pytest.skip(f"needs {', '.join(missing)} and there is no apt-get to install them")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing]):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}"


def subprocess_env() -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false")
    # (and SLURM's: tests run inside an srun step would otherwise make every trainer an srun task)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_STEP_ID", "SLURM_PROCID"):
        env.pop(key, None)
    return env


_ZYGOTE = []


def forked() -> Zygote | None:
    """This process's fork server for launches (tests/zygote.py), or None with TEST_LAUNCHER=subprocess."""
    if os.environ.get("TEST_LAUNCHER", "zygote") == "subprocess":
        return None
    if not _ZYGOTE:
        _ZYGOTE.append(Zygote(subprocess_env()))
        atexit.register(_ZYGOTE[0].close)
    return _ZYGOTE[0]


# What run_cmd forks from the fork server, whose imports these need: `python SCRIPT` and `python -m tools.X`
FORKED_SCRIPTS = ("trainer.py", "tests/workers/faulty_trainer.py")
FORKED_MODULES = ("tools.",)


def run_cmd(cmd: list[str], timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a command from the repository root. `python convert2ckpt.py ARGS` runs in this process: its `main()` is
    the whole command (exit code, stdout, stderr; an unexpected exception fails the test as a traceback would),
    and a new Python process would add only start-up time. `python trainer.py ARGS` and `python -m tools.X ARGS` run
    as a process forked from the fork server, which has imported what they need (tests/zygote.py)."""
    environ = {**subprocess_env(), **(env or {})}
    if cmd[:2] == [sys.executable, "convert2ckpt.py"] and not env:
        return convert_in_process(cmd[2:])
    if cmd[0] == sys.executable and (zygote := forked()) is not None:
        if cmd[1] in FORKED_SCRIPTS:
            return zygote.run(cmd[1], cmd[2:], 1, ranks=False, env=environ, timeout=timeout)
        if cmd[1] == "-m" and cmd[2].startswith(FORKED_MODULES):
            return zygote.run(f"-m {cmd[2]}", cmd[3:], 1, ranks=False, env=environ, timeout=timeout)
    return subprocess.run(cmd, cwd=REPO, env=environ, capture_output=True, text=True, timeout=timeout)


def convert_in_process(args: list[str]) -> subprocess.CompletedProcess:
    import contextlib
    import io

    import convert2ckpt

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = convert2ckpt.main(list(args))
        except SystemExit as e:  # argparse's usage errors
            code = e.code if isinstance(e.code, int) else 2
    return subprocess.CompletedProcess(["convert2ckpt.py", *args], code, out.getvalue(), err.getvalue())


def spawn_ranks(worker, tmp_path, *args, ranks: int = 2, suffix: str = "pt", timeout: int = 300) -> list[str]:
    """Run `worker(rank, store, *args, out)` in `ranks` processes (gloo through a file store in `tmp_path`), each
    saving its results to its own `out`; returns those paths once every process exited cleanly. The processes are
    forked from the fork server (tests/workers/call.py; string arguments), or spawned with TEST_LAUNCHER=subprocess."""
    store = str(tmp_path / "store")
    outs = [str(tmp_path / f"rank{r}.{suffix}") for r in range(ranks)]
    if (zygote := forked()) is not None:
        call = [f"{worker.__module__}:{worker.__name__}", store, *args, str(tmp_path / f"rank{{rank}}.{suffix}")]
        proc = zygote.run("tests/workers/call.py", call, ranks, ranks=True, env=subprocess_env(), timeout=timeout)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return outs
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(r, store, *args, outs[r])) for r in range(ranks)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
        assert p.exitcode == 0, f"rank {procs.index(p)} exited with {p.exitcode}"
    return outs


def torchrun(script: str, nprocs: int, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node N script args`: its ranks forked from the fork server (tests/zygote.py: the same
    environment variables, process per rank and exit codes), or torchrun itself with TEST_LAUNCHER=subprocess."""
    if (zygote := forked()) is not None:
        return zygote.run(
            script, list(args), nprocs, ranks=True, env=subprocess_env(), port=free_port(), timeout=timeout
        )
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nprocs}", f"--master_port={free_port()}"]
    return run_cmd(cmd + [script, *args], timeout)


def deepspeed_launch(nprocs: int, *overrides: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """The README's path: `deepspeed --num_gpus N trainer.py overrides...`. The tests about that launch itself
    (the demo, signals to the job, a failure on one rank stopping all, one error line per rank, the hostfile and
    SLURM launches) use it; the training tests use `launch`."""
    return run_cmd(deepspeed_cmd(nprocs, *overrides), timeout)


def deepspeed_cmd(nprocs: int, *overrides: str) -> list[str]:
    """`deepspeed --num_gpus N --master_port P trainer.py overrides...` on a free port."""
    return [LAUNCHER, "--num_gpus", str(nprocs), "--master_port", str(free_port()), "trainer.py", *overrides]


def launch(nprocs: int, *overrides: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node N trainer.py overrides...`: the same ranks with the same environment as the
    `deepspeed` launcher gives them (training/distributed.py reads only torch's variables), started without its two
    extra Python processes (each imports torch and DeepSpeed) and its one-second polling: about 4 s and 2.5 CPU
    seconds less per launch on this machine, the suite's largest single cost after the ranks' own imports."""
    return torchrun("trainer.py", nprocs, *overrides, timeout=timeout)


def small_run(ckpt: str, out, train: str, **extra) -> list[str]:
    """Trainer overrides of a small fp32 run on the tiny model; `extra` adds or replaces keys."""
    args = {
        "model_name_or_path": ckpt,
        "output_dir": str(out),
        "train_file": train,
        "do_eval": "false",
        "seq_length": 16,
        "micro_batch_size": 2,
        "deepspeed": "fp32",
        **extra,
    }
    return [f"{k}={v}" for k, v in args.items()]


def check(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    )
    return proc


def read_jsonl(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="session")
def workdir(tmp_path_factory) -> Path:
    """Where the shared inputs live. Under pytest-xdist (scripts/test.sh runs 2 workers) one directory for all
    workers: the first to need an input builds it under a file lock, the others reuse it."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = tmp_path_factory.getbasetemp().parent / "shared_work"
        shared.mkdir(exist_ok=True)
        return shared
    return tmp_path_factory.mktemp("work")


def shared_path(tmp_path_factory, name: str) -> Path:
    """A path every pytest-xdist worker of this session sees (a fresh temporary one without xdist)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return tmp_path_factory.getbasetemp().parent / name
    return tmp_path_factory.mktemp(name)


def built_once(path: Path, build) -> None:
    """Run `build()` unless another test process already did (marker file), holding a lock while it runs."""
    from filelock import FileLock

    with FileLock(f"{path}.lock"):
        if not Path(f"{path}.done").exists():
            build()
            Path(f"{path}.done").write_text("")


@pytest.fixture(scope="session")
def tokenizer_dir(workdir) -> str:
    texts = [r["prompt"] + r["response"] for r in addition_rows()[:2000]]
    texts += ["the quick brown fox jumps over the lazy dog", "pipeline parallel training of language models"] * 20
    path = workdir / "tokenizer"
    built_once(path, lambda: make_sp_tokenizer(str(path), texts, vocab_size=60))
    return str(path)


@pytest.fixture(scope="session")
def chat_tokenizers(tmp_path_factory):
    """A sentencepiece LLaMA tokenizer (byte fallback) and a byte-level BPE tokenizer.json tokenizer."""
    from tools.tiny_models import SAMPLE_TEXTS, make_bpe_tokenizer, make_sp_tokenizer

    texts = SAMPLE_TEXTS * 20 + ["<|im_start|>user\nhi<|im_end|>\n[INST] <<SYS>>\nsystem\n<</SYS>>\n\nx [/INST] y"] * 5
    specials = ["<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    root = tmp_path_factory.mktemp("chat_tokenizers")
    return {
        "sentencepiece": make_sp_tokenizer(str(root / "sp"), texts, vocab_size=320, byte_fallback=True),
        "bpe": make_bpe_tokenizer(str(root / "bpe"), texts, vocab_size=320, special_tokens=specials),
    }


@pytest.fixture(scope="session")
def hf_models(workdir, tokenizer_dir) -> dict[str, str]:
    """{variant: HF directory} saved with save_pretrained as sharded safetensors."""
    out = {name: str(workdir / f"hf_{name}") for name in MODEL_VARIANTS}

    def build():
        for i, (name, overrides) in enumerate(MODEL_VARIANTS.items()):
            make_hf_model(out[name], tiny_config(**overrides), seed=i, tokenizer_dir=tokenizer_dir)
            if name.startswith("gemma4"):  # q/k norms at 0.5, as a trained model tempers them (`temper_attention`)
                temper_attention(out[name])
            if CARRYING_VARIANTS.get(name) == "unread_kv":
                add_unread_kv(out[name])
            elif name in CARRYING_VARIANTS:
                add_mtp_layer(out[name], CARRYING_VARIANTS[name])

    built_once(workdir / "hf_models", build)
    return out


@pytest.fixture(scope="session")
def converted(workdir, hf_models) -> dict[str, str]:
    """{variant: pipeline checkpoint} written by convert2ckpt.py."""
    out = {name: str(workdir / f"ckpt_{name}") for name in hf_models}

    def build():
        for name, hf_dir in hf_models.items():
            check(run_cmd([sys.executable, "convert2ckpt.py", "--input", hf_dir, "--output", out[name]]))

    built_once(workdir / "converted", build)
    return out


# The 3-step PP=2 x DP=2 run that the multi-node launches (torchrun --nnodes, deepspeed --hostfile) must equal.
NODES_RUN = {"gradient_accumulation_steps": 2, "learning_rate": 3e-3, "num_stages": 2, "seed": 5, "max_steps": 3}


@pytest.fixture(scope="session")
def single_node_run(workdir, converted, sft_data) -> Path:
    """`NODES_RUN` launched as one node of 4 ranks, once per session."""
    out = workdir / "single_node_run"
    built_once(out, lambda: check(deepspeed_launch(4, *small_run(converted["gqa"], out, sft_data[0], **NODES_RUN))))
    return out


@pytest.fixture(scope="session")
def sft_data(workdir) -> tuple[str, str]:
    """prompt/response train and eval files (addition), small enough for quick runs."""
    rows = addition_rows(seed=1)
    train, evals = workdir / "data" / "train.jsonl", workdir / "data" / "eval.jsonl"

    def build():
        write_jsonl(str(train), rows[:400])
        write_jsonl(str(evals), rows[400:437])  # 37 rows: not a multiple of anything

    built_once(workdir / "data", build)
    return str(train), str(evals)


# The longest tests run first, so that with several workers none is left running alone at the end.
LONGEST_FIRST = (
    "test_sigkill_during_saves",
    "test_demo_script",
    "test_forward_parity_pp_and_tp",  # 219 s in the CI run of 24f1fd1 (its --durations), and below it:
    "test_requeued_batch_job",  # 128 s
    "test_second_jobs_on_the_port",  # 81 s
    "test_one_32k_token_row",  # 74 s
    "test_two_jobs_started_at_the_same_moment",  # 62 s
    "test_bf16_zero1",
    "test_expert_parallel_under_zero1_and_bf16",
    "test_fp32_zero0",
    "test_resume_moves_across_tp_and_pp",
    "test_hf_directory_is_converted",
    "test_tp4_starts",
    "test_a_failed_or_hung_rank",
    "test_lora_pipeline_training",
    "test_hostfile_launch",
)


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: not any(name in item.name for name in LONGEST_FIRST))  # stable: otherwise as collected
