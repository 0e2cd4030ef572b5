"""Pipeline outputs equal the transformers model (every family) on the same weights (fp32)."""

import json

import pytest
import torch
from transformers import AutoConfig

from tests.conftest import MODEL_VARIANTS, MOE_VARIANTS, check, torchrun
from tests.workers.forward_parity import CP_LAYOUTS, EP_CP_LAYOUTS, EP_LAYOUTS, LAYOUTS, SEQ, TP_NOT_BUILT, cp_refused
from tools.tiny_models import tiny_config

pytestmark = pytest.mark.slow  # launches the trainer on several ranks

CASES = [
    ("mha", "sdpa"),
    ("gqa", "sdpa"),
    ("tied", "sdpa"),
    ("gqa", "eager"),
    ("llama3", "sdpa"),
    ("qwen2", "sdpa"),
    ("qwen3", "sdpa"),
    ("mistral", "sdpa"),
    ("mistral", "eager"),
    ("gqa", "sdpa-packed"),
    ("mistral", "eager-packed"),
    ("mixtral", "sdpa"),
    ("qwen2_moe", "eager"),
    ("qwen3_moe", "sdpa"),
    ("llama4", "sdpa"),
    ("helium", "sdpa"),
    ("smollm3", "sdpa"),
    ("ministral3", "eager"),
    ("seed_oss", "sdpa"),
    ("ernie4_5", "sdpa"),
    ("ernie4_5", "sdpa-packed"),
    ("gemma3", "sdpa"),
    ("gemma3", "eager-packed"),
    ("phi3", "sdpa"),
    ("glm4", "sdpa"),
    ("olmo2", "sdpa"),
    ("olmo3", "eager-packed"),
    ("glm4_moe", "sdpa"),
    ("deepseek_v3", "eager-packed"),
    ("deepseek_v3", "sdpa"),  # unpacked rows: bit-identical at PP=1, 2, 4
    ("mistral4", "sdpa"),
    ("gpt_oss", "eager-packed"),
    ("gpt_oss", "eager"),
    ("qwen3_next", "sdpa"),  # Qwen3.5's linear attention is the same generic path (its training parity: PP=2)
    ("qwen3_5_moe", "sdpa"),  # ... and Qwen3.5-MoE's, with its own rotary embedding and experts fused on the hub
    ("deepseek_v32", "sdpa-packed"),  # the indexer's keys chosen within each document
    # Gemma 4: per-layer inputs and shared K/V carried across every cut (PP=2 cuts between each K/V's maker and its
    # reader for the local layers, not for the global ones), packed documents through the shared K/V
    ("gemma4", "sdpa"),
    ("gemma4", "eager-packed"),
    # GLM-5: the shared index (int32) carried across the cut (PP=2: block 1 -> blocks 2, 3), within each document
    ("glm_moe_dsa", "sdpa"),
    ("glm_moe_dsa", "sdpa-packed"),
    ("gemma4_moe", "sdpa"),  # its experts beside the dense MLP, over EP=2 and TP=2 (with SP) too
    # DeepSeek-V4: its 3 residual streams across every cut, the tokens to its hash layers (PP=2: to block 3), EP=2,
    # TP=2 as transformers' plan splits it (its attention whole on every rank, its experts split; with and without SP)
    ("deepseek_v4", "eager"),
    # One module each: EXAONE 4's local and global NoPE layers (packed: each document's window), Gemma 2's soft-capped
    # attention (eager), Hunyuan (no TP: its q/k norms' split is not built), InternLM3, Granite's multipliers
    # through the vocab-parallel head.
    ("exaone4", "sdpa-packed"),
    ("gemma2", "eager"),
    ("hunyuan", "sdpa"),
    ("internlm3", "sdpa"),
    ("granite", "sdpa"),
    ("olmoe", "sdpa"),  # over EP=2 and TP=2 too: its whole-projection q/k norms split with the heads
    ("dots1", "sdpa-packed"),
    ("flex_olmo", "sdpa"),
    ("minimax_m2", "sdpa"),
    ("glm4_moe_lite", "sdpa-packed"),
    ("apertus", "sdpa"),
    ("exaone_moe", "sdpa-packed"),
    ("hunyuan_moe", "sdpa"),
    ("mimo_v2_flash", "eager-packed"),
    ("ernie_moe", "sdpa-packed"),
    ("cohere2", "sdpa"),
    ("lfm2", "sdpa"),  # short convolutions beside attention (packed rows and CP refused: the convolution's state)
    ("lfm2_moe", "sdpa"),  # ... with sparse blocks (over EP=2 too)
    ("granite4", "sdpa"),  # Mamba-2 beside NoPE attention, experts beside the shared MLP (over EP=2 too)
    ("falcon_h1", "sdpa"),  # Mamba-2 beside attention in every layer (packed rows and CP refused)
    ("nemotron_h", "sdpa"),  # one mixer a block: Mamba-2, experts (over EP=2 too), NoPE attention, an MLP
    ("kimi_linear", "sdpa"),  # Kimi Delta Attention beside NoPE latent attention, experts (over EP=2 too)
]
MOE = {f"{m}-{attn}" for m, attn in CASES if m in MOE_VARIANTS}
NO_TP = {f"{m}-{attn}" for m, attn in CASES if MODEL_VARIANTS[m].get("model_type") in TP_NOT_BUILT}
# Context parallelism is skipped where the registry refuses it (recurrent layers, `Family.cp_refused`), as the worker
# skips it: named by the same rule, so that a new family's cases need no list here.
NO_CP = {f"{m}-{attn}" for m, attn in CASES if cp_refused(tiny_config(**MODEL_VARIANTS[m]))}


