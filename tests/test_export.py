"""convert2ckpt.py --to-hf: HF -> pipeline -> HF is bit-identical and loads with Auto* classes."""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch

from checkpoint.export import export_pipeline_to_hf
from tests.baseline import hf_model
from tests.conftest import FAMILY_VARIANTS, hf_state, one_error_line, run_cmd


@pytest.mark.parametrize(
    "variant", ["mha", "gqa", "tied", *FAMILY_VARIANTS, "deepseek_v32", "glm_moe_dsa", "deepseek_v4"]
)
def test_round_trip_is_bit_identical(variant, hf_models, converted, tmp_path):
    """HF -> pipeline -> HF: every tensor bit-identical, and the export loads as the same family."""
    from transformers import AutoTokenizer

    out = tmp_path / "hf"
    proc = run_cmd(
        [
            sys.executable,
            "convert2ckpt.py",
            "--to-hf",
            "--input",
            converted[variant],
            "--output",
            str(out),
            "--max-shard-size",
            "150KB",
        ]
    )
    assert proc.returncode == 0, proc.stderr
    original, exported = hf_state(hf_models[variant]), hf_state(out)
    assert set(original) == set(exported)
    for key, value in original.items():  # bytes: FP8 tensors compare as bytes (a 0-dim one, Apertus's, as a row)
        assert exported[key].dtype == value.dtype and torch.equal(
            exported[key].reshape(-1).view(torch.uint8), value.reshape(-1).view(torch.uint8)
        ), key
    index = json.load(open(out / "model.safetensors.index.json"))
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all(os.path.getsize(out / s) < 150 * 1024 + 8192 for s in shards)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in original.values())
    model, reference = hf_model(str(out)), hf_model(hf_models[variant])  # in aligned memory: equal bits, equal logits
    assert type(model) is type(reference)
    ignore = ("_name_or_path",)
    assert {k: v for k, v in model.config.to_dict().items() if k not in ignore} == {
        k: v for k, v in reference.config.to_dict().items() if k not in ignore
    }
    ids = torch.randint(3, 60, (2, 12))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
    assert len(AutoTokenizer.from_pretrained(str(out))) == len(AutoTokenizer.from_pretrained(hf_models[variant]))


def test_dtype_cast_and_tag(converted, hf_models, tmp_path):
    stats = export_pipeline_to_hf(
        converted["gqa"], str(tmp_path / "bf16"), tag="global_step0", dtype="bf16", log=lambda *_: None
    )
    assert all(t.dtype == torch.bfloat16 for t in hf_state(tmp_path / "bf16").values())
    assert json.load(open(tmp_path / "bf16" / "config.json"))["dtype"] == "bfloat16"
    assert stats.tensors == len(hf_state(hf_models["gqa"]))  # every tensor of the model it was converted from


def _expect_error(args, fragment, out):
    proc = run_cmd([sys.executable, "convert2ckpt.py", "--to-hf", *args])
    assert proc.returncode == 2, proc.stderr
    one_error_line(proc, fragment, prefix="convert2ckpt: error:")
    assert not os.path.exists(out)


