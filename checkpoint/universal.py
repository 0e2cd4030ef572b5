"""Moving a training checkpoint to another PP x TP x DP layout with its optimizer state.

Every save records its layout (`layout.json` in the tag directory). When `resume=true` finds a
checkpoint saved with another layout, it is converted once with DeepSpeed's own universal
checkpoint tool (`deepspeed.checkpoint.ds_to_universal`: per-parameter fp32 weights and Adam
moments, named by global layer index, so layout-free) and loaded with `load_universal`. Weights
always come from the layer files, which are layout-free by construction.

DeepSpeed's tool reads ZeRO optimizer shards only; ZeRO-0 state (the fp32 preset) is reshaped by
parameter name instead (checkpoint/optimizer_reshape.py). A model with experts is converted by
checkpoint/expert_universal.py, which assembles the experts split over EP ranks.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys

from checkpoint.errors import CheckpointError
from checkpoint.names import LAYOUT_FILE
from checkpoint.staging import make_unique_dir, write_text_atomic

LAYOUT_KEYS = ("num_stages", "dp_size", "stage_bounds", "tp_size", "vocab_pad_multiple", "context_parallel_size")
# what older saves lack
LAYOUT_DEFAULTS = {"tp_size": 1, "vocab_pad_multiple": 1, "expert_parallel_size": 1, "context_parallel_size": 1}


def write_layout(step_dir: str, layout: dict) -> None:
    os.makedirs(step_dir, exist_ok=True)
    write_text_atomic(os.path.join(step_dir, LAYOUT_FILE), json.dumps(layout, indent=2))


def read_layout(step_dir: str) -> dict | None:
    path = os.path.join(step_dir, LAYOUT_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def layout_changed(saved: dict | None, current: dict) -> bool:
    """Whether a checkpoint saved with layout `saved` resumes in another one (older saves: TP 1)."""
    return saved is not None and any(saved.get(k, LAYOUT_DEFAULTS.get(k)) != current[k] for k in LAYOUT_KEYS)


def check_movable(saved: dict, current: dict, where: str) -> None:
    """Raise CheckpointError naming what prevents resuming `saved` in the `current` layout."""
    if saved["global_batch_size"] != current["global_batch_size"]:
        raise CheckpointError(
            f"{where}: saved with a global batch of {saved['global_batch_size']} sequences, this run has "
            f"{current['global_batch_size']} (micro_batch_size x gradient_accumulation_steps x DP); keep it equal "
            "so the data position and loss curve carry over"
        )
    moved_by_name = (saved["precision"], current["precision"], current["zero_stage"]) == ("fp32", "fp32", 0)
    if saved.get("zero_stage", 0) == 0 and not moved_by_name:
        raise CheckpointError(
            f"{where}: ZeRO-0 optimizer state moves between fp32 ZeRO-0 runs only (saved {saved['precision']}, "
            f"this run {current['precision']} ZeRO-{current['zero_stage']}); resume with deepspeed=fp32"
        )
    if saved.get("zero_stage", 0) >= 1 and current["zero_stage"] < 1:
        raise CheckpointError(f"{where}: ZeRO-1 optimizer state moves into ZeRO-1 runs only (deepspeed.zero_stage=1)")


# A checkpoint up to this size converts in the rank's own process: starting a Python with torch and DeepSpeed costs
# more than such a conversion (the tests' moved launches took 8-13 s with the child, 2.3-4.1 s without, on 2 cores).
# A larger one converts in a child process,
# whose memory (every DP rank's optimizer shards pass through it, a few times the bytes on disk at the peak) goes
# back to the system when it ends.
IN_PROCESS_BYTES = 1 << 30


def ensure_universal(ckpt_dir: str, tag: str, experts: bool = False) -> str:
    """Convert `ckpt_dir/tag` to DeepSpeed's universal format once; returns the universal tag. A model with
    `experts` goes through checkpoint/expert_universal.py (its fused experts assembled over the EP ranks)."""
    universal = f"{tag}_universal"
    target = os.path.join(ckpt_dir, universal)
    if os.path.isdir(target):
        return universal
    source = os.path.join(ckpt_dir, tag)
    tmp = make_unique_dir(ckpt_dir, f".{universal}.tmp-")
    out = os.path.join(tmp, "out")
    try:
        convert_to_universal(source, out, experts, in_process=_tree_bytes(source) <= IN_PROCESS_BYTES)
        os.replace(out, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return universal


def convert_to_universal(source: str, out: str, experts: bool, in_process: bool) -> None:
    """DeepSpeed's universal-checkpoint tool (checkpoint/expert_universal.py for `experts`) from the tag directory
    `source` into `out`, in this process or a child one. CheckpointError naming `source` if it fails."""
    # A Muon run's momentum through DeepSpeed's tool (checkpoint/muon_universal.py; with experts, expert_universal.py).
    muon = not experts and (read_layout(source) or {}).get("optimizer") == "muon"
    tool = "checkpoint.muon_universal" if muon else "deepspeed.checkpoint.ds_to_universal"
    tool = "checkpoint.expert_universal" if experts else tool
    argv = [f"--input_folder={source}", f"--output_folder={out}"]  # a path starting with "-" stays a value
    if not experts:
        argv += ["--num_extract_workers", "1", "--num_merge_workers", "1", "--inject_missing_state"]
    if in_process:
        try:
            # The tools report with print and draw tqdm bars on stderr: neither belongs in rank 0's log.
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                if experts:
                    from checkpoint.expert_universal import main

                    main(argv)
                elif muon:
                    from checkpoint.muon_universal import main

                    main(argv)
                else:
                    from deepspeed.checkpoint import ds_to_universal

                    with _argv([tool, *argv]):
                        ds_to_universal.main(ds_to_universal.parse_arguments())
        except (Exception, SystemExit) as e:  # what DeepSpeed's tool raises (argparse exits): one line naming it
            raise CheckpointError(
                f"{source}: conversion to a universal checkpoint failed: {type(e).__name__}: {e}"
            ) from e
        return
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository: our module's import root
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", tool, *argv], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise CheckpointError(f"{source}: conversion to a universal checkpoint failed: {last}")


@contextlib.contextmanager
def _argv(argv: list[str]):
    saved, sys.argv = sys.argv, argv
    try:
        yield
    finally:
        sys.argv = saved


def _tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def universal_info(config, tp_size: int = 1) -> dict:
    """DeepSpeed's universal-checkpoint description of our parameters (`module.universal_checkpoint_info`):
    how each merges across tensor-parallel ranks, by exact name. Column-parallel weights need no entry (DeepSpeed
    concatenates along dim 0 by default); row-parallel ones concatenate along dim 1; replicated ones are averaged;
    the vocabulary loses its padding (and is padded again for the new degree); the tied embedding is kept from
    the first stage only. A sparse block's fused experts get no entry: checkpoint/expert_universal.py assembles them
    and records how each rank takes its share. A fused projection (models/sharding.py's parts rules) is a parameter
    with sub-parameters: gate and up halves (DeepSpeed's two sub-parameters along dim 0); q, k and v by heads, with
    the widths each of the `tp_size` ranks saving it holds (DeepSpeed's sub-parameter shape and shard widths)."""
    import re

    from deepspeed.checkpoint import constants as c

    from checkpoint.expert_universal import is_expert
    from models.key_table import decoder_buffers, layer_keys
    from models.moe import param_name_of
    from models.pipe_layout import DECODER, TIED_PARAM, pipe_layers
    from models.sharding import REPLICA, ROW, VOCAB, parts_rule
    from models.tp_rules import fused_parts_shape, tp_split

    rules = {}
    for layer in pipe_layers(config.num_hidden_layers, config.tie_word_embeddings):
        buffers = decoder_buffers(config, layer.block) if layer.kind == DECODER else set()  # no optimizer state
        for key in layer_keys(layer, config):
            tied = config.tie_word_embeddings and layer.index == 0
            name = param_name_of(config, key) if layer.kind == DECODER else key
            if name is not None and key not in buffers:
                rules[TIED_PARAM if tied else f"{layer.index}.{name}"] = tp_split(layer.kind, key, config)

    experts = {name for name, rule in rules.items() if is_expert(name, rule)}  # assembled by expert_universal

    def patterns(rule: str) -> list[str]:
        return [f"^{re.escape(name)}$" for name, r in rules.items() if r == rule and name not in experts]

    info = {c.UNIVERSAL_CHECKPOINT_VERSION_KEY: c.UNIVERSAL_CHECKPOINT_VERSION_VALUE}
    for key, rule in (
        (c.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS, ROW),
        (c.PARAMETER_TO_AVERAGE_PATTERNS, REPLICA),
        (c.VOCABULARY_PARAMETER_PATTERNS, VOCAB),
    ):
        if patterns(rule):  # DeepSpeed's converter insists every declared pattern matches a parameter
            info[key] = patterns(rule)
    halves = patterns(parts_rule(1, 1))
    if halves:
        info[c.PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0] = halves
    fused = {name: rule for name, rule in rules.items() if rule.startswith("parts:") and rule != parts_rule(1, 1)}
    if fused:
        info[c.PARAMETER_WITH_SUB_PARAMS], info[c.SUB_PARAM_SHARD_WIDTHS] = [], {}
        for name in fused:  # q/k/v (attention's, linear attention's): each part's rows, then the other dims
            shape = fused_parts_shape(name.split(".", 1)[1], config)
            pattern = f"^{re.escape(name)}$"
            info[c.PARAMETER_WITH_SUB_PARAMS].append(dict(patterns=[pattern], shape=shape, partition_dim=0))
            info[c.SUB_PARAM_SHARD_WIDTHS][pattern] = [[r // tp_size] * tp_size for r in shape[0]]
    info[c.ORIGINAL_VOCAB_SIZE] = config.vocab_size
    if config.tie_word_embeddings:
        info[c.PIPELINE_REPLICATED_PARAMETER_PATTERNS] = [f"^{re.escape(TIED_PARAM)}$"]
    return info
