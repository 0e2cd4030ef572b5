"""Reading a checkpoint's `config.json` and checking the `model` group's preset (schema/model.py `ModelSettings`)
against it. Errors are ValueError with one line naming the file or key.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from models.families import ALIASES, CONTAINERS, DEFAULT_MODEL_TYPE, FAMILIES
from models.layer_config import global_attr
from schema.model import ModelSettings

# Architecture fields a preset may set; checked against a checkpoint's config.json.
ARCH_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_theta",
    "tie_word_embeddings",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "intermediate_size_mlp",
    "interleave_moe_layer_step",
    "attention_chunk_size",
)


def config_field(model_type: str | None, key: str) -> str:
    """The transformers config field of preset key `key` for a family (the families' `MoeSpec.num_experts`)."""
    family = FAMILIES.get(model_type or DEFAULT_MODEL_TYPE)
    return family.moe.num_experts if key == "num_experts" and family is not None and family.moe else key


SUPPORTED_MODEL_TYPES = tuple(sorted([*FAMILIES, *CONTAINERS, *ALIASES]))  # the registry's (models/families/)


def _read_config_json(path: str) -> dict:
    """config.json of `path` as JSON, refused (ValueError naming the file) unless a supported family."""
    file = os.path.join(path, "config.json")
    if not os.path.exists(file):
        raise ValueError(f"{file}: missing")
    try:
        with open(file) as f:
            raw = json.load(f)
        model_type = raw.get("model_type")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from None
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{file}: model_type={model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    if model_type in CONTAINERS:  # the text model's config (the other towers are not read)
        raw = text_config_json(raw)
    text_type = raw.get("model_type")
    raw = {**raw, "model_type": ALIASES.get(text_type, text_type)}  # read as the architecture it is (`kimi_k2`)
    family = FAMILIES.get(raw["model_type"])
    if family is None:
        raise ValueError(f"{file}: the text model's model_type={text_type!r} is not supported")
    for key, why in family.refused_fields.items():
        if raw.get(key) not in (None, False):
            raise ValueError(f"{file}: model_type={text_type!r} with {key}={raw[key]}: {why}")
    return raw


def text_config_json(raw: dict) -> dict:
    """The config.json of a container checkpoint's text model (`CONTAINERS`), as transformers' text model writes
    it; any other config unchanged."""
    container = CONTAINERS.get(raw.get("model_type"))
    if container is None:
        return raw
    text = dict(raw.get(container.config_key) or {})
    family = FAMILIES.get(ALIASES.get(text.get("model_type"), text.get("model_type")))
    derived = f"{family.prefix}ForCausalLM" if family else None  # (an unsupported text model is refused by its type)
    text["architectures"] = [container.text_architecture or derived]
    for key in ("dtype", "transformers_version", "quantization_config"):  # a quantized container's: its text's too
        if key in raw:
            text.setdefault(key, raw[key])
    # transformers ties a container's head by the container's own config, whatever its text config says (absent: the
    # container class's default, Mistral3Config's tied)
    tie = raw["tie_word_embeddings"] if "tie_word_embeddings" in raw else _container_tie_default(raw["model_type"])
    if tie is not None:
        text["tie_word_embeddings"] = tie
    return text


def _container_tie_default(model_type: str) -> bool | None:
    """`tie_word_embeddings` of transformers' config class for a container model type, where it has one."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return getattr(getattr(transformers, CONFIG_MAPPING_NAMES.get(model_type, ""), None), "tie_word_embeddings", None)


def load_hf_config(path: str):
    """The transformers config in `path`/config.json (an HF model dir or a pipeline checkpoint).

    Raises:
        ValueError: missing, not JSON, or a model type this project does not support; names the file.
    """
    raw = _read_config_json(path)
    import transformers

    # NOTE: the family's own config class, not AutoConfig: resolving AutoConfig imports transformers' whole
    # auto-mapping (seconds per process, and conversion runs one process per command).
    config_class = getattr(transformers, FAMILIES[raw["model_type"]].config_class)
    with open(os.path.join(path, "config.json")) as f:
        if json.load(f).get("model_type") in {*CONTAINERS, *ALIASES}:  # the text model's part, or another name
            return config_class.from_dict(raw)
    return config_class.from_pretrained(path)


@dataclass(frozen=True)
class ConfigFields:
    """The numbers of config.json that converting weights needs, read without importing transformers.

    Importing transformers' config machinery costs 2-3 s per process, as long as converting a 1.6 GB
    model; conversion reads these fields at once and checks them against transformers' own reading of
    the file (`differing_field`) before its output is published. A default is what every supported
    family's config class assumes when the file leaves the key out (tests/test_families.py holds them
    to transformers); keys without a default must be in the file.
    """

    model_type: str
    vocab_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False


def read_config_fields(path: str) -> ConfigFields | None:
    """`ConfigFields` of `path`/config.json; None when a key without a default is missing or not plainly typed
    (then only transformers knows what the file means). Raises ValueError as `load_hf_config` does."""
    from dataclasses import MISSING, fields

    raw = _read_config_json(path)
    family = FAMILIES[raw["model_type"]]
    if family.moe is not None and (not family.moe_when or raw.get(family.moe_when)):  # experts: the config class's
        return None
    named = {b for b in (family.qkv_bias, family.o_bias, family.mlp_bias) if isinstance(b, str)}
    if named - {"attention_bias", "mlp_bias"}:  # a bias field read here only through transformers
        return None
    values = {}
    for f in fields(ConfigFields):
        if f.name not in raw or raw[f.name] is None:
            if f.default is MISSING:
                return None
            if f.name in family.config_defaults:
                values[f.name] = family.config_defaults[f.name]
            continue
        value, kind = raw[f.name], type(f.default) if f.default is not MISSING else None
        if f.name != "model_type" and type(value) is not (kind or int):  # bool is not int here
            return None
        values[f.name] = value
    return ConfigFields(**values)


def differing_field(light: ConfigFields, config) -> str | None:
    """The first field `light` reads differently from the transformers config of the same file, else None."""
    from dataclasses import fields

    for f in fields(ConfigFields):
        if getattr(light, f.name) != (have := global_attr(config, f.name, f.default)):
            return f"{f.name}={getattr(light, f.name)!r} (transformers reads {have!r})"
    return None


def preset_values(model: ModelSettings) -> dict:
    """The architecture fields a preset sets."""
    return {k: getattr(model, k) for k in ARCH_KEYS if getattr(model, k) is not None}


def _config_fields(model: ModelSettings, model_type: str) -> dict:
    """`model.config_fields`, each a field of the family's transformers config. Raises ValueError."""
    import transformers

    fields = dict(model.config_fields or {})
    if not fields:
        return fields
    config_class = getattr(transformers, FAMILIES[ALIASES.get(model_type, model_type)].config_class)
    default = config_class()
    typed = {config_field(model_type, k): k for k in ARCH_KEYS}  # n_routed_experts: model.num_experts
    for key in fields:
        if key in typed or key in ARCH_KEYS:
            raise ValueError(f"model.config_fields.{key}: set it as model.{typed.get(key, key)}")
        if key not in default.to_dict():  # a field, not a method or a generic attribute
            raise ValueError(f"model.config_fields.{key}: not a field of {config_class.__name__} ({model_type})")
    return fields


def _agrees(want, have) -> bool:
    """A preset's value against the checkpoint's: a dict (rope_parameters) by the keys the preset names."""
    if isinstance(want, dict) and isinstance(have, dict):
        return all(k in have and _agrees(v, have[k]) for k, v in want.items())
    if isinstance(want, list | tuple) and isinstance(have, list | tuple):
        return len(want) == len(have) and all(_agrees(w, h) for w, h in zip(want, have, strict=True))
    return want == have


def check_preset(config, model: ModelSettings, where: str) -> None:
    """A preset named on the command line must describe the checkpoint's model. Raises ValueError."""
    for key, want in preset_values(model).items():
        field = config_field(getattr(config, "model_type", None), key)
        have = config.rope_parameters.get("rope_theta") if key == "rope_theta" else global_attr(config, field)
        if have != want:
            raise ValueError(f"model.{key}={want} (preset {model.name}) but {where} has {key}={have}")
    for key, want in _config_fields(model, config.model_type).items():
        # a per-layer table (Gemma 4's `per_layer_config`) as config.json writes it
        have = config.to_dict().get(key) if key == "per_layer_config" else getattr(config, key, None)
        if not _agrees(want, have):
            raise ValueError(f"model.config_fields.{key}={want} (preset {model.name}) but {where} has {key}={have}")


def config_from_preset(model: ModelSettings):
    """The family's transformers config built from a preset (training from scratch)."""
    from transformers import AutoConfig

    preset = preset_values(model)
    model_type = preset.pop("model_type", DEFAULT_MODEL_TYPE)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model.model_type={model_type!r} is not supported (supported: {', '.join(FAMILIES)})")
    fields = {config_field(model_type, k): v for k, v in preset.items() if k != "rope_theta"}
    config = AutoConfig.for_model(model_type, **fields, **_config_fields(model, model_type))
    if "rope_theta" in preset:
        config.rope_parameters["rope_theta"] = preset["rope_theta"]
    return config
