"""Tiny multimodal checkpoints whose text model is one of our families (tests/test_convert.py,
tests/test_quantized_sources.py)."""

from models.families import FAMILIES
from tools.tiny_models import tiny_config

_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28)
_CLIP = dict(vision_config=_VISION | dict(model_type="clip_vision_model", patch_size=14), vision_feature_layer=-1)
_SIGLIP = dict(vision_config=_VISION | dict(model_type="siglip_vision_model", patch_size=14), vision_feature_layer=-1)
_IDEFICS = dict(vision_config=_VISION | dict(patch_size=14))
# container -> (transformers' class prefix, its config's other fields: a one-layer vision tower)
VISION_LANGUAGE = {
    "llava": ("Llava", _CLIP),
    "llava_next": ("LlavaNext", _CLIP | dict(image_grid_pinpoints=[[28, 28]])),
    "llava_onevision": ("LlavaOnevision", _SIGLIP | dict(image_grid_pinpoints=[[28, 28]])),
    "internvl": ("InternVL", dict(vision_config=_VISION | dict(image_size=[28, 28], patch_size=[14, 14]))),
    "idefics3": ("Idefics3", _IDEFICS),
    "smolvlm": ("SmolVLM", _IDEFICS),
}


def multimodal(family: str):
    """A tiny multimodal model whose text model is `family`'s, and the name of its vision tower's keys."""
    import transformers

    if family == "llama4":
        vision = transformers.Llama4VisionConfig(
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=64,
            image_size=28,
            patch_size=14,
            vision_output_dim=32,
            projector_input_dim=32,
            projector_output_dim=32,
        ).to_dict()
        text = tiny_config("llama4_text", num_key_value_heads=2).to_dict()
        config = transformers.Llama4Config(text_config=text, vision_config=vision)
        return transformers.Llama4ForConditionalGeneration(config), "vision_model.", "llama4_text", "Llama4ForCausalLM"
    if family == "kimi_k25":  # Kimi K2.5: DeepSeek-V3's text model, the hub's remote-code text type `kimi_k2`
        text = tiny_config("deepseek_v3", num_key_value_heads=4).to_dict() | {"model_type": "kimi_k2"}
        vision = dict(
            patch_size=14, pos_emb_height=4, pos_emb_width=4, pos_emb_time=2, num_attention_heads=2,
            num_hidden_layers=1, hidden_size=32, intermediate_size=64,
        )  # fmt: skip
        config = transformers.Kimi_K25Config(
            text_config=text, vision_config=vision, projection_hidden_size=32, tie_word_embeddings=False
        )
        model = transformers.Kimi_K25ForConditionalGeneration(config)
        return model, "vision_tower.", "kimi_k2", "DeepseekV3ForCausalLM"
    if family.startswith("mistral3"):  # Mistral Small 4 (`mistral4` text), Ministral 3, Mistral Small 3.1 (`mistral`)
        text_type = family.split("-")[1]
        text = tiny_config(text_type, **({} if text_type == "mistral4" else {"num_key_value_heads": 2})).to_dict()
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, head_dim=16)
        vision |= dict(image_size=32, patch_size=8)  # Mistral Small 4's head untied; Mistral3Config's default: tied
        config = transformers.Mistral3Config(text_config=text, vision_config=vision, tie_word_embeddings=False)
        if text_type != "mistral4":
            config = transformers.Mistral3Config(text_config=text, vision_config=vision)
        model = transformers.Mistral3ForConditionalGeneration(config)
        return model, "vision_tower.", text_type, f"{FAMILIES[text_type].prefix}ForCausalLM"
    if family.split("-")[0] in VISION_LANGUAGE:  # "llava-mistral": LLaVA holding a Mistral text model
        container, text_type = family.split("-")
        text = tiny_config(text_type, num_key_value_heads=2).to_dict()
        prefix, build = VISION_LANGUAGE[container]
        config = getattr(transformers, f"{prefix}Config")(text_config=text, **build)
        model = getattr(transformers, f"{prefix}ForConditionalGeneration")(config)
        towers = "model.vision_model." if container in ("idefics3", "smolvlm") else "vision_tower."
        return model, towers, text_type, f"{FAMILIES[text_type].prefix}ForCausalLM"
    if family == "lfm2_vl":  # LFM2-VL: LFM2's text model beside a SigLIP2 tower
        text = tiny_config("lfm2", num_key_value_heads=2).to_dict()
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, patch_size=8)
        config = transformers.Lfm2VlConfig(
            text_config=text, vision_config=vision | dict(num_patches=16), projector_hidden_size=32
        )
        return transformers.Lfm2VlForConditionalGeneration(config), "model.vision_tower.", "lfm2", "Lfm2ForCausalLM"
    if family == "qwen3_vl":  # its text model's MRoPE in three interleaved sections, DeepStack into layer 0
        text = tiny_config("qwen3", num_key_value_heads=2, head_dim=16).to_dict() | {"model_type": "qwen3_vl_text"}
        text["rope_parameters"] |= {"mrope_section": [4, 2, 2], "mrope_interleaved": True}
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=8)
        config = transformers.Qwen3VLConfig(text_config=text, vision_config=vision | dict(deepstack_visual_indexes=[0]))
        return (
            transformers.Qwen3VLForConditionalGeneration(config),
            "model.visual.",
            "qwen3_vl_text",
            "Qwen3ForCausalLM",
        )
    if family == "glm4v_moe":  # GLM-4.5V / 4.6V: GLM-4.5's text model, MRoPE over its rotary half
        text = tiny_config("glm4_moe", num_key_value_heads=2, attention_bias=True).to_dict()  # (no q/k norms)
        text |= {"model_type": "glm4v_moe_text"}
        text["rope_parameters"] |= {"mrope_section": [2, 1, 1]}
        vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64)
        config = transformers.AutoConfig.for_model(family, text_config=text, vision_config=vision)
        model = transformers.AutoModelForImageTextToText.from_config(config)
        return model, "model.visual.", "glm4v_moe_text", "Glm4MoeForCausalLM"
    if family in ("qwen3_5", "qwen3_5_moe"):
        prefix = "Qwen3_5" if family == "qwen3_5" else "Qwen3_5Moe"
        text = tiny_config(f"{family}_text", num_key_value_heads=2).to_dict()
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=8)
        config = getattr(transformers, f"{prefix}Config")(text_config=text, vision_config=vision)
        model = getattr(transformers, f"{prefix}ForConditionalGeneration")(config)
        return model, "model.visual.", f"{family}_text", f"{prefix}ForCausalLM"
    if family == "gemma4":  # Gemma 4 E2B/E4B: vision and audio towers beside the text model (PLE, shared K/V)
        text = tiny_config("gemma4_text", tie_word_embeddings=True).to_dict()
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, head_dim=16)
        audio = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, subsampling_conv_channels=[8, 4])
        config = transformers.Gemma4Config(
            text_config=text,
            vision_config=vision | dict(num_key_value_heads=2),
            audio_config=audio | dict(output_proj_dims=32),
        )
        return (
            transformers.Gemma4ForConditionalGeneration(config),
            "model.audio_tower.",
            "gemma4_text",
            "Gemma4ForCausalLM",
        )
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32)
    # No logit soft-cap, as the hub's Gemma 3 configs: Gemma3ForConditionalGeneration's forward applies none even when
    # set, where Gemma3ForCausalLM (the text model we convert to) applies it.
    text = tiny_config("gemma3_text", num_key_value_heads=2, tie_word_embeddings=True, final_logit_softcapping=None)
    text = text.to_dict()
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision | dict(patch_size=8), mm_tokens_per_image=4
    )
    return transformers.Gemma3ForConditionalGeneration(config), "vision_tower.", "gemma3_text", "Gemma3ForCausalLM"


