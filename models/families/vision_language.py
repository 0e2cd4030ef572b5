"""The vision-language containers whose text model is a registered family, taken for text rows: conversion reads
the text model (config.json's `text_config`, its keys under the container's prefix), keeps the vision tower and the
projector aside (checkpoint/carried.py), and the export writes the container back, those tensors byte for byte.
Image inputs are not trained.

- LLaVA 1.5 (`llava`), LLaVA-NeXT (`llava_next`), LLaVA-OneVision (`llava_onevision`) and InternVL 3 in transformers'
  layout (`internvl`, the `-hf` checkpoints): the text model under `language_model.` (its head at
  `language_model.lm_head.`), as transformers 5 still saves them.
- Idefics3 (`idefics3`) and SmolVLM (`smolvlm`): the text model under `model.text_model.`, its head at `lm_head.`.
- Qwen3-VL (`qwen3_vl`, dense): its text model read as Qwen3 (below).
- GLM-4.5V and GLM-4.6V (`glm4v_moe`): the text model (`glm4v_moe_text`) read as GLM-4.5's (below).
- LFM2-VL (`lfm2_vl`): its text model LFM2's (models/families/lfm2.py), under `model.language_model.`, its head at
  `lm_head.`.
"""

from models.families import Container, register_alias, register_container

for container in ("llava", "llava_next", "llava_onevision", "internvl"):
    register_container(container, Container("text_config", "language_model."))
for container in ("idefics3", "smolvlm"):
    register_container(
        container, Container("text_config", "", renames=(("model.text_model.", "model."), ("lm_head.", "lm_head.")))
    )

# Qwen3-VL (`qwen3_vl`): its text model (`qwen3_vl_text`) is Qwen3's layer with interleaved MRoPE, whose three
# position rows are one and the same on text rows, so it computes Qwen3's RoPE: read as Qwen3 (its config's
# `mrope_section` unread), its keys under `model.language_model.` and its head at `lm_head.`. DeepStack adds visual
# features to early layers only with images.
register_alias("qwen3_vl_text", "qwen3")
register_container(
    "qwen3_vl",
    Container(
        "text_config", "", "Qwen3ForCausalLM", renames=(("model.language_model.", "model."), ("lm_head.", "lm_head."))
    ),
)
register_container(
    "lfm2_vl",
    Container(
        "text_config", "", "Lfm2ForCausalLM", renames=(("model.language_model.", "model."), ("lm_head.", "lm_head."))
    ),
)
# GLM-4.5V / GLM-4.6V (`glm4v_moe`): its text model (`glm4v_moe_text`) is GLM-4.5's layer with MRoPE over three
# sections of its rotary half, whose position rows are one and the same on text rows: read as GLM-4.5 (`glm4_moe`;
# its config's `mrope_section` unread), the logits of text rows equal bit for bit; its keys under
# `model.language_model.`, its head at `lm_head.`. (GLM-4.1V's and GLM-4.6V-Flash's dense text model, `glm4v_text`,
# rotates otherwise than GLM-4's: not read.)
register_alias("glm4v_moe_text", "glm4_moe")
register_container(
    "glm4v_moe",
    Container("text_config", "", "", renames=(("model.language_model.", "model."), ("lm_head.", "lm_head."))),
)
