#!/usr/bin/env bash
# One run on the GPU machine: the gpu-marked tests, then the full kernel benchmark. Everything
# lands under $OUT (8 files at most: the runner brings back only that many, 2 folders deep):
#   $OUT/summary.md        versions, GPUs, test status, the exact bench command, wall times
#   $OUT/gpu_tests.log     pytest -m gpu output
#   $OUT/bench/            bench.json, bench.csv, bench.md and 3 PNGs (`ligertune bench --out`)
# The compact bench table (bench.md) is printed last.
#
# Run from the repo root, after the caller has installed the wheels:
#   source .whl/install.sh && bash scripts/gpu_check.sh
# Knobs (environment): BENCH_ARGS (extra `ligertune bench` options, e.g. "--quick"),
# TESTS_TIMEOUT_S (default 180), BENCH_BUDGET_S (default 240: cases not started by then are
# reported "skipped"). With the defaults the whole run stays under ~8 minutes on an H200.
#
# The tests failing does not stop the benchmark; the exit status is non-zero if either failed.
set -euo pipefail
source "$(dirname "$0")/report_header.sh"

: "${OUT:?set OUT to the folder for the results}"
PYTHON=${PYTHON:-python3}
TESTS_TIMEOUT_S=${TESTS_TIMEOUT_S:-180}
BENCH_BUDGET_S=${BENCH_BUDGET_S:-240}
mkdir -p "$OUT/bench"
summary="$OUT/summary.md"
start=$(date +%s)

nvidia-smi -L
{
  report_header "GPU check"
} > "$summary"

# --- tests ----------------------------------------------------------------------------------
# SIGINT on timeout, so pytest still prints its summary of what ran.
tests_start=$(date +%s)
if "$PYTHON" -c 'import pytest' 2>/dev/null; then
  set +e
  timeout --signal=INT --kill-after=30 "$TESTS_TIMEOUT_S" \
    "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu_tests.log"
  tests_rc=${PIPESTATUS[0]}
  set -e
  case $tests_rc in
    0) tests_status="passed" ;;
    5) tests_status="no gpu tests collected" ;;
    124 | 130 | 137) tests_status="TIMED OUT after ${TESTS_TIMEOUT_S}s" ;;
    *) tests_status="FAILED (pytest exit $tests_rc)" ;;
  esac
  tests_line=$(grep -E '(passed|failed|error|skipped|no tests ran)' "$OUT/gpu_tests.log" | tail -n 1 || true)
else
  tests_rc=1
  tests_status="NOT RUN: pytest is not installed (add it to the wheelhouse)"
  tests_line=""
  echo "$tests_status" | tee "$OUT/gpu_tests.log"
fi
tests_s=$(( $(date +%s) - tests_start ))

# --- benchmark ------------------------------------------------------------------------------
# shellcheck disable=SC2206  # BENCH_ARGS is deliberately split into options
bench_cmd=("$PYTHON" -m ligertune.cli bench --out "$OUT/bench" --time-budget "$BENCH_BUDGET_S" ${BENCH_ARGS:-})
bench_start=$(date +%s)
set +e
"${bench_cmd[@]}"
bench_rc=$?
set -e
bench_s=$(( $(date +%s) - bench_start ))

{
  echo "- gpu tests: $tests_status ($tests_s s): ${tests_line:-no summary line}"
  echo "- bench: exit $bench_rc ($bench_s s): \`${bench_cmd[*]}\`"
  echo "  (same as \`ligertune bench --out $OUT/bench --time-budget $BENCH_BUDGET_S ${BENCH_ARGS:-}\`)"
  echo "- total wall time: $(( $(date +%s) - start )) s"
} >> "$summary"

echo
cat "$summary"
echo
if [ -f "$OUT/bench/bench.md" ]; then cat "$OUT/bench/bench.md"; fi
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
