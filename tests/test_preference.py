"""Preference tuning against TRL: pair tokenization and the losses and reward metrics of DPO (sigmoid), IPO and
SimPO, on the same pairs and models (a reference that differs from the policy)."""

from __future__ import annotations

import os

import pytest
import torch

from data.errors import DataError
from data.pairs import encode_pair, pair_sequences
from models.preference import REWARD_METRICS, PreferenceSettings, preference_losses, reward_sums, sft_loss
from tests.conftest import spawn_ranks
from tests.test_data import CHATML
from tools.tiny_models import tiny_config

STRING_PAIRS = [
    {"prompt": "12+30=", "chosen": "42", "rejected": "43"},
    {"prompt": "the quick brown fox", "chosen": " jumps over the lazy dog", "rejected": " sleeps"},
    {"prompt": "pipeline parallel", "chosen": " training of language models", "rejected": " parking"},
]
CHAT_PAIRS = [
    {
        "prompt": [{"role": "user", "content": "12+30="}],
        "chosen": [{"role": "assistant", "content": "42"}],
        "rejected": [{"role": "assistant", "content": "43 or so"}],
    },
    {
        "prompt": [{"role": "user", "content": "the quick brown fox"}],
        "chosen": [{"role": "assistant", "content": "jumps over the lazy dog"}],
        "rejected": [{"role": "assistant", "content": "sleeps"}],
    },
]
# No prompt: the turns both conversations share are the prompt (TRL's extract_prompt).
IMPLICIT_PROMPT_PAIRS = [
    {
        "chosen": [{"role": "user", "content": "the quick brown fox"}, {"role": "assistant", "content": "jumps"}],
        "rejected": [{"role": "user", "content": "the quick brown fox"}, {"role": "assistant", "content": "sleeps"}],
    },
    {
        "chosen": [{"role": "user", "content": "12+30="}, {"role": "assistant", "content": "42"}],
        "rejected": [{"role": "user", "content": "12+30="}, {"role": "assistant", "content": "24"}],
    },
]
# HuggingFaceH4/ultrafeedback_binarized: a string prompt beside whole conversations (the prompt column is not used,
# TRL's maybe_extract_prompt takes the shared turns).
H4_PAIRS = [
    {
        "prompt": "12+30=",
        "chosen": [{"role": "user", "content": "12+30="}, {"role": "assistant", "content": "42"}],
        "rejected": [{"role": "user", "content": "12+30="}, {"role": "assistant", "content": "43 or so"}],
    },
    {
        "prompt": "the quick brown fox",
        "chosen": [{"role": "user", "content": "the quick brown fox"}, {"role": "assistant", "content": "jumps"}],
        "rejected": [{"role": "user", "content": "the quick brown fox"}, {"role": "assistant", "content": "sleeps"}],
    },
]
PAIRS = {
    "strings": STRING_PAIRS,
    "chat": CHAT_PAIRS,
    "chat-implicit-prompt": IMPLICIT_PROMPT_PAIRS,
    "ultrafeedback-h4": H4_PAIRS,
}


def tiny_pair_models(tok):
    """(policy, reference): two differently initialised tiny LLaMAs over the tokenizer's vocabulary."""
    from transformers import LlamaForCausalLM

    config = tiny_config(
        vocab_size=len(tok),
        num_hidden_layers=2,
        pad_token_id=None,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
    )
    config._attn_implementation = "sdpa"
    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        models.append(LlamaForCausalLM(config).eval())
    return models


def completion_logps(model, sequences) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-prob of each sequence's target tokens, their count), sequences right-padded into one batch."""
    width = max(len(ids) for ids, _ in sequences)
    ids = torch.tensor([i + [0] * (width - len(i)) for i, _ in sequences])
    targets = torch.tensor([t + [False] * (width - len(t)) for _, t in sequences])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1].float()
    per_token = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    mask = targets[:, 1:]
    return (per_token * mask).sum(-1), mask.sum(-1)


