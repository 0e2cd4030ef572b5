"""A multimodal checkpoint whose text model is a registered family (`models.families.register_container`).

Model code only: no DeepSpeed, no distributed code.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Container:
    """A multimodal checkpoint whose text model is one of FAMILIES: its config.json nests the text model's config
    under `config_key`, and its weights carry `prefix` before the text model's keys (the other towers' keys are
    not read). Conversion takes the text model only; the pipeline checkpoint is that text model's."""

    config_key: str
    prefix: str
    # transformers' class of the text model; "" where the container holds several families' text models (Mistral
    # 3's: Mistral, Ministral 3, Mistral 4): the text family's `<Prefix>ForCausalLM`.
    text_architecture: str = ""
    # Where the text model's keys sit when it is not one prefix before all of them: (hub prefix, text model prefix)
    # pairs (Qwen3.5's `model.language_model.layers.0...` is the text model's `model.layers.0...`, its `lm_head.` the
    # same); empty: `prefix` before every text key.
    renames: tuple[tuple[str, str], ...] = ()

    def text_key(self, hub_key: str) -> str | None:
        """The text model's key of a hub key, or None for another tower's (kept aside: checkpoint/carried.py)."""
        for hub, text in self.renames or ((self.prefix, ""),):
            if hub_key.startswith(hub):
                return text + hub_key[len(hub) :]
        return None

    def hub_key(self, text_key: str) -> str:
        """The hub key of a text model's key (`text_key` inverted)."""
        for hub, text in self.renames or ((self.prefix, ""),):
            if text_key.startswith(text):
                return hub + text_key[len(text) :]
        raise KeyError(f"{text_key}: not a key of the text model")
