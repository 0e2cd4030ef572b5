"""Tensor parallelism: the split/merge maths (any degree to any degree, bit-exact) and the vocab-parallel loss."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from models.layout import DECODER, EMBED, linear_modules, tp_split
from models.loss import IGNORE_INDEX
from models.sharding import COLUMN, REPLICA, ROW, VOCAB, merge, merged_shape, padded_vocab, shard


@pytest.mark.parametrize("rule", [COLUMN, ROW, VOCAB, REPLICA])
def test_split_then_merge_is_exact_between_any_degrees(rule):
    """Degrees that divide the (12) heads: 1, 2, 3, 4, 6; every pair, via the whole tensor, bit for bit."""
    vocab = 61  # not a multiple of any degree: the vocabulary is padded
    torch.manual_seed(0)
    whole = torch.randn(vocab if rule == VOCAB else 24, 36)
    for a, b in itertools.product([1, 2, 3, 4, 6], repeat=2):
        shards = [shard(whole, rule, r, a, vocab) for r in range(a)]
        assert merged_shape([s.shape for s in shards], rule, vocab) == tuple(whole.shape)
        resplit = [shard(merge(shards, rule, vocab), rule, r, b, vocab) for r in range(b)]
        assert torch.equal(merge(resplit, rule, vocab), whole), (rule, a, b)
        if rule == VOCAB:
            assert all(s.shape[0] == padded_vocab(vocab, b) // b for s in resplit)
            pad = padded_vocab(vocab, b) - vocab
            assert not resplit[-1][resplit[-1].shape[0] - pad :].any()  # the padding rows (the last shard's) are zero
        if rule == REPLICA:
            assert all(torch.equal(s, whole) for s in resplit)


def test_megatron_split_rules():
    expected = {"self_attn.q_proj": COLUMN, "self_attn.k_proj": COLUMN, "self_attn.v_proj": COLUMN,
                "self_attn.o_proj": ROW, "mlp.gate_proj": COLUMN, "mlp.up_proj": COLUMN,
                "mlp.down_proj": ROW}  # fmt: skip
    for module in linear_modules():
        rule = expected[module]
        assert tp_split(DECODER, f"{module}.weight") == rule
        assert tp_split(DECODER, f"{module}.bias") == (REPLICA if rule == ROW else COLUMN)  # row bias added once
        lora = (REPLICA, COLUMN) if rule == COLUMN else (ROW, REPLICA)  # (A, B) follow the layer they adapt
        a, b = (tp_split(DECODER, f"{module}.lora_{x}.default.weight") for x in "AB")
        assert (a, b) == lora
    assert tp_split(DECODER, "input_layernorm.weight") == REPLICA and tp_split(EMBED, "weight") == VOCAB
    assert padded_vocab(32000, 8) == 32000 and padded_vocab(32001, 8, 64) == 32064 and padded_vocab(50257, 3) == 50259


def test_vocab_parallel_cross_entropy_masks_padding_and_matches_torch(tmp_path):
    """One rank, vocabulary padded from 61 to 64: loss and gradient equal torch's on the 61 real columns."""
    import torch.distributed as dist

    from models.tensor_parallel import TensorParallel, vocab_parallel_cross_entropy

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        tp = TensorParallel(1, 0, vocab_multiple=64, group=dist.new_group([0]))
        torch.manual_seed(0)
        logits = torch.randn(2, 5, 64, requires_grad=True)
        labels = torch.randint(0, 61, (2, 5))
        labels[0, :2] = IGNORE_INDEX
        ours = vocab_parallel_cross_entropy(logits, labels, tp, vocab_size=61)
        ours.backward()
        ref_logits = logits.detach()[..., :61].clone().requires_grad_()
        flat = ref_logits.reshape(-1, 61)
        ref = F.cross_entropy(flat, labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
        ref.backward()
        torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(logits.grad[..., :61], ref_logits.grad, rtol=1e-6, atol=1e-7)
        assert not logits.grad[..., 61:].any()  # padded columns get no gradient
    finally:
        dist.destroy_process_group()
