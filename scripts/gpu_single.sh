#!/usr/bin/env bash
# The single-GPU half of the GPU checks and benchmarks, in one run: GPU tests, `ligertune
# compare` (plain and --ablate) and the end-to-end benchmarks of the Llama-3.2-1B shape. The
# work is cut into lanes in four slots; slot i runs on GPU i mod G and its lanes one after the
# other, so on a 4-GPU machine the slots run side by side (each on a GPU of its own) and on
# one GPU everything runs in turn. About 9 minutes with 4 GPUs.
#
#   source .whl/install.sh && OUT=out bash scripts/gpu_single.sh
#
#   SLOTS="moe;vision;vision_lora patching;grpo" OUT=out bash scripts/gpu_single.sh
#
# Lanes (SLOTS: ';' between slots, ' ' between the lanes of one slot; default
# "tests;compare;patching ablate;seq")
#   tests     pytest -m gpu: every GPU test but the distributed, patching, compare and family ones
#   patching  pytest -m gpu tests/test_patching_gpu.py (parity and convergence per family)
#   compare   ligertune compare on the 1B bench recipe; the compare GPU tests; e2e_bench
#             eager vs ligertune vs Liger at bs 8 × 2048
#   ablate    ligertune compare --ablate on the 1B bench recipe (one arm per kernel)
#   seq       e2e_bench --seq-lens on the 1B shape, bs 1, random-token rows: longest sequence
#             per provider, throughput and memory against the length
#   moe       the MoE GPU tests; scripts/moe_bench.py (the experts block at three shapes); e2e_bench
#             on the Qwen3-30B-A3B shape cut to 4 layers, bf16, bs 2 × 4096 random tokens: HF
#             (grouped_mm experts), ours with HF's experts, ours (moe_experts), Liger
#   vision    the vision-language GPU tests; e2e_bench on the Qwen2.5-VL-7B shape, 4 images of
#             896 × 896 (4 × 1024 tokens) per row, bs 2: eager, ours, Liger
#   vision_lora  the same rows on the LoRA bench recipe: HF + peft, ours, Liger
#   grpo      scripts/grpo_bench.py loss (ours, eager, compile, Liger at chunk sizes 1 and 8) and e2e
#             (whole steps against TRL's GRPOTrainer: needs wheelhouse.sh trl==1.16.0), the grpo GPU tests
# Results under $OUT: summary.md (what ran, exit statuses, the tables) and results.tar.gz
# (every lane's outputs and logs). Knobs: LANE_BUDGET_S (default 500: a lane's budget),
# SEQ_LENS (default 4096,16384,32768,65536,131072), PYTHON.
set -uo pipefail
source "$(dirname "$0")/report_header.sh"

: "${OUT:?set OUT to the folder for the results}"
PYTHON=${PYTHON:-python3}
LANE_BUDGET_S=${LANE_BUDGET_S:-500}
SEQ_LENS=${SEQ_LENS:-4096,16384,32768,65536,131072}
RECIPE=recipes/llama3.2-1b-alpaca-bench.yaml
WORK=$(mktemp -d)
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
gpus=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')
(( gpus > 0 )) || { echo "no CUDA GPU visible"; exit 1; }
start=$(date +%s)

lane_tests() {
  timeout --signal=INT --kill-after=20 "$LANE_BUDGET_S" "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider tests \
    --ignore=tests/test_distributed_gpu.py --ignore=tests/test_compare.py --ignore=tests/test_patching_gpu.py \
    --ignore=tests/test_moe_gpu.py --ignore=tests/kernels/test_moe.py --ignore=tests/test_vision_gpu.py \
    --ignore=tests/test_grpo_gpu.py --ignore=tests/kernels/test_fused_linear_policy_loss.py
}

lane_patching() {
  timeout --signal=INT --kill-after=20 300 "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider tests/test_patching_gpu.py
}

lane_compare() {
  "$PYTHON" -m ligertune compare "$RECIPE" --steps 20 --out "$WORK/compare/cmp"
  timeout --signal=INT --kill-after=20 200 "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider tests/test_compare.py
  "$PYTHON" scripts/e2e_bench.py "$RECIPE" --steps 15 --warmup 5 --timeout 120 --time-budget 120 --out "$WORK/compare/e2e"
}

lane_ablate() {
  "$PYTHON" -m ligertune compare "$RECIPE" --steps 12 --ablate --kernels rms_norm,rope,swiglu,fused_linear_cross_entropy \
    --out "$WORK/ablate/cmp"
}

lane_seq() {
  "$PYTHON" scripts/e2e_bench.py "$RECIPE" training.micro_batch_size=1 --seq-lens "$SEQ_LENS" --random-rows 1 \
    --steps 4 --warmup 2 --timeout 150 --time-budget $((LANE_BUDGET_S - 150)) --out "$WORK/seq/e2e" \
    --title "Llama-3.2-1B shape, 1 × H200, bs 1, bf16, random-token rows"
}