def our_evaluation(policy, reference, tok, pairs, settings: PreferenceSettings, seq_length: int = 64) -> dict:
    """Our tokenization and losses on the HF models: TRL's metric names, means over the pairs."""
    chosen, rejected = [], []
    for row in pairs:
        sequences = pair_sequences(*encode_pair(row, tok), seq_length)
        if sequences is None:  # the prompt fills seq_length: left out, as TRL leaves it out
            continue
        chosen.append(sequences[0])
        rejected.append(sequences[1])
    logps, tokens = completion_logps(policy, chosen + rejected)
    ref, _ = completion_logps(reference, chosen + rejected)
    n = len(chosen)
    losses, chosen_rewards, rejected_rewards = preference_losses(
        settings, logps[:n], logps[n:], tokens[:n], tokens[n:], ref[:n], ref[n:]
    )
    sums = reward_sums(chosen_rewards, rejected_rewards) / n
    loss = losses.mean() + settings.sft_weight * sft_loss(logps[:n], tokens[:n])
    return {
        "loss": float(loss),
        "pairs": n,
        **{k: float(v) for k, v in zip(REWARD_METRICS, sums, strict=True)},
    }


def trl_evaluation(policy, reference, tok, pairs, settings: PreferenceSettings, tmp_path, max_length: int = 64) -> dict:
    """TRL's DPOTrainer.evaluate() over every pair in one batch (`sft_weight`: TRL's "sft" loss added with it)."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer
    from trl.data_utils import maybe_extract_prompt

    sft = {"loss_type": [settings.loss_type, "sft"], "loss_weights": [1.0, settings.sft_weight]}
    losses = sft if settings.sft_weight else {"loss_type": [settings.loss_type]}
    args = DPOConfig(
        output_dir=str(tmp_path / "trl"),
        per_device_eval_batch_size=len(pairs),
        beta=settings.beta,
        report_to="none",
        **losses,
        use_cpu=True,
        max_length=max_length,
        dataloader_num_workers=0,
        bf16=False,
    )
    # TRL's own reading of a pair row (its DPOTrainer takes a prompt column as it is: HuggingFaceH4's layout needs
    # maybe_extract_prompt first, as its docs say).
    data = Dataset.from_list([maybe_extract_prompt(dict(p)) for p in pairs])
    trainer = DPOTrainer(
        model=policy, ref_model=reference, args=args, train_dataset=data, eval_dataset=data, processing_class=tok
    )
    out = trainer.evaluate()
    return {
        "loss": out["eval_loss"],
        "pairs": len(trainer.eval_dataset),
        **{k: out[f"eval_{k}"] for k in REWARD_METRICS},
    }


@pytest.mark.parametrize("kind", ["sentencepiece", "bpe"])
@pytest.mark.parametrize("rows", list(PAIRS))
def test_pair_tokens_losses_and_rewards_equal_trl_dpo(rows, kind, chat_tokenizers, tmp_path):
    """Our pair tokenization and the sigmoid (alone and with the chosen NLL, TRL's "sft" term) and IPO losses on two
    tiny models against `DPOTrainer.evaluate()` over the same pairs in one batch: the same pairs kept (the
    sentencepiece chat prompts fill seq_length in both), loss within 1e-5 relative, reward accuracy exactly, the
    other reward means 1e-4."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_tokenizers[kind])
    tok.chat_template = CHATML
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    policy, reference = tiny_pair_models(tok)
    for settings in (
        PreferenceSettings("sigmoid", beta=0.1),
        PreferenceSettings("ipo", beta=0.1),
        PreferenceSettings("sigmoid", beta=0.2, sft_weight=0.5),
    ):
        ours = our_evaluation(policy, reference, tok, PAIRS[rows], settings)
        theirs = trl_evaluation(policy, reference, tok, PAIRS[rows], settings, tmp_path)
        print(f"{rows}/{kind}/{settings}: ours {ours}, TRL {theirs}")
        assert ours["pairs"] == theirs["pairs"] >= 1
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
        assert ours["rewards/accuracies"] == theirs["rewards/accuracies"]
        for key in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), key


