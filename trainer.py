"""Fine-tune a LLaMA-family model with DeepSpeed pipeline parallelism (PP x DP).

    deepspeed --num_gpus N trainer.py model_name_or_path=CKPT num_stages=2 train_file=... [overrides]
    torchrun --nproc_per_node N trainer.py ...        # works as well
    python trainer.py ...                             # one rank

Configuration: conf/config.yaml and its groups (model/, data/, deepspeed/, experiment/), checked
against the dataclasses in training/config.py. `python trainer.py --help` lists them.
"""

from __future__ import annotations

import difflib
import os
import re
import sys

# NOTE: the deepspeed launcher appends --local_rank=N (LOCAL_RANK is also in the environment) and
# hydra rejects it: strip it before hydra parses sys.argv.
sys.argv = [a for i, a in enumerate(sys.argv) if i == 0 or not re.fullmatch(r"--local[_-]rank(=\d+)?", a)]

import hydra  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from training.config import TrainConfig, register_configs  # noqa: E402

CONF_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "conf")


def check_overrides(args: list[str], conf_dir: str) -> str | None:
    """A one-line problem with a command-line override (unknown key, wrong type, unknown preset), or None.

    Hydra reports these as multi-line messages after composing; checking first gives the key, the
    reason and a close match.
    """
    schema = OmegaConf.structured(TrainConfig)
    keys = [k for k, _ in _dotted(OmegaConf.to_container(schema))]
    groups = {g for g in os.listdir(conf_dir) if os.path.isdir(os.path.join(conf_dir, g))}
    for arg in args:
        if arg.startswith("-") or "=" not in arg:
            continue
        key, value = arg.split("=", 1)
        if key.startswith(("hydra", "+", "~")):
            continue
        if key in groups and not ("." in value or value.startswith("{")):
            presets = sorted(f[:-5] for f in os.listdir(os.path.join(conf_dir, key)) if f.endswith(".yaml"))
            if value not in presets and value != "null":
                return f"{key}={value}: unknown preset (conf/{key}/ has {', '.join(presets)})"
            continue
        sweep = ("," in value and not value.startswith(("[", "{", "'", '"'))) or value.startswith(
            ("range(", "choice(", "interval(", "glob(")
        )  # a multirun sweep (`-m learning_rate=1e-4,3e-4`): hydra checks each value
        if sweep and (key in keys or key in groups):
            continue
        try:
            OmegaConf.merge(schema, OmegaConf.from_dotlist([arg]))
        except Exception as e:  # noqa: BLE001 - omegaconf's key, type and grammar errors
            if key not in keys and not any(k.startswith(key + ".") for k in keys):
                close = difflib.get_close_matches(key, keys, n=1)
                return f"{key}: unknown config key" + (f" (did you mean {close[0]}?)" if close else "")
            reason = str(e).strip().splitlines()[0]
            return f"{arg}: {reason}"
    return None


def _dotted(tree: dict, prefix: str = ""):
    for k, v in tree.items():
        yield prefix + k, v
        if isinstance(v, dict):
            yield from _dotted(v, prefix + k + ".")


register_configs()
_problem = check_overrides(sys.argv[1:], CONF_DIR)
if _problem:
    print(f"trainer: error: {_problem}", file=sys.stderr, flush=True)
    sys.exit(2)


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(dict_cfg: DictConfig) -> None:
    from training.errors import USER_ERRORS
    from training.loop import Trainer

    cfg: TrainConfig = OmegaConf.to_object(dict_cfg)
    try:
        Trainer(cfg).run()
    except USER_ERRORS as e:
        # NOTE: one write per line: every rank prints it, and print()'s separate newline would interleave them.
        sys.stderr.write(f"trainer: error: {e}\n")
        sys.stderr.flush()
        sys.exit(2)


if __name__ == "__main__":
    main()