lane_moe() {
  timeout --signal=INT --kill-after=20 200 "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider \
    tests/kernels/test_moe.py tests/test_moe_gpu.py
  timeout --signal=INT --kill-after=20 300 "$PYTHON" scripts/moe_bench.py --rep-ms 200 --out "$WORK/moe/moe-bench.json"
  "$PYTHON" scripts/e2e_bench.py recipes/qwen3-30b-a3b-alpaca-bench.yaml parallel.strategy=none \
    'model.config_overrides={num_hidden_layers: 4}' training.precision=bf16 training.micro_batch_size=2 \
    training.activation_checkpointing=none --seq-lens 4096 --random-rows 16 --steps 10 --warmup 4 \
    --providers eager,ligertune-hf-experts,ligertune,liger --timeout 100 --time-budget 150 --out "$WORK/moe/e2e" \
    --title "Qwen3-30B-A3B shape, 4 layers, 1 GPU, bs 2 × 4096, bf16"
}

VL_ROWS=(data.max_seq_len=4608 data.image_min_pixels=802816 data.image_max_pixels=802816 training.micro_batch_size=2
         --image-rows 16 --images-per-row 4 --steps 10 --warmup 4 --timeout 140)

lane_vision() {
  timeout --signal=INT --kill-after=20 150 "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider tests/test_vision_gpu.py
  "$PYTHON" scripts/e2e_bench.py recipes/qwen2.5-vl-7b-docs-bench.yaml "${VL_ROWS[@]}" --time-budget 240 \
    --out "$WORK/vision/e2e" --title "Qwen2.5-VL-7B shape, 1 GPU, bs 2 × (4 images × 1024 + text) tokens"
}

lane_vision_lora() {
  "$PYTHON" scripts/e2e_bench.py recipes/qwen2.5-vl-7b-docs-lora-bench.yaml "${VL_ROWS[@]}" --time-budget 240 \
    --out "$WORK/vision_lora/e2e" --title "Qwen2.5-VL-7B shape, LoRA, 1 GPU, bs 2 × (4 images × 1024 + text) tokens"
}

lane_grpo() {
  timeout --signal=INT --kill-after=20 120 "$PYTHON" scripts/grpo_bench.py loss --out "$WORK/grpo/grpo-loss.json"
  timeout --signal=INT --kill-after=20 330 "$PYTHON" scripts/grpo_bench.py e2e --steps 4 --warmup 2 --trl-micro 64,16 \
    --timeout 150 --out "$WORK/grpo/grpo-e2e.json"
  timeout --signal=INT --kill-after=20 90 "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider tests/test_grpo_gpu.py
}

# Slots of lanes; slot i runs on GPU i mod G, its lanes one after the other.
IFS=';' read -r -a slots <<< "${SLOTS:-tests;compare;patching ablate;seq}"
declare -A on_gpu
for i in "${!slots[@]}"; do
  g=$((i % gpus))
  on_gpu[$g]="${on_gpu[$g]:-} ${slots[$i]}"
done
pids=()
for g in "${!on_gpu[@]}"; do
  (
    for lane in ${on_gpu[$g]}; do
      mkdir -p "$WORK/$lane"
      lane_start=$(date +%s)
      # Each lane bounds itself: pytest by `timeout`, the benchmarks by their own per-arm
      # timeouts and time budgets (their arms run in sessions of their own, out of reach of an
      # outer `timeout`).
      CUDA_VISIBLE_DEVICES=$g "lane_$lane" > "$WORK/$lane/lane.log" 2>&1
      echo "$lane $? $(( $(date +%s) - lane_start )) $g" >> "$WORK/status"
    done
  ) &
  pids+=($!)
done
wait "${pids[@]}"

{
  report_header "Single-GPU checks and benchmarks"
  echo "| lane | exit | seconds | GPU |"
  echo "|---|---|---|---|"
  sort "$WORK/status" | while read -r lane rc secs g; do echo "| $lane | $rc | $secs | $g |"; done
  echo
  echo "total: $(( $(date +%s) - start )) s"
  for lane in tests patching compare moe vision vision_lora grpo; do
    [[ -f $WORK/$lane/lane.log ]] || continue
    echo; echo "## $lane: pytest summaries"; echo
    grep -E '^(FAILED|ERROR)|[0-9]+ (passed|failed)' "$WORK/$lane/lane.log" | tail -n 30
  done
  for f in compare/cmp/compare.md compare/e2e/e2e.md ablate/cmp/compare.md seq/e2e/e2e.md moe/e2e/e2e.md \
    vision/e2e/e2e.md vision_lora/e2e/e2e.md; do
    [[ -d $WORK/${f%%/*} ]] || continue
    echo; echo "## $f"; echo
    cat "$WORK/$f" 2>/dev/null || { echo "missing; lane log tail:"; tail -n 20 "$WORK/${f%%/*}/lane.log"; }
  done
  if [[ -f $WORK/grpo/lane.log ]]; then
    echo; echo "## grpo (lane log, tables)"; echo; echo '```'
    grep -v -E '^\[|^ *$' "$WORK/grpo/lane.log" | tail -n 60
    echo '```'
  fi
  if [[ -f $WORK/moe/moe-bench.json ]]; then
    echo; echo "## scripts/moe_bench.py"; echo; echo '```'
    grep -E '^(qwen3-30b-a3b|gpt-oss-20b|mixtral-8x7b) ' "$WORK/moe/lane.log"
    echo '```'
  fi
} > "$OUT/summary.md"
tar -czf "$OUT/results.tar.gz" -C "$WORK" --exclude='random-tokens.jsonl' --exclude='image-rows.jsonl' --exclude='*.safetensors' --exclude='*.pt' .
cat "$OUT/summary.md"
