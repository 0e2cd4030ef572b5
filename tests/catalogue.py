"""The bad-input catalogue's harness: every case gives a one-line error naming the problem and the file or
key, exits non-zero, leaves no output that looks complete, and leaves its inputs untouched.

Each case builds its own inputs under tmp_path and returns (command, expected fragment, output
path, input paths[, ranks]). The inputs are hashed before and after the command. A multi-rank case
expects the one-line error once per rank (every rank learns of a failure on any rank) and no traceback.

Config cases (`@catalogue.config_case`): a trainer command whose error comes from its overrides alone
(override checks, `validate`, the model's config, `validate_layout`, the stage bounds), before any data or
weight is read (the trainer has only made output_dir and its log by then). Data cases
(`@catalogue.data_case`): one whose error comes from reading its train file. Both run in-process through the
trainer's own functions (`config_error`, `data_error`); cases of each kind still launch the trainer
(`@catalogue.case`: an unknown key, a value, a layout on 4 ranks, a missing file, a bad row on 4 ranks), so the
one line on stderr, once per rank, the exit code and the untouched inputs are
proven end to end for every kind.
The cases live in tests/test_bad_inputs.py (inputs that are wrong) and tests/test_bad_outputs.py (commands
that would destroy or mix what the user has).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from pathlib import Path

from tests.conftest import one_error_line, run_cmd, small_run


class Catalogue(dict):
    """name -> case function; `@catalogue.case` registers one, `@catalogue.config_case` one checked in-process."""

    def __init__(self):
        super().__init__()
        self.in_process: dict[str, str] = {}  # name -> "config" or "data"

    def case(self, fn):
        self[fn.__name__] = fn
        return fn

    def config_case(self, fn):
        self.in_process[fn.__name__] = "config"
        return self.case(fn)

    def data_case(self, fn):
        self.in_process[fn.__name__] = "data"
        return self.case(fn)


def config_error(overrides: list[str], world_size: int = 1) -> str:
    """The error the trainer gives for `overrides` before it reads data or weights, found in-process
    through the trainer's own steps: the override checks and composition, `validate`, the model's config, the
    layout and the stage bounds (training/assembly.py runs them in this order). AssertionError when none fails."""
    from models.partition import stage_bounds
    from schema.compose import compose_config
    from schema.train import model_stages
    from training.assembly import load_model_config
    from training.errors import RunError
    from training.precision import resolve
    from training.validate import validate, validate_layout

    try:
        cfg = compose_config(overrides)
        validate(cfg)
        resolve(cfg)  # as training/assembly.py does
        model_config = load_model_config(cfg)
        validate_layout(cfg, world_size, model_config)
        stage_bounds(model_config, model_stages(cfg.pipeline_schedule, cfg.num_stages), cfg.model.partition)
    except (ValueError, RunError) as e:
        return str(e)
    raise AssertionError(f"no error for {overrides}")


def data_error(overrides: list[str]) -> str:
    """The error the trainer gives while reading the train file of `overrides` (a valid config), found
    in-process through its own steps: the tokenizer, then `open_dataset` into the run's data cache
    (training/assembly.py and training/data_setup.py). AssertionError when the data reads."""
    from data.dataset import cache_root
    from data.errors import DataError
    from data.open_dataset import open_dataset
    from models.tokenizer import configured_tokenizer
    from schema.compose import compose_config
    from training.validate import validate

    cfg = compose_config(overrides)
    validate(cfg)
    tokenizer, _ = configured_tokenizer(cfg.tokenizer_name_or_path, cfg.model_name_or_path)
    try:
        open_dataset(
            cfg, cfg.train_file, tokenizer, train=True, cache_dir=cache_root(cfg.data.cache_dir, cfg.output_dir)[0]
        )
    except DataError as e:
        return str(e)
    raise AssertionError(f"no error for {overrides}")


def trainer_cmd(*overrides: str, script: str = "trainer.py") -> list[str]:
    return [sys.executable, script, *overrides]


def run_args(ckpt: str, out: Path, train: str, **extra) -> list[str]:
    return small_run(ckpt, out, train, **{"max_steps": 2, **extra})


def convert_cmd(src: Path | str, out: Path) -> list[str]:
    return [sys.executable, "convert2ckpt.py", "--input", str(src), "--output", str(out)]


def copy(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


def digest(paths) -> dict[str, str]:
    out = {}
    for root in paths:
        root = Path(root)
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for p in files:
            out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def looks_complete(out: Path | None, inputs) -> list[str]:
    """Output the failed command left that a user could mistake for a result."""
    if out is None or not out.exists():
        return []
    protected = {Path(p).name for p in inputs}
    names = [n for n in os.listdir(out) if n not in protected]
    return [n for n in names if n.startswith("global_step") or n in ("latest", "model.safetensors.index.json")]


class Inputs:
    def __init__(self, tmp_path, hf_models, converted, sft_data):
        self.tmp, self.hf, self.out = tmp_path, hf_models, tmp_path / "out"
        self.ckpt, self.mha_ckpt, self.train = converted["gqa"], converted["mha"], sft_data[0]
        self.env = {}


def run_case(fn, t: Inputs, monkeypatch, in_process: str | None = None) -> None:
    """Run one case and check every promise of the catalogue (config and data cases in-process: the module doc)."""
    cmd, fragment, out, inputs, *rest = fn(t)
    ranks = rest[0] if rest else 1
    before = digest(inputs)
    if in_process:
        assert cmd[:2] == [sys.executable, "trainer.py"] and ranks == 1 and not t.env, cmd
        line = config_error(cmd[2:]) if in_process == "config" else data_error(cmd[2:])
        assert fragment in line and "\n" not in line, line
        assert digest(inputs) == before, "inputs changed"
        assert not looks_complete(out, inputs), os.listdir(out)
        if in_process == "data":
            assert not [p for p in (out.rglob("*") if out.exists() else []) if ".partial" in p.name], "half-built store"
        print(f"{fn.__name__}: {line}")
        return
    for key, value in t.env.items():
        monkeypatch.setenv(key, value)
    proc = run_cmd(cmd, timeout=300)
    line = one_error_line(proc, fragment)  # the message is one line
    assert ranks == 1 or proc.stderr.count(line) == ranks, proc.stderr[-3000:]  # once on every rank
    assert digest(inputs) == before, "inputs changed"
    assert not looks_complete(out, inputs), os.listdir(out)
    if out is not None and out.exists():
        assert not [n for n in os.listdir(out) if n.startswith((".saving-", ".tmp"))], os.listdir(out)
    print(f"{fn.__name__}: {line}")