@pytest.mark.slow
def test_export_errors(converted, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(converted["gqa"], broken)
    os.remove(broken / "global_step0" / "layer_03-model_00-model_states.pt")
    _expect_error(
        ["--input", str(broken), "--output", str(tmp_path / "o1")], "layer_03-model_00-model_states.pt", tmp_path / "o1"
    )
    _expect_error(
        ["--input", converted["gqa"], "--output", str(tmp_path / "o2"), "--tag", "global_step9"],
        "global_step9",
        tmp_path / "o2",
    )
    (broken / "global_step0" / "layer_03-model_00-model_states.pt").write_bytes(b"not a zip")
    _expect_error(["--input", str(broken), "--output", str(tmp_path / "o3")], "cannot read layer file", tmp_path / "o3")
    os.makedirs(tmp_path / "taken")
    (tmp_path / "taken" / "config.json").write_text("{}")
    proc = run_cmd(
        [sys.executable, "convert2ckpt.py", "--to-hf", "--input", converted["gqa"], "--output", str(tmp_path / "taken")]
    )
    one_error_line(
        proc,
        "taken: output exists and holds a directory of 1 entries (config.json) that convert2ckpt did not write",
        prefix="convert2ckpt: error:",
    )


@pytest.mark.slow
def test_inspect_reports_a_converted_checkpoint(converted):
    proc = run_cmd([sys.executable, "convert2ckpt.py", "--inspect", converted["tied"], "--json"])
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["source"] == "converted from Hugging Face" and info["step"] == 0
    assert (
        info["layer_files"] == 6 and info["missing_layers"] == [] and info["tp_ranks"] == [0]
    )  # tied: no lm_head file
    assert info["model"]["tie_word_embeddings"] and info["dtype"] == {"float32": 19}
    assert info["layout"]["num_stages"] is None and info["optimizer_state"] == "none"
    text = run_cmd([sys.executable, "convert2ckpt.py", "--inspect", converted["tied"]]).stdout
    assert "converted from Hugging Face" in text and "loadable with any number of stages" in text
    # A model with experts: Qwen2-MoE, every 2nd of 4 layers sparse.
    text = run_cmd([sys.executable, "convert2ckpt.py", "--inspect", converted["qwen2_moe"]]).stdout
    assert "tied embeddings True, 4 experts (top-2) in 2 layers" in text


@pytest.mark.parametrize("variant", ["gqa", "tied", "qwen3_moe", "gemma4"])
def test_the_hf_side_of_verify_holds_one_layer_at_a_time(variant, hf_models, tmp_path):
    """`--verify --against`'s HF model (checkpoint/compare.py): transformers' own loader with each decoder layer on
    disk. Its logits equal the whole fp32 model's, bit for bit, and no more than the modules outside the layer lists
    plus the largest layer are ever in memory (tied, and Qwen3-MoE's experts fused by transformers on load)."""
    from checkpoint.compare import hf_reference_streamed
    from checkpoint.hf_reader import read_model_config

    hf_dir = hf_models[variant]
    whole = hf_model(hf_dir, dtype=torch.float32, attn_implementation="eager")
    ids = torch.randint(
        0, whole.config.get_text_config().vocab_size, (2, 12), generator=torch.Generator().manual_seed(0)
    )
    with torch.inference_mode():
        expected = whole(ids).logits
    layers = [m for m in whole.modules() if isinstance(m, torch.nn.ModuleList)]
    size = {id(m): sum(p.numel() * p.element_size() for p in m.parameters()) for m in whole.modules()}
    in_lists = sum(size[id(lst)] for lst in layers if not any(lst is not o and lst in o.modules() for o in layers))
    largest = max(size[id(layer)] for lst in layers for layer in lst)
    resident = sum(p.numel() * p.element_size() for p in whole.parameters()) - in_lists
    del whole

    model = hf_reference_streamed(hf_dir, read_model_config(hf_dir), str(tmp_path / "offload"))
    held = []

    class Count(torch.overrides.TorchFunctionMode):  # at every op of the forward: the weights in memory
        def __torch_function__(self, func, types, args=(), kwargs=None):
            held.append(sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type != "meta"))
            return func(*args, **(kwargs or {}))

    with torch.inference_mode(), Count():
        logits = model(ids).logits
    assert torch.equal(logits, expected)
    assert resident < max(held) <= resident + largest, (max(held), resident, largest)
    assert resident + largest < in_lists / 2  # the layers are most of the model: streaming them is what is measured


@pytest.mark.slow
def test_verify_manifest_and_logits(converted, hf_models, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(converted["gqa"], ckpt)
    ok = run_cmd([sys.executable, "convert2ckpt.py", "--verify", str(ckpt), "--against", hf_models["gqa"]])
    assert ok.returncode == 0 and "every file matches" in ok.stdout and "max |logit difference|" in ok.stdout, ok.stderr
    assert float(ok.stdout.strip().split()[-1]) < 1e-5
    wrong = run_cmd([sys.executable, "convert2ckpt.py", "--verify", str(ckpt), "--against", hf_models["mha"]])
    assert wrong.returncode == 2 and "logits differ" in wrong.stderr

    layer = ckpt / "global_step0" / "layer_02-model_00-model_states.pt"
    data = bytearray(layer.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit
    layer.write_bytes(bytes(data))
    os.remove(ckpt / "global_step0" / "layer_04-model_00-model_states.pt")
    (ckpt / "global_step0" / "stray.pt").write_bytes(b"x")
    bad = run_cmd([sys.executable, "convert2ckpt.py", "--verify", str(ckpt)])
    assert bad.returncode == 2
    assert "layer_02-model_00-model_states.pt: contents changed" in bad.stderr
    assert "layer_04-model_00-model_states.pt: missing" in bad.stderr
    assert "stray.pt: not listed in the manifest" in bad.stderr


def test_manifests_written_with_sha256_still_verify(converted, tmp_path):
    """Manifests hash with xxh3-128 now; one written before (sha256) verifies as it is and still catches a flipped bit,
    also when a piece is copied (`--combine`'s copy_verified)."""
    import hashlib

    from checkpoint.errors import CheckpointError
    from checkpoint.manifest import HASH, copy_verified, verify_manifest

    step = tmp_path / "ckpt" / "global_step0"
    shutil.copytree(converted["gqa"], tmp_path / "ckpt")
    listed = json.loads((step / "manifest.json").read_text())
    assert HASH == "xxh3_128" and all(set(e) >= {"size", HASH} for e in listed["files"].values())
    for name, entry in listed["files"].items():
        entry.pop(HASH)
        entry["sha256"] = hashlib.sha256((step / name).read_bytes()).hexdigest()
    (step / "manifest.json").write_text(json.dumps(listed))
    layer = step / "layer_02-model_00-model_states.pt"
    (tmp_path / "copy").mkdir()
    copy_verified(str(layer), str(tmp_path / "copy"), listed["files"][layer.name])
    assert verify_manifest(str(step)) == []
    data = bytearray(layer.read_bytes())
    data[len(data) // 2] ^= 0x01
    layer.write_bytes(bytes(data))
    assert [(p.path, p.reason) for p in verify_manifest(str(step))] == [
        (str(layer), "contents changed (sha256 differs from the manifest)")
    ]
    with pytest.raises(CheckpointError, match="contents changed \\(size or sha256 differs"):
        copy_verified(str(layer), str(tmp_path / "copy"), listed["files"][layer.name])
