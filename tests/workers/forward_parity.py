"""Worker (torchrun, 4 ranks): pipeline logits/loss vs transformers.LlamaForCausalLM for PP = 1, 2, 4.

    torchrun --nproc_per_node 4 tests/workers/forward_parity.py CASES_JSON OUT_DIR

CASES_JSON: [{"name", "hf_dir", "ckpt_dir", "attn"}]. Each rank writes OUT_DIR/rank{R}.json with one
record per (case, PP) it checked on the last stage: max |logit difference| and both losses.
"""

import json
import os
import sys

import torch

from models.loss import IGNORE_INDEX, CausalLMLoss
from training.checkpointing import load_stage_weights
from training.config import TrainConfig
from training.distributed import init_distributed
from training.engine import build_module, initialize_engine
from training.topology import Coords

BATCH, SEQ = 2, 24


def batch_for(dp_rank: int, vocab: int):
    g = torch.Generator().manual_seed(1000 + dp_rank)
    ids = torch.randint(3, vocab, (BATCH, SEQ), generator=g)
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = IGNORE_INDEX
    labels[0, :5] = IGNORE_INDEX  # some prompt-like ignored positions
    pos = torch.arange(SEQ).expand(BATCH, SEQ).contiguous()
    return ids, pos, labels


def main():
    cases_path, out_dir = sys.argv[1], sys.argv[2]
    rank, world = init_distributed()
    from transformers import AutoConfig, LlamaForCausalLM

    records = []
    for case in json.load(open(cases_path)):
        for pp in (1, 2, 4):
            dp = world // pp
            cfg = TrainConfig(num_stages=pp, micro_batch_size=BATCH, gradient_accumulation_steps=1, seq_length=SEQ)
            config = AutoConfig.from_pretrained(case["ckpt_dir"])
            config._attn_implementation = case["attn"]
            loss_fn = CausalLMLoss()
            coords = Coords(rank, world, pp)
            module = build_module(cfg, coords, config, loss_fn)
            load_stage_weights(module, os.path.join(case["ckpt_dir"], "global_step0"))
            module._synchronize_tied_weights()
            engine = initialize_engine(cfg, coords, module, 1)
            stage, dp_rank = rank // dp, rank % dp
            ids, pos, labels = batch_for(dp_rank, config.vocab_size)
            scale = torch.tensor(1.0)
            _, logits = engine.eval_batch(
                iter([((ids, pos), (labels, scale))]), return_logits=True, num_micro_batches=1
            )
            if stage == pp - 1:
                hf = LlamaForCausalLM.from_pretrained(
                    case["hf_dir"], attn_implementation=case["attn"], dtype=torch.float32
                )
                hf_labels = torch.full_like(ids, IGNORE_INDEX)
                hf_labels[:, 1:] = labels[:, :-1]  # HF shifts labels itself
                with torch.no_grad():
                    ref = hf(input_ids=ids, labels=hf_labels)
                loss_sum, tokens = loss_fn.totals()
                err = None
                try:  # logits bit-identical (the README says so); the loss is HF's fp32 mean vs our fp64 division
                    assert torch.equal(logits, ref.logits), f"max |logit diff| {(logits - ref.logits).abs().max()}"
                    torch.testing.assert_close(torch.tensor(loss_sum / tokens), ref.loss, rtol=1e-6, atol=1e-6)
                except AssertionError as e:
                    err = str(e)
                records.append(
                    {
                        "case": case["name"],
                        "pp": pp,
                        "dp_rank": dp_rank,
                        "max_abs_logit_diff": float((logits - ref.logits).abs().max()),
                        "loss": loss_sum / tokens,
                        "hf_loss": float(ref.loss),
                        "error": err,
                    }
                )
            del engine, module
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(records, f)


if __name__ == "__main__":
    main()
