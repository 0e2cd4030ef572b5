"""Typed run configuration, registered in hydra's ConfigStore so a misspelt key fails at start-up.

The parts of other owners sit beside it (schema/model.py: `model`, `lora`; schema/data.py: `data`); this module
composes them with the training settings, and owns the values derived from them (the functions below). Precedence:
dataclass defaults < `conf/*.yaml` (groups model/, data/, deepspeed/, experiment/) < command-line overrides.
The config is passed explicitly; nothing reads a global. Checks of values: schema/checks.py (the config alone)
and training/validate.py (against the model and the launch).
The comment on each field is its line in docs/configuration.md (`python -m tools.config_reference`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore

from schema.choice import Choice
from schema.data import SEQUENCES_PER_PAIR, DataConfig
from schema.model import LoraSettings, LossType, ModelSettings

RESUME_MODES = ("true", "false", "auto")

# NOTE: the functional form because "1f1b" is no Python identifier; omegaconf matches members by name.
PipelineSchedule = Choice("PipelineSchedule", [(name, name) for name in ("1f1b", "zero_bubble", "dualpipev")])


class Objective(Choice):
    sft = "sft"  # next-token loss on rows
    dpo = "dpo"  # preference pairs (the `dpo` settings)


class Precision(Choice):
    auto = "auto"  # bf16 on a bf16-capable GPU, fp16 on other GPUs, fp32 on CPU
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class AccumDtype(Choice):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class Scheduler(Choice):
    cosine = "cosine"
    linear = "linear"
    constant = "constant"


class OptimizerName(Choice):
    adamw = "adamw"  # AdamW for every parameter
    muon = "muon"  # Muon for the decoder layers' matrices, AdamW for the rest (training/muon.py)


class MuonLr(Choice):
    match_rms_adamw = "match_rms_adamw"  # lr x 0.2 sqrt(max(A, B)): AdamW's learning rate carries over (Moonlight)
    original = "original"  # lr x sqrt(max(1, A / B)) (Keller Jordan's)


class NsDtype(Choice):
    bf16 = "bf16"  # torch.optim.Muon's
    fp32 = "fp32"  # reproducible across layouts to fp32 rounding (bf16 turns summation-order noise into 0.5% steps)


class NonFinite(Choice):
    stop = "stop"  # a NaN/inf loss ends the run without saving (last checkpoint kept)
    skip = "skip"  # skip that step's update and go on


@dataclass
class DeepSpeedConfig:
    """What goes into the DeepSpeed engine config (see `training.engine.deepspeed_config`)."""

    precision: Precision = Precision.auto  # auto: bf16 on a bf16-capable GPU, fp16 on other GPUs, fp32 on CPU
    zero_stage: int | None = None  # None: 1 on GPU, 0 on CPU; the pipeline engine allows <= 1
    offload_optimizer: bool = False  # CPU offload; DeepSpeed supports it under PP with fp16 only
    grad_accum_dtype: AccumDtype | None = None  # gradient accumulation dtype; None: fp32 when precision is bf16
    initial_scale_power: int = 16  # fp16 dynamic loss scale start, 2**N
    steps_per_print: int = 1_000_000  # DeepSpeed's own console line; we log every step ourselves
    wall_clock_breakdown: bool = False  # DeepSpeed's timing of forward, backward and step in its log


@dataclass
class OptimConfig:
    # adamw; or muon: the decoder layers' matrices (each expert's, each part of a fused projection) by Muon, the rest
    # (embeddings, head, norms, biases, every 1-D tensor) by AdamW with the settings below (docs/training.md)
    name: OptimizerName = OptimizerName.adamw
    weight_decay: float = 0.0  # decoupled weight decay (AdamW's and Muon's)
    beta1: float = 0.9  # AdamW's first-moment decay
    beta2: float = 0.95  # AdamW's second-moment decay
    eps: float = 1e-8  # AdamW's denominator term
    max_grad_norm: float = 1.0  # 0 disables clipping
    lr_scheduler: Scheduler = Scheduler.cosine  # the learning rate after warm-up, down to min_lr_ratio x lr
    warmup_steps: int = 0  # linear warm-up from 0 over this many steps
    warmup_ratio: float = 0.0  # used when warmup_steps == 0
    min_lr_ratio: float = 0.1  # where cosine and linear decay end, as a fraction of learning_rate
    muon_momentum: float = 0.95  # Muon's momentum (torch.optim.Muon's)
    muon_nesterov: bool = True  # Muon's Nesterov momentum
    muon_ns_steps: int = 5  # Newton-Schulz iterations per orthogonalisation
    # The Newton-Schulz iteration's dtype: bf16 as torch.optim.Muon; fp32 where runs in different layouts must agree
    # (bf16 rounding turns the 1e-7 summation-order differences of two layouts' gradients into 0.5%-of-a-weight steps)
    muon_ns_dtype: NsDtype = NsDtype.bf16
    muon_adjust_lr: MuonLr = MuonLr.match_rms_adamw  # each matrix's step size from learning_rate and its shape


@dataclass
class DpoConfig:
    """Preference tuning (`objective=dpo`): the loss on pairs and the reference whose log-probs it compares against."""

    beta: float = 0.1  # DPO's KL strength; IPO's tau; SimPO's reward scale
    loss_type: LossType = LossType.sigmoid  # sigmoid (DPO), ipo, simpo (reference-free, length-normalised)
    gamma: float = 0.5  # SimPO's target reward margin (TRL's simpo_gamma)
    sft_weight: float = 0.0  # adds the chosen completions' NLL with this weight (TRL's "sft" loss term, rpo_alpha)
    # An HF directory or a pipeline checkpoint; None: the starting weights (model_name_or_path; with LoRA, the base
    # without adapters). Its log-probs are computed once, before training, and cached beside the tokenized data.
    reference_model: str | None = None


@dataclass
class MoeConfig:
    """Mixture-of-experts models (models/moe.py; the families with a `MoeSpec`, docs/moe.md)."""

    # Weight of transformers' load-balancing loss, added per micro-batch over every sparse layer of the model. None:
    # the model config's router_aux_loss_coef when its output_router_logits is true, else 0 (as transformers does).
    aux_loss_coef: float | None = None
    # Llama 4: run each expert on its routed tokens only (one grouped matmul), not every expert on every token with
    # the others' inputs scaled by 0 as transformers does: the same model within fp32 rounding, E / k times less
    # expert compute and activation memory. Always so under expert parallelism; other families always route.
    routed_experts: bool = False
    # DeepSeek-V3's auxiliary-loss-free balancing (deepseek_v3, glm4_moe): after every optimizer step each sparse
    # layer's `e_score_correction_bias` moves by this much toward the experts that got fewer tokens than the mean
    # (models/moe.py `balance`), from the step's loads over the whole global batch. 0: the bias stays as loaded.
    bias_update_rate: float = 0.0


@dataclass
class CheckpointConfig:
    """How saves run (training/saving.py)."""

    # true: the loop is blocked only while the state is copied into host buffers; files are written in the background
    # and published at a later step boundary once every rank's are durable. false: written and published in the call.
    async_save: bool = True


@dataclass
class TrainConfig:
    # a converted pipeline checkpoint (convert2ckpt.py), an HF directory, or a Hub id (ORG/NAME, converted at load)
    model_name_or_path: str | None = None
    tokenizer_name_or_path: str | None = None  # a directory or Hub id; default: model_name_or_path
    model_revision: str | None = None  # the branch, tag or commit of Hub ids in model/tokenizer/reference paths
    # A recipe's model shape (conf/model/NAME) for planning or a run from scratch: taken only when neither
    # model_name_or_path nor model= gives one, so a recipe runs any checkpoint of its layout's size.
    plan_model: str | None = None
    output_dir: str = "outputs/run"  # checkpoints, metrics.jsonl, logs, the resolved train_config.yaml
    num_stages: int = 1  # pipeline stages (PP); world = PP x TP x CP x DP
    # 1f1b (DeepSpeed's), zero_bubble (weight gradients deferred into the bubble), dualpipev (two stages per rank
    # in a V, DeepSpeed's; needs gradient_accumulation_steps >= 2 x num_stages).
    pipeline_schedule: PipelineSchedule = PipelineSchedule["1f1b"]
    tensor_parallel_size: int = 1  # TP ranks per stage (adjacent ranks, one node): world = PP x TP x DP
    # Models with experts: split each sparse block's experts over this many data-parallel ranks of a stage (E must
    # divide the DP size and the number of experts); tokens reach their experts by all-to-all.
    expert_parallel_size: int = 1
    # Context parallelism (DeepSpeed-Ulysses): C ranks of a stage hold the same rows, each seq_length / C positions,
    # from the embedding to the loss; attention trades them for heads by all-to-all. World = PP x TP x CP x DP.
    context_parallel_size: int = 1
    # With TP: each TP rank holds seq_length / TP positions between the split regions (norms, residual stream,
    # stage-to-stage tensors). None: on whenever tensor_parallel_size > 1; false: every rank holds them all.
    sequence_parallel: bool | None = None
    # A path (.jsonl, .json, .parquet, a datasets directory) or a list of them.
    # NOTE: Any because omegaconf has no unions.
    train_file: Any = None
    eval_file: Any = None  # held-out rows (or pairs), as train_file
    do_train: bool = True  # false: evaluate only
    do_eval: bool | None = None  # None: evaluate when eval_file is given
    max_steps: int = -1  # > 0 overrides num_train_epochs
    num_train_epochs: int = 1  # passes over the train set when max_steps is -1
    seq_length: int = 512  # tokens per row; longer rows are truncated (or packed rows filled to it)
    micro_batch_size: int = 1  # rows (DPO: pairs) per micro-batch per data-parallel rank
    gradient_accumulation_steps: int = 1  # micro-batches per optimizer step (the pipeline's micro-batches)
    eval_micro_batch_size: int | None = None  # default: micro_batch_size
    learning_rate: float = 2e-5  # peak learning rate (AdamW's; Muon's before optim.muon_adjust_lr)
    seed: int = 42  # the data order, the mixture and initial weights (from-scratch runs, LoRA adapters)
    save_steps: int = 0  # 0: save only at the end
    save_manifest: bool = True  # sizes, hashes and tensor shapes of every saved file (convert2ckpt.py --verify)
    eval_steps: int = 0  # 0: evaluate only at the end
    # false: a fresh run; true: continue from the newest checkpoint in output_dir; auto: if there is one.
    # NOTE: a string, not an Enum: omegaconf reads `resume=true` as a boolean before an Enum could see it.
    resume: str = "false"
    resume_from: str | None = None  # global_stepN: resume this (older) checkpoint on purpose; newer ones move aside
    overwrite_output_dir: bool = False  # a fresh run into an output_dir with checkpoints moves the earlier run aside
    nonfinite_loss: NonFinite = NonFinite.stop  # what a NaN or inf loss does (stop: end without saving)
    keep_last_n: int = 0  # keep only the newest N checkpoints (never the one `latest` names); 0: keep all
    logging_steps: int = 1  # a log line and a metrics.jsonl record every N steps
    log_all_ranks: bool = False  # INFO lines from every rank (default: rank 0 and the reporting rank)
    progress_bar: bool = True  # one tqdm bar on the reporting rank, when stderr is a terminal
    report_to: list[str] = field(default_factory=list)  # also send metrics to: tensorboard, wandb
    dist_timeout_minutes: float = 30.0  # a collective waiting this long for a failed/hung rank errors out
    dist_init_timeout_minutes: float = 5.0  # start-up: every rank must reach the job's rendezvous within this
    model: ModelSettings = field(default_factory=ModelSettings)
    data: DataConfig = field(default_factory=DataConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    lora: LoraSettings = field(default_factory=LoraSettings)
    objective: Objective = Objective.sft  # sft: next-token loss on rows; dpo: preference pairs (the `dpo` settings)
    dpo: DpoConfig = field(default_factory=DpoConfig)
    moe: MoeConfig = field(default_factory=MoeConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


def register_configs() -> None:
    """Register the schemas in hydra's ConfigStore, once per process (35-47 ms: a fork of a process that did it, as
    the tests' fork server, finds them there)."""
    cs = ConfigStore.instance()
    if "train_schema.yaml" in cs.repo and "deepspeed_schema.yaml" in cs.repo.get("deepspeed", {}):
        return
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(group="model", name="model_schema", node=ModelSettings)
    cs.store(group="data", name="data_schema", node=DataConfig)
    cs.store(group="deepspeed", name="deepspeed_schema", node=DeepSpeedConfig)


