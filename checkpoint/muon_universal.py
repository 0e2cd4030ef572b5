"""DeepSpeed's universal checkpoint of a Muon run (`optim.name=muon`) saved by DeepSpeed's bf16 optimizer (ZeRO-1).

    python -m checkpoint.muon_universal --input_folder RUN/global_stepN --output_folder OUT

DeepSpeed's converter (`deepspeed.checkpoint.ds_to_universal`, 0.19.8) reads Adam's two moments of every optimizer
group and merges each state of a parameter by its rule (TP shards, fused q/k/v sub-parameters, replicated ones).
A Muon group (training/muon.py) holds one state, `momentum_buffer`: here the converter reads it as that group's
first moment (and zeros as its second), so the momentum is extracted and merged by DeepSpeed's own rules exactly as
Adam's first moment is, then the files of each Muon parameter are renamed back (`momentum_buffer.pt`, no second
moment). DeepSpeed's loader (`load_hp_checkpoint_state`) takes whatever states a parameter's directory holds, so a
run in any layout resumes with the momentum. Models with experts go through checkpoint/expert_universal.py, which
reads the momentum the same way (`momentum_as_first_moment`) and renames it back (`momentum_named_back`).

Run by checkpoint/universal.py `convert_to_universal`, in the rank's process or as a subprocess.
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch

MOMENTUM, FIRST, SECOND = "momentum_buffer", "exp_avg", "exp_avg_sq"


@contextlib.contextmanager
def momentum_as_first_moment():
    """Within: DeepSpeed's checkpoint reader returns each Muon group's momentum as Adam's `exp_avg` (zeros as
    `exp_avg_sq`). Yields the set it fills with the names of the Muon groups' parameters."""
    from deepspeed.checkpoint.constants import BASE_OPTIMIZER_STATE, OPTIMIZER_STATE_DICT, PARAM_SLICE_MAPPINGS
    from deepspeed.checkpoint.deepspeed_checkpoint import DeepSpeedCheckpoint

    read, names = DeepSpeedCheckpoint.get_zero_checkpoint_state, set()

    def with_momentum_as_moments(self, *args, **kwargs):
        state = read(self, *args, **kwargs)
        optim = state[OPTIMIZER_STATE_DICT]
        base = optim[BASE_OPTIMIZER_STATE]
        for index, group in enumerate(base["param_groups"]):
            held = base["state"].get(index, {})
            if group.get("muon") and MOMENTUM in held:
                held[FIRST], held[SECOND] = held[MOMENTUM], torch.zeros_like(held[MOMENTUM])
                names.update(optim[PARAM_SLICE_MAPPINGS][index])
        return state

    DeepSpeedCheckpoint.get_zero_checkpoint_state = with_momentum_as_moments
    try:
        yield names
    finally:
        DeepSpeedCheckpoint.get_zero_checkpoint_state = read


def main(argv: list[str]) -> None:
    """DeepSpeed's converter over `argv` (its own arguments), the Muon parameters' momentum carried."""
    from deepspeed.checkpoint import ds_to_universal

    saved, sys.argv = sys.argv, ["ds_to_universal", *argv]
    try:
        args = ds_to_universal.parse_arguments()
    finally:
        sys.argv = saved
    with momentum_as_first_moment() as names:
        ds_to_universal.main(args)
    momentum_named_back(args.output_folder, names)


def momentum_named_back(output_folder: str, names) -> None:
    """In the universal checkpoint `output_folder`: each Muon parameter of `names` holds its momentum under its own
    name (DeepSpeed's tool wrote it as `exp_avg`), and no second moment."""
    for name in names:
        folder = os.path.join(output_folder, "zero", name)
        os.replace(os.path.join(folder, f"{FIRST}.pt"), os.path.join(folder, f"{MOMENTUM}.pt"))
        os.remove(os.path.join(folder, f"{SECOND}.pt"))


if __name__ == "__main__":
    main(sys.argv[1:])
