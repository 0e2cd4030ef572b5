"""The run config from conf/ and command-line overrides: the one way a command, tool or test builds it.

Overrides are checked before hydra composes them (one line naming the key); trainer.py, `python -m data.prepare`,
`python -m tools.memory_estimate` and the tests all go through `compose_config` (trainer.py through hydra.main,
for sweeps and --help, after the same `check_overrides`).
"""

from __future__ import annotations

import difflib
import functools
import os
import re

from omegaconf import DictConfig, OmegaConf

from schema.train import TrainConfig

CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")


def check_overrides(args: list[str], conf_dir: str) -> str | None:
    """A one-line problem with a command-line override (unknown key, wrong type, unknown preset), or None.

    Hydra reports these as multi-line messages after composing; checking first gives the key, the
    reason and a close match.
    """
    schema, keys = _schema()
    groups = {g for g in os.listdir(conf_dir) if os.path.isdir(os.path.join(conf_dir, g))}
    kinds = [_kind(arg, keys, groups) for arg in args]
    values = [arg for arg, kind in zip(args, kinds, strict=True) if kind == "value"]
    merges = True  # one merge per override; one merge for all (every rank of every launch checks) where that is
    # the same check: no key repeated or inside another (a later override would hide an earlier one's problem)
    named = [arg.split("=", 1)[0] for arg in values]
    if not any(a == b or a.startswith(b + ".") for i, a in enumerate(named) for b in named[:i] + named[i + 1 :]):
        try:
            OmegaConf.merge(schema, OmegaConf.from_dotlist(values))
            merges = False
        except Exception:  # noqa: BLE001 - omegaconf's key, type and grammar errors, found again below
            pass
    for arg, kind in zip(args, kinds, strict=True):
        key, value = arg.split("=", 1) if kind != "skip" else (arg, "")
        if kind == "preset":
            if value not in _presets(conf_dir, key) and value != "null":
                return _unknown_preset(conf_dir, key, value)
        if kind != "value" or not merges:
            continue
        try:
            OmegaConf.merge(schema, OmegaConf.from_dotlist([arg]))
        except Exception as e:  # noqa: BLE001 - omegaconf's key, type and grammar errors
            if key not in keys and not any(k.startswith(key + ".") for k in keys):
                close = difflib.get_close_matches(key, keys, n=1)
                return f"{key}: unknown config key" + (f" (did you mean {close[0]}?)" if close else "")
            reason = str(e).strip().splitlines()[0]
            choices = re.match(r"Invalid value '.*', expected one of \[(.*)\]", reason)  # an enum key
            return f"{arg}: choose one of {choices[1]}" if choices else f"{arg}: {reason}"
    return None


def _presets(conf_dir: str, group: str) -> list[str]:
    """The presets of a config group: conf/<group>/*.yaml."""
    return sorted(f[:-5] for f in os.listdir(os.path.join(conf_dir, group)) if f.endswith(".yaml"))


def _unknown_preset(conf_dir: str, group: str, value: str, key: str | None = None) -> str:
    return f"{key or group}={value}: unknown preset (conf/{group}/ has {', '.join(_presets(conf_dir, group))})"


@functools.cache
def _schema() -> tuple[DictConfig, list[str]]:
    """TrainConfig as an OmegaConf schema (merges copy it, never change it) and its dotted keys, once a process."""
    schema = OmegaConf.structured(TrainConfig)
    return schema, [k for k, _ in _dotted(OmegaConf.to_container(schema))]


def _kind(arg: str, keys: list[str], groups: set[str]) -> str:
    """What `check_overrides` checks of one override: "preset" (a config group's file), "value" (merged into the
    schema), or "skip" (a flag, hydra's own keys, `+`/`~` edits, a multirun sweep: hydra checks each value)."""
    if arg.startswith("-") or "=" not in arg:
        return "skip"
    key, value = arg.split("=", 1)
    if key.startswith(("hydra", "+", "~")):
        return "skip"
    if key in groups and not ("." in value or value.startswith("{")):
        return "preset"
    sweep = ("," in value and not value.startswith(("[", "{", "'", '"'))) or value.startswith(
        ("range(", "choice(", "interval(", "glob(")
    )  # a multirun sweep (`-m learning_rate=1e-4,3e-4`)
    return "skip" if sweep and (key in keys or key in groups) else "value"


def _dotted(tree: dict, prefix: str = ""):
    for k, v in tree.items():
        yield prefix + k, v
        if isinstance(v, dict):
            yield from _dotted(v, prefix + k + ".")


def compose_config(overrides: list[str], conf_dir: str = CONF_DIR) -> TrainConfig:
    """The run config `trainer.py OVERRIDES` would get (conf/ + overrides, typed), without starting a run.

    Raises:
        ValueError: one line naming the override or key.
    """
    from hydra import compose, initialize_config_dir

    from schema.train import register_configs

    register_configs()
    problem = check_overrides(overrides, conf_dir)
    if problem:
        raise ValueError(problem)
    try:
        with initialize_config_dir(config_dir=conf_dir, version_base="1.3"):
            cfg = OmegaConf.to_object(compose(config_name="config", overrides=overrides))
    except Exception as e:  # noqa: BLE001 - hydra and omegaconf raise many types
        raise ValueError((str(e).strip().splitlines() or [type(e).__name__])[0]) from None
    return with_plan_model(cfg, conf_dir)


def with_plan_model(cfg: TrainConfig, conf_dir: str = CONF_DIR) -> TrainConfig:
    """`cfg` with its recipe's `plan_model` preset as the model's shape when nothing else gives one (no
    model_name_or_path, no model= preset): the fields the preset sets and `cfg.model` leaves unset. ValueError
    (one line) for an unknown preset."""
    if not cfg.plan_model or cfg.model_name_or_path or cfg.model.hidden_size is not None:
        return cfg
    if cfg.plan_model not in _presets(conf_dir, "model"):
        raise ValueError(_unknown_preset(conf_dir, "model", cfg.plan_model, key="plan_model"))
    path = os.path.join(conf_dir, "model", f"{cfg.plan_model}.yaml")
    preset = OmegaConf.to_container(OmegaConf.load(path))
    preset.pop("defaults", None)
    checked = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(type(cfg.model)), preset))  # typed
    unset = type(cfg.model)()
    for key in preset:
        ours = getattr(cfg.model, key)
        if key == "config_fields":  # the run's own entries over the preset's
            setattr(cfg.model, key, {**checked.config_fields, **ours})
        elif key in ("name", "source") or ours == getattr(unset, key):
            setattr(cfg.model, key, getattr(checked, key))
    return cfg
