"""Convert LLaMA checkpoints between Hugging Face and DeepSpeed pipeline layouts.

    python convert2ckpt.py --input HF_DIR --output CKPT_DIR [--dtype bf16|fp16|fp32] [--force]
    python convert2ckpt.py --to-hf --input CKPT_DIR --output HF_DIR [--tag global_stepN] [--dtype ...]
    python convert2ckpt.py --inspect CKPT_DIR [--tag global_stepN] [--json]
    python convert2ckpt.py --verify CKPT_DIR [--tag global_stepN] [--against HF_DIR]

Both directions stream: peak memory is about one layer, never the whole model. Output is written
to a temporary directory and renamed into place when complete. Errors are one line naming the file
or key, with exit status 2, and leave no output behind.
"""

from __future__ import annotations

import argparse
import sys

from checkpoint.convert import DTYPES, convert_hf_to_pipeline
from checkpoint.hf_reader import CheckpointError


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", help="HF model directory, or a pipeline checkpoint with --to-hf")
    p.add_argument("--output", help="directory to create")
    p.add_argument("--inspect", metavar="CKPT_DIR", help="print a pipeline checkpoint's layout and exit")
    p.add_argument("--json", action="store_true", help="with --inspect: machine-readable output")
    p.add_argument("--verify", metavar="CKPT_DIR", help="check a checkpoint against its manifest and exit")
    p.add_argument("--against", metavar="HF_DIR", help="with --verify: also compare logits with this HF model")
    p.add_argument("--to-hf", action="store_true", help="export a pipeline checkpoint (converted or trained) to HF")
    p.add_argument("--tag", default=None, help="with --to-hf: checkpoint tag to export (default: the one in 'latest')")
    p.add_argument("--max-shard-size", default="5GB", help="with --to-hf: safetensors shard size (default 5GB)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast weights (default: keep stored dtype)")
    p.add_argument("--force", action="store_true", help="replace an existing output directory")
    args = p.parse_args(argv)
    if not (args.inspect or args.verify) and not (args.input and args.output):
        p.error("--input and --output are required (or --inspect / --verify CKPT_DIR)")
    return args


def verify(ckpt_dir: str, tag: str | None, against: str | None) -> int:
    import os

    from checkpoint.manifest import compare_with_hf, verify_manifest
    from checkpoint.pipeline_reader import read_tag

    tag = read_tag(ckpt_dir, tag)
    problems = verify_manifest(os.path.join(ckpt_dir, tag))
    for line in problems:
        print(f"convert2ckpt: verify: {line}", file=sys.stderr)
    if not problems:
        print(f"{os.path.join(ckpt_dir, tag)}: every file matches manifest.json")
    if against and not problems:
        diff = compare_with_hf(ckpt_dir, tag, against)
        print(f"max |logit difference| against {against}: {diff:.3g}")
        if diff > 1e-3:
            print(f"convert2ckpt: verify: logits differ from {against} by {diff:.3g}", file=sys.stderr)
            return 2
    return 2 if problems else 0


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.verify:
            return verify(args.verify, args.tag, args.against)
        if args.inspect:
            from checkpoint.inspect import inspect_checkpoint

            print(inspect_checkpoint(args.inspect, args.tag, args.json))
        elif args.to_hf:
            from checkpoint.export import export_pipeline_to_hf

            export_pipeline_to_hf(
                args.input, args.output, args.tag, args.dtype, max_shard_size=args.max_shard_size, force=args.force
            )
        else:
            if args.tag:
                raise CheckpointError("--tag only applies with --to-hf or --inspect")
            convert_hf_to_pipeline(args.input, args.output, dtype=args.dtype, force=args.force)
    except CheckpointError as e:
        print(f"convert2ckpt: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