def tokenizer_sources(cfg: TrainConfig) -> list[tuple[str, str | None]]:
    """(key, value) of `tokenizer_name_or_path` and `model_name_or_path`, in the order the tokenizer is looked for."""
    return [("tokenizer_name_or_path", cfg.tokenizer_name_or_path), ("model_name_or_path", cfg.model_name_or_path)]


def resume_mode(cfg: TrainConfig) -> str:
    """`resume` as one of RESUME_MODES ("True" from a YAML boolean reads as "true"); `resume_from` means true."""
    return "true" if cfg.resume_from else str(cfg.resume).lower()


def sequence_parallel(cfg: TrainConfig) -> bool:
    """Whether the run shards the sequence over its TP ranks (`sequence_parallel`; default: whenever TP > 1)."""
    return cfg.tensor_parallel_size > 1 and cfg.sequence_parallel is not False


def evaluating(cfg: TrainConfig) -> bool:
    """Whether the run evaluates: `do_eval` when set, else whenever an eval_file is given."""
    return cfg.do_eval if cfg.do_eval is not None else cfg.eval_file is not None


def model_stages(schedule: str, num_stages: int) -> int:
    """Stages the model is cut into: DualPipeV's ranks hold two each (rank r: stages r and 2p-1-r)."""
    return 2 * num_stages if schedule == "dualpipev" else num_stages


