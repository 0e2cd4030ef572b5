"""Building a run from its config: topology, model config, data, the stage, the engine, a resume.

Every piece of set-up that can fail on some ranks only (rank 0 counts and tokenizes, each stage reads
its own layer files, data ranks load the tokenizer) runs inside `agreed()`: all ranks learn of a failure
and exit with the same one line (training/distributed.py).
"""

from __future__ import annotations

import functools
import logging
import os

import torch.distributed as dist

from checkpoint.dequantize import is_quantized
from checkpoint.hf_reader import is_hf_dir
from checkpoint.kept_quantized import hold_hub_weights
from checkpoint.names import CARRIED_FILE, CONTAINER_CONFIG, LORA_FILE
from checkpoint.saves import clean_stale, read_tag, written_saves
from common.hub import is_hub_id, resolve_once
from data.chat import configure_chat_template
from data.collator import CausalLMCollator
from data.pair_dataset import PairCollator
from data.sources import hub_dataset, is_hub_dataset, paths_of
from models.config import check_preset, config_from_preset, load_hf_config
from models.families import resolve_attention
from models.frozen_weights import held_bytes
from models.lora import add_lora, parallelize_lora
from models.loss import CausalLMLoss
from models.moe import WithAuxLoss, default_aux_loss_coef, is_moe, num_experts
from models.nf4 import quantize_stage
from models.partition import stage_bounds
from models.preference import PreferenceLoss, PreferenceSettings
from models.tensor_parallel import TensorParallel, token_cross_entropy_for, vocab_parallel
from models.tokenizer import check_tokenizer_fits, configured_tokenizer
from models.vocab_parallel_loss import vocab_parallel_cross_entropy
from schema.frozen import freeze
from schema.train import TrainConfig, model_stages, padded_seq_length, sequence_parallel, tokenizer_sources
from training import checkpointing
from training.data_setup import data_state, load_data, pad_id, write_data_report
from training.distributed import LAUNCH, agreed, init_distributed, ranks_work
from training.engine import build_module, describe_auto_precision, initialize_engine
from training.errors import RunError
from training.logs import configure_logging, log_to_file
from training.precision import resolve
from training.reference_logps import attach_reference, needs_reference
from training.rendezvous import job_key
from training.run_dir import check_paths, prepare_output_dir, roll_back
from training.run_state import Run
from training.saving import publish
from training.topology import Coords
from training.validate import validate, validate_layout

log = logging.getLogger("trainer")


def _loss_fn(cfg: TrainConfig, model_config, tp: TensorParallel):
    """The last stage's loss: `CausalLMLoss`, or `PreferenceLoss` for objective=dpo; through the vocab-parallel
    cross-entropy when the head is split (no rank holds [B, S, V] logits; padded rows never reach the loss)."""
    split = vocab_parallel(model_config, tp)
    if cfg.objective == "dpo":
        loss = PreferenceLoss(
            PreferenceSettings.of(cfg.dpo),
            token_cross_entropy_for(model_config, tp),
            cfg.model.loss_chunk_size,
            cfg.model.fused_head_loss,
        )
    else:
        cross_entropy = None
        if split:
            cross_entropy = functools.partial(vocab_parallel_cross_entropy, tp=tp, vocab_size=model_config.vocab_size)
        loss = CausalLMLoss(cross_entropy, cfg.model.loss_chunk_size, cfg.model.fused_head_loss)
    if not is_moe(model_config):
        return loss
    coef = cfg.moe.aux_loss_coef
    return WithAuxLoss(loss, default_aux_loss_coef(model_config) if coef is None else coef)


def _user_error(e: Exception) -> RunError:
    return RunError(str(e))


def load_model_config(cfg: TrainConfig):
    """The model's transformers config: from `model_name_or_path` (checked against a preset named on the
    command line) or from the preset alone; attention implementation set. Raises RunError."""
    try:
        if cfg.model_name_or_path:
            path = os.path.join(cfg.model_name_or_path, "config.json")
            if not os.path.exists(path):
                raise RunError(f"model_name_or_path: {path} is missing (convert the model with convert2ckpt.py)")
            config = load_hf_config(cfg.model_name_or_path)
            check_preset(config, cfg.model, path)
        else:
            config = config_from_preset(cfg.model)
    except ValueError as e:
        raise _user_error(e) from None
    if is_quantized(config):  # FP8 / MXFP4 hub weights load dequantized: the run's model (and its export) is plain
        config.quantization_config = None
        del config.quantization_config
    try:
        impl = resolve_attention(config, cfg.model.attn_implementation and str(cfg.model.attn_implementation))
    except ValueError as e:
        raise _user_error(e) from None
    if impl == "flash_attention_2":
        try:
            import flash_attn  # noqa: F401
        except ImportError:
            raise RunError(
                "model.attn_implementation=flash_attention_2 needs flash-attn (requirements-gpu.txt)"
            ) from None
    config._attn_implementation = impl
    rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if cfg.seq_length > config.max_position_embeddings and rope_type == "default":
        raise RunError(
            f"seq_length={cfg.seq_length} exceeds max_position_embeddings={config.max_position_embeddings} "
            "and the model configures no RoPE scaling"
        )
    return config


