#!/usr/bin/env bash
# The single-GPU half of the GPU checks and benchmarks, in one run: GPU tests, `ligertune
# compare` (plain and --ablate) and the end-to-end benchmarks of the Llama-3.2-1B shape. The
# work is cut into lanes in four slots; slot i runs on GPU i mod G and its lanes one after the
# other, so on a 4-GPU machine the slots run side by side (each on a GPU of its own) and on
# one GPU everything runs in turn. About 9 minutes with 4 GPUs.
#
#   source .whl/install.sh && OUT=out bash scripts/gpu_single.sh
#
# Lanes
#   tests     pytest -m gpu: every GPU test but the distributed, patching and compare ones
#   patching  pytest -m gpu tests/test_patching_gpu.py (parity and convergence per family)
#   compare   ligertune compare on the 1B bench recipe; the compare GPU tests; e2e_bench
#             eager vs ligertune vs Liger at bs 8 × 2048
#   ablate    ligertune compare --ablate on the 1B bench recipe (one arm per kernel)
#   seq       e2e_bench --seq-lens on the 1B shape, bs 1, random-token rows: longest sequence
#             per provider, throughput and memory against the length
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
    --ignore=tests/test_distributed_gpu.py --ignore=tests/test_compare.py --ignore=tests/test_patching_gpu.py
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

# Four slots of lanes; slot i runs on GPU i mod G, its lanes one after the other.
slots=("tests" "compare" "patching ablate" "seq")
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
  for lane in tests patching compare; do
    echo; echo "## $lane: pytest summaries"; echo
    grep -E '^(FAILED|ERROR)|[0-9]+ (passed|failed)' "$WORK/$lane/lane.log" | tail -n 30
  done
  for f in compare/cmp/compare.md compare/e2e/e2e.md ablate/cmp/compare.md seq/e2e/e2e.md; do
    echo; echo "## $f"; echo
    cat "$WORK/$f" 2>/dev/null || { echo "missing; lane log tail:"; tail -n 20 "$WORK/${f%%/*}/lane.log"; }
  done
} > "$OUT/summary.md"
tar -czf "$OUT/results.tar.gz" -C "$WORK" --exclude='random-tokens.jsonl' --exclude='*.safetensors' --exclude='*.pt' .
cat "$OUT/summary.md"