def test_simpo_equals_trl_cpo_simpo_loss():
    """SimPO (reference-free, length-normalised, margin gamma): losses and rewards equal TRL's CPOTrainer.cpo_loss
    (trl.experimental.cpo, loss_type="simpo", cpo_alpha=0) on the same length-averaged log-probs."""
    from types import SimpleNamespace

    from trl.experimental.cpo import CPOTrainer

    torch.manual_seed(0)
    chosen, rejected = -torch.rand(6) * 40, -torch.rand(6) * 40
    chosen_tokens, rejected_tokens = torch.randint(1, 20, (6,)), torch.randint(1, 20, (6,))
    settings = PreferenceSettings("simpo", beta=2.0, gamma=0.7)
    losses, chosen_rewards, rejected_rewards = preference_losses(
        settings, chosen, rejected, chosen_tokens, rejected_tokens
    )
    trl_self = SimpleNamespace(
        alpha=0.0,
        loss_type="simpo",
        simpo_gamma=0.7,
        beta=2.0,
        label_smoothing=0.0,
        accelerator=SimpleNamespace(device="cpu"),
    )
    ref = CPOTrainer.cpo_loss(trl_self, chosen / chosen_tokens, rejected / rejected_tokens)
    for ours, theirs in zip((losses, chosen_rewards, rejected_rewards), ref, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)


def pair_batch(policy, reference, tok, pairs, seq_length: int = 64):
    """What the last stage sees for `pairs` in one micro-batch: logits [2P, S, V] of the policy (a leaf that takes
    a gradient), shifted labels (targets: completion tokens), and the reference's summed log-probs [2P]."""
    sequences = [pair_sequences(*encode_pair(row, tok), seq_length) for row in pairs]
    ordered = [s[0] for s in sequences if s] + [s[1] for s in sequences if s]
    ids = torch.tensor([i + [0] * (seq_length - len(i)) for i, _ in ordered])
    targets = torch.tensor([t + [False] * (seq_length - len(t)) for _, t in ordered])
    labels = torch.roll(ids, -1, 1).masked_fill(~torch.roll(targets, -1, 1), -100)
    labels[:, -1] = -100
    with torch.no_grad():
        logits = policy(input_ids=ids).logits
    ref, _ = completion_logps(reference, ordered)
    return logits.requires_grad_(), labels, ref


@pytest.mark.parametrize("kind", ["sentencepiece", "bpe"])
def test_pipeline_preference_loss_equals_trl_whole_and_in_chunks(kind, chat_tokenizers, tmp_path):
    """The last stage's PreferenceLoss on one micro-batch of every pair (pair scale 1/P, token scale 1 / chosen
    tokens): loss and metrics equal TRL's evaluation; computing the per-token log-probs 7 tokens at a time gives the
    same loss and the same gradient with respect to the logits; the vocab-parallel per-token cross-entropy (one rank,
    vocabulary padded to a multiple of 64) the same again; chunks without a gradient (evaluation) the same loss."""
    import functools

    import torch.distributed as dist
    from transformers import AutoTokenizer

    from models.preference import PreferenceLoss
    from models.tensor_parallel import TensorParallel
    from models.vocab_parallel_loss import vocab_parallel_token_cross_entropy

    tok = AutoTokenizer.from_pretrained(chat_tokenizers[kind])
    tok.pad_token = tok.pad_token or tok.eos_token
    policy, reference = tiny_pair_models(tok)
    settings = PreferenceSettings("sigmoid", beta=0.2, sft_weight=0.5)
    theirs = trl_evaluation(policy, reference, tok, STRING_PAIRS, settings, tmp_path)
    logits, labels, ref = pair_batch(policy, reference, tok, STRING_PAIRS)
    p = labels.shape[0] // 2
    scales = torch.tensor(1.0 / p), torch.tensor(1.0 / int((labels[:p] != -100).sum()))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        tp = TensorParallel(1, 0, vocab_multiple=64, group=dist.new_group([0]))
        padded = torch.nn.functional.pad(logits.detach(), (0, 64 - logits.shape[-1] % 64))  # padded vocabulary
        vocab_ce = functools.partial(vocab_parallel_token_cross_entropy, tp=tp, vocab_size=logits.shape[-1])
        grads = {}
        for name, loss_fn, x in [
            ("whole", PreferenceLoss(settings), logits),
            ("chunks of 7", PreferenceLoss(settings, chunk=7), logits),
            ("vocab-parallel chunks", PreferenceLoss(settings, vocab_ce, chunk=7), padded.requires_grad_()),
        ]:
            x.grad = None
            loss = loss_fn(x, (labels, ref, *scales))
            loss.backward()
            grads[name] = x.grad[..., : logits.shape[-1]].clone()
            got = loss_fn.totals()
            assert float(loss.detach()) == pytest.approx(theirs["loss"], rel=1e-5), name
            assert got["pairs"] == theirs["pairs"]  # and the same pairs ranked right (TRL's mean is fp32):
            assert round(got["rewards/accuracies"] * p) == round(theirs["rewards/accuracies"] * p)
            for key in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
                assert got[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), (name, key)
    finally:
        dist.destroy_process_group()
    for name in ("chunks of 7", "vocab-parallel chunks"):
        torch.testing.assert_close(grads[name], grads["whole"], rtol=1e-5, atol=1e-7, msg=name)
    with torch.no_grad():  # evaluation and the reference pass: chunks without a backward
        loss = PreferenceLoss(settings, chunk=7)(logits.detach(), (labels, ref, *scales))
    assert float(loss) == pytest.approx(theirs["loss"], rel=1e-5)