def min_micro_batches(schedule: str, num_stages: int) -> int:
    """Micro-batches per step the schedule needs (DeepSpeed's DualPipeV schedule refuses fewer than 2p)."""
    return model_stages(schedule, num_stages) if schedule == "dualpipev" else 1


def eval_micro_batch_size(cfg: TrainConfig) -> int:
    """Samples per evaluation micro-batch: `eval_micro_batch_size`, default `micro_batch_size`."""
    return cfg.eval_micro_batch_size or cfg.micro_batch_size


def sequences_per_sample(cfg: TrainConfig) -> int:
    """Sequences the pipeline runs per sample: a DPO pair's chosen and rejected, or one row."""
    return SEQUENCES_PER_PAIR if cfg.objective == "dpo" else 1


def sequence_shards(cfg: TrainConfig) -> int:
    """How many equal parts the sequence dimension is cut into between stages: CP ranks, times TP ranks with sequence
    parallelism."""
    return cfg.context_parallel_size * (cfg.tensor_parallel_size if sequence_parallel(cfg) else 1)


def padded_seq_length(cfg: TrainConfig) -> int:
    """The length every batch row is padded to: `seq_length` rounded up to a multiple of `sequence_shards`.
    The padding is ignored by the loss and masked from every real token (it comes after them)."""
    shards = sequence_shards(cfg)
    return -(-cfg.seq_length // shards) * shards
