"""Single-process reference: train the transformers model (AutoModelForCausalLM) on the same global batches.

Independent of the pipeline code: transformers' model computes the forward and the loss (its own label shift, mean
over every target token of the global batch, its load-balancing loss) and torch clips and steps. What it shares with
the trainer, each part proven on its own elsewhere:
- the rows: `TokenizedDataset` (tokens and targets held to transformers' chat templates and LLaMA-Factory's formats
  in tests/test_data.py and tests/test_formats.py), `PackedDataset` / `BlockDataset` / `arranged` (unpacked here
  into rows of their own, so packing itself is what the parity tests prove), `IGNORE_INDEX`;
- which rows each step takes (`TrainPlan`: tests/test_data.py) and the optimizer recipe (`make_optimizer`, torch's
  AdamW and the warmup-cosine schedule: tests/test_engine_config.py; with `optim.name=muon`, torch.optim.Muon beside
  it: tests/muon_reference.py);
- the attention implementation a family gets (`resolve_attention`), LoRA's seeded adapters (`add_lora`, held to
  PEFT's in tests/test_lora.py);
- for `train_dpo_reference`: `PairDataset` and the preference and sft losses (`preference_losses`, `sft_loss`,
  equal to TRL's in tests/test_preference.py).
"""

from __future__ import annotations

import os
import sys

import torch

from data.dataset import TokenizedDataset
from data.packing import BlockDataset, PackedDataset, arranged
from data.sampling import TrainPlan
from models.families import resolve_attention
from models.lora import add_lora
from models.loss import IGNORE_INDEX
from schema.train import TrainConfig
from tests.muon_reference import reference_optimizer