def _tokenizer(cfg: TrainConfig, vocab_size: int):
    try:
        tokenizer, where = configured_tokenizer(cfg.tokenizer_name_or_path, cfg.model_name_or_path)
        check_tokenizer_fits(len(tokenizer), vocab_size, where)
        configure_chat_template(tokenizer, cfg.data)
    except ValueError as e:
        raise _user_error(e) from None
    return tokenizer


def _weights_source(run: Run, plan: checkpointing.ResumePlan) -> str | None:
    """The step directory the stage's weights load from: the moved checkpoint itself (weights are layout-free),
    else model_name_or_path (converted first if it is a Hugging Face directory); LoRA resumes take the base."""
    cfg, c = run.cfg, run.coords
    if plan.moved and not cfg.lora.enabled:
        return os.path.join(cfg.output_dir, plan.tag)
    if not cfg.model_name_or_path or (plan.tag and not cfg.lora.enabled):
        return None
    path = cfg.model_name_or_path
    if is_hf_dir(path):
        from training.hf_source import convert_on_load

        path, reused = convert_on_load(path, cfg.output_dir, c, run.bounds)
        log.info("%s %s as %s", "reusing the conversion of" if reused else "converted", cfg.model_name_or_path, path)
    run.lora_base = os.path.abspath(path)
    with agreed():
        tag = read_tag(path)
    return os.path.join(path, tag)


def resolve_hub_ids(cfg: TrainConfig, has_data: bool) -> None:
    """Hub ids in `model_name_or_path`, `tokenizer_name_or_path` and `dpo.reference_model` become their snapshot
    directories (common/hub.py): per cache, the first rank downloads and the others wait for it; the ranks that read
    data fetch its Hub datasets. Collective."""
    named = [(k, v) for k, v in _hub_keys(cfg) if is_hub_id(v)]
    specs = [p for spec in (cfg.train_file, cfg.eval_file) for p in paths_of(spec) if is_hub_dataset(p)]
    datasets = specs if has_data else []
    if not named and not specs:  # (the same on every rank: ranks without data still pulse)
        return
    found, job = {}, job_key(cfg.output_dir, os.environ)

    def work() -> None:
        for key, value in named:  # an id named twice is fetched once, with weights if any key needs them
            weights = any(v == value and k != "tokenizer_name_or_path" for k, v in named)
            found[key] = resolve_once(value, key, job, cfg.model_revision, weights)
        for spec in datasets:  # downloaded and converted to Arrow now, under the pulses (data/sources.py)
            hub_dataset(spec)

    ranks_work(work)
    for key, value in named:
        log.info("%s %s: %s", key, value, found[key])
    cfg.model_name_or_path = found.get("model_name_or_path", cfg.model_name_or_path)
    cfg.tokenizer_name_or_path = found.get("tokenizer_name_or_path", cfg.tokenizer_name_or_path)
    cfg.dpo.reference_model = found.get("dpo.reference_model", cfg.dpo.reference_model)


def _hub_keys(cfg: TrainConfig) -> list[tuple[str, str | None]]:
    return [*tokenizer_sources(cfg), ("dpo.reference_model", cfg.dpo.reference_model)]


def commit_written_saves(cfg: TrainConfig) -> None:
    """Rank 0, at start: publish each save every rank finished writing whose commit never came (the job stopped in
    between), as the commit would have; `clean_stale` removes any other staging directory afterwards."""
    for staging, tag, ranks in written_saves(cfg.output_dir):
        try:
            publish(staging, tag, ranks, cfg)
            log.warning(
                "published %s: every rank had written it before the last run stopped", os.path.join(cfg.output_dir, tag)
            )
        except (OSError, ValueError) as e:  # ValueError: a marker that is not JSON (not ours)
            log.warning("%s not published (%s): removed", staging, e)


