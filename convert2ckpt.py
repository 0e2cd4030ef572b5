"""Convert a Hugging Face LLaMA checkpoint into DeepSpeed pipeline layer files.

    python convert2ckpt.py --input HF_DIR --output CKPT_DIR [--dtype bf16|fp16|fp32] [--force]

Streams: peak memory is about one layer, never the whole model. Errors are one line naming the
file or key, with exit status 2, and leave no output behind.
"""

from __future__ import annotations

import argparse
import sys

from checkpoint.convert import DTYPES, convert_hf_to_pipeline
from checkpoint.hf_reader import CheckpointError


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="Hugging Face model directory (config.json + weights)")
    p.add_argument("--output", required=True, help="checkpoint directory to create")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast weights (default: keep stored dtype)")
    p.add_argument("--force", action="store_true", help="replace an existing output directory")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        convert_hf_to_pipeline(args.input, args.output, dtype=args.dtype, force=args.force)
    except CheckpointError as e:
        print(f"convert2ckpt: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
