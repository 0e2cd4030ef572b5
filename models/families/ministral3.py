"""Ministral 3 (`ministral3`): Mistral's layer (no biases, `sliding_window` on every layer when set) whose queries are
scaled by position (`rope_parameters.llama_4_scaling_beta`, from the position ids each layer receives)."""

from models.families import Family, register

# The tiny model's queries are scaled from position 8 on (the hub's from 16,384).
TINY_ROPE = dict(
    rope_type="yarn",
    rope_theta=1e6,
    factor=32.0,  # max_position_embeddings 256 / 8, as YaRN expects
    original_max_position_embeddings=8,
    llama_4_scaling_beta=0.1,
    beta_fast=32.0,
    beta_slow=1.0,
    mscale=1.0,
    mscale_all_dim=1.0,
)
register(Family("ministral3", "Ministral3", window_everywhere=True, tiny=dict(head_dim=16, rope_parameters=TINY_ROPE)))
