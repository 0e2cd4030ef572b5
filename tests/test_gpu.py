"""On a CUDA GPU only (skipped elsewhere; CI has none): each family's pipeline layers in bf16 with SDPA (eager for
gpt-oss, which transformers runs only so) against
transformers' own model in bf16 on the same GPU. On CPU the same cases are bit-identical in fp32
(tests/test_families.py); here the kernels are cuBLAS's and SDPA's flash/efficient ones, in bf16.

Run where a GPU is: `python -m pytest tests/test_gpu.py -s` (benchmarks/gpu_check.sh does, and prints each case)."""

from __future__ import annotations

import gc

import pytest
import torch

from tests.conftest import hf_state
from tests.family_cases import FAMILY_CONFIGS
from tests.test_families import pipeline_logits
from tools.tiny_models import tiny_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("name", list(FAMILY_CONFIGS))
def test_family_layers_match_transformers_in_bf16_on_gpu(name, tmp_path):
    from transformers import AutoModelForCausalLM

    from models.families import resolve_attention

    model_type, overrides = FAMILY_CONFIGS[name]
    config = tiny_config(model_type, **{"num_hidden_layers": 3, "num_key_value_heads": 2} | overrides)
    attn = resolve_attention(config, None)  # SDPA, or eager where transformers has none for the family (gpt-oss)
    config._attn_implementation = attn
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, attn_implementation=attn)
    hf = hf.cuda().eval()
    state = {k: v.to(torch.bfloat16) for k, v in hf_state(str(tmp_path)).items()}
    ids = torch.randint(0, config.vocab_size, (2, 12), device="cuda")
    with torch.no_grad():
        reference = hf(input_ids=ids).logits
    ours = pipeline_logits(config, state, ids, device="cuda", dtype=torch.bfloat16)
    diff = (ours.float() - reference.float()).abs()
    print(
        f"bf16 GPU {name}: {int((diff > 0).sum())} of {diff.numel()} logits differ, max |diff| "
        f"{float(diff.max()):.3g} (max |logit| {float(reference.float().abs().max()):.3g})"
    )
    # The same kernels in the same order: equal to the bit (all 25 cases were, on an H200: docs/measured.md).
    assert torch.equal(ours, reference)


def test_snapshot_of_gpu_tensors_copies_into_pinned_buffers_reused_by_the_next_save():
    """Buffers for GPU tensors are touched and registered (checkpoint/background_writer.py `pinned_empty`: copies
    into untouched pageable memory ran at 1 GiB/s on an H200 node); the next save refills the same ones."""
    from checkpoint.background_writer import HostSnapshot

    flat = torch.arange(3 * 2**20, dtype=torch.float32, device="cuda")
    state = {"w": flat[: 2**20], "m": [flat[2**20 :]], "b": torch.ones(3, dtype=torch.bfloat16, device="cuda")}
    snapshot = HostSnapshot()
    first = snapshot.copy(state, ("f",))
    assert snapshot.pending_device_copies
    snapshot.ready()
    assert first["w"].is_pinned() and first["m"][0].is_pinned() and first["b"].is_pinned()
    assert torch.equal(first["m"][0], state["m"][0].cpu()) and torch.equal(first["b"], state["b"].cpu())
    flat.mul_(-1.0)  # the next steps
    second = snapshot.copy(state, ("f",))
    assert second["w"].data_ptr() == first["w"].data_ptr()
    snapshot.ready()
    assert torch.equal(second["w"], state["w"].cpu()) and torch.equal(second["m"][0], state["m"][0].cpu())
    snapshot.buffers.clear()  # freed: unregistered first (weakref.finalize), then unmapped, raising nothing
    del first, second
    gc.collect()
    torch.cuda.synchronize()


def test_data_parallel_groups_reduce_cpu_tensors_beside_cuda_ones(tmp_path):
    """The loop reduces a few CPU scalars (token counts, router and eval sums) over groups made with the default
    backend: NCCL alone refuses them, so the process group pairs it with gloo (`process_group_backend`)."""
    import os
    import subprocess
    import sys

    script = """
import os, sys, torch, torch.distributed as dist
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
from training.distributed import init_distributed, shutdown_distributed
init_distributed(job_dir=sys.argv[1])
group = dist.new_group([0])  # as DeepSpeed makes its data-parallel groups: the default backend
cpu, cuda = torch.ones(2), torch.ones(2, device="cuda")
dist.all_reduce(cpu, group=group)
dist.all_reduce(cuda, group=group)
print("backend", dist.get_backend(), float(cpu.sum()), float(cuda.sum()))
shutdown_distributed()
"""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = [sys.executable, "-c", script, str(tmp_path)]
    done = subprocess.run(run, cwd=repo, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "backend cpu:gloo,cuda:nccl 2.0 2.0" in done.stdout, done.stdout
