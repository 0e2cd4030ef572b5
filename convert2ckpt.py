"""Convert decoder checkpoints of every supported family (docs/families.md) between Hugging Face and DeepSpeed
pipeline layouts, at any tensor-parallel degree; inspect and verify them.

    python convert2ckpt.py --input HF_DIR --output CKPT_DIR [--dtype bf16|fp16|fp32] [--workers N] [--force] [--tp T]
    python convert2ckpt.py --input ORG/NAME [--revision REV] --output CKPT_DIR   (a Hugging Face Hub id: its cache,
                                                                                  HF_HUB_OFFLINE, HF_TOKEN)
    python convert2ckpt.py --input CKPT_DIR --output CKPT2_DIR --tp T          (any pipeline checkpoint, any TP)
    python convert2ckpt.py --input HF_DIR --output PIECE_DIR --layers 0-20       (or --stages 0,1 --num-stages 4,
                                                                                  or --tp 8 --tp-ranks 0,1,2,3)
    python convert2ckpt.py --combine PIECE_DIR [PIECE_DIR ...] --output CKPT_DIR
    python convert2ckpt.py --to-hf --input CKPT_DIR --output HF_DIR [--tag global_stepN] [--dtype ...]
    python convert2ckpt.py --to-peft --input RUN --output ADAPTER_DIR [--base-model HF_DIR_OR_ID] (a LoRA run's
                                                                                  adapters as a PEFT directory)
    python convert2ckpt.py --inspect CKPT_DIR [--tag global_stepN] [--json]
    python convert2ckpt.py --verify CKPT_DIR [--tag global_stepN] [--against HF_DIR]

Both directions stream: peak memory is about one layer, never the whole model. Output is written
to a temporary directory and renamed into place when complete. Errors are one line naming the file
or key, with exit status 2, and leave no output behind.
"""

from __future__ import annotations

import argparse
import os
import sys

from checkpoint.convert import combine_pieces, convert_hf_to_pipeline
from checkpoint.dtypes import DTYPES
from checkpoint.errors import CheckpointError
from checkpoint.layer_files import FORMATS
from checkpoint.names import LATEST
from common.hub import HubError, resolve


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", help="HF model directory or Hub id (ORG/NAME), or a pipeline checkpoint with --to-hf")
    p.add_argument("--revision", help="with a Hub id for --input or --against: a branch, tag or commit")
    p.add_argument("--output", help="directory to create")
    p.add_argument("--inspect", metavar="CKPT_DIR", help="print a pipeline checkpoint's layout and exit")
    p.add_argument("--json", action="store_true", help="with --inspect: machine-readable output")
    p.add_argument("--verify", metavar="CKPT_DIR", help="check a checkpoint against its manifest and exit")
    p.add_argument(
        "--against", metavar="HF_DIR", help="with --verify: also compare logits with this HF model (or Hub id)"
    )
    p.add_argument("--to-hf", action="store_true", help="export a pipeline checkpoint (converted or trained) to HF")
    p.add_argument(
        "--to-peft", action="store_true", help="write a LoRA run's adapters as a PEFT directory (PeftModel, vLLM)"
    )
    p.add_argument(
        "--base-model", help="with --to-peft: base_model_name_or_path (default: the model the run started from)"
    )
    p.add_argument(
        "--tag", default=None, help="with --to-hf/--to-peft: checkpoint tag to export (default: the one in 'latest')"
    )
    p.add_argument(
        "--merge-lora",
        nargs="?",
        const=True,
        metavar="ADAPTER_DIR",
        help="with --to-hf: merge the LoRA adapter trained in --input, or this PEFT adapter directory",
    )
    p.add_argument("--max-shard-size", default="5GB", help="with --to-hf: safetensors shard size (default 5GB)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast weights (default: keep stored dtype)")
    p.add_argument("--force", action="store_true", help="replace an existing output directory")
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="HF -> pipeline with N processes on disjoint layer groups; peak memory is about N x one layer",
    )
    p.add_argument("--format", choices=FORMATS, default="pt", help="layer file format (both load everywhere)")
    p.add_argument("--layers", help="convert only these pipeline layers (e.g. 0-20,40) into a piece directory")
    p.add_argument("--stages", help="convert only these stages' layers (e.g. 0,1); needs --num-stages")
    p.add_argument("--num-stages", type=int, help="with --stages: the pipeline stages to partition into")
    p.add_argument("--partition", default="parameters", help="with --stages: parameters, uniform or e.g. 2,3,3,2")
    p.add_argument("--combine", nargs="+", metavar="PIECE_DIR", help="join pieces into one checkpoint at --output")
    p.add_argument("--tp", type=int, default=1, help="write each layer as T tensor-parallel shards (default 1)")
    p.add_argument("--tp-ranks", help="with --tp: write only these TP ranks' files (e.g. 0,1) into a piece directory")
    args = p.parse_args(argv)
    if args.combine and not args.output:
        p.error("--combine needs --output")
    if not (args.inspect or args.verify or args.combine) and not (args.input and args.output):
        p.error("--input and --output are required (or --inspect / --verify CKPT_DIR, or --combine)")
    if args.to_peft and (args.to_hf or args.merge_lora):
        p.error("--to-peft writes the adapters alone: not with --to-hf or --merge-lora")
    if args.base_model and not args.to_peft:
        p.error("--base-model applies to --to-peft")
    if args.stages and not args.num_stages:
        p.error("--stages needs --num-stages")
    if args.tp_ranks and args.tp == 1:
        p.error("--tp-ranks needs --tp")
    return args


def tp_ranks(args) -> list[int] | None:
    if not args.tp_ranks:
        return None
    try:
        return sorted({int(r) for r in args.tp_ranks.split(",")})
    except ValueError:
        raise CheckpointError(f"--tp-ranks {args.tp_ranks}: expected ranks like 0,1") from None


