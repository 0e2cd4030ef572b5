"""Llama 4 (`llama4_text`: Llama4ForCausalLM, and the text model of `llama4` Llama4ForConditionalGeneration
checkpoints, whose text weights sit under `language_model.`).

Its own attention: RoPE (interleaved pairs, complex `freqs_cis`) on most layers with chunked attention
(`attention_chunk_size`, "chunked_attention" in `layer_types`) and weightless L2 q/k norms after RoPE (no keys), NoPE
layers with full causal attention and attention temperature tuning. Sparse layers listed in `moe_layers`, their
experts fused on the hub as in memory (x @ W layout), each expert's input scaled by the sigmoid of its top-k router
logit, and a shared expert; the dense layers' MLP width is `intermediate_size_mlp`. transformers adds no
load-balancing loss, and does not run the family with flash-attn (chunked attention).
"""

from models.families import Container, Family, MoeSpec, register, register_container

register(
    Family(
        "llama4_text",
        "Llama4Text",
        qkv_bias="attention_bias",
        o_bias="attention_bias",  # its q/k norms are weightless (no keys)
        moe=MoeSpec(
            "feed_forward",
            ("gate_proj", "up_proj", "down_proj"),
            "num_local_experts",
            "intermediate_size",
            every_layer=False,
            shared_expert=True,
            shared_gate=False,
            block="feed_forward",
            router="router",
            router_logits=1,
            hub_fused=True,
            scaled_inputs=True,
            moe_layers=True,
            aux_loss=False,
        ),
        package="llama4",
        dense_size="intermediate_size_mlp",
        flash_refused="chunked attention needs a mask",
        # Experts and shared expert `intermediate_size` wide, dense layers `intermediate_size_mlp`; every 2nd layer
        # sparse, every 4th NoPE (full attention with temperature tuning), the others chunked.
        tiny=dict(
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=64,
            intermediate_size_mlp=128,
            interleave_moe_layer_step=2,
            attention_chunk_size=4,
            floor_scale=4,
            head_dim=16,
        ),
    )
)
register_container("llama4", Container("text_config", "language_model.", "Llama4ForCausalLM"))
