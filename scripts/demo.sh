#!/usr/bin/env bash
# The demo: tiny LLaMA + sentencepiece tokenizer built on the fly, converted with convert2ckpt.py,
# fine-tuned on two-digit addition with PP=2 x DP=2 on 4 ranks through the deepspeed launcher,
# evaluated, and summarised. Installs what it needs first (scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
OUT=${DEMO_DIR:-outputs/demo}
RANKS=${DEMO_RANKS:-4}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
start=$(date +%s)

echo "== 1/4 building a tiny LLaMA, its tokenizer and the addition data in $OUT"
rm -rf "$OUT"
python -m demo.prepare "$OUT"

echo "== 2/4 converting the Hugging Face checkpoint to pipeline layer files"
python convert2ckpt.py --input "$OUT/hf_model" --output "$OUT/ckpt"

echo "== 3/4 fine-tuning: deepspeed --num_gpus $RANKS trainer.py experiment=demo (PP=2 x DP=$((RANKS / 2)))"
deepspeed --num_gpus "$RANKS" --master_port "${MASTER_PORT:-$(python -m tools.free_port)}" trainer.py experiment=demo \
  model_name_or_path="$OUT/ckpt" output_dir="$OUT/run" \
  train_file="$OUT/data/train.jsonl" eval_file="$OUT/data/eval.jsonl" "$@" 2>&1 \
  | grep --line-buffered -E '^\[rank|^output_dir|^  [a-z_.]+: |[Ee]rror|Traceback' || true
test -f "$OUT/run/eval_results.json" || { echo "demo: training failed (see above)" >&2; exit 1; }

echo "== 4/4 results"
python -m demo.report "$OUT/run" "$OUT/data/eval.jsonl"
python -m tools.plot_metrics "$OUT/run" | sed 's/^/plot: /'
python -m tools.generate --checkpoint "$OUT/run" --prompt "12+34=" --prompt "51+49=" --max-new-tokens 4 2>/dev/null \
  | sed 's/^/generate: /'
echo "demo finished in $(( $(date +%s) - start ))s; checkpoint, logs and metrics are in $OUT/run"