def test_pair_store_collator_and_loss_equal_trl(chat_tokenizers, tmp_path):
    """Pairs from a JSONL file through the tokenized store (built once, then opened from the cache), the pair
    collator and PreferenceLoss: the same sequences as data/pairs.py, a pair whose prompt fills seq_length counted
    in the report and scoring nothing, and the loss and metrics of TRL's evaluation of the other pairs. A pair
    without 'rejected' is refused naming its file and line."""
    import json

    from transformers import AutoTokenizer

    from data.errors import DataError
    from data.pair_dataset import PairCollator, PairDataset
    from models.preference import PreferenceLoss
    from schema.data import DataConfig

    tok = AutoTokenizer.from_pretrained(chat_tokenizers["bpe"])
    tok.pad_token = tok.pad_token or tok.eos_token
    long_prompt = {"prompt": "the quick brown fox " * 20, "chosen": " jumps", "rejected": " sleeps"}
    rows = STRING_PAIRS[:2] + [long_prompt] + STRING_PAIRS[2:]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cache = str(tmp_path / "cache")
    ds = PairDataset(str(path), tok, 64, DataConfig(), cache_dir=cache)
    again = PairDataset(str(path), tok, 64, DataConfig(), cache_dir=cache)
    assert not ds.from_cache and again.from_cache and again.fingerprint() == ds.fingerprint()
    assert len(ds) == 4 and ds.has_targets().tolist() == [True, True, False, True]
    report = ds.report()
    assert report["pairs"] == 4 and report["pairs_without_targets"] == 1 and report["truncated_pairs"] == 1
    for i, row in enumerate(rows):
        expected = pair_sequences(*encode_pair(row, tok), 64)
        c_ids, c_tg, r_ids, r_tg, ref = ds[i]
        assert torch.equal(ref, torch.zeros(2))  # no reference pass has run
        if expected is None:  # the prompt fills seq_length: no completion token in either sequence
            assert not c_tg.any() and not r_tg.any() and len(c_ids) == 64
            continue
        assert (c_ids.tolist(), c_tg.tolist()) == expected[0] and (r_ids.tolist(), r_tg.tolist()) == expected[1]

    policy, reference = tiny_pair_models(tok)
    (ids, _), (labels, _), _ = PairCollator(64, tok.pad_token_id)([ds[i] for i in range(len(ds))])
    p = len(ds)
    assert ids.shape == (2 * p, 64) and torch.equal(labels[2], torch.full((64,), -100))  # the no-target pair
    with torch.no_grad():
        logits = policy(input_ids=ids).logits
        ref_logits = reference(input_ids=ids).logits
    ref = -torch.nn.functional.cross_entropy(ref_logits.transpose(1, 2), labels, reduction="none").sum(-1)
    settings = PreferenceSettings("sigmoid", beta=0.1)
    loss_fn = PreferenceLoss(settings)
    kept = int(ds.has_targets().sum())
    loss = loss_fn(logits, (labels, ref, torch.tensor(1.0 / kept), torch.tensor(0.0))).detach()
    theirs = trl_evaluation(policy, reference, tok, rows, settings, tmp_path)  # TRL drops the long prompt itself
    assert loss_fn.totals()["pairs"] == theirs["pairs"] == kept
    assert float(loss) == pytest.approx(theirs["loss"], rel=1e-5)

    path.write_text(json.dumps(STRING_PAIRS[0]) + "\n" + json.dumps({"prompt": "a", "chosen": "b"}) + "\n")
    with pytest.raises(DataError, match=r"pairs\.jsonl:2: preference rows need 'chosen' and 'rejected'"):
        PairDataset(str(path), tok, 64, DataConfig(), cache_dir=cache)