def export_to_hf(args) -> None:
    """--to-hf; a Hugging Face --input (only with --merge-lora ADAPTER_DIR) is converted to a temp checkpoint first."""
    import shutil

    from checkpoint.export import export_pipeline_to_hf
    from checkpoint.hf_reader import is_hf_dir
    from checkpoint.outputs import HF_EXPORT, check_output
    from checkpoint.staging import make_unique_dir

    adapter = args.merge_lora if isinstance(args.merge_lora, str) else None
    check_output(args.output, HF_EXPORT, args.force, [("input", args.input), ("adapter", adapter)])
    if not is_hf_dir(args.input):
        export_pipeline_to_hf(
            args.input, args.output, args.tag, args.dtype, args.max_shard_size, args.force, merge_lora=args.merge_lora
        )
        return
    if adapter is None:
        raise CheckpointError(f"{args.input}: a Hugging Face directory; --to-hf takes a pipeline checkpoint")
    parent = os.path.dirname(os.path.abspath(args.output))
    tmp = None
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = make_unique_dir(parent, ".merge-base-")
        source = os.path.join(tmp, "ckpt")
        convert_hf_to_pipeline(args.input, source, log=lambda *_: None)
        export_pipeline_to_hf(
            source,
            args.output,
            args.tag,
            args.dtype,
            args.max_shard_size,
            args.force,
            merge_lora=adapter,
            recorded_input=args.input,
        )
    except OSError as e:
        raise CheckpointError(f"{e.filename or parent}: cannot write ({e.strerror or e})") from None
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def selected_layers(args) -> list[int] | None:
    """Pipeline layer indices from --layers or --stages (with --num-stages/--partition), else None."""
    if not (args.layers or args.stages):
        return None
    from checkpoint.convert import parse_layer_range
    from checkpoint.hf_reader import read_model_config
    from models.key_table import all_layer_keys
    from models.partition import stage_bounds

    config = read_model_config(args.input)
    valid = sorted(all_layer_keys(config))
    if args.layers:
        return parse_layer_range(args.layers, valid)
    partition = args.partition if args.partition in ("parameters", "uniform") else args.partition.split(",")
    try:
        bounds = stage_bounds(config, args.num_stages, partition)
        stages = [int(s) for s in args.stages.split(",")]
    except ValueError as e:
        raise CheckpointError(f"--stages {args.stages}: {e}") from None
    if any(not 0 <= s < args.num_stages for s in stages):
        raise CheckpointError(f"--stages {args.stages}: stages are 0..{args.num_stages - 1}")
    return [i for s in stages for i in range(bounds[s], bounds[s + 1]) if i in valid]


def verify(ckpt_dir: str, tag: str | None, against: str | None) -> int:
    from checkpoint.compare import compare_with_hf
    from checkpoint.manifest import verify_manifest
    from checkpoint.pipeline_reader import PipelineCheckpoint

    ckpt = PipelineCheckpoint(ckpt_dir, tag, scan=False)  # the scan below reports every unsafe file, as data
    problems = verify_manifest(ckpt.step_dir, progress=True)
    problems += ckpt.unsafe_files(skip={p.path for p in problems})
    for problem in problems:
        print(f"convert2ckpt: verify: {problem}", file=sys.stderr)
    if not problems:
        print(f"{ckpt.step_dir}: every file matches manifest.json")
    if against and not problems:
        diff = compare_with_hf(ckpt_dir, ckpt.tag, against)
        print(f"max |logit difference| against {against}: {diff:.3g}")
        if diff > 1e-3:
            print(f"convert2ckpt: verify: logits differ from {against} by {diff:.3g}", file=sys.stderr)
            return 2
    return 2 if problems else 0


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        args.against = resolve(args.against, "--against", args.revision)
        if not (args.to_hf or args.to_peft):
            args.input = resolve(args.input, "--input", args.revision)
        if args.verify:
            return verify(args.verify, args.tag, args.against)
        if args.combine:
            combine_pieces(args.combine, args.output, force=args.force)
            return 0
        if args.inspect:
            from checkpoint.inspect import inspect_checkpoint

            print(inspect_checkpoint(args.inspect, args.tag, args.json))
        elif args.to_hf:
            export_to_hf(args)
        elif args.to_peft:
            from checkpoint.peft_export import export_peft

            export_peft(args.input, args.output, args.tag, args.base_model, args.dtype, args.force)
        else:
            from checkpoint.hf_reader import is_hf_dir

            layers = selected_layers(args)
            if not is_hf_dir(args.input) and os.path.isdir(args.input) and LATEST in os.listdir(args.input):
                from checkpoint.reshard import reshard_checkpoint

                if args.dtype or args.workers != 1:  # resharding keeps the stored dtype and runs in one process
                    raise CheckpointError(
                        "--dtype and --workers apply to a Hugging Face --input, not a pipeline "
                        "checkpoint (resharding keeps its dtype)"
                    )

                reshard_checkpoint(
                    args.input, args.output, args.tp, tp_ranks(args), layers, args.tag, args.format, args.force
                )
                return 0
            if args.tag:
                raise CheckpointError(
                    "--tag only applies with --to-hf, --to-peft, --inspect or a pipeline checkpoint --input"
                )
            convert_hf_to_pipeline(
                args.input,
                args.output,
                dtype=args.dtype,
                force=args.force,
                layers=layers,
                workers=args.workers,
                fmt=args.format,
                tp_size=args.tp,
                tp_ranks=tp_ranks(args),
            )
    except (CheckpointError, HubError) as e:
        print(f"convert2ckpt: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