def kimi_k25_as_on_the_hub(mm_dir) -> None:
    """A saved Kimi_K25ForConditionalGeneration directory as the hub keeps it: its text layers `layers`
    (transformers 5.23 saves them as `blocks`: its vision tower's `blocks` -> `layers` rename, reversed on save,
    reaches the text model too) and its text model's type `kimi_k2`."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    path = Path(mm_dir) / "model.safetensors"
    hub = {k.replace(".model.blocks.", ".model.layers."): v for k, v in load_file(path).items()}
    save_file(hub, path, metadata={"format": "pt"})
    conf = json.loads((Path(mm_dir) / "config.json").read_text())
    conf["text_config"]["model_type"] = "kimi_k2"
    (Path(mm_dir) / "config.json").write_text(json.dumps(conf))


def text_rows_compute_as(model, family_type: str, architecture: str) -> bool:
    """Whether the multimodal `model`'s logits on text rows equal those of `family_type`'s model (`architecture`)
    holding its text weights, bit for bit: the container's text model is read as that family's."""
    import torch
    import transformers

    model.eval()
    ids = torch.randint(3, model.config.text_config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    text = transformers.AutoConfig.for_model(**(model.config.text_config.to_dict() | {"model_type": family_type}))
    ours = getattr(transformers, architecture)(text).eval()
    renames = (("model.language_model.", "model."), ("language_model.model.", "model."), ("language_model.", ""))
    state = {}
    for key, value in model.state_dict().items():
        hub = next(((p, t) for p, t in renames if key.startswith(p)), None)
        if hub is not None or key.startswith("lm_head."):
            state[hub[1] + key[len(hub[0]) :] if hub else key] = value
    ours.load_state_dict(state)
    with torch.no_grad():
        return torch.equal(ours(input_ids=ids).logits, model(input_ids=ids).logits)
