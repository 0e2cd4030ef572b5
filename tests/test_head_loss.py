"""The LM head fused with the loss over token tiles (models/loss.py `HeadOutput`, `tiled_summed_loss`,
`tiled_token_losses`) against the unfused path (the whole logits, then the loss): the loss and every gradient (the
hidden states', the head weight's), tied and untied heads, soft-capped logits, DPO's log-probs, evaluation."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from models.head import LMHeadPipe, softcap, split_stats, tied_lm_head_forward
from models.loss import IGNORE_INDEX, CausalLMLoss, HeadOutput, default_tile, grads_in_forward
from models.preference import PreferenceLoss, PreferenceSettings, ReferenceScorer

VOCAB, HIDDEN = 97, 16


def _config(cap=None, tied=False):
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_attention_heads=2,
        tie_word_embeddings=tied,
        final_logit_softcapping=cap,
        pad_token_id=0,
    )


def _head(config):
    """(the head's forward, its weight), tied (the embedding's weight) or not."""
    torch.manual_seed(0)
    if config.tie_word_embeddings:
        from models.layers import EmbeddingPipe

        embedding = EmbeddingPipe(config)
        return (lambda h: tied_lm_head_forward(embedding, h)), embedding.weight
    head = LMHeadPipe(config)
    return head, head.weight


def _rows(dtype, batch=3, seq=13):
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(batch, seq, HIDDEN, generator=g).to(dtype).requires_grad_()
    labels = torch.randint(0, VOCAB, (batch, seq), generator=g)
    labels[0, :5] = IGNORE_INDEX
    labels[-1, -3:] = IGNORE_INDEX
    return hidden, labels


def _grads(loss, hidden, weight):
    return torch.autograd.grad(loss, (hidden, weight))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("cap", [None, 5.0], ids=["plain", "softcapped"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [(3, 13), (1, 11)], ids=["grads-in-forward", "recomputed"])
def test_the_fused_head_and_loss_equal_the_unfused_ones(tied, cap, dtype, rows):
    """39 tokens (>= the hidden size): the gradients taken in forward; 11 tokens: each tile recomputed in backward."""
    config = _config(cap, tied)
    head, weight = _head(config)
    weight.data = weight.data.to(dtype)
    hidden, labels = _rows(dtype, *rows)
    assert grads_in_forward(labels.numel(), HIDDEN, True) == (rows == (3, 13))
    scale = torch.tensor(0.37)
    out = head(hidden)
    assert isinstance(out, HeadOutput) and out.vocab == VOCAB
    unfused = CausalLMLoss(fused=False)(out, (labels, scale))
    expected = _grads(unfused, hidden, weight)
    truth = expected
    if dtype == torch.bfloat16:  # against the fp32 gradients: the fused ones within bf16's rounding of them
        hidden32, weight32 = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
        logits32 = softcap(hidden32 @ weight32.T, cap)
        truth = _grads(CausalLMLoss(fused=False)(logits32, (labels, scale)), hidden32, weight32)
    for chunk in (0, 1, 5, 16, 1000):  # 0: the default tile (every token here)
        loss_fn = CausalLMLoss(chunk=chunk)
        fused = loss_fn(head(hidden), (labels, scale))
        torch.testing.assert_close(fused, unfused, rtol=1e-6, atol=1e-6)
        for got, want, true in zip(_grads(fused, hidden, weight), expected, truth, strict=True):
            assert got.dtype == want.dtype
            if dtype == torch.float32:
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
            else:  # no further from fp32 than the unfused bf16 gradient (plus one bf16 step of the largest)
                step = true.abs().max() / 128
                assert (got.float() - true).abs().max() <= (want.float() - true).abs().max() + step
        assert loss_fn.totals()[1] == int((labels != IGNORE_INDEX).sum())
        with torch.no_grad():  # evaluation: no gradient kept, the same loss
            torch.testing.assert_close(CausalLMLoss(chunk=chunk)(head(hidden), (labels, scale)), unfused)


def test_a_frozen_head_takes_no_gradient_and_a_frozen_input_none_either():
    """LoRA freezes the head: the fused loss then computes the hidden states' gradient alone; with neither
    trainable it runs as evaluation."""
    head, weight = _head(_config())
    weight.requires_grad_(False)
    hidden, labels = _rows(torch.float32)
    unfused = CausalLMLoss(fused=False)(head(hidden), (labels, torch.tensor(1.0)))
    fused = CausalLMLoss(chunk=4)(head(hidden), (labels, torch.tensor(1.0)))
    torch.testing.assert_close(torch.autograd.grad(fused, hidden)[0], torch.autograd.grad(unfused, hidden)[0])
    loss = CausalLMLoss(chunk=4)(head(hidden.detach()), (labels, torch.tensor(1.0)))
    assert not loss.requires_grad
    torch.testing.assert_close(loss, unfused.detach())


def test_split_stats_makes_the_logits_unless_asked_not_to():
    head, _ = _head(_config())
    hidden, _ = _rows(torch.float32)
    stats = torch.zeros(4)
    logits, got = split_stats((head(hidden), stats))
    torch.testing.assert_close(logits, hidden @ head.weight.T)
    assert got is stats
    assert isinstance(split_stats(head(hidden), lazy=True)[0], HeadOutput)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "simpo"])
def test_dpo_log_probs_fused_with_the_head_equal_the_unfused_ones(loss_type):
    """A pair loss needs every token's log-prob before its gradient is known: the tiles are recomputed in backward.
    The loss, the gradients and the reference pass's log-probs equal the unfused path's."""
    head, weight = _head(_config(cap=7.0))
    hidden, labels = _rows(torch.float32, batch=4, seq=9)
    ref = torch.tensor([-20.0, -25.0, -22.0, -30.0])
    extras = (labels, ref, torch.tensor(0.5), torch.tensor(0.1))
    settings = PreferenceSettings(loss_type=loss_type, sft_weight=0.3)
    unfused = PreferenceLoss(settings, fused=False)(head(hidden), extras)
    expected = _grads(unfused, hidden, weight)
    for chunk in (0, 4):
        fused = PreferenceLoss(settings, chunk=chunk)(head(hidden), extras)
        torch.testing.assert_close(fused, unfused, rtol=1e-6, atol=1e-6)
        for got, want in zip(_grads(fused, hidden, weight), expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    scorers = [ReferenceScorer(fused=False), ReferenceScorer(chunk=4)]
    for scorer in scorers:
        scorer(head(hidden), (labels, None, torch.arange(2)))
    torch.testing.assert_close(scorers[0].scored[0][1], scorers[1].scored[0][1])


def test_the_default_tile_holds_about_256_mib_of_fp32_logits():
    assert default_tile(49_152) == 1024 and default_tile(128_256) == 512 and default_tile(262_144) == 256
    assert default_tile(32_000) == 2048 and default_tile(10_000_000) == 128
