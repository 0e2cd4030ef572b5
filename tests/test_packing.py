"""Packed rows equal unpacked rows, token by token; the chunked loss equals the plain one; recompute is exact."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from data.collator import CausalLMCollator
from models.attention_masks import document_mask, flash_varlen_kwargs
from models.layers import DecoderOptions, decoder_layer_class
from models.loss import IGNORE_INDEX, CausalLMLoss, chunked_cross_entropy, summed_cross_entropy
from tools.tiny_models import tiny_config

LlamaDecoderPipe = decoder_layer_class("llama")  # the pipeline layer of a LLaMA decoder block


def rows(seed: int, lengths: list[int], vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(1, vocab, (n,), generator=g)
        targets = torch.rand(n, generator=g) > 0.3
        out.append((ids, targets))
    return out


def stack(config, options: DecoderOptions, state: dict) -> torch.nn.ModuleList:
    """Embedding, the decoder blocks and the LM head of an HF model, as pipeline decoder layers."""
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM(config)
    hf.load_state_dict(state)
    blocks = torch.nn.ModuleList(LlamaDecoderPipe(config, i, options) for i in range(config.num_hidden_layers))
    for i, block in enumerate(blocks):
        block.load_state_dict(hf.model.layers[i].state_dict())
    return hf, blocks


def per_token_losses(hf, blocks, input_ids, position_ids, labels) -> torch.Tensor:
    hidden = hf.model.embed_tokens(input_ids)
    for block in blocks:
        hidden, _ = block((hidden, position_ids))
    logits = hf.lm_head(hf.model.norm(hidden)).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none").view(
        labels.shape
    )


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_rows_give_the_losses_and_gradients_of_unpacked_rows(attn, monkeypatch):
    """Same rows, once packed (3 per row, position_ids restarting) and once one per row: every scored token's
    loss and every parameter's gradient agree (fp32), and padding never leaks into a row. SDPA attends each
    document alone (models/attention_masks.py `sdpa_by_document`): no [S, S] mask is built."""
    if attn == "sdpa":
        monkeypatch.setattr("models.layers.attention_mask", lambda *a, **k: pytest.fail("a dense mask was built"))
    torch.manual_seed(0)
    config = tiny_config(num_key_value_heads=2, attn_implementation=attn)
    config._attn_implementation = attn
    state = __import__("transformers").LlamaForCausalLM(config).state_dict()
    samples = rows(1, [5, 9, 3, 7, 4, 2], config.vocab_size)
    seq = 20

    packed_collate = CausalLMCollator(seq, pad_token_id=0, packing=True)
    (ids_p, pos_p), labels_p, tokens_p = packed_collate([samples[:3], samples[3:]])
    plain_collate = CausalLMCollator(seq, pad_token_id=0)
    (ids_u, pos_u), labels_u, tokens_u = plain_collate(samples)
    assert int(tokens_p) == int(tokens_u) == sum(len(ids) for ids, _ in samples)

    grads, losses = [], []
    for options, batch in (
        (DecoderOptions(packed=True), (ids_p, pos_p, labels_p)),
        (DecoderOptions(), (ids_u, pos_u, labels_u)),
    ):
        hf, blocks = stack(config, options, state)
        per_token = per_token_losses(hf, blocks, *batch)
        scored = per_token[batch[2] != IGNORE_INDEX]
        scored.sum().backward()
        losses.append(scored)
        params = list(hf.model.embed_tokens.parameters()) + list(blocks.parameters()) + list(hf.lm_head.parameters())
        grads.append([p.grad for p in params])
    # Tokens come in the same order both ways (rows laid end to end, in order).
    assert losses[0].shape == losses[1].shape and losses[0].numel() > 10
    if attn == "eager":  # the same masked products: bit-identical (fp32)
        assert torch.equal(losses[0], losses[1]), (losses[0] - losses[1]).abs().max()
    else:  # SDPA's causal kernel on each document's 2-9 tokens against a padded row of 20: fp32 rounding
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=1e-6)
    for packed, plain in zip(*grads, strict=True):
        torch.testing.assert_close(packed, plain, rtol=1e-4, atol=1e-6)


def test_document_mask_and_flash_arguments_follow_position_ids():
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0]])
    mask = document_mask(position_ids)[0, 0]
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [0, 0, 0, 1, 0, 0],
            [0, 0, 0, 1, 1, 0],
            [0, 0, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)
    kwargs = flash_varlen_kwargs(torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]]))
    assert kwargs["cu_seq_lens_q"].tolist() == [0, 3, 5, 6, 10, 12] and kwargs["max_length_q"] == 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_cross_entropy_equals_the_plain_loss(dtype):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 11, 50, generator=g).to(dtype).requires_grad_()
    labels = torch.randint(0, 50, (3, 11), generator=g)
    labels[0, :4] = IGNORE_INDEX
    plain = summed_cross_entropy(logits, labels)
    (plain_grad,) = torch.autograd.grad(plain * 0.7, logits)
    for chunk in (1, 4, 7, 33, 100):
        chunked = chunked_cross_entropy(logits, labels, chunk)
        (grad,) = torch.autograd.grad(chunked * 0.7, logits)
        torch.testing.assert_close(chunked, plain, rtol=1e-6, atol=1e-5)
        tol = dict(rtol=1e-6, atol=1e-7) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-3)
        torch.testing.assert_close(grad, plain_grad, **tol)
        with torch.no_grad():  # eval: no gradient kept
            torch.testing.assert_close(chunked_cross_entropy(logits, labels, chunk), plain, rtol=1e-6, atol=1e-5)
    loss = CausalLMLoss(chunk=4)
    loss(logits, (labels, torch.tensor(1.0)))
    assert loss.totals()[1] == int((labels != IGNORE_INDEX).sum())


def test_the_loss_reads_nothing_back_to_the_host(monkeypatch):
    """A training micro-batch's loss makes no device-to-host copy (on a GPU each one stalls the pipeline): the
    totals stay tensors until `totals()` reads them once, for evaluation."""
    g = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(2, 5, 11, generator=g), torch.randint(0, 11, (2, 5), generator=g)
    labels[0, :2] = IGNORE_INDEX
    expected = float(summed_cross_entropy(logits, labels))
    for chunk in (0, 3):
        loss = CausalLMLoss(chunk=chunk)
        with monkeypatch.context() as m:
            for name in ("item", "__float__", "__int__", "tolist"):
                m.setattr(torch.Tensor, name, lambda *_, n=name: pytest.fail(f"the loss read a value back ({n})"))
            for _ in range(2):
                loss(logits, (labels, torch.tensor(1.0)))
        total, tokens = loss.totals()
        assert tokens == 2 * 8 and total == pytest.approx(2 * expected, rel=1e-6)


def test_recomputed_block_equals_the_stored_one():
    """A decoder block recomputed in backward (activation_checkpointing) gives the same output and gradients."""
    torch.manual_seed(0)
    config = tiny_config()
    config._attn_implementation = "sdpa"
    plain = LlamaDecoderPipe(config, 0, DecoderOptions())
    recompute = LlamaDecoderPipe(config, 0, DecoderOptions(checkpoint_every=2))
    recompute.load_state_dict(plain.state_dict())
    assert recompute.recompute and not LlamaDecoderPipe(config, 1, DecoderOptions(checkpoint_every=2)).recompute
    hidden = torch.randn(2, 8, config.hidden_size)
    position_ids = torch.arange(8).expand(2, 8)
    outs = []
    for layer in (plain, recompute):
        x = hidden.clone().requires_grad_()
        out, _ = layer((x, position_ids))
        out.square().sum().backward()
        outs.append((out, x.grad, [p.grad for p in layer.parameters()]))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    for a, b in zip(outs[0][2], outs[1][2], strict=True):
        assert torch.equal(a, b)


def test_the_log_names_the_layers_that_take_a_dense_mask(caplog):
    """Packed rows: the decoder blocks whose window is shorter than the row take the [S, S] mask, and the log says
    which and why; the others attend each document alone."""
    import logging

    from training.engine import log_masked_layers

    config = tiny_config("mistral", sliding_window=6)
    config._attn_implementation = "sdpa"
    options = DecoderOptions(packed=True)
    blocks = torch.nn.ModuleList(decoder_layer_class("mistral")(config, i, options) for i in range(2))
    assert all(block.by_document for block in blocks)
    with caplog.at_level(logging.INFO, logger="training.engine"):
        log_masked_layers(blocks, 16)
        log_masked_layers(blocks, 6)  # the window covers the row: no mask
    assert [r.getMessage() for r in caplog.records] == [
        "packed rows: decoder blocks [0, 1] take a dense [S, S] mask (a sliding window)"
    ]