def assemble(cfg: TrainConfig) -> Run:
    """Build this rank's part of the run described by `cfg`. Collective; raises RunError (same on every rank)."""
    rank, world = init_distributed(cfg.dist_timeout_minutes, cfg.output_dir, cfg.dist_init_timeout_minutes)
    coords = Coords(
        rank,
        world,
        cfg.num_stages,
        cfg.tensor_parallel_size,
        cfg.pipeline_schedule == "dualpipev",
        cfg.context_parallel_size,
    )
    configure_logging(coords, cfg.log_all_ranks)
    log.info("%s", LAUNCH[0])
    with agreed():
        try:
            validate(cfg)
            auto = cfg.deepspeed.precision == "auto"
            resolve(cfg)  # the run's precision and ZeRO stage, once: read as they are from here on
        except ValueError as e:
            raise _user_error(e) from None
        check_paths(cfg)
        if rank == 0:
            commit_written_saves(cfg)  # before a fresh run looks for an earlier run's checkpoints: it is one
            try:
                prepare_output_dir(cfg)
            except OSError as e:
                why = e.strerror or e
                raise RunError(f"output_dir {cfg.output_dir}: cannot move the earlier run aside ({why})") from None
    with agreed():
        try:
            os.makedirs(cfg.output_dir, exist_ok=True)
        except OSError as e:
            raise RunError(f"output_dir {cfg.output_dir}: cannot create ({e.strerror})") from None
        if not os.access(cfg.output_dir, os.W_OK):
            raise RunError(f"output_dir {cfg.output_dir}: not writable")
    resolve_hub_ids(cfg, coords.has_data)
    freeze(cfg)  # resolved (precision, ZeRO stage, Hub ids): read as it is from here on (schema/frozen.py)
    checkpointing.seed_everything(cfg.seed)
    if rank == 0:
        for name in clean_stale(cfg.output_dir):
            log.warning("removed %s, left by an interrupted save", os.path.join(cfg.output_dir, name))
        if auto:
            log.info(describe_auto_precision(str(cfg.deepspeed.precision)))
    log_to_file(cfg.output_dir, rank)
    with agreed():
        model_config = load_model_config(cfg)
        try:
            validate_layout(cfg, world, model_config)
            stages = model_stages(cfg.pipeline_schedule, cfg.num_stages)
            bounds = stage_bounds(model_config, stages, cfg.model.partition)  # once per run
        except ValueError as e:
            raise _user_error(e) from None
    tp = TensorParallel(
        cfg.tensor_parallel_size, coords.tp_rank, cfg.model.vocab_pad_multiple, sequence_parallel=sequence_parallel(cfg)
    )
    run = Run(cfg, coords, model_config, _loss_fn(cfg, model_config, tp), bounds, tp=tp)
    run.layout = checkpointing.saved_layout(cfg, coords, model_config, bounds)
    resume = checkpointing.plan_resume(cfg, coords, run.layout, is_moe(model_config))  # bad resumes fail now
    with agreed():
        if coords.has_data:
            run.tokenizer = _tokenizer(cfg, model_config.vocab_size)
    load_data(run)
    if cfg.objective == "dpo":
        run.collate = PairCollator(
            padded_seq_length(cfg),
            pad_id(run.tokenizer),
            lengths=is_moe(model_config),
            context=(coords.cp_rank, coords.cp),
        )
    else:
        run.collate = CausalLMCollator(
            padded_seq_length(cfg),
            pad_id(run.tokenizer),
            cfg.data.documents_share_rows,
            lengths=is_moe(model_config),
            context=(coords.cp_rank, coords.cp),
        )
    run.data_state = data_state(run)
    if needs_reference(cfg):  # before the training stage exists: the pass builds (and drops) a stage of its own
        attach_reference(run)

    source = _weights_source(run, resume)
    module = build_module(
        cfg, coords, model_config, run.loss_fn, tp, bounds, skip_init=cfg.model_name_or_path is not None
    )
    with agreed():
        if source:
            run.loaded_layers = checkpointing.load_stage_weights(module, source, model_config, tp)
    module._synchronize_tied_weights()
    if source:
        log.info("loaded %s: rank %d read %d layer files", source, rank, len(run.loaded_layers))
    if cfg.lora.quantize == "nf4":  # QLoRA: the stage's frozen decoder linears, as transformers' 4-bit model holds them
        held = quantize_stage(module, cfg.lora.quantize_double, cfg.lora.quantize_experts)
        log.info(
            "lora.quantize=nf4: %d linear layers held in NF4 on rank %d (%.3f GiB of weights and buffers)",
            held,
            rank,
            held_bytes(module) / 2**30,
        )
    if cfg.lora.keep_quantized:  # the hub's FP8 / MXFP4 tensors of the stage's decoder layers, held as they are
        experts = module._ep.local_experts(num_experts(model_config)) if is_moe(model_config) else None
        with agreed():  # (a block a TP shard cuts, a missing key: on some ranks only; every rank stops)
            try:
                held = hold_hub_weights(module, cfg.model_name_or_path, model_config, experts, (tp.rank, tp.size))
            except ValueError as e:
                raise RunError(f"lora.keep_quantized=true: {e}") from None
        log.info(
            "lora.keep_quantized: %d weights held as %s's on rank %d (%.2f MiB of weights and buffers)",
            held,
            cfg.model_name_or_path,
            rank,
            held_bytes(module) / 2**20,
        )
    if cfg.lora.enabled:
        lo = cfg.lora
        trainable = add_lora(module, lo.r, lo.alpha, lo.dropout, lo.target_modules, cfg.seed, tp.rank, tp.size)
        parallelize_lora(module, tp)
        log.info(
            "LoRA r=%d alpha=%g on %s: %d trainable parameters on rank %d",
            lo.r,
            lo.alpha,
            lo.target_modules,
            trainable,
            rank,
        )
        with agreed():
            if resume.moved:  # the adapter, saved per global layer like the weights
                adapter = os.path.join(cfg.output_dir, resume.tag)
                checkpointing.load_stage_weights(module, adapter, model_config, tp, trainable_only=True)
    run.engine = initialize_engine(
        cfg, coords, module, max(run.total_steps, 1), load_universal=bool(resume.universal_tag)
    )
    if resume.tag:
        run.step = checkpointing.resume(
            run.engine, cfg, resume, run.data_state, model_config, tp, max(run.total_steps, 1)
        )
        with agreed():
            checkpointing.restore_rng(cfg, coords, resume)
            if cfg.resume_from and rank == 0:  # only once the resume is known to work: newer steps move aside
                roll_back(cfg.output_dir, cfg.resume_from)
        log.info("resumed from %s at step %d", os.path.join(cfg.output_dir, resume.tag), run.step)
    if rank == 0:
        write_run_files(run)
    dist.barrier()
    return run


