#!/usr/bin/env bash
# The multi-GPU checks and benchmarks on one host with 4 GPUs (an H200 ×4), in two parts of
# under 10 minutes each (one device call each):
#
#   source .whl/install.sh && OUT=out PART=1 bash scripts/gpu_distributed.sh
#   source .whl/install.sh && OUT=out PART=2 bash scripts/gpu_distributed.sh
#
# PART=1  pytest -m gpu tests/test_distributed_gpu.py (each strategy with kernels on against one
#         GPU, resumes, 2 "nodes" × 2 GPUs against 1 × 4, on a small model); then the
#         Llama-3-8B shape at 4 × 2048 tokens per GPU, eager vs ligertune vs Liger, under FSDP2
#         and under DeepSpeed ZeRO-3 (`scripts/e2e_bench.py --nproc-per-node 4`). The eager and
#         ligertune arms are the strategy × kernels off/on table of the distributed issue.
# PART=2  the same FSDP2 table at seq 512 (16 × 512 tokens per GPU, the same tokens per step),
#         then the longest sequence per provider: bs 1 per GPU, random-token rows, lengths
#         $SEQ_LENS (default 32768,65536), SEQ_STEPS (2) steps each: an 8B step at 64k tokens
#         per GPU takes ~25 s, and the peak memory is reached in the first steps.
#
# Every 8B arm: the bench recipe (random init, bf16-mixed, activation checkpointing), STEPS
# steps (default 8) of which the first WARMUP (3) are left out of the rates; each arm is
# limited to ARM_TIMEOUT_S (150 s) and arms that would start later than BUDGET_S (420 s) after
# the start are reported as skipped, so a part ends within BUDGET_S + ARM_TIMEOUT_S. Results under $OUT: summary.md (the tables, printed last)
# and results.tar.gz (every arm's log, metrics and result).
set -uo pipefail
source "$(dirname "$0")/report_header.sh"

: "${OUT:?set OUT to the folder for the results}"
: "${PART:?set PART to 1 or 2}"
PYTHON=${PYTHON:-python3}
STEPS=${STEPS:-8}
WARMUP=${WARMUP:-3}
ARM_TIMEOUT_S=${ARM_TIMEOUT_S:-150}
BUDGET_S=${BUDGET_S:-420}
TESTS_TIMEOUT_S=${TESTS_TIMEOUT_S:-200}
SEQ_LENS=${SEQ_LENS:-32768,65536}
SEQ_STEPS=${SEQ_STEPS:-2}
RECIPE=recipes/llama3-8b-alpaca-bench.yaml
WORK=$(mktemp -d)
# NVLink multicast (NVLS) stays off on these machines.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p "$OUT"
start=$(date +%s)
gpus=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')
nvidia-smi -L

# bench NAME SECONDS_LEFT_AT_START [e2e_bench options and overrides...]: one e2e_bench table
# of the 8B shape on every GPU, with what is left of the budget.
bench() {
  local name=$1
  shift
  local left=$((BUDGET_S - ($(date +%s) - start)))
  "$PYTHON" scripts/e2e_bench.py "$RECIPE" --nproc-per-node "$gpus" --steps "$STEPS" --warmup "$WARMUP" "$@" \
    --timeout "$ARM_TIMEOUT_S" --time-budget "$((left > 0 ? left : 0))" --out "$WORK/$name" \
    > "$WORK/$name.log" 2>&1
  echo "$name: exit $? ($(( $(date +%s) - start )) s)"
}

if [[ $PART == 1 ]]; then
  timeout --signal=INT --kill-after=30 "$TESTS_TIMEOUT_S" \
    "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider tests/test_distributed_gpu.py > "$WORK/tests.log" 2>&1
  echo "tests: exit $? ($(( $(date +%s) - start )) s)"
  bench fsdp-2048 parallel.strategy=fsdp
  bench zero3-2048 parallel.strategy=deepspeed parallel.deepspeed.zero_stage=3
  tables=(fsdp-2048 zero3-2048)
else
  bench fsdp-512 parallel.strategy=fsdp data.max_seq_len=512 training.micro_batch_size=16 --steps 6
  bench fsdp-seq parallel.strategy=fsdp training.micro_batch_size=1 --seq-lens "$SEQ_LENS" --random-rows "$gpus" \
    --steps "$SEQ_STEPS" --warmup 1 \
    --title "Llama-3-8B shape, FSDP2 on $gpus × H200, bs 1 per GPU, bf16-mixed + activation checkpointing"
  tables=(fsdp-512 fsdp-seq)
fi

{
  report_header "Multi-GPU part $PART"
  if [[ -f $WORK/tests.log ]]; then
    echo; echo "## tests/test_distributed_gpu.py"; echo
    grep -E '^(FAILED|ERROR)|[0-9]+ (passed|failed)' "$WORK/tests.log" | tail -n 20
  fi
  report_tables "$WORK" "${tables[@]}"
  echo; echo "total: $(( $(date +%s) - start )) s"
} > "$OUT/summary.md"
tar -czf "$OUT/results.tar.gz" -C "$WORK" --exclude='random-tokens.jsonl' .
cat "$OUT/summary.md"
