"""Worker (torchrun, 4 ranks): pipeline logits/loss vs transformers' model for PP x TP = 1, 2, 4 x 1 and 1, 2 x 2.

    torchrun --nproc_per_node 4 tests/workers/forward_parity.py CASES_JSON OUT_DIR

CASES_JSON: [{"name", "hf_dir", "ckpt_dir", "attn"}]. Each rank writes OUT_DIR/rank{R}.json with one
record per (case, layout) it checked on the last stage: max |logit difference| and both losses. With
tensor parallelism the vocabulary shards of the logits are gathered first.
"""

import functools
import json
import os
import sys

import torch
import torch.distributed as dist

from models.loss import IGNORE_INDEX
from models.partition import stage_bounds
from models.tensor_parallel import TensorParallel, vocab_parallel, vocab_parallel_cross_entropy
from training.checkpointing import load_stage_weights
from training.config import TrainConfig
from training.distributed import init_distributed, shutdown_distributed
from training.engine import build_module, initialize_engine
from training.topology import Coords

BATCH, SEQ = 2, 24
LAYOUTS = [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)]  # (PP, TP); DP = 4 / (PP x TP)


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
    from transformers import AutoConfig, AutoModelForCausalLM

    from models.loss import CausalLMLoss

    records = []
    for case in json.load(open(cases_path)):
        for pp, tp_size in LAYOUTS:
            cfg = TrainConfig(num_stages=pp, tensor_parallel_size=tp_size, micro_batch_size=BATCH,
                              gradient_accumulation_steps=1, seq_length=SEQ)  # fmt: skip
            config = AutoConfig.from_pretrained(case["ckpt_dir"])
            config._attn_implementation = case["attn"]
            coords = Coords(rank, world, pp, tp_size)
            tp = TensorParallel(tp_size, coords.tp_rank)
            ce = None
            if vocab_parallel(config, tp):
                ce = functools.partial(vocab_parallel_cross_entropy, tp=tp, vocab_size=config.vocab_size)
            loss_fn = CausalLMLoss(ce)
            module = build_module(cfg, coords, config, loss_fn, tp, stage_bounds(config, pp, cfg.model.partition))
            load_stage_weights(module, os.path.join(case["ckpt_dir"], "global_step0"), config, tp)
            module._synchronize_tied_weights()
            engine = initialize_engine(cfg, coords, module, 1)
            ids, pos, labels = batch_for(coords.dp_rank, config.vocab_size)
            scale = torch.tensor(1.0)
            _, logits = engine.eval_batch(
                iter([((ids, pos), (labels, scale))]), return_logits=True, num_micro_batches=1
            )
            if coords.is_last and tp_size > 1:  # this rank's vocabulary rows: gather them all
                shards = [torch.empty_like(logits) for _ in range(tp_size)]
                dist.all_gather(shards, logits.contiguous(), group=tp.group)
                logits = torch.cat(shards, dim=-1)[..., : config.vocab_size]
            if coords.is_last:
                hf = AutoModelForCausalLM.from_pretrained(
                    case["hf_dir"], attn_implementation=case["attn"], dtype=torch.float32
                )
                hf_labels = torch.full_like(ids, IGNORE_INDEX)
                hf_labels[:, 1:] = labels[:, :-1]  # HF shifts labels itself
                with torch.no_grad():
                    ref = hf(input_ids=ids, labels=hf_labels)
                loss_sum, tokens = loss_fn.totals()
                err = None
                try:
                    if tp_size == 1:  # bit-identical (the README says so)
                        assert torch.equal(logits, ref.logits), f"max |logit diff| {(logits - ref.logits).abs().max()}"
                    else:  # row-parallel sums add the same terms in another order
                        torch.testing.assert_close(logits, ref.logits, rtol=1e-5, atol=1e-5)
                    # the loss is HF's fp32 mean vs our fp64 division
                    torch.testing.assert_close(torch.tensor(loss_sum / tokens), ref.loss, rtol=1e-6, atol=1e-6)
                except AssertionError as e:
                    err = str(e)
                records.append(
                    {
                        "case": case["name"],
                        "pp": pp,
                        "tp": tp_size,
                        "dp_rank": coords.dp_rank,
                        "tp_rank": coords.tp_rank,
                        "max_abs_logit_diff": float((logits - ref.logits).abs().max()),
                        "loss": loss_sum / tokens,
                        "hf_loss": float(ref.loss),
                        "error": err,
                    }
                )
            del engine, module
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(records, f)
    shutdown_distributed()


if __name__ == "__main__":
    main()
