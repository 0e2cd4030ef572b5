"""Worker (torchrun, 4 ranks): pipeline logits/loss vs transformers' model for PP x TP = 1, 2, 4 x 1 and 1, 2 x 2,
the TP layouts without and with sequence parallelism; models with experts also at EP=2, PP=2 x EP=2 and
TP=2 x EP=2 with sequence parallelism.

    torchrun --nproc_per_node 4 tests/workers/forward_parity.py CASES_JSON OUT_DIR
    torchrun --nproc_per_node 8 tests/workers/forward_parity.py CASES_JSON OUT_DIR --pp2-tp2-cp2

The second form checks PP=2 x TP=2 x CP=2 only (without and with sequence parallelism), on 8 ranks.

CASES_JSON: [{"name", "hf_dir", "ckpt_dir", "attn", "packed"}]. Each rank writes OUT_DIR/rank{R}.json with one
record per (case, layout) it checked on the last stage: max |logit difference| and both losses, and (every
rank of a PP=2 layout) the floating-point bytes it sent to the other stage and the hidden positions its stage
received per micro-batch (stage-to-stage traffic, counted on DeepSpeed's p2p.send). With
tensor parallelism the vocabulary shards of the logits are gathered first. Sequence-parallel logits are also
compared with the same layout's logits without it. Packed cases hold two documents per row (position ids
restart); the reference runs transformers on each document alone.
"""

import functools
import json
import os
import sys

import torch
import torch.distributed as dist

from models.carry import carried_bytes
from models.context_parallel import shard
from models.families import FAMILIES
from models.head import split_stats
from models.layer_kinds import linear_attention_refusal, residual_streams
from models.loss import IGNORE_INDEX
from models.moe import WithAuxLoss, aux_loss, empty_stats, is_moe
from models.partition import stage_bounds
from models.tensor_parallel import TensorParallel, vocab_parallel
from models.vocab_parallel_loss import vocab_parallel_cross_entropy
from schema.train import TrainConfig
from tests.baseline import hf_model
from training.checkpointing import load_stage_weights
from training.distributed import init_distributed, shutdown_distributed
from training.engine import build_module, initialize_engine
from training.precision import resolve
from training.topology import Coords

BATCH, SEQ = 2, 24
LAYOUTS = [(1, 1, False), (2, 1, False), (4, 1, False), (1, 2, False), (2, 2, False), (1, 2, True), (2, 2, True)]
# Models with experts also split them over expert_parallel_size=2: EP=2 (DP=4), PP=2 x EP=2, TP=2 x EP=2 with SP.
EP_LAYOUTS = [(1, 1, False), (2, 1, False), (1, 2, True)]
# Context parallelism C=2 (Ulysses): CP=2 (DP=2), PP=2 x CP=2, TP=2 x CP=2 without and with SP; dense models.
CP_LAYOUTS = [(1, 1, False), (2, 1, False), (1, 2, False), (1, 2, True)]
EP_CP_LAYOUTS = [(1, 1, False), (2, 1, False)]  # experts split over EP=2 ranks of the data axis under CP=2


def cp_refused(config) -> bool:  # what context parallelism refuses (training/validate.py): linear attention, DSA
    return linear_attention_refusal(config, "") is not None or bool(FAMILIES[config.model_type].cp_refused)


TP_NOT_BUILT = {name for name, family in FAMILIES.items() if family.tp_refused}  # (`Family.tp_refused`)
FIRST_DOC = 10  # packed cases: documents of 10 and 14 tokens per row


def batch_for(dp_rank: int, vocab: int, packed: bool):
    g = torch.Generator().manual_seed(1000 + dp_rank)
    ids = torch.randint(3, vocab, (BATCH, SEQ), generator=g)
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = IGNORE_INDEX
    labels[0, :5] = IGNORE_INDEX  # some prompt-like ignored positions
    pos = torch.arange(SEQ).expand(BATCH, SEQ).contiguous()
    if packed:
        pos = torch.cat([torch.arange(FIRST_DOC), torch.arange(SEQ - FIRST_DOC)]).expand(BATCH, SEQ).contiguous()
        labels[:, FIRST_DOC - 1] = IGNORE_INDEX  # a document's last token does not predict the next document
    return ids, pos, labels


def reference(hf, ids, labels, packed: bool):
    """transformers' logits and mean loss over our (already shifted) labels; packed rows one document at a time."""
    with torch.no_grad():
        if packed:
            logits = torch.cat([hf(input_ids=ids[:, :FIRST_DOC]).logits, hf(input_ids=ids[:, FIRST_DOC:]).logits], 1)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
            return logits, loss, None
        hf_labels = torch.full_like(ids, IGNORE_INDEX)
        hf_labels[:, 1:] = labels[:, :-1]  # HF shifts labels itself
        experts = getattr(hf.config, "num_experts_per_tok", None) is not None
        ref = hf(input_ids=ids, **({"output_router_logits": True} if experts else {}))
        loss = torch.nn.functional.cross_entropy(ref.logits[:, :-1].flatten(0, 1), hf_labels[:, 1:].flatten())
        return ref.logits, loss, ref.aux_loss if experts else None


