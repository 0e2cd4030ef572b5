"""DeepSeek-V4 (`deepseek_v4`: V4-Flash, V4-Pro): every layer's residual is `hc_mult` streams (manifold-constrained
hyper-connections: hidden [B, S, N, H] from the embedding, which repeats each token's vector N times, to the head,
where transformers' `DeepseekV4HyperHead` mixes them into one before the final norm; each layer's `attn_hc` and
`ffn_hc` collapse the streams into the sublayer's input and spread its output back). Attention is shared-KV
multi-query attention (one K=V head) over a sliding window, with per-head sinks, partial interleaved RoPE ("main"
and "compress" tables by layer kind), a grouped low-rank output projection, and in "compressed_sparse_attention"
layers a compressor of every `compress_rates` positions (with its lightning indexer choosing `index_topk` entries
a query), in "heavily_compressed_attention" layers a coarser one without indexer. Every layer's MLP is sparse:
routed experts with the SwiGLU clamp (`swiglu_limit`), one shared expert, the `sqrtsoftplus` router with its score
bias, and in "hash_moe" layers (`mlp_layer_types`) a router whose experts are a fixed table of the token id
(`tid2eid`): the tokens are carried from the embedding to those layers (models/carry.py, wherever the cut falls).
The indexer chooses entries (integers): no gradient reaches it, in transformers' model either, so it stays as loaded
(frozen), as V3.2's does.

Its hub keys are DeepSeek's names (`attn.wq_a`, `ffn.experts.N.w1`, `hc_attn_fn`, `head.weight`), which transformers
renames at load and back at save (its conversion mapping): the key table holds the names as transformers saves them
(`hub_renames`), and conversion also reads DeepSeek's own release layout (no `model.` prefix, `embed.weight`,
`hc_head_fn`). The multi-token-prediction layers (`mtp.*`, which transformers skips) are carried. transformers runs
the family in eager attention only; the compressors pool every `compress_rates` positions of the row whatever
document they belong to, so packed rows and context parallelism are refused."""

from models.families import Family, MoeSpec, register

DEEPSEEK_V4_MOE = MoeSpec(
    "ffn",
    ("w1", "w3", "w2"),
    "n_routed_experts",
    "moe_intermediate_size",
    every_layer=True,
    router_choice=True,
    score_bias=True,  # its top-k routers' (the hash routers' choice is their table)
    shared_expert=True,
    shared_gate=False,
    aux_loss=False,  # (transformers' own counts its top-k routers' softmax choice: `output_router_logits` refused)
)

register(
    Family(
        "deepseek_v4",
        "DeepseekV4",
        moe=DEEPSEEK_V4_MOE,
        streams="hc_mult",
        hub_renames=True,
        carries=("routing_tokens",),
        # Its lightning indexer's output is the entries it chooses: no gradient reaches it in transformers either.
        frozen=("self_attn.compressor.indexer",),
        flash_refused="its head_dim of 512 is beyond flash-attn's 256, and its per-head sinks",
        cp_refused="compressors pool every compress_rates positions of the whole row and its indexer scores them all, "
        "while a context-parallel rank holds its own positions only",
        packing_refused="its compressors pool every compress_rates positions of the row across document boundaries",
        refused_fields={
            "output_router_logits": "transformers' load-balancing loss for it counts the softmax top-k of its top-k "
            "routers only, not the experts its routers choose (score bias, hash table) that the pipeline's router "
            "statistics count; leave it off, as the released configs do",
        },
        # transformers' plan: the attention (one K=V head) whole on every TP rank, the experts split
        replicated_attention=True,
        tp_entry_norms=("post_attention_layernorm",),
        # 6 layers: each attention kind (sliding window, compressed sparse with its indexer, heavily compressed) and
        # each router (hash, top-k) on both stages at PP=2 (hash layers 0, 1 and 3: the tokens cross the cut);
        # 3 streams, windows of 8 positions, a compressed entry every 4 (CSA) or 8 (HCA) positions, 2 chosen a query.
        tiny=dict(
            num_hidden_layers=6,
            num_key_value_heads=1,
            head_dim=32,
            partial_rotary_factor=0.25,
            q_lora_rank=24,
            intermediate_size=32,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            o_groups=2,
            o_lora_rank=16,
            index_n_heads=4,
            index_head_dim=16,
            index_topk=2,
            sliding_window=8,
            hc_mult=3,
            hc_sinkhorn_iters=4,
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
            layer_types=[
                "sliding_attention",
                "compressed_sparse_attention",
                "heavily_compressed_attention",
                "sliding_attention",
                "compressed_sparse_attention",
                "heavily_compressed_attention",
            ],
            mlp_layer_types=["hash_moe", "hash_moe", "moe", "hash_moe", "moe", "moe"],
            num_nextn_predict_layers=0,
        ),
    )
)
