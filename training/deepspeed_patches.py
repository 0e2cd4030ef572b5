"""Every place this project reaches into DeepSpeed beyond its public API, in one list: what it replaces, overrides,
sets, adds or reads, where, why, and the test that fails if DeepSpeed changes it.

`deepspeed==0.19.8` is pinned (requirements.txt), and every entry was checked against that version's source. To move
the pin: install the new version, run `bash scripts/test.sh -k deepspeed_patches` (it fails first on the version,
then on each entry whose DeepSpeed attribute is gone or whose new attribute now clashes), re-read each entry's
DeepSpeed code, fix what changed, set `CHECKED_AGAINST`, and run the tests the entries name.

Kinds (`Patch.how`):
- "replaced": an attribute of a DeepSpeed object assigned a function of ours (on the instance, or `__class__`);
- "overridden": a method of a DeepSpeed class defined again in our subclass of it;
- "set": a data attribute DeepSpeed owns (or reads from our objects) assigned by us;
- "added": a name DeepSpeed does not have, put on its object (it must stay free);
- "read": a private attribute or function of DeepSpeed read or called.

`tests/test_deepspeed_patches.py` checks each entry against the installed DeepSpeed, that its test exists, and that
every assignment into an engine, optimizer, scheduler or pipeline module and every DeepSpeed subclass's method in
the project's code is listed here: a new patch without its entry fails the suite. This module is data only; the
trainer reads `CHECKED_AGAINST` to warn when another DeepSpeed is installed.
"""

from __future__ import annotations

from dataclasses import dataclass

CHECKED_AGAINST = "0.19.8"
KINDS = ("replaced", "overridden", "set", "added", "read")


@dataclass(frozen=True)
class Patch:
    owner: str  # the DeepSpeed class or module, dotted (torch's where DeepSpeed holds a torch object: noted in `why`)
    name: str  # the attribute
    how: str  # "replaced", "overridden", "set", "added" or "read" (module docstring)
    where: str  # our file (and function)
    why: str
    test: str  # tests/FILE.py::TEST that fails if DeepSpeed changes it
    # where the owner is not DeepSpeed's (a torch object DeepSpeed holds, a flag it reads from ours): the DeepSpeed
    # (or torch) module whose source must still name `name`
    read_by: str = ""


ENGINE = "deepspeed.runtime.engine.DeepSpeedEngine"
PIPE_ENGINE = "deepspeed.runtime.pipe.engine.PipelineEngine"
PIPE_MODULE = "deepspeed.runtime.pipe.module.PipelineModule"
DUALPIPE_MODULE = "deepspeed.runtime.pipe.dualpipev.DualPipeVModule"
BF16 = "deepspeed.runtime.bf16_optimizer.BF16_Optimizer"
ZERO12 = "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer"
GROUPS = "deepspeed.utils.groups"
LAMBDA_LR = "torch.optim.lr_scheduler.LambdaLR"
ADAMW = "torch.optim.AdamW"
TENSOR = "torch.nn.Parameter"
TORCH_TENSOR = "torch.Tensor"
UNIVERSAL = "deepspeed.checkpoint.ds_to_universal"
CKPT_ENGINE = "deepspeed.runtime.checkpoint_engine.checkpoint_engine.CheckpointEngine"
TORCH_CKPT_ENGINE = "deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine.TorchCheckpointEngine"
ULYSSES = "deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPAttentionHF"
MOE = "deepspeed.moe.layer.MoE"
TRAIN_SCHEDULE = "deepspeed.runtime.pipe.schedule.TrainSchedule"
BASE_OPTIMIZER = "deepspeed.runtime.base_optimizer"