SENT = {"float_bytes": 0}


def count_p2p_sends() -> None:
    """Count the floating-point bytes DeepSpeed's pipeline engine sends between stages (not its integer metadata)."""
    from deepspeed.runtime.pipe import p2p

    send = p2p.send

    def counting_send(tensor, *args, **kwargs):
        if tensor.is_floating_point():
            SENT["float_bytes"] += tensor.numel() * tensor.element_size()
        return send(tensor, *args, **kwargs)

    p2p.send = counting_send


def reuse_process_groups() -> None:
    """One process group per set of ranks for the whole worker. Each layout's engine asks for its groups anew (about
    12 per engine, 117 engines) and gloo builds every one from scratch (a rendezvous and a connection per peer): a
    quarter of this worker's time. Every rank asks for the same groups in the same order, so every rank reuses the
    same ones."""
    new_group, groups = dist.new_group, {}

    def cached(ranks=None, *args, **kwargs):
        key = (None if ranks is None else tuple(ranks), repr(args), repr(sorted(kwargs.items())))
        if key not in groups:
            groups[key] = new_group(ranks, *args, **kwargs)
        return groups[key]

    dist.new_group = cached


def without_shard_offset(engine, batch) -> torch.Tensor:
    """The negative control of Llama 4's NoPE temperature under CP: the logits when each CP rank counts its positions
    from 0, as if the layer passed no `ShardOffset` (models/layers.py looks it up on the module at call time)."""
    from models import context_parallel

    original = context_parallel.ShardOffset
    context_parallel.ShardOffset = lambda offset: original(0)
    try:
        _, outputs = engine.eval_batch(iter([batch]), return_logits=True, num_micro_batches=1)
    finally:
        context_parallel.ShardOffset = original
    return split_stats(outputs)[0]


