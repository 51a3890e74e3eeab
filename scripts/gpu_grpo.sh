#!/usr/bin/env bash
# grpo on one GPU, in one run: its GPU tests (the policy loss at 8k completion tokens × 151,936
# vocab against float64; a short training run whose generation peak the memory plan predicts),
# the policy loss alone against Liger's fused GRPO loss, then whole steps against TRL's
# GRPOTrainer (no vLLM) on the Qwen2.5-1.5B shape. Results under $OUT:
#   $OUT/summary.md          versions, GPUs, exit statuses, the two tables
#   $OUT/tests.log           pytest -m gpu output
#   $OUT/grpo-loss.json      scripts/grpo_bench.py loss
#   $OUT/grpo-e2e.json       scripts/grpo_bench.py e2e
#
# TRL is not a dependency of the project: install it for this run only (pip install trl==1.16.0;
# it needs accelerate, datasets, pandas, psutil and pyarrow). Then, on the GPU machine:
#   OUT=out bash scripts/gpu_grpo.sh
# Knobs: E2E_STEPS (default 6 timed steps after 2 warm-up ones), TRL_MICRO (default 64,32,16,8:
# TRL's per-device batch in completions, largest first until one fits), PYTHON.
set -uo pipefail
source "$(dirname "$0")/report_header.sh"

: "${OUT:?set OUT to the folder for the results}"
PYTHON=${PYTHON:-python3}
E2E_STEPS=${E2E_STEPS:-6}
TRL_MICRO=${TRL_MICRO:-64,32,16,8}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
summary="$OUT/summary.md"
report_header "grpo on one GPU" > "$summary"

timeout --signal=INT --kill-after=30 400 "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider \
  tests/kernels/test_fused_linear_policy_loss.py tests/test_grpo_gpu.py 2>&1 | tee "$OUT/tests.log"
tests_rc=${PIPESTATUS[0]}

"$PYTHON" scripts/grpo_bench.py loss --loss-type grpo --out "$OUT/grpo-loss.json" | tee "$OUT/loss.txt"
loss_rc=${PIPESTATUS[0]}

"$PYTHON" scripts/grpo_bench.py e2e --steps "$E2E_STEPS" --warmup 2 --trl-micro "$TRL_MICRO" \
  --out "$OUT/grpo-e2e.json" | tee "$OUT/e2e.txt"
e2e_rc=${PIPESTATUS[0]}

{
  echo "tests: exit $tests_rc; loss bench: exit $loss_rc; e2e bench: exit $e2e_rc"
  echo
  echo '## policy loss, forward + backward (8 × 1024 completion tokens, H 1536, V 151,936, bf16)'
  echo '```'
  cat "$OUT/loss.txt"
  echo '```'
  echo
  echo '## whole steps, Qwen2.5-1.5B shape (8 prompts × 8 completions × 256 tokens per step)'
  echo '```'
  cat "$OUT/e2e.txt"
  echo '```'
} >> "$summary"
rm -f "$OUT/loss.txt" "$OUT/e2e.txt"
cat "$summary"
(( tests_rc == 0 && loss_rc == 0 && e2e_rc == 0 ))