REFERENCE = "tests/test_training.py::test_training_matches_single_process_reference"
BF16_MOVES = "tests/test_training.py::test_bf16_zero1_trains_resumes_and_moves_between_layouts"
EP_ZERO1 = "tests/test_expert_parallel_training.py::test_expert_parallel_under_zero1_and_bf16"
EP_RESUME = "tests/test_expert_parallel_training.py::test_expert_parallel_checkpoint_resumes_with_any_ep"
NAN = "tests/test_faults.py::test_nan_loss_stops_and_keeps_last_checkpoint"
SCHEDULES = "tests/test_schedules.py::test_schedule_trains_as_1f1b_and_the_reference"
ZB_STEPS = "tests/test_schedules.py::test_zero_bubble_keeps_1f1b_communication_and_runs_every_weight_pass"
STAGE_BUILD = "tests/test_pipeline_run.py::test_each_rank_builds_and_reads_only_its_stage"
ASYNC_KILL = "tests/test_async_saves.py::test_sigkill_mid_write_or_mid_commit_resumes_bit_identically"
TP_MOVES = "tests/test_tp_training.py::test_resume_moves_across_tp_and_pp"
CP_DPO = "tests/test_dpo.py::test_dpo_training_matches_single_process_reference"
NEW_SCHEDULE = "tests/test_engine_config.py::test_resume_follows_the_new_schedule_settings"
EP_SAVES = "tests/test_expert_parallel_training.py::test_saves_gather_one_sparse_layer_at_a_time"