def test_forward_parity_pp_and_tp(hf_models, converted, tmp_path):
    """PP = 1, 2, 4 (bit-identical logits) and PP x TP = 1 x 2, 2 x 2 (within 2e-6) against transformers; the TP
    layouts with sequence parallelism also against themselves without it (within 1e-6); models with experts also at
    EP=2, PP=2 x EP=2 and TP=2 x EP=2 with SP (within 1e-6). Every family, sliding
    windows (Mistral's 6 < 24 positions) and packed rows (two documents per row, against transformers on each).
    Mixture-of-experts families also give transformers' load-balancing loss (over stages, within 1e-6)."""
    cases = [
        {
            "name": f"{m}-{attn}",
            "hf_dir": hf_models[m],
            "ckpt_dir": converted[m],
            "attn": attn.split("-")[0],
            "packed": attn.endswith("-packed"),
        }
        for m, attn in CASES
    ]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    check(torchrun("tests/workers/forward_parity.py", 4, str(tmp_path / "cases.json"), str(tmp_path)))
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(4)]
    records = [r for rank in ranks for r in rank["records"]]
    seen = {(r["case"], r["pp"], r["tp"], r["sp"], r["ep"], r["cp"], r["dp_rank"], r["tp_rank"]) for r in records}
    # Every (case, layout) is checked on every rank of the last stage (each CP rank on its positions); models with
    # experts at EP=2 too, and every case at CP=2.
    layouts = [(*x, 1, 1) for x in LAYOUTS]
    assert seen == {
        (c["name"], pp, tp, sp, ep, cp, d, t)
        for c in cases
        for pp, tp, sp, ep, cp in layouts
        + ([(*x, 2, 1) for x in EP_LAYOUTS] + [(*x, 2, 2) for x in EP_CP_LAYOUTS] if c["name"] in MOE else [])
        + [(*x, 1, 2) for x in CP_LAYOUTS]
        if (tp == 1 or c["name"] not in NO_TP) and (cp == 1 or c["name"] not in NO_CP)
        for d in range(4 // (pp * tp * cp))
        for t in range(tp)
    }
    failures = [r for r in records if r["error"]]
    assert not failures, failures
    for tp in (1, 2):
        diffs = [r["max_abs_logit_diff"] for r in records if r["tp"] == tp and r["ep"] == r["cp"] == 1]
        print(f"forward parity TP={tp}: {len(diffs)} checks, max |logit diff| = {max(diffs):.3g}")
    worst = max(r["max_abs_logit_diff"] for r in records if r["ep"] == 2)
    print(f"forward parity EP=2: {sum(r['ep'] == 2 for r in records)} checks, max |logit diff| = {worst:.3g}")
    worst = max(r["max_abs_logit_diff"] for r in records if r["cp"] == 2)
    print(f"forward parity CP=2: {sum(r['cp'] == 2 for r in records)} checks, max |logit diff| = {worst:.3g}")
    # Negative control: Llama 4's NoPE layers scale queries by floor((p + 1) / floor_scale) of the row's position p;
    # without the shard's offset CP rank 1 counts its 12 positions from 0, and only rank 1 changes.
    assert AutoConfig.from_pretrained(hf_models["llama4"]).floor_scale < SEQ // 2
    control = [r for r in records if "no_offset_diff" in r]
    assert {r["cp_rank"] for r in control} == {0, 1}
    assert all(r["no_offset_diff"] == r["max_abs_logit_diff"] for r in control if r["cp_rank"] == 0)
    off = min(r["no_offset_diff"] for r in control if r["cp_rank"] == 1)
    print(f"Llama 4 under CP without the shard's offset: CP rank 1's logits at least {off:.3g} off")
    assert off > 50 * 2e-6  # measured 3.58e-4: far outside the CP logits' bound
    # Stage-to-stage traffic of one micro-batch [B, S, H], counted on DeepSpeed's p2p.send, per rank of stage 0:
    # PP=2 alone sends it whole; TP=2 without sequence parallelism sends 1/T of it (DeepSpeed's partitioning, after
    # which stage 1 all-gathers the whole [B, S, H] on every TP rank), with it each rank's own S/T positions (and
    # stage 1 holds only those).
    traffic = [t for rank in ranks for t in rank["traffic"]]
    assert {(t["tp"], t["sp"]) for t in traffic} == {(1, False), (2, False), (2, True)}
    for t in traffic:
        if t["stage"] == 0:
            # With experts, the router statistics too ([2E + 2] fp32), with Gemma 4 its carried per-layer inputs and
            # K/V (models/carry.py), and DeepSpeed's partitioning is off (it takes only outputs whose later tensors
            # need no gradient): TP ranks without SP send the whole hidden.
            extra = t["stats_bytes"] + t["carried_bytes"]
            split = t["tp"] if not extra or t["sp"] else 1
            assert t["sent_float_bytes"] == t["hidden_bytes"] // split + extra, t
        else:  # forward only: stage 1 sends nothing back
            shards = t["cp"] * (2 if t["sp"] else 1)
            assert t["sent_float_bytes"] == 0 and t["received_positions"] == [SEQ // shards], t
    sent = {
        (t["tp"], t["sp"]): t["sent_float_bytes"]
        for t in traffic
        if t["stage"] == 0 and not t["stats_bytes"] + t["carried_bytes"] and t["cp"] == 1
    }
    print(
        f"stage-to-stage bytes per rank and micro-batch: TP=1 {sent[1, False]}, TP=2 {sent[2, False]} "
        f"(stage 1 all-gathers them), TP=2 + SP {sent[2, True]} (stage 1 keeps the shard)"
    )
    cp2 = {
        t["sent_float_bytes"]
        for t in traffic
        if t["stage"] == 0 and t["cp"] == 2 and not t["stats_bytes"] + t["carried_bytes"]
    }
    assert cp2 == {sent[1, False] // 2}


def test_forward_parity_pp2_tp2_cp2(hf_models, converted, tmp_path):
    """PP=2 x TP=2 x CP=2 on 8 ranks, without and with sequence parallelism (the row cut into C x T = 4 pieces):
    logits within 2e-6 of transformers' on each rank's positions, for packed rows, a sliding window with eager
    attention and Qwen3's q/k norms with KV heads replicated (1 per TP rank, C=2)."""
    names = [("gqa", "sdpa-packed"), ("mistral", "eager"), ("qwen3", "sdpa")]
    cases = [
        {"name": f"{m}-{a}", "hf_dir": hf_models[m], "ckpt_dir": converted[m], "attn": a.split("-")[0]}
        | {"packed": a.endswith("-packed")}
        for m, a in names
    ]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    check(torchrun("tests/workers/forward_parity.py", 8, str(tmp_path / "cases.json"), str(tmp_path), "--pp2-tp2-cp2"))
    records = [r for rank in range(8) for r in json.loads((tmp_path / f"rank{rank}.json").read_text())["records"]]
    # the last stage's 4 ranks (CP x TP) in both layouts, for every case
    assert sorted((r["case"], r["sp"]) for r in records) == sorted((c["name"], sp) for c in cases for sp in (0, 1) * 4)
    assert not [r for r in records if r["error"]], records
    print(
        f"forward parity PP=2 x TP=2 x CP=2: {len(records)} checks, max |logit diff| "
        f"{max(r['max_abs_logit_diff'] for r in records):.3g}"
    )


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
