"""ERNIE 4.5 dense (`ernie4_5`, Baidu): LLaMA's layer with every projection's bias (q/k/v/o and the MLP's) when
`use_bias`, and RoPE on interleaved pairs (transformers' own rotary and attention for it)."""

from models.families import Family, register

ERNIE = Family(
    "ernie4_5", "Ernie4_5", qkv_bias="use_bias", o_bias="use_bias", mlp_bias="use_bias", tiny=dict(head_dim=16)
)
register(ERNIE)
