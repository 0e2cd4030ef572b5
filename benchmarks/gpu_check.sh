#!/usr/bin/env bash
# ../shared/GPU.md as one call on a lent GPU machine (one GPU, no internet, no DeepSpeed or hydra in its image):
#   here:  mkdir -p .whl; pip wheel/download our pins of deepspeed, hydra-core, omegaconf, antlr4-python3-runtime,
#          transformers, peft, pydantic(+core), hjson, ... into .whl (ignored by git; see docs/measured.md)
#   there: bash benchmarks/gpu_check.sh      (device tool: carry [".whl"]; results under $OUT)
# STEPS picks the steps and their order (default: tests parity save save_async throughput; also: moe, issue 38's sparse
# blocks of each family against transformers' own; moe_train, whole DeepSeek-V3 and gpt-oss models trained against
# transformers + AdamW, with throughput and peak memory); SKIP_PLAIN=1 leaves
# the plain loop out of the throughput step; ASYNC_MODES="true" runs save_async without its synchronous control.
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
  ASYNC=(seq_length=64 micro_batch_size=2 gradient_accumulation_steps=2)
  MOE=(--hidden 128 --experts 4 --top-k 2 --tokens 256 --repeat 2 --dtype bf16)
  MOE_SHAPE=(--layers 2 --hidden 64 --heads 4 --kv-heads 4 --vocab 256 --rows 400)
  MOE_PARITY=(--seq 64 --mbs 2 --ga 2 --steps 3)
  MOE_THROUGHPUT=(--seq 128 --mbs 2 --ga 2 --steps 3 --warmup 1)
  DEEPSEEK='{"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "intermediate_size": 128}'
  GPT_OSS='{"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32, "num_key_value_heads": 2}'
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
  ASYNC=(seq_length=1024 micro_batch_size=8 gradient_accumulation_steps=16)  # steps of ~2 s: a write fits between saves
  # DeepSeek-V2-Lite's sparse block (hidden 2048, 64 experts of 1408, top-6) in every family's own layer, 2 x 4096 tokens.
  MOE=(--hidden 2048 --experts 64 --expert-size 1408 --top-k 6 --tokens 8192 --repeat 20 --dtype bf16)
  # Whole models of DeepSeek-V3 and gpt-oss at ~0.6B (8 layers, hidden 1024, 32 experts of 704, top-4), vocab 32000.
  MOE_SHAPE=(--layers 8 --hidden 1024 --heads 16 --kv-heads 16 --vocab 32000 --rows 20000)  # MLA: as many KV heads
  MOE_PARITY=(--seq 1024 --mbs 2 --ga 2 --steps 8)
  MOE_THROUGHPUT=(--seq 4096 --mbs 2 --ga 2 --steps 5 --warmup 2)
  DEEPSEEK='{"n_routed_experts": 32, "num_experts_per_tok": 4, "moe_intermediate_size": 704, "n_group": 4,
    "topk_group": 2, "intermediate_size": 2816, "q_lora_rank": 384, "kv_lora_rank": 256, "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 32, "v_head_dim": 64, "max_position_embeddings": 4096}'
  GPT_OSS='{"num_local_experts": 32, "num_experts_per_tok": 4, "intermediate_size": 704, "num_key_value_heads": 4,
    "head_dim": 64, "sliding_window": 128, "max_position_embeddings": 4096}'
  export OMP_NUM_THREADS=8
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
rm -rf "$W"
STEPS=${STEPS:-tests parity save save_async throughput}
for s in $STEPS; do
  case $s in tests | parity | save | save_async | throughput | moe | moe_train) ;; *) echo "unknown step $s" >&2; exit 2 ;; esac
