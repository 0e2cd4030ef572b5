"""Worker: the real Trainer with instrumentation, configured exactly as `trainer.py OVERRIDES` would be.

    torchrun --nproc_per_node N tests/workers/instrumented_run.py OUT_JSON_DIR OVERRIDES...

Records per rank: which decoder layers were built (off the meta device), which checkpoint files
were read, every open() of the data files, every row index read per data file, the step count, and for each
layer file, when the save takes its state, how many sparse layers held every expert gathered (`gathered_experts`).
"""

import builtins
import json
import os
import sys

import torch
from deepspeed.comm import comm as deepspeed_comm  # (its `cdb`: the backend made by init_distributed)

from data import dataset as dataset_mod
from models import layers as layers_mod

out_dir, overrides = sys.argv[1], sys.argv[2:]
rec = {"decoder_built": [], "files_loaded": [], "data_opens": [], "rows": {}, "gathered_at_save": []}
stage_module = []  # the engine's module, once built

_init = layers_mod.DecoderPipe.__init__


def counting_init(self, config, layer_idx, *args, **kwargs):
    if torch.get_default_device().type != "meta":  # meta builds only count parameters
        rec["decoder_built"].append(layer_idx)
    _init(self, config, layer_idx, *args, **kwargs)


layers_mod.DecoderPipe.__init__ = counting_init

_load = torch.load


def recording_load(f, *args, **kwargs):
    if isinstance(f, (str, os.PathLike)) and str(f).endswith("model_states.pt"):
        rec["files_loaded"].append(os.path.basename(str(f)))
    return _load(f, *args, **kwargs)


torch.load = recording_load

from training import saving as saving_mod  # noqa: E402

_snapshot_save = saving_mod.SnapshotEngine.save


def recording_save(self, state_dict, path):
    """When DeepSpeed hands a layer's state to the save (copied to host right there; written later)."""
    name = os.path.basename(str(path))
    if name.startswith("layer_") and stage_module:
        held = sum(getattr(m, "gathered_experts", None) is not None for m in stage_module[0].modules())
        rec["gathered_at_save"].append([name, held])
    return _snapshot_save(self, state_dict, path)


saving_mod.SnapshotEngine.save = recording_save

_getitem = dataset_mod.TokenizedDataset.__getitem__


def recording_getitem(self, index):
    rec["rows"].setdefault(os.path.basename(self.path), []).append(int(index))
    return _getitem(self, index)


dataset_mod.TokenizedDataset.__getitem__ = recording_getitem


def main():
    from schema.compose import compose_config
    from training.distributed import shutdown_distributed
    from training.loop import Trainer

    cfg = compose_config(overrides)
    data_files = {os.path.abspath(cfg.train_file), os.path.abspath(cfg.eval_file)}
    _open = builtins.open

    def recording_open(file, *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and os.path.abspath(str(file)) in data_files:
            rec["data_opens"].append(os.path.basename(str(file)))
        return _open(file, *args, **kwargs)

    builtins.open = recording_open
    trainer = Trainer(cfg)
    stage_module.append(trainer.assembled.engine.module)
    loaded_at_start = list(rec["files_loaded"])  # later loads: the manifest of a save reads shapes
    rec["shm_op"] = deepspeed_comm.cdb.shm_comm_op is not None  # DeepSpeed's CPU shared-memory all-reduce: unbuilt
    trainer.run()
    rec["files_loaded"] = loaded_at_start
    builtins.open = _open
    run = trainer.assembled
    rec.update(
        rank=run.coords.rank,
        stage=run.coords.stage,
        dp_rank=run.coords.dp_rank,
        steps=run.engine.global_steps,
        dataset=type(run.train_set).__name__,
        from_cache=getattr(run.train_set, "from_cache", None),
        local_layers=list(run.engine.module.local_layer_indices()),
    )
    with open(os.path.join(out_dir, f"rank{rec['rank']}.json"), "w") as f:
        json.dump(rec, f)
    shutdown_distributed()


if __name__ == "__main__":
    main()
