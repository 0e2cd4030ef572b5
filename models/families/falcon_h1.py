"""Falcon-H1 (`falcon_h1`: Falcon-H1-0.5B to 34B, Falcon-H1R): Mamba-2 and attention side by side in every layer
(`mamba` and `self_attn` read one norm's output, their outputs scaled and added), a SwiGLU MLP under `feed_forward`
(`pre_ff_layernorm` before it), the final norm `model.final_layernorm`; muP everywhere: embeddings times
`embedding_multiplier`, logits times `lm_head_multiplier` (generic rules), and inside transformers' layer the
attention's input and output, the keys, the SSM's output and the MLP's gate and down multipliers, and the
`mup_vector` that scales Mamba's projected gate, x, B, C and dt (transformers' model attaches it to every layer:
`Family.layer_buffers`). Every layer carries Mamba's state along the row: packed rows and context parallelism are
refused in one line. Tensor parallelism is refused until Mamba's split is built."""

from models.families import Family, register

MAMBA = "Mamba-2 mixer in every layer carries a state along the whole row"

register(
    Family(
        "falcon_h1",
        "FalconH1",
        qkv_bias="attention_bias",
        o_bias="attention_bias",
        mlp_bias="mlp_bias",
        norms=("input_layernorm", "pre_ff_layernorm"),
        tp_entry_norms=("input_layernorm", "pre_ff_layernorm"),
        mlp="feed_forward",
        final_norm="final_layernorm",
        embedding_multiplier="embedding_multiplier",
        logits_multiplier="lm_head_multiplier",
        layer_buffers={"mamba.mup_vector": "compute_mup_vector"},
        packing_refused=MAMBA,
        cp_refused=MAMBA,
        tp_refused="its Mamba-2 mixers' heads, convolution channels and norm groups are not in the split rules yet",
        # 8 Mamba heads of 16 over 2 groups, chunks of 8 (a 12-token row spans two), its gated norm on; multipliers
        # of Falcon-H1-1.5B's kind, none 1, so each one shows.
        tiny=dict(
            mamba_d_ssm=128,
            mamba_n_heads=8,
            mamba_d_head=16,
            mamba_n_groups=2,
            mamba_d_state=16,
            mamba_chunk_size=8,
            mamba_rms_norm=True,
            embedding_multiplier=5.6,
            lm_head_multiplier=0.039,
            attention_in_multiplier=1.5,
            attention_out_multiplier=0.9,
            key_multiplier=0.39,
            ssm_in_multiplier=1.25,
            ssm_out_multiplier=0.23,
            ssm_multipliers=[0.35, 0.25, 0.5, 0.3, 0.3],
            mlp_multipliers=[0.88, 0.78],
        ),
    )
)