done
ensure_model() {  # the model and rows (built by the parity or throughput step the same way where they run first)
  [ -f "$W/hf/config.json" ] || python3 -c "import sys; from benchmarks.train_throughput import build
L, H, A, KV, I, V, R = map(int, sys.argv[2:])
build(sys.argv[1], L, H, A, R, num_key_value_heads=KV, intermediate_size=I, vocab_size=V, max_position_embeddings=4096)" \
    "$W" "${SHAPE[1]}" "${SHAPE[3]}" "${SHAPE[5]}" "${SHAPE[7]}" "${SHAPE[9]}" "${SHAPE[11]}" "${SHAPE[13]}" \
    > "$OUT/build.log" 2>&1
}

log "versions"
(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi") \
  | tee -a "$OUT/summary.txt"
python3 -c "import sys, torch, transformers, deepspeed, peft
print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers',
      transformers.__version__, 'deepspeed', deepspeed.__version__, 'peft', peft.__version__,
      torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')" 2>&1 | tail -1 | tee -a "$OUT/summary.txt"

run_tests() {
log "1. the GPU-only tests (tests/test_gpu.py, test_parity's GPU case)"
timeout 200 python3 -m pytest tests/test_gpu.py tests/test_parity.py -k gpu -s -q -p no:cacheprovider \
  > "$OUT/tests.log" 2>&1
grep -E "^bf16 GPU|passed|failed|skipped|Error" "$OUT/tests.log" | tail -40 | tee -a "$OUT/summary.txt"
}

run_parity() {
log "2. bf16 parity: trainer vs transformers + AdamW (benchmarks/gpu_parity.py)"
timeout 300 python3 -m benchmarks.gpu_parity --work "$W" --out "$OUT/parity.json" "${SHAPE[@]}" "${PARITY[@]}" \
  --device $DEV --fp32-trainer --threads "$OMP_NUM_THREADS" > "$OUT/parity.log" 2>&1
grep -E "^logits:| vs |losses:|Error|exited" "$OUT/parity.log" | tee -a "$OUT/summary.txt"
}

run_save() {
log "3. the save stall, synchronous saves (issue 39's baseline)"
ensure_model
rm -rf "$W/save"
timeout 200 python3 -m deepspeed.launcher.runner --num_gpus 1 trainer.py model_name_or_path="$W/hf" \
  output_dir="$W/save" train_file="$W/train.jsonl" do_eval=false "${SAVE[@]}" gradient_accumulation_steps=4 \
  max_steps=6 save_steps=3 keep_last_n=1 deepspeed=bf16_zero1 progress_bar=false checkpoint.async_save=false \
  > "$OUT/save.log" 2>&1
grep -E "saved step|step [0-9]+/|Error" "$OUT/save.log" | sed 's/^.*\] //' | tee -a "$OUT/summary.txt"
du -sh "$W/save/global_step6" 2>/dev/null | tee -a "$OUT/summary.txt"
}

run_save_async() {
# Saves at steps 8 and 16 of ~2 s each, asynchronous (the default) and not, to tmpfs when it has room (a node's NVMe writes
# GB/s; this machine's disk 0.4 GB/s would make the second save wait for the first): the blocked seconds per save.
log "4. the save stall, asynchronous vs synchronous saves every 8 steps (issue 39)"
ensure_model
df -h /dev/shm "$W" | tee -a "$OUT/summary.txt"
D=$W/async; [ "$(df --output=avail -k /dev/shm | tail -1)" -gt 50000000 ] && D=/dev/shm/gpu_check
for mode in ${ASYNC_MODES:-true false}; do
  rm -rf "$D"
  timeout 170 python3 -m deepspeed.launcher.runner --num_gpus 1 trainer.py model_name_or_path="$W/hf" \
    output_dir="$D" train_file="$W/train.jsonl" do_eval=false "${ASYNC[@]}" max_steps=16 save_steps=8 \
    keep_last_n=1 deepspeed=bf16_zero1 progress_bar=false checkpoint.async_save=$mode > "$OUT/async_$mode.log" 2>&1
  echo "async_save=$mode (output_dir $D):" | tee -a "$OUT/summary.txt"
  grep -E "saved step|Error" "$OUT/async_$mode.log" | sed 's/^.*\] //' | tee -a "$OUT/summary.txt"
  python3 -c "import json, statistics as st, sys
m = [json.loads(l) for l in open(sys.argv[1])]
print('steps', [round(r['step_seconds'], 3) for r in m], 'median', round(st.median(r['step_seconds'] for r in m), 3))
print('save_seconds', {r['step']: round(r['save_seconds'], 3) for r in m if 'save_seconds' in r})
print('losses', [r['loss'] for r in m])
print('peak GiB', max(r.get('max_memory_allocated_gib', 0) for r in m))" "$D/metrics.jsonl" 2>&1 | tee -a "$OUT/summary.txt"
done
du -sh "$D"/global_step* 2>/dev/null | tee -a "$OUT/summary.txt"
rm -rf "$D"
}
run_throughput() {
log "5. throughput, MFU, peak memory vs the planner (benchmarks/train_throughput.py, packing on)"
timeout 300 python3 -m benchmarks.train_throughput --work "$W" "${SHAPE[@]}" "${THROUGHPUT[@]}" --repeat 1 \
  --packing --precision bf16 --device $DEV --peak-tflops 989 --threads "$OMP_NUM_THREADS" \
  --profile "$OUT/profile.txt" ${SKIP_PLAIN:+--skip-plain} > "$OUT/throughput.log" 2>&1
grep -E "^model:|^m=|Error|exited" "$OUT/throughput.log" | tee -a "$OUT/summary.txt"
}

run_moe() {
log "6. one sparse block of each family, ours vs transformers' own (benchmarks/moe.py --families, issue 38)"
timeout 240 python3 -m benchmarks.moe --families gpt_oss,deepseek_v3,mixtral,glm4_moe,mistral4,qwen3_next,qwen3_5_moe_text \
  "${MOE[@]}" --device $DEV > "$OUT/moe.log" 2>&1
grep -E "^block|Error" "$OUT/moe.log" | tee -a "$OUT/summary.txt"
}

run_moe_train() {
# Whole mixture-of-experts models on one GPU: the trainer (bf16_zero1, EP=1) against transformers + AdamW in bf16
# (logits, 8 steps' losses and grad norms, the fp32 loop as yardstick), then step time against the plain loop, MFU
# over the parameters a token uses, and peak memory against the planner.
for fam in deepseek_v3 gpt_oss; do
  config=$DEEPSEEK; [ $fam = gpt_oss ] && config=$GPT_OSS
  log "7. $fam: bf16 parity of the trainer against transformers + AdamW (benchmarks/gpu_parity.py --model-type)"
  timeout 130 python3 -m benchmarks.gpu_parity --work "$W/$fam" --out "$OUT/parity_$fam.json" "${MOE_SHAPE[@]}" \
    "${MOE_PARITY[@]}" --model-type $fam --config "$config" --precision bf16 --device $DEV \
    --threads "$OMP_NUM_THREADS" > "$OUT/parity_$fam.log" 2>&1
  grep -E "^logits:| vs |losses:|Error|exited" "$OUT/parity_$fam.log" | tee -a "$OUT/summary.txt"
  log "8. $fam: throughput, MFU, peak memory vs the planner (benchmarks/train_throughput.py --model-type)"
  timeout 100 python3 -m benchmarks.train_throughput --work "$W/$fam" "${MOE_SHAPE[@]}" "${MOE_THROUGHPUT[@]}" \
    --model-type $fam --config "$config" --repeat 1 --precision bf16 --device $DEV --peak-tflops 989 \
    --threads "$OMP_NUM_THREADS" > "$OUT/throughput_$fam.log" 2>&1
  grep -E "^model:|^m=|Error|exited" "$OUT/throughput_$fam.log" | tee -a "$OUT/summary.txt"
done
}

for s in $STEPS; do "run_$s"; done
log "done"