@pytest.mark.parametrize("kind", ["sentencepiece", "bpe"])
def test_batched_pair_encoding_equals_one_pair_at_a_time(kind, chat_tokenizers):
    """`encode_pairs` tokenizes the string pairs of a chunk in one batched call, conversations one by one: the
    sequences equal `encode_pair`'s on each row, in order, string and conversational rows mixed."""
    from transformers import AutoTokenizer

    from data.pairs import encode_pairs

    tok = AutoTokenizer.from_pretrained(chat_tokenizers[kind])
    tok.chat_template = CHATML
    rows = [
        r
        for trio in zip(
            STRING_PAIRS, CHAT_PAIRS + [STRING_PAIRS[0]], IMPLICIT_PROMPT_PAIRS + [CHAT_PAIRS[0]], strict=True
        )
        for r in trio
    ]
    got = encode_pairs([(f"f:{i}", r) for i, r in enumerate(rows)], tok)
    expected = []
    for row in rows:
        prompt, chosen, rejected = encode_pair(row, tok)
        expected += [(prompt + c, [False] * len(prompt) + [True] * len(c)) for c in (chosen, rejected)]
    assert got == expected and len(got) == 2 * len(rows)


def test_pair_mixture_reads_reference_log_probs_by_store_pair(chat_tokenizers, tmp_path):
    """A weighted mixture repeats and leaves out pairs; the reference log-probs are kept in the stores' own order
    (what the reference pass scores, whatever the seed and weights), and each item reads its own pair's."""
    import json

    import numpy as np
    from transformers import AutoTokenizer

    from data.pair_dataset import PairDataset
    from schema.data import DataConfig

    tok = AutoTokenizer.from_pretrained(chat_tokenizers["bpe"])
    files = []
    for name, rows in (("a", STRING_PAIRS), ("b", STRING_PAIRS[::-1] + STRING_PAIRS[:1])):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        files.append(str(tmp_path / f"{name}.jsonl"))
    mixed = PairDataset(files, tok, 64, DataConfig(), weights=[3.0, 1.0], seed=3, cache_dir=str(tmp_path / "c"))
    stores = mixed.store_order()
    assert stores.store_pairs == len(stores) == 7 and len(mixed) == 7 and stores.index is None
    assert sorted({mixed.pair_id(i) for i in range(len(mixed))}) != list(range(7))  # repeats, and some left out
    mixed.reference = np.arange(14, dtype=np.float32).reshape(7, 2)
    for i in range(len(mixed)):
        pair = mixed.pair_id(i)
        *sequences, ref = mixed[i]
        assert ref.tolist() == [2.0 * pair, 2.0 * pair + 1]
        assert all(torch.equal(a, b) for a, b in zip(sequences, stores[pair][:4], strict=True))


def _collect_worker(rank: int, store: str, out: str) -> None:
    import numpy as np
    import torch.distributed as dist

    from training.reference_logps import _collect

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        # Rank r scored pairs r, r + 2, ... in micro-batches of 2 (the last padded with -1); values 10 * pair + side.
        ids = torch.tensor(list(range(rank, 9, 2)) + [-1] * (rank == 0))
        scored = []
        for batch in ids.split(2):
            chosen, rejected = 10.0 * batch + 1, 10.0 * batch + 2
            scored.append((batch, torch.cat([chosen, rejected]).float()))
        got = _collect(scored, 9, rank, chunk=4)  # three reduces: 4 + 4 + 1 pairs
        if rank == 0:
            np.save(out, got)
        else:
            assert got is None
    finally:
        dist.destroy_process_group()
    # NOTE: exit at once: gloo's threads can abort the interpreter's teardown ("terminate called without an
    # active exception", SIGABRT) after the work is done and saved.
    os._exit(0)