# fmt: off
PATCHES: tuple[Patch, ...] = (
    # --- the engine (training/engine.py) ---
    Patch(LAMBDA_LR, "_last_lr", "set", "training/engine.py follow_new_schedule",
          "DeepSpeed holds our LambdaLR: after a resume its last rates follow this run's schedule settings",
          NEW_SCHEDULE, read_by="torch.optim.lr_scheduler"),
    Patch(LAMBDA_LR, "base_lrs", "set", "training/engine.py follow_new_schedule",
          "the restored schedule's base rate replaced by this run's learning_rate",
          NEW_SCHEDULE, read_by="torch.optim.lr_scheduler"),
    Patch(PIPE_MODULE, "universal_checkpoint_info", "set", "training/engine.py build_module",
          "read by `DeepSpeedEngine._save_checkpoint` (getattr UNIVERSAL_CHECKPOINT_INFO): how each parameter merges "
          "across TP ranks in a universal checkpoint", BF16_MOVES, read_by="deepspeed.checkpoint.constants"),
    Patch(PIPE_ENGINE, "_allocate_or_extend_buffers", "replaced", "training/engine.py keep_buffer_dtypes",
          "a reused receive buffer of another dtype is reallocated (an fp32 gradient read into an int64 buffer)",
          TP_MOVES),
    Patch(PIPE_ENGINE, "_grad_layer_buf", "read", "training/engine.py keep_buffer_dtypes",
          "the receive buffers, by position, that the replacement above checks", TP_MOVES),
    Patch(PIPE_ENGINE, "_allocate_buffer", "read", "training/engine.py keep_buffer_dtypes",
          "allocates the replacement buffer", TP_MOVES),
    Patch(PIPE_MODULE, "loss_fn", "set", "training/backward_prologue.py prologue_on_the_loss",
          "the last stage's loss wrapped: DeepSpeed's backward prologue (the bf16 optimizer clears its low-precision "
          "gradients) hooked on the loss, since the stage's output is the head's HeadOutput, no tensor",
          BF16_MOVES, read_by="deepspeed.runtime.pipe.engine"),
    Patch(ENGINE, "_backward_prologue", "read", "training/backward_prologue.py LossWithPrologue",
          "the prologue DeepSpeed's forward hooks on output tensors; hooked on the loss instead", BF16_MOVES),
    Patch(ENGINE, "_backward_prologue_per_tensor", "read", "training/backward_prologue.py LossWithPrologue",
          "its per-tensor half (a gradient not yet scaled by the micro-batch count)", BF16_MOVES),
    Patch("deepspeed.runtime.utils", "register_output_backward_hooks", "read",
          "training/backward_prologue.py LossWithPrologue", "hooks the prologue on the loss as on an output",
          BF16_MOVES),
    Patch(TORCH_TENSOR, "_backward_hook_managers", "read", "training/backward_prologue.py LossWithPrologue",
          "the managers DeepSpeed hangs on the router statistics beside the head's output: their hooks removed",
          BF16_MOVES, read_by="deepspeed.runtime.utils"),
    Patch(ENGINE, "_copy_recovery_script", "replaced", "training/engine.py initialize_engine",
          "no zero_to_fp32.py in our checkpoints: it cannot read pipeline layer files", BF16_MOVES),
    Patch(ADAMW, "overflow", "set", "training/engine.py initialize_engine",
          "DeepSpeed's fp32 path reads `optimizer.overflow` to skip the LR step: set on a non-finite norm",
          NAN, read_by="deepspeed.runtime.engine"),
    Patch(ADAMW, "step", "replaced", "training/engine.py initialize_engine",
          "fp32 ZeRO-0: no update from a non-finite gradient, as DeepSpeed's bf16/fp16 optimizers skip one",
          NAN, read_by="deepspeed.runtime.engine"),
    Patch(ENGINE, "_global_grad_norm", "set", "training/engine.py initialize_engine",
          "the fp32 path clips without recording the norm that `get_global_grad_norm` reports", REFERENCE),
    Patch(ENGINE, "clip_fp32_gradients", "replaced", "training/engine.py initialize_engine",
          "DeepSpeed's clip_grad_norm_, plus the norm recorded and a non-finite one marked an overflow", REFERENCE),
    Patch(TENSOR, "model_parallel", "set", "training/engine.py initialize_engine",
          "read by `deepspeed.runtime.utils.is_model_parallel_parameter`: each parameter counted once in the norm",
          REFERENCE, read_by="deepspeed.runtime.utils"),
    Patch(PIPE_MODULE, "_synchronize_tied_weights", "read", "training/engine.py build_module",
          "fresh weights: the tied embedding and head equal on both stages", REFERENCE),
    # --- experts (training/expert_parallel.py) ---
    Patch(TENSOR, "ds_optim_param", "set", "training/expert_parallel.py keep_from_broadcast",
          "`DeepSpeedEngine._broadcast_model` skips such parameters: each rank keeps its own experts",
          EP_RESUME, read_by="deepspeed.runtime.engine"),
    Patch(GROUPS, "_EXPERT_PARALLEL_GROUP", "set", "training/expert_parallel.py register",
          "our EP group under DeepSpeed's name for it (ep_size_E)", EP_ZERO1),
    Patch(GROUPS, "_EXPERT_PARALLEL_GROUP_RANKS", "set", "training/expert_parallel.py register",
          "its ranks", EP_ZERO1),
    Patch(GROUPS, "_EXPERT_DATA_PARALLEL_GROUP", "set", "training/expert_parallel.py register",
          "our expert-data group: expert gradients reduced and their state sharded over it", EP_ZERO1),
    Patch(GROUPS, "_EXPERT_DATA_PARALLEL_GROUP_RANKS", "set", "training/expert_parallel.py register",
          "its ranks", EP_ZERO1),
    Patch(GROUPS, "expert_tensor_parallel_world_size", "set", "training/expert_parallel.py register",
          "experts split over TP too: their norm summed over the model-parallel group", EP_ZERO1),
    Patch(TENSOR, "allreduce", "set", "training/expert_parallel.py register",
          "read by `deepspeed.moe.utils.is_moe_param`: experts get optimizer groups of their own",
          EP_ZERO1, read_by="deepspeed.moe.utils"),
    Patch(TENSOR, "group_name", "set", "training/expert_parallel.py register",
          "the expert group's name, as DeepSpeed's MoE layers mark theirs", EP_ZERO1, read_by="deepspeed.moe.utils"),
    Patch(MOE, "__init__", "overridden", "training/expert_parallel.py _ExpertsMarker",
          "a marker without parameters; `DeepSpeedEngine._configure_distributed_model` looks for an MoE instance",
          EP_ZERO1),
    Patch(MOE, "set_deepspeed_parallelism", "overridden", "training/expert_parallel.py _ExpertsMarker",
          "our groups are registered already: nothing to set up", EP_ZERO1),
    Patch(MOE, "forward", "overridden", "training/expert_parallel.py _ExpertsMarker",
          "never run", EP_ZERO1),
    Patch(PIPE_MODULE, "deepspeed_moe_marker", "added", "training/expert_parallel.py deepspeed_sees_experts",
          "the marker's submodule name, around `deepspeed.initialize` only", EP_ZERO1),
    Patch(ENGINE, "has_moe_layers", "set", "training/expert_parallel.py checkpoint_files_as_ours",
          "False around save and load: DeepSpeed writes our layer files, not one file per expert", EP_ZERO1),
    Patch(ENGINE, "_get_gradients_for_reduction", "replaced", "training/expert_parallel.py attach",
          "fp32 ZeRO-0 under EP: experts left out of the data-parallel all-reduce", EP_RESUME),
    Patch(ENGINE, "allreduce_gradients", "replaced", "training/expert_parallel.py attach",
          "then the experts all-reduced over their expert-data group", EP_RESUME),
    Patch(ENGINE, "_global_grad_norm", "set", "training/expert_parallel.py attach",
          "the norm with every expert counted once", EP_RESUME),
    Patch(ADAMW, "overflow", "set", "training/expert_parallel.py attach",
          "a non-finite norm skips the step", EP_RESUME, read_by="deepspeed.runtime.engine"),
    Patch(ENGINE, "clip_fp32_gradients", "replaced", "training/expert_parallel.py attach",
          "the EP-aware norm and clip", EP_RESUME),
    Patch(BF16, "get_grads_for_norm", "replaced", "training/expert_parallel.py count_whole_experts_once",
          "expert tensors whole on every TP rank (gpt-oss's down biases) counted once in the norm", EP_ZERO1),
    Patch(BF16, "fp32_groups_gradients", "read", "training/expert_parallel.py count_whole_experts_once",
          "the gradients the replacement above counts", EP_ZERO1),
    Patch(PIPE_MODULE, "save_state_dict", "replaced", "training/expert_parallel.py _gathered_while_saving",
          "one sparse layer's experts gathered over EP just before DP rank 0 writes it", EP_SAVES),
    Patch(BF16, "load_hp_checkpoint_state_from_checkpoint_dir", "replaced",
          "training/expert_parallel.py universal_load_by_name",
          "a universal resume with experts reads each group's state by parameter name, not group position", EP_ZERO1),
    Patch(ZERO12, "load_hp_checkpoint_state_from_checkpoint_dir", "replaced",
          "training/expert_parallel.py universal_load_by_name",
          "the same, for ZeRO-1's optimizer", EP_ZERO1),
    Patch(LAMBDA_LR, "load_state_dict", "replaced", "training/expert_parallel.py universal_load_by_name",
          "DeepSpeed restores our scheduler: its per-group lists fitted to this run's group count",
          EP_ZERO1, read_by="deepspeed.runtime.engine"),
    Patch(BF16, "_load_global_state", "read", "training/expert_parallel.py universal_load_by_name",
          "called as DeepSpeed's own loader does", EP_ZERO1),
    Patch(BASE_OPTIMIZER, "_get_universal_checkpoint_ep_info", "read",
          "training/expert_parallel.py universal_load_by_name",
          "which parameters are experts, as DeepSpeed reads it", EP_ZERO1),
    Patch(TENSOR, "_hp_mapping", "read", "training/expert_parallel.py universal_load_by_name",
          "what DeepSpeed's `link_hp_params` gives each parameter: its optimizer state's keys",
          EP_ZERO1, read_by="deepspeed.utils.mixed_precision_linkage"),
    # --- saves (training/saving.py, checkpoint/) ---
    Patch(ENGINE, "checkpoint_engine", "set", "training/saving.py Saver._snapshot",
          "for one save_checkpoint, our SnapshotEngine: states copied to host buffers, written in the background",
          ASYNC_KILL),
    Patch(CKPT_ENGINE, "save", "overridden", "training/saving.py SnapshotEngine",
          "copies each state into host buffers and writes nothing", ASYNC_KILL),
    Patch(CKPT_ENGINE, "load", "overridden", "training/saving.py SnapshotEngine",
          "never used to load", ASYNC_KILL),
    Patch(CKPT_ENGINE, "create", "overridden", "training/saving.py SnapshotEngine",
          "nothing to open", ASYNC_KILL),
    Patch(CKPT_ENGINE, "commit", "overridden", "training/saving.py SnapshotEngine",
          "our writer commits (publish by rename)", ASYNC_KILL),
    Patch(CKPT_ENGINE, "preserves_storage_sharing", "overridden", "training/saving.py SnapshotEngine",
          "read by `PipelineModule.save_state_dict`: our snapshot copies tensors compactly", ASYNC_KILL),
    Patch(CKPT_ENGINE, "__init__", "overridden", "training/saving.py SnapshotEngine",
          "holds the snapshot", ASYNC_KILL),
    Patch(TORCH_CKPT_ENGINE, "load", "replaced", "checkpoint/layer_files.py layer_files_as_plain_data",
          "layer files read as plain memory-mapped tensors during load_checkpoint, never unpickled",
          "tests/test_security.py::test_resume_loads_our_own_files_safely"),
    Patch(ENGINE, "global_steps", "set", "checkpoint/optimizer_reshape.py load_moved_state",
          "a ZeRO-0 layout move: the counters taken from the old engine files (with global_samples, skipped_steps)",
          "tests/test_training.py::test_fp32_zero0_checkpoint_moves_between_layouts"),
    Patch("deepspeed.checkpoint.deepspeed_checkpoint.DeepSpeedCheckpoint", "get_zero_checkpoint_state", "replaced",
          "checkpoint/muon_universal.py momentum_as_first_moment",
          "within a universal conversion of a Muon run only: each Muon group's momentum read as Adam's exp_avg, so "
          "DeepSpeed's converter merges it by its own rules (restored after)",
          "tests/test_muon_training.py::test_muon_under_bf16_zero1_follows_the_fp32_run"),
    Patch(UNIVERSAL, "_extract_zero_shard_files", "read", "checkpoint/expert_universal.py convert",
          "its ZeRO-1/2 conversion, run per expert group (also _merge_tp_slice_files, _save_optimizer_state, "
          "_inject_missing_state, _check_for_required_state, _group_per_tp_shapes, _aggregate_autoep_zero12_metadata)",
          EP_ZERO1),
    Patch(UNIVERSAL, "_merge_tp_slice_files", "read", "checkpoint/expert_universal.py convert",
          "as above", EP_ZERO1),
    Patch(UNIVERSAL, "_save_optimizer_state", "read", "checkpoint/expert_universal.py convert",
          "as above", EP_ZERO1),
    Patch(UNIVERSAL, "_inject_missing_state", "read", "checkpoint/expert_universal.py convert",
          "as above", EP_ZERO1),
    Patch(UNIVERSAL, "_check_for_required_state", "read", "checkpoint/expert_universal.py convert",
          "as above", EP_ZERO1),
    Patch(UNIVERSAL, "_group_per_tp_shapes", "read", "checkpoint/expert_universal.py convert",
          "as above", EP_ZERO1),
    Patch(UNIVERSAL, "_aggregate_autoep_zero12_metadata", "read", "checkpoint/expert_universal.py convert",
          "as above", EP_ZERO1),
    # --- schedules (training/zero_bubble_engine.py, training/schedules.py) ---
    Patch(PIPE_ENGINE, "__class__", "replaced", "training/zero_bubble_engine.py make_zero_bubble",
          "a built 1F1B engine becomes the zero-bubble one", SCHEDULES),
    Patch(PIPE_ENGINE, "store", "added", "training/zero_bubble_engine.py make_zero_bubble",
          "the engine's WeightGradStore", SCHEDULES),
    Patch(PIPE_ENGINE, "_grad_recv_buffer", "added", "training/zero_bubble_engine.py ZeroBubbleEngine",
          "the kept receive buffer a deferred weight gradient must not see overwritten", SCHEDULES),
    Patch(PIPE_ENGINE, "grad_layer", "set", "training/zero_bubble_engine.py ZeroBubbleEngine",
          "back-propagate a clone of the received gradient", SCHEDULES),
    Patch(PIPE_ENGINE, "_train_schedule", "overridden", "training/zero_bubble_engine.py ZeroBubbleEngine",
          "the zero-bubble schedule", SCHEDULES),
    Patch(PIPE_ENGINE, "_exec_backward_pass", "overridden", "training/zero_bubble_engine.py ZeroBubbleEngine",
          "B only, W deferred", SCHEDULES),
    Patch(PIPE_ENGINE, "_exec_recv_grads", "overridden", "training/zero_bubble_engine.py ZeroBubbleEngine",
          "receive into the kept buffer", SCHEDULES),
    Patch(PIPE_ENGINE, "reset_activation_shape", "overridden", "training/zero_bubble_engine.py ZeroBubbleEngine",
          "also drops the kept buffer", SCHEDULES),
    Patch(PIPE_ENGINE, "_exec_weight_pass", "added", "training/zero_bubble_engine.py ZeroBubbleEngine",
          "the W instruction's handler", SCHEDULES),
    Patch(PIPE_ENGINE, "_INSTRUCTION_MAP", "overridden", "training/zero_bubble_engine.py ZeroBubbleEngine",
          "its functions: BackwardPass and RecvGrad remapped, WeightPass added", SCHEDULES),
    Patch(TRAIN_SCHEDULE, "steps", "overridden", "training/schedules.py ZeroBubbleSchedule",
          "WeightPass where the stage would idle", ZB_STEPS),
    # --- the pipeline module (models/pipeline.py), context parallelism (models/context_parallel.py) ---
    Patch(PIPE_MODULE, "_partition_layers", "overridden", "models/pipeline.py PipelineStageModule",
          "precomputed stage bounds, and the TP / EP / CP groups", STAGE_BUILD),
    Patch(PIPE_MODULE, "_get_frozen_parameter_names", "overridden", "models/pipeline.py PipelineStageModule",
          "LoRA saves: frozen names of sparse layers as their layer files' keys",
          "tests/test_lora.py::test_lora_on_a_model_with_experts_matches_peft"),
    Patch(PIPE_MODULE, "forward", "overridden", "models/pipeline.py PipelineStageModule",
          "carried view tensors made contiguous before the send", REFERENCE),
    Patch(PIPE_MODULE, "__init__", "overridden", "models/pipeline.py PipelineStageModule",
          "our attributes set before DeepSpeed's __init__ partitions and builds", STAGE_BUILD),
    Patch(PIPE_MODULE, "parts", "set", "models/pipeline.py PipelineStageModule._partition_layers",
          "the stage bounds", STAGE_BUILD),
    Patch(PIPE_MODULE, "_set_bounds", "read", "models/pipeline.py PipelineStageModule._partition_layers",
          "(and _topo, _grid, _layer_specs, _local_start, _local_stop)", STAGE_BUILD),
    Patch(PIPE_MODULE, "local_layer_indices", "added", "models/pipeline.py PipelineStageModule",
          "ours", STAGE_BUILD),
    Patch(PIPE_MODULE, "phases", "added", "models/pipeline.py PipelineStageModule",
          "ours", STAGE_BUILD),
    Patch(PIPE_MODULE, "activate_phase", "added", "models/pipeline.py PipelineStageModule",
          "a no-op before DualPipeVModule's in the MRO", STAGE_BUILD),
    Patch(DUALPIPE_MODULE, "_partition_layers", "overridden", "models/pipeline.py DualPipeStageModule",
          "DeepSpeed's body over precomputed bounds", SCHEDULES),
    Patch(DUALPIPE_MODULE, "activate_phase", "overridden", "models/pipeline.py DualPipeStageModule",
          "delegates past PipelineStageModule's no-op", SCHEDULES),
    Patch(DUALPIPE_MODULE, "phase_bounds", "set", "models/pipeline.py DualPipeStageModule._partition_layers",
          "as DeepSpeed's own (with num_stages doubled)", SCHEDULES),
    Patch(ULYSSES, "forward", "overridden", "models/context_parallel.py UlyssesAttention",
          "any batch (the shape checks fixed at construction follow it), MLA's narrower value heads padded", CP_DPO),
    Patch(ULYSSES, "required_query_shape", "set", "models/context_parallel.py UlyssesAttention.forward",
          "follows the batch", CP_DPO),
    Patch(ULYSSES, "batch_size", "set", "models/context_parallel.py UlyssesAttention.forward",
          "the shape checks follow the batch", CP_DPO),
    Patch(ULYSSES, "required_key_value_shape", "set", "models/context_parallel.py UlyssesAttention.forward",
          "the shape checks follow the batch", CP_DPO),
    Patch(ULYSSES, "required_context_shape", "set", "models/context_parallel.py UlyssesAttention.forward",
          "the shape checks follow the batch", CP_DPO),
    Patch(DUALPIPE_MODULE, "num_stages", "set", "models/pipeline.py DualPipeStageModule._partition_layers",
          "doubled, as DeepSpeed's own _partition_layers does (two phases a rank)", SCHEDULES),
    Patch(MOE, "num_experts", "set", "training/expert_parallel.py _ExpertsMarker",
          "what DeepSpeed's engine reads from an MoE layer (`_configure_distributed_model`)", EP_ZERO1),
    # --- start-up (training/distributed.py) ---
    Patch("deepspeed.ops", "__compatible_ops__", "set", "training/distributed.py _without_shm_all_reduce",
          "deepspeed_shm_comm marked unavailable: init_distributed does not JIT-build the CPU shm all-reduce",
          STAGE_BUILD, read_by="deepspeed.comm.torch"),
)
# fmt: on
