"""Mistral (`mistral`): LLaMA with no biases and `config.sliding_window` on every layer."""

from models.families import Family, register

register(Family("mistral", "Mistral", window_everywhere=True))
