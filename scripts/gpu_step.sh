#!/usr/bin/env bash
# The whole-step checks and benchmark on one GPU, in one run (about 9 minutes on an H100):
#   1. GPU tests of the packed-row attention, torch.compile with the kernels, and FP8
#   2. scripts/e2e_bench.py on the Llama-3.2-1B bench recipe (bs 8 × 2048, packed bundled
#      Alpaca rows): HF eager, Liger-patched HF, ours, and one arm per setting on top of ours
#      (the attention backend, compile, FP8), side by side in one run.
#
#   source .whl/install.sh && OUT=out bash scripts/gpu_step.sh
#
# Knobs: PROVIDERS (the e2e arms), STEPS (default 15), TESTS_TIMEOUT_S (default 240),
# E2E_BUDGET_S (default 330: arms not started by then are reported skipped).
# Results under $OUT (the runner brings back 8 files): summary.md (printed last), tests.log,
# e2e.json, e2e.md and results.tar.gz (every arm's log and metrics).
set -uo pipefail
source "$(dirname "$0")/report_header.sh"

: "${OUT:?set OUT to the folder for the results}"
PYTHON=${PYTHON:-python3}
PROVIDERS=${PROVIDERS:-eager,liger,ligertune,ligertune-sdpa,eager-compile,ligertune-compile,ligertune-compile-fp8}
STEPS=${STEPS:-15}
TESTS_TIMEOUT_S=${TESTS_TIMEOUT_S:-240}
E2E_BUDGET_S=${E2E_BUDGET_S:-330}
RECIPE=recipes/llama3.2-1b-alpaca-bench.yaml
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
start=$(date +%s)

tests=(tests/test_attention.py tests/test_fp8.py)
for extra in tests/test_compile_gpu.py; do [ -f "$extra" ] && tests+=("$extra"); done
timeout --signal=INT --kill-after=20 "$TESTS_TIMEOUT_S" "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider \
  "${tests[@]}" > "$OUT/tests.log" 2>&1
tests_rc=$?

WORK=$(mktemp -d)
"$PYTHON" scripts/e2e_bench.py "$RECIPE" --providers "$PROVIDERS" --steps "$STEPS" --warmup 5 --timeout 180 \
  --time-budget "$E2E_BUDGET_S" --out "$WORK/e2e" > "$WORK/e2e.log" 2>&1
e2e_rc=$?
cp "$WORK"/e2e/e2e.json "$WORK"/e2e/e2e.md "$OUT"/ 2>/dev/null
tar -czf "$OUT/results.tar.gz" -C "$WORK" --exclude='*.safetensors' --exclude='*.pt' .

{
  report_header "Whole-step checks and benchmark"
  echo "| part | exit |"
  echo "|---|---|"
  echo "| GPU tests (${tests[*]}) | $tests_rc |"
  echo "| e2e_bench | $e2e_rc |"
  echo
  echo "total: $(( $(date +%s) - start )) s"
  echo; echo "## GPU tests"; echo
  grep -E '^(FAILED|ERROR)|[0-9]+ (passed|failed)' "$OUT/tests.log" | tail -n 30
  echo; echo "## e2e"; echo
  cat "$OUT/e2e.md" 2>/dev/null || tail -n 30 "$WORK/e2e.log"
} > "$OUT/summary.md"
cat "$OUT/summary.md"
