#!/usr/bin/env bash
# ../shared/GPU.md as one call on a lent GPU machine (one GPU, no internet, no DeepSpeed or hydra in its image):
#   here:  mkdir -p .whl; pip wheel/download our pins of deepspeed, hydra-core, omegaconf, antlr4-python3-runtime,
#          transformers, peft, pydantic(+core), hjson, ... into .whl (ignored by git; see docs/measured.md)
#   there: bash benchmarks/gpu_check.sh      (device tool: carry [".whl"]; results under $OUT)
# DRY=1 runs every step on this CPU with tiny shapes and no installs, to check the script itself.
# Each step has its own time limit and goes on after a failure; everything is logged under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check_out}
mkdir -p "$OUT"
W=${WORK:-/tmp/gpu_check}
log() { echo "== $(date +%T) $*" | tee -a "$OUT/summary.txt"; }

if [ "${DRY:-0}" = 1 ]; then
  . .venv/bin/activate
  DEV=cpu
  SHAPE=(--layers 2 --hidden 64 --heads 4 --kv-heads 2 --intermediate 128 --vocab 256 --rows 400)
  PARITY=(--seq 64 --mbs 2 --ga 2 --steps 3 --precision bf16)
  THROUGHPUT=(--seq 256 --mbs 2 --ga 2 --steps 4 --warmup 1)
  SAVE=(seq_length=64 micro_batch_size=2)
  export OMP_NUM_THREADS=1
else
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site
  DEV=cuda
  # TinyLlama-1.1B's shape (22 layers, hidden 2048, 32 heads, 4 KV heads, MLP 5632, vocab 32000), random weights.
  SHAPE=(--layers 22 --hidden 2048 --heads 32 --kv-heads 4 --intermediate 5632 --vocab 32000 --rows 20000)
  PARITY=(--seq 1024 --mbs 2 --ga 4 --steps 20 --precision bf16)
  THROUGHPUT=(--seq 4096 --mbs "${MBS:-6}" --ga 4 --steps 8 --warmup 3)
  SAVE=(seq_length=1024 micro_batch_size=2)
  export OMP_NUM_THREADS=8
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
rm -rf "$W"

log "versions"
(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi") \
  | tee -a "$OUT/summary.txt"
python3 -c "import sys, torch, transformers, deepspeed, peft
print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers',
      transformers.__version__, 'deepspeed', deepspeed.__version__, 'peft', peft.__version__,
      torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')" 2>&1 | tail -1 | tee -a "$OUT/summary.txt"

log "1. the GPU-only tests (tests/test_gpu.py, test_parity's GPU case)"
timeout 200 python3 -m pytest tests/test_gpu.py tests/test_parity.py -k gpu -s -q -p no:cacheprovider \
  > "$OUT/tests.log" 2>&1
grep -E "^bf16 GPU|passed|failed|skipped|Error" "$OUT/tests.log" | tail -40 | tee -a "$OUT/summary.txt"

log "2. bf16 parity: trainer vs transformers + AdamW (benchmarks/gpu_parity.py)"
timeout 300 python3 -m benchmarks.gpu_parity --work "$W" --out "$OUT/parity.json" "${SHAPE[@]}" "${PARITY[@]}" \
  --device $DEV --fp32-trainer --threads "$OMP_NUM_THREADS" > "$OUT/parity.log" 2>&1
grep -E "^logits:| vs |losses:|Error|exited" "$OUT/parity.log" | tee -a "$OUT/summary.txt"

log "3+4. throughput, MFU, peak memory vs the planner (benchmarks/train_throughput.py, packing on)"
timeout 300 python3 -m benchmarks.train_throughput --work "$W" "${SHAPE[@]}" "${THROUGHPUT[@]}" --repeat 1 \
  --packing --precision bf16 --device $DEV --peak-tflops 989 --threads "$OMP_NUM_THREADS" \
  --profile "$OUT/profile.txt" > "$OUT/throughput.log" 2>&1
grep -E "^model:|^m=|Error|exited" "$OUT/throughput.log" | tee -a "$OUT/summary.txt"

log "5. the save stall today (synchronous saves; issue 39's baseline)"
rm -rf "$W/save"
timeout 200 python3 -m deepspeed.launcher.runner --num_gpus 1 trainer.py model_name_or_path="$W/hf" \
  output_dir="$W/save" train_file="$W/train.jsonl" do_eval=false "${SAVE[@]}" gradient_accumulation_steps=4 \
  max_steps=6 save_steps=3 keep_last_n=1 deepspeed=bf16_zero1 progress_bar=false > "$OUT/save.log" 2>&1
grep -E "saved checkpoint|step [0-9]+/|Error" "$OUT/save.log" | sed 's/^.*\] //' | tee -a "$OUT/summary.txt"
du -sh "$W/save/global_step6" 2>/dev/null | tee -a "$OUT/summary.txt"
log "done"
