"""Pipeline outputs equal the transformers model (every family) on the same weights (fp32)."""

import json

import pytest
import torch

from tests.conftest import check, torchrun

pytestmark = pytest.mark.slow  # launches the trainer on several ranks

CASES = [("mha", "sdpa"), ("gqa", "sdpa"), ("tied", "sdpa"), ("gqa", "eager"), ("llama3", "sdpa"), ("qwen2", "sdpa"),
         ("qwen3", "sdpa"), ("mistral", "sdpa"), ("mistral", "eager")]  # fmt: skip


def test_forward_parity_pp_and_tp(hf_models, converted, tmp_path):
    """PP = 1, 2, 4 (bit-identical logits) and PP x TP = 1 x 2, 2 x 2 (within 1e-5) against transformers."""
    cases = [
        {"name": f"{m}-{attn}", "hf_dir": hf_models[m], "ckpt_dir": converted[m], "attn": attn} for m, attn in CASES
    ]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    check(torchrun("tests/workers/forward_parity.py", 4, str(tmp_path / "cases.json"), str(tmp_path)))
    records = [r for rank in range(4) for r in json.loads((tmp_path / f"rank{rank}.json").read_text())]
    seen = {(r["case"], r["pp"], r["tp"], r["dp_rank"], r["tp_rank"]) for r in records}
    # Every (case, layout) is checked on every rank of the last stage.
    layouts = [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)]
    assert seen == {
        (c["name"], pp, tp, d, t) for c in cases for pp, tp in layouts for d in range(4 // (pp * tp)) for t in range(tp)
    }
    failures = [r for r in records if r["error"]]
    assert not failures, failures
    for tp in (1, 2):
        worst = max(r["max_abs_logit_diff"] for r in records if r["tp"] == tp)
        print(f"forward parity TP={tp}: {sum(r['tp'] == tp for r in records)} checks, max |logit diff| = {worst:.3g}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_sdpa_matches_hf_on_gpu(hf_models):
    """bf16 SDPA decoder layer on GPU vs HF's bf16 model: same kernels, so tight agreement."""
    from transformers import LlamaForCausalLM

    from models.layers import decoder_layer_class

    hf = LlamaForCausalLM.from_pretrained(hf_models["gqa"], dtype=torch.bfloat16, attn_implementation="sdpa").cuda()
    layer = decoder_layer_class("llama")(hf.config, 0).cuda().to(torch.bfloat16)
    layer.load_state_dict(hf.model.layers[0].state_dict())
    x = torch.randn(2, 32, hf.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(32, device="cuda").expand(2, 32)
    ours, _ = layer((x, pos))
    ref = hf.model.layers[0](x, position_embeddings=hf.model.rotary_emb(x, pos), position_ids=pos)
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)