def main():
    cases_path, out_dir = sys.argv[1], sys.argv[2]
    rank, world = init_distributed()
    count_p2p_sends()
    reuse_process_groups()
    traffic = []
    from transformers import AutoConfig

    from models.loss import CausalLMLoss

    records, without_sp, references = [], {}, {}
    for case in json.load(open(cases_path)):
        packed = case.get("packed", False)
        model_config = AutoConfig.from_pretrained(case["ckpt_dir"])
        experts = is_moe(model_config)
        layouts = [(*x, 1, 1) for x in LAYOUTS] + [(*x, 2, 1) for x in EP_LAYOUTS if experts]
        layouts += [(*x, 1, 2) for x in CP_LAYOUTS if not cp_refused(model_config)]
        layouts += [(*x, 2, 2) for x in EP_CP_LAYOUTS if experts and not cp_refused(model_config)]
        if "--pp2-tp2-cp2" in sys.argv[3:]:
            layouts = [(2, 2, False, 1, 2), (2, 2, True, 1, 2)]
        if model_config.model_type in TP_NOT_BUILT:
            layouts = [x for x in layouts if x[1] == 1]
        for pp, tp_size, sp, ep, cp in layouts:
            cfg = TrainConfig(
                num_stages=pp,
                tensor_parallel_size=tp_size,
                micro_batch_size=BATCH,
                gradient_accumulation_steps=1,
                seq_length=SEQ,
                sequence_parallel=sp,
                expert_parallel_size=ep,
                context_parallel_size=cp,
            )
            cfg.data.packing = packed
            resolve(cfg)  # as the trainer does (training/precision.py)
            config = AutoConfig.from_pretrained(case["ckpt_dir"])
            config._attn_implementation = case["attn"]
            coords = Coords(rank, world, pp, tp_size, cp=cp)
            tp = TensorParallel(tp_size, coords.tp_rank, sequence_parallel=sp)
            ce = None
            if vocab_parallel(config, tp):
                ce = functools.partial(vocab_parallel_cross_entropy, tp=tp, vocab_size=config.vocab_size)
            loss_fn = CausalLMLoss(ce)
            if is_moe(config):
                loss_fn = WithAuxLoss(loss_fn, 0.1)
            bounds = stage_bounds(config, pp, cfg.model.partition)
            module = build_module(cfg, coords, config, loss_fn, tp, bounds)
            load_stage_weights(module, os.path.join(case["ckpt_dir"], "global_step0"), config, tp)
            module._synchronize_tied_weights()
            engine = initialize_engine(cfg, coords, module, 1)
            ids, pos, labels = batch_for(coords.dp_rank, config.vocab_size, packed)
            mine = shard(ids, coords.cp_rank, cp), shard(labels, coords.cp_rank, cp)  # this CP rank's; pos whole
            received = []
            if pp == 2 and coords.stage == 1:  # the hidden positions this rank's stage receives
                module.forward_funcs[0].register_forward_pre_hook(
                    lambda _m, args, seen=received: seen.append(args[0][0].shape[1])
                )
            SENT["float_bytes"] = 0
            scale = torch.tensor(1.0)
            _, outputs = engine.eval_batch(
                iter([((mine[0], pos), (mine[1], scale))]), return_logits=True, num_micro_batches=1
            )
            logits, stats = split_stats(outputs) if coords.is_last else (outputs, None)
            if pp == 2:
                traffic.append(
                    {
                        "case": case["name"],
                        "tp": tp_size,
                        "sp": sp,
                        "cp": cp,
                        "stage": coords.stage,
                        "sent_float_bytes": SENT["float_bytes"],
                        "received_positions": received[:1],
                        "hidden_bytes": BATCH * SEQ * residual_streams(config) * config.hidden_size * 4 // cp,
                        "stats_bytes": empty_stats(config).numel() * 4 if is_moe(config) else 0,
                        # the family's carried tensors at the cut (Gemma 4's per-layer inputs and shared K/V)
                        "carried_bytes": carried_bytes(config, bounds[1] - 1, BATCH, SEQ, 4, tp_size, cp, sp),
                    }
                )
            if coords.is_last and tp_size > 1:  # this rank's vocabulary rows: gather them all
                shards = [torch.empty_like(logits) for _ in range(tp_size)]
                dist.all_gather(shards, logits.contiguous(), group=tp.group)
                logits = torch.cat(shards, dim=-1)[..., : config.vocab_size]
            if coords.is_last:
                if (case["name"], coords.dp_rank) not in references:  # the same batch in every layout
                    hf = hf_model(case["hf_dir"], attn_implementation=case["attn"], dtype=torch.float32)
                    references[case["name"], coords.dp_rank] = reference(hf, ids, labels, packed)
                ref_logits, ref_loss, ref_aux = references[case["name"], coords.dp_rank]
                ref_logits = shard(ref_logits, coords.cp_rank, cp)
                loss_sum, tokens = loss_fn.totals()
                if cp > 1:  # the row's loss: its shards' sums
                    sums = torch.tensor([loss_sum, tokens], dtype=torch.float64)
                    dist.all_reduce(sums, group=module._cp.group)
                    loss_sum, tokens = float(sums[0]), int(sums[1])
                err, key = None, (case["name"], pp, coords.dp_rank, coords.tp_rank)
                try:
                    # TP and CP: max 5.07e-7 over every family's checks (docs/measured.md); held at 2e-6, no rtol
                    if cp > 1:  # attention over the whole row after the all-to-all; the same kernel, other strides
                        torch.testing.assert_close(logits, ref_logits, rtol=0, atol=2e-6)
                    elif ep > 1:  # the experts' matmuls on other sets of rows: fp32 rounding of another blocking
                        torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-6)
                    elif tp_size == 1 and not packed:  # bit-identical (README and docs/architecture.md say so)
                        assert torch.equal(logits, ref_logits), f"max |logit diff| {(logits - ref_logits).abs().max()}"
                    else:  # row-parallel sums add the same terms in another order
                        torch.testing.assert_close(logits, ref_logits, rtol=0, atol=2e-6)
                    if sp and ep == cp == 1:  # the same sums as without SP, reduce-scattered instead of all-reduced
                        torch.testing.assert_close(logits, without_sp[key], rtol=1e-6, atol=1e-6)
                    elif tp_size > 1 and ep == cp == 1:
                        without_sp[key] = logits
                    # the loss is HF's fp32 mean vs our fp64 division
                    torch.testing.assert_close(torch.tensor(loss_sum / tokens), ref_loss, rtol=1e-6, atol=1e-6)
                    # transformers' load-balancing loss over every sparse layer of the model, where we reproduce it
                    # (not DeepSeek-V4's: `output_router_logits` refused, training/validate.py)
                    if ref_aux is not None and FAMILIES[config.model_type].moe.aux_loss:
                        torch.testing.assert_close(aux_loss(stats), ref_aux, rtol=1e-6, atol=1e-6)
                except AssertionError as e:
                    err = str(e)
                records.append(
                    {
                        "case": case["name"],
                        "pp": pp,
                        "tp": tp_size,
                        "sp": sp,
                        "ep": ep,
                        "cp": cp,
                        "dp_rank": coords.dp_rank,
                        "tp_rank": coords.tp_rank,
                        "cp_rank": coords.cp_rank,
                        "max_abs_logit_diff": float((logits - ref_logits).abs().max()),
                        "loss": loss_sum / tokens,
                        "hf_loss": float(ref_loss),
                        "error": err,
                    }
                )
            if cp > 1 and pp == tp_size == ep == 1 and getattr(config, "attn_temperature_tuning", False):
                control = without_shard_offset(engine, ((mine[0], pos), (mine[1], scale)))
                records[-1]["no_offset_diff"] = float((control - ref_logits).abs().max())
            del engine, module
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"records": records, "traffic": traffic}, f)
    shutdown_distributed()


if __name__ == "__main__":
    main()
