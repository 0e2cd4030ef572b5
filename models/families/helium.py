"""Helium (`helium`, Kyutai): LLaMA's layer with q/k/v biases when `attention_bias` (o_proj never has one) and MLP
biases when `mlp_bias`."""

from models.families import Family, register

register(Family("helium", "Helium", qkv_bias="attention_bias", mlp_bias="mlp_bias", tiny=dict(head_dim=16)))