def test_reference_scores_reach_rank_0_in_chunks(tmp_path):
    """The reference pass's gather: two scoring ranks' (pair ids, log-probs) micro-batches, padding pairs among
    them, reduced to rank 0 a chunk at a time, land at their pairs exactly."""
    import numpy as np

    out = spawn_ranks(_collect_worker, tmp_path, suffix="npy", timeout=120)[0]  # rank 0 saves the scores
    pairs = np.arange(9, dtype=np.float32)
    assert np.array_equal(np.load(out), np.stack([10 * pairs + 1, 10 * pairs + 2], axis=1))


def test_data_prepare_builds_the_pair_stores_the_trainer_reads(chat_tokenizers, tmp_path, capsys):
    """`python -m data.prepare objective=dpo train_file=pairs.jsonl` prepares pairs (it used to read them as SFT rows
    and fail on 'response'): the store it builds is the one the trainer's `open_dataset` then finds, unbuilt."""
    import json

    from data.open_dataset import open_dataset
    from schema.compose import compose_config
    from training.prepare import main

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(p) + "\n" for p in STRING_PAIRS))
    tok_dir = chat_tokenizers["bpe"]
    args = [f"model_name_or_path={tok_dir}", "objective=dpo", f"train_file={pairs}", f"output_dir={tmp_path / 'run'}"]
    assert main([*args, "seq_length=32"]) == 0
    assert f"{pairs}: 3 pairs" in capsys.readouterr().out
    cfg = compose_config([*args, "seq_length=32"])
    from transformers import AutoTokenizer

    ds = open_dataset(
        cfg,
        str(pairs),
        AutoTokenizer.from_pretrained(tok_dir),
        train=True,
        cache_dir=str(tmp_path / "run" / "data_cache"),
        build=False,
    )
    assert ds.from_cache and len(ds) == 3 and ds.report()["pairs"] == 3


def test_hub_pair_layouts_and_column_names_give_our_own_layouts_tokens(chat_tokenizers):
    """trl-lib/ultrafeedback_binarized (message lists, the prompt inside), HuggingFaceH4/ultrafeedback_binarized
    (a string prompt beside whole conversations) and renamed columns (data.prompt_key, data.chosen_key,
    data.rejected_key): the same tokens and targets as the same pairs in our own layout (an explicit prompt)."""
    from transformers import AutoTokenizer

    from data.pairs import encode_pairs
    from schema.data import DataConfig

    tok = AutoTokenizer.from_pretrained(chat_tokenizers["bpe"])
    tok.chat_template = CHATML

    def ours(rows, cfg=None):
        return encode_pairs([(f"row {i}", r) for i, r in enumerate(rows)], tok, cfg)

    explicit = [
        {"prompt": [{"role": "user", "content": p}], "chosen": [c[1]], "rejected": [r[1]]}
        for p, c, r in ((row["prompt"], row["chosen"], row["rejected"]) for row in H4_PAIRS)
    ]
    trl_lib = [{"chosen": row["chosen"], "rejected": row["rejected"]} for row in H4_PAIRS]
    assert ours(H4_PAIRS) == ours(trl_lib) == ours(explicit)
    renamed = DataConfig(prompt_key="question", chosen_key="better", rejected_key="worse")
    for rows in (explicit, STRING_PAIRS, H4_PAIRS):
        moved = [{renamed.prompt_key: r.get("prompt"), "better": r["chosen"], "worse": r["rejected"]} for r in rows]
        assert ours(moved, renamed) == ours(rows)
    with pytest.raises(DataError, match="row 0: preference rows need 'better' and 'worse'"):
        ours(STRING_PAIRS, renamed)