def write_run_files(run: Run) -> None:
    """Resolved config, model config, tokenizer and data report, so output_dir is itself a loadable model dir."""
    import json
    import shutil

    from omegaconf import OmegaConf

    cfg = run.cfg
    if cfg.lora.enabled:  # what `convert2ckpt.py --to-hf --merge-lora` needs
        lo = cfg.lora
        info = {"r": lo.r, "alpha": lo.alpha, "dropout": lo.dropout, "target_modules": list(lo.target_modules)}
        info |= {
            "quantize": lo.quantize,
            "quantize_double": lo.quantize_double,
            "quantize_experts": lo.quantize_experts,
        }
        info["base"] = run.lora_base
        with open(os.path.join(cfg.output_dir, LORA_FILE), "w") as f:
            json.dump(info, f, indent=2)
    with open(os.path.join(cfg.output_dir, "train_config.yaml"), "w") as f:
        f.write(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    run.model_config.save_pretrained(cfg.output_dir)
    if run.tokenizer is not None:
        run.tokenizer.save_pretrained(cfg.output_dir)
    source = cfg.model_name_or_path
    target = os.path.join(cfg.output_dir, "generation_config.json")
    generation = os.path.join(source, "generation_config.json") if source else ""
    if generation and os.path.exists(generation) and not os.path.exists(target):
        shutil.copy2(generation, target)
    for name in (CARRIED_FILE, CONTAINER_CONFIG):  # hub tensors carried untrained, a container's layout (exports)
        kept = os.path.join(run.lora_base or "", name)
        if run.lora_base and os.path.exists(kept) and not os.path.exists(os.path.join(cfg.output_dir, name)):
            partial = os.path.join(cfg.output_dir, f".{name}.partial")  # a kill mid-copy leaves no truncated file
            shutil.copy2(kept, partial)
            os.replace(partial, os.path.join(cfg.output_dir, name))
    write_data_report(run)