def hf_model(hf_dir: str, **kwargs):
    """`AutoModelForCausalLM.from_pretrained` with every tensor copied into memory of its own. transformers leaves
    each tensor where the safetensors file maps it, and a CPU matmul can round differently on operands aligned
    differently: the same bits from two files gave logits 1 ulp apart (a Mistral 4 export against its source: 48 of
    2,000 batches; none once copied). The pipeline's own weights live in freshly allocated (64-byte aligned) memory."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, **kwargs)
    for tensor in [*model.parameters(), *model.buffers()]:
        tensor.data = tensor.data.clone()
    return model


def quantized(cfg: TrainConfig) -> dict:
    """`from_pretrained`'s arguments for transformers' own 4-bit model of `cfg.lora.quantize=nf4` (QLoRA)."""
    if cfg.lora.quantize != "nf4":
        return {}
    from transformers import BitsAndBytesConfig

    bnb = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=cfg.lora.quantize_double,
        bnb_4bit_compute_dtype=torch.float32,
    )
    return {"quantization_config": bnb, "device_map": "cpu"}


def global_batch(dataset, plan: TrainPlan, step: int, seed: int, seq_length: int, pad_id: int):
    """Rows of optimizer step `step` over all DP ranks, as HF inputs (unshifted labels). With packing, the
    rows inside the step's packed rows, each in an HF row of its own (what packing must reproduce); with
    concatenation, each piece of a document that a block holds."""
    epoch, skip = plan.position(step)
    indices = []
    for r in range(plan.dp_size):
        indices += plan.epoch_indices(epoch, r, seed, skip)[: plan.rows_per_step]
    rows = [dataset[i] for i in indices]
    if isinstance(dataset, (PackedDataset, BlockDataset)):
        rows = [row for packed in rows for row in packed]
    ids = torch.full((len(rows), seq_length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), seq_length), dtype=torch.long)
    labels = torch.full((len(rows), seq_length), IGNORE_INDEX, dtype=torch.long)
    for i, (tokens, targets) in enumerate(rows):
        n = len(tokens)
        ids[i, :n], mask[i, :n] = tokens, 1
        labels[i, :n] = torch.where(targets, tokens, IGNORE_INDEX)
    labels[:, 0] = IGNORE_INDEX
    return ids, mask, labels


def train_baseline(hf_dir: str, tokenizer_dir: str, cfg: TrainConfig, dp: int, steps: int, cp_split: int = 0):
    """Returns (model, [loss per step], [grad norm per step]); `model.step_tokens` holds each step's tokens
    that are not padding (what the trainer's metrics call input_tokens). With experts and `cp_split`,
    `model.router_control` holds the negative control of the router statistics under CP on the first step
    (`_router_control`): (aux's largest relative change over its micro-batches, the loss's change, fewest tokens)."""
    from transformers import AutoConfig, AutoTokenizer

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(hf_dir)  # SDPA, or eager where transformers has no SDPA for it (gpt-oss)
    attn = resolve_attention(config, None)
    model = hf_model(hf_dir, dtype=torch.float32, attn_implementation=attn, **quantized(cfg))
    model.train()
    if cfg.lora.enabled:  # the same per-layer seeded adapters as the pipeline (models/lora.py)
        lo = cfg.lora
        add_lora(model, lo.r, lo.alpha, lo.dropout, lo.target_modules, cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    d = cfg.data
    dataset = TokenizedDataset(cfg.train_file, tokenizer, cfg.seq_length, d, concat=d.concatenate)
    dataset = arranged(dataset, d.packing, d.concatenate, cfg.seq_length, train=True)
    plan = TrainPlan(len(dataset), dp, cfg.micro_batch_size, cfg.gradient_accumulation_steps)
    total = plan.total_steps(cfg.max_steps, cfg.num_train_epochs)
    optimizer, scheduler = reference_optimizer(cfg, model, total)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    losses, norms, step_tokens = [], [], []
    experts = getattr(model.config, "num_experts_per_tok", None) is not None
    loads = _expert_loads(model) if cfg.moe.bias_update_rate else None
    model.router_control = None
    for step in range(steps):
        ids, mask, labels = global_batch(dataset, plan, step, cfg.seed, cfg.seq_length, pad_id)
        step_tokens.append(int(mask.sum()))
        if experts:
            loss = _micro_batch_steps(model, ids, mask, labels, cfg, cp_split if step == 0 else 0)
        else:
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
        max_norm = cfg.optim.max_grad_norm if cfg.optim.max_grad_norm > 0 else float("inf")
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if loads is not None:  # DeepSeek-V3's balancing, written out: +rate below the mean load, -rate above
            with torch.no_grad():
                for router, counts in loads.items():
                    step = torch.sign(counts.mean() - counts) * cfg.moe.bias_update_rate
                    router.e_score_correction_bias += step.to(router.e_score_correction_bias.dtype)
                    counts.zero_()
    model.step_tokens = step_tokens
    return model, losses, norms


def _expert_loads(model) -> dict:
    """{router: [E] tokens it sent to each expert since the last reset}, counted by forward hooks on every router
    with a score bias, over the real tokens of the forward (`model.real_tokens`, the attention mask, set by the
    caller)."""
    loads = {}
    for router in [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]:
        loads[router] = torch.zeros(router.e_score_correction_bias.shape[0], dtype=torch.float64)

        def count(module, _inputs, outputs):
            if not torch.is_grad_enabled():  # an evaluation's forward
                return
            chosen = outputs[2][model.real_tokens.reshape(-1).bool()]  # [tokens, k]
            loads[module] += torch.bincount(chosen.reshape(-1), minlength=len(loads[module])).double()

        router.register_forward_hook(count)
    return loads


def _micro_batch_steps(model, ids, mask, labels, cfg: TrainConfig, cp_split: int = 0) -> torch.Tensor:
    """A model with experts: transformers' load-balancing loss is a function of the micro-batch (its expert
    shares over the micro-batch's tokens), so each micro-batch (in the order DP ranks and gradient accumulation
    take the rows) runs on its own, as gradient accumulation over transformers' model does: the step's loss is
    the mean cross-entropy over every target token of the global batch plus the coefficient times the mean of the
    micro-batches' `aux_loss` (transformers' own, with the padding mask). Backward per micro-batch."""
    coef = cfg.moe.aux_loss_coef
    if coef is None:
        coef = model.config.router_aux_loss_coef if model.config.output_router_logits else 0.0
    chunks = range(0, ids.shape[0], cfg.micro_batch_size)
    targets = int((labels[:, 1:] != IGNORE_INDEX).sum())
    total = torch.zeros(())
    for start in chunks:
        rows = slice(start, start + cfg.micro_batch_size)
        model.real_tokens = mask[rows]
        out = model(input_ids=ids[rows], attention_mask=mask[rows], output_router_logits=True)
        if cp_split and coef:  # over the step's micro-batches: the largest relative change of aux, the loss's
            change, tokens = _router_control(model, out, mask[rows], cp_split)
            relative, moved, fewest = model.router_control or (0.0, 0.0, tokens)
            relative = max(relative, abs(change) / float(out.aux_loss.detach()))
            model.router_control = (relative, moved + coef * change / len(chunks), min(fewest, tokens))
        logits = out.logits[:, :-1].float()
        ce = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels[rows, 1:].reshape(-1), reduction="sum"
        )
        loss = ce / targets + (coef * out.aux_loss / len(chunks) if coef else 0.0)  # Llama 4's has none
        loss.backward()
        total += loss.detach()
    return total


@torch.no_grad()
def _router_control(model, out, mask, split: int) -> tuple[float, int]:
    """The negative control of the router statistics under context parallelism, on one micro-batch: the change of
    transformers' load-balancing loss if each of 2 CP ranks computed it from the routing of its own positions only
    (no sum of the statistics over the ranks), averaged over the ranks; and the fewer real tokens of the two sides
    of `split` (the control shows nothing unless both hold some)."""
    balance = sys.modules[type(model).__module__].load_balancing_loss_func
    rows, width = mask.shape
    gates = [g.reshape(rows, width, -1) for g in out.router_logits]
    shards = (slice(split), slice(split, None))
    each = [
        balance(
            tuple(g[:, s].reshape(-1, g.shape[-1]) for g in gates),
            model.num_experts,
            model.num_experts_per_tok,
            mask[:, s],
        )
        for s in shards
    ]
    return float(sum(each) / len(each) - out.aux_loss), min(int(mask[:, s].sum()) for s in shards)


@torch.no_grad()
def baseline_eval(model, tokenizer_dir: str, eval_file: str, cfg: TrainConfig) -> tuple[float, int]:
    """(mean loss over every target token of eval_file, token count), one unpadded row (with concatenation: one
    piece of a document in a block) at a time."""
    from transformers import AutoTokenizer

    d = cfg.data
    dataset = TokenizedDataset(
        eval_file, AutoTokenizer.from_pretrained(tokenizer_dir), cfg.seq_length, d, concat=d.concatenate
    )
    if d.concatenate:
        blocks = BlockDataset(dataset, cfg.seq_length, drop_last=False)
        pieces = [piece for b in range(len(blocks)) for piece in blocks[b]]
    else:
        pieces = [dataset[i] for i in range(len(dataset))]
    model.eval()
    total, tokens = 0.0, 0
    for ids, targets in pieces:
        labels = torch.where(targets, ids, IGNORE_INDEX)[1:]
        logits = model(input_ids=ids[None]).logits[0, :-1].float()
        total += float(torch.nn.functional.cross_entropy(logits, labels, reduction="sum"))
        tokens += int((labels != IGNORE_INDEX).sum())
    return total / tokens, tokens


def hub_state_dict(model) -> dict[str, torch.Tensor]:
    """The model's weights under the hub's keys, as `save_pretrained` writes them (experts one key each, fused where
    the family's hub keeps them so; the tied head under its own name too, as our reader returns it)."""
    import tempfile

    from safetensors.torch import load_file

    from checkpoint.expert_layouts import fuse_per_expert
    from tools.tiny_models import hub_named

    state = {}
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        hub_named(tmp, model.config)  # (a key transformers' save names otherwise: Kimi Linear's dense MLP)
        for name in sorted(os.listdir(tmp)):
            if name.endswith(".safetensors"):
                state.update(load_file(os.path.join(tmp, name)))
    if model.config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return fuse_per_expert(state, model.config)


def hf_sequence_logps(model, sequences, positions: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-prob of each sequence's completion tokens, their count) with the HF model, right-padded rows
    in one batch, with autograd (the single-process reference trains through it). `positions`: only the tokens
    predicted at those positions (one context-parallel rank's share of the row)."""
    width = max(len(ids) for ids, _ in sequences)
    ids = torch.stack([torch.nn.functional.pad(i, (0, width - len(i))) for i, _ in sequences])
    targets = torch.stack([torch.nn.functional.pad(t, (0, width - len(t))) for _, t in sequences])
    logits = model(input_ids=ids).logits[:, :-1].float()
    per_token = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    mask = torch.zeros_like(targets[:, 1:])
    mask[:, positions] = targets[:, 1:][:, positions]
    return (per_token * mask).sum(-1), mask.sum(-1)


def dpo_step_loss(settings, model, reference, sequences, n: int, positions: slice = slice(None)) -> tuple:
    """TRL's loss over the step's pairs (chosen rows first, then the rejected) plus the sft term: (loss, chosen
    rewards, rejected rewards, completion tokens per sequence)."""
    from models.preference import preference_losses, sft_loss

    logps, tokens = hf_sequence_logps(model, sequences, positions)
    with torch.no_grad():
        ref, _ = hf_sequence_logps(reference.eval(), sequences, positions)
    per_pair, chosen, rejected = preference_losses(
        settings, logps[:n], logps[n:], tokens[:n], tokens[n:], ref[:n], ref[n:]
    )
    return per_pair.mean() + settings.sft_weight * sft_loss(logps[:n], tokens[:n]), chosen, rejected, tokens


@torch.no_grad()
def without_context_sum(settings, model, reference, sequences, n: int, split: int) -> tuple[float, int]:
    """The negative control of DPO under context parallelism: the loss if each of 2 CP ranks scored only its own
    positions (no sum of the log-probs over the ranks), averaged over them; and how many sequences have completion
    tokens on both sides of `split` (with none, the sum changes nothing and the control proves nothing)."""
    with torch.random.fork_rng():  # no draw of the reference's training is consumed
        halves = [
            dpo_step_loss(settings, model, reference, sequences, n, p) for p in (slice(split), slice(split, None))
        ]
    crossing = int(((halves[0][3] > 0) & (halves[1][3] > 0)).sum())
    return float(sum(h[0] for h in halves) / 2), crossing


def train_dpo_reference(policy_dir: str, reference_dir: str, cfg: TrainConfig, dp: int, cp_split: int = 0) -> tuple:
    """The single-process reference: the HF policy (with `cfg.lora`: PEFT adapters seeded as the pipeline seeds
    them) trained on the same global batches of pairs with TRL's loss (our `preference_losses`, equal to TRL's in
    tests/test_preference.py) over every pair of the step, plus `sft_weight` x the step's chosen tokens' mean NLL;
    the reference's log-probs from the HF reference model. Returns (model, losses, grad norms, reward margins,
    and with `cp_split` the second step's `without_context_sum`)."""
    from transformers import AutoConfig, AutoTokenizer

    from data.pair_dataset import PairDataset
    from data.sampling import TrainPlan
    from models.lora import add_lora
    from models.preference import PreferenceSettings
    from training.engine import make_optimizer

    torch.manual_seed(0)
    attn = resolve_attention(AutoConfig.from_pretrained(policy_dir), None)  # SDPA, or eager (gpt-oss's sinks)
    model = hf_model(policy_dir, dtype=torch.float32, attn_implementation=attn).train()
    reference = hf_model(reference_dir, dtype=torch.float32, attn_implementation=attn)
    if cfg.lora.enabled:
        lo = cfg.lora
        add_lora(model, lo.r, lo.alpha, lo.dropout, lo.target_modules, cfg.seed)
    d = cfg.data
    pairs = PairDataset(
        cfg.train_file, AutoTokenizer.from_pretrained(policy_dir), cfg.seq_length, d, d.train_weights, cfg.seed
    )
    plan = TrainPlan(len(pairs), dp, cfg.micro_batch_size, cfg.gradient_accumulation_steps)
    optimizer, scheduler = make_optimizer(cfg, model.named_parameters(), plan.total_steps(cfg.max_steps, 1))
    settings = PreferenceSettings.of(cfg.dpo)
    losses, norms, margins, control = [], [], [], None
    for step in range(cfg.max_steps):
        epoch, skip = plan.position(step)
        batch = [
            pairs[int(i)] for r in range(dp) for i in plan.epoch_indices(epoch, r, cfg.seed, skip)[: plan.rows_per_step]
        ]
        sequences = [(p[0], p[1]) for p in batch] + [(p[2], p[3]) for p in batch]
        if step == 1 and cp_split:  # the second step: at the first, a policy that is its reference scores ln 2 anyway
            control = without_context_sum(settings, model, reference, sequences, len(batch), cp_split)
        loss, chosen, rejected, _ = dpo_step_loss(settings, model, reference, sequences, len(batch))
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.max_grad_norm)))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        margins.append(float((chosen - rejected).mean()))
    return model, losses, norms, margins, control
