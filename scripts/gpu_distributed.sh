#!/usr/bin/env bash
# One run on a 4-GPU H200 machine (about 9 minutes): the distributed GPU tests (strategies with
# kernels on vs one GPU, resumes, 2 "nodes" × 2 GPUs vs 1 × 4 on a small model), then a
# Llama-3-8B-shape table, strategy × kernels → tokens/s/GPU and peak memory, and, if the time
# budget leaves room, the 8B FSDP job as 2 "nodes" × 2 GPUs (c10d on localhost) vs 1 × 4.
#
# Run from the repo root, after the caller has installed the wheels:
#   source .whl/install.sh && OUT=out bash scripts/gpu_distributed.sh
#
# Results under $OUT (4 files):
#   tests.log     pytest -m gpu tests/test_distributed_gpu.py
#   arms.log      every arm's full output, one after the other
#   results.json  per arm: status, tok/s/GPU, MFU, peak memory, per-step losses
#   table.md      the table and the loss agreements (printed last)
# Each arm is `ligertune train recipes/llama3-8b-alpaca-bench.yaml --nproc-per-node N` with
# overrides (random init, bundled data, bf16-mixed, activation checkpointing, 4 × 2048 tokens
# per GPU, MAX_STEPS steps of which the first WARMUP are left out of the rates). An arm that
# fails (OOM, error, timeout) is reported in the table; the others still run. Nothing is
# checkpointed: the run directories go to $SCRATCH and are deleted after each arm.
#
# Knobs (environment): STRATEGIES (default "fsdp deepspeed"; ddp needs ~16 bytes per
# parameter per GPU, 128 GB for 8B before activations, so it is left out), MAX_STEPS (10),
# WARMUP (3), ARM_TIMEOUT_S (170), TESTS_TIMEOUT_S (220), BUDGET_S (540: arms that would start
# after it are reported "skipped"), PYTHON, SCRATCH.
set -uo pipefail

: "${OUT:?set OUT to the folder for the results}"
PYTHON=${PYTHON:-python3}
STRATEGIES=${STRATEGIES:-fsdp deepspeed}
MAX_STEPS=${MAX_STEPS:-10}
WARMUP=${WARMUP:-3}
ARM_TIMEOUT_S=${ARM_TIMEOUT_S:-170}
TESTS_TIMEOUT_S=${TESTS_TIMEOUT_S:-220}
BUDGET_S=${BUDGET_S:-540}
SCRATCH=${SCRATCH:-$(mktemp -d)}
# NVLink multicast (NVLS) stays off on these machines.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT" "$SCRATCH"
start=$(date +%s)
elapsed() { echo $(( $(date +%s) - start )); }
gpus=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')
nvidia-smi -L
echo "GPUs: $gpus; scratch: $SCRATCH"

# --- tests ------------------------------------------------------------------------------------
timeout --signal=INT --kill-after=30 "$TESTS_TIMEOUT_S" \
  "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider tests/test_distributed_gpu.py > "$OUT/tests.log" 2>&1
tests_rc=$?
tests_line=$(grep -E '(passed|failed|error|skipped|no tests ran)' "$OUT/tests.log" | tail -n 1)
echo "tests: exit $tests_rc: $tests_line ($(elapsed) s)"

# --- the table --------------------------------------------------------------------------------
: > "$OUT/arms.log"
status_file="$SCRATCH/status.tsv"
: > "$status_file"

# train_8b DIR [launch options and overrides...]: one node's launcher of an arm, time-limited.
# SIGTERM on timeout reaches every rank through the launcher; torchrun kills them 30 s later.
train_8b() {
  local dir=$1
  shift
  timeout --signal=TERM --kill-after=60 "$ARM_TIMEOUT_S" \
    "$PYTHON" -m ligertune train recipes/llama3-8b-alpaca-bench.yaml "$@" \
    training.max_steps="$MAX_STEPS" logging.throughput_warmup_steps="$WARMUP" logging.log_every=1 \
    logging.progress=plain checkpoint.save_final=false checkpoint.export_hf=false checkpoint.resume=none \
    output_dir="$dir"
}

# finish_arm NAME EXIT_STATUS START_TIME: record the arm, keep its metrics, drop its directory.
finish_arm() {
  printf '%s\t%s\t%s\n' "$1" "$2" "$(( $(date +%s) - $3 ))" >> "$status_file"
  mkdir -p "$SCRATCH/metrics"
  cp "$SCRATCH/$1/metrics.jsonl" "$SCRATCH/metrics/$1.jsonl" 2>/dev/null
  rm -rf "${SCRATCH:?}/$1"
  echo "arm $1: exit $2 ($(elapsed) s)"
}

# has_time NAME SECONDS: whether SECONDS more fit the budget; records the arm as skipped if not.
has_time() {
  if (( $(elapsed) + $2 > BUDGET_S )); then
    printf '%s\tskipped\t0\n' "$1" >> "$status_file"
    echo "arm $1: skipped (time budget)"
    return 1
  fi
}

for strategy in $STRATEGIES; do
  for kernels in all none; do
    name="$strategy-kernels-$kernels"
    has_time "$name" 60 || continue
    arm_start=$(date +%s)
    echo "===== arm $name" >> "$OUT/arms.log"
    train_8b "$SCRATCH/$name" --nproc-per-node "$gpus" parallel.strategy="$strategy" kernels="$kernels" \
      >> "$OUT/arms.log" 2>&1
    finish_arm "$name" $? "$arm_start"
  done
done

# The fsdp-kernels-all job again as two "nodes" of two GPUs on this host (c10d rendezvous on
# localhost, the same command on both), when the budget leaves room: same losses as 1 × 4.
# The tiny-model version of this check is in the tests above.
name=fsdp-kernels-all-2x2
if (( gpus >= 4 )) && [[ " $STRATEGIES " == *" fsdp "* ]] && has_time "$name" 100; then
  port=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  arm_start=$(date +%s)
  pids=()
  for devices in 0,1 2,3; do
    CUDA_VISIBLE_DEVICES=$devices train_8b "$SCRATCH/$name" --nnodes 2 --nproc-per-node 2 \
      --rdzv-endpoint "localhost:$port" parallel.strategy=fsdp kernels=all > "$SCRATCH/$name-$devices.log" 2>&1 &
    pids+=($!)
  done
  rc=0
  for pid in "${pids[@]}"; do
    wait "$pid" || rc=$?
  done
  for devices in 0,1 2,3; do
    echo "===== arm $name, node on GPUs $devices" >> "$OUT/arms.log"
    cat "$SCRATCH/$name-$devices.log" >> "$OUT/arms.log"
  done
  finish_arm "$name" "$rc" "$arm_start"
fi

# --- summary ----------------------------------------------------------------------------------
"$PYTHON" - "$SCRATCH" "$OUT" "$gpus" "$tests_rc" "$tests_line" "$(elapsed)" <<'EOF'
import json
import sys
from pathlib import Path

scratch, out, gpus, tests_rc, tests_line, seconds = sys.argv[1:]
scratch, out = Path(scratch), Path(out)
arms = {}
for line in (scratch / "status.tsv").read_text().splitlines():
    name, rc, wall = line.split("\t")
    metrics = scratch / "metrics" / f"{name}.jsonl"
    records = [json.loads(r) for r in metrics.read_text().splitlines()] if metrics.is_file() else []
    summary = next((r for r in reversed(records) if r["event"] == "summary"), {})
    start = next((r for r in records if r["event"] == "start"), {})
    status = "skipped" if rc == "skipped" else "ok" if rc == "0" and summary else f"failed (exit {rc})"
    if rc == "124":
        status = "timed out"
    arms[name] = {
        "status": status,
        "wall_s": int(wall),
        "world_size": start.get("world_size"),
        "tokens_per_s_per_gpu": summary.get("tokens_per_s_per_gpu"),
        "mfu": summary.get("mfu"),
        "peak_mem_allocated_gib": summary.get("peak_mem_allocated_gib"),
        "peak_mem_reserved_gib": summary.get("peak_mem_reserved_gib"),
        "losses": {r["step"]: r["loss"] for r in records if r["event"] == "train"},
    }
(out / "results.json").write_text(json.dumps(arms, indent=2) + "\n")


def fmt(value, spec, unit=""):
    return "n/a" if value is None else format(value, spec) + unit


def max_rel(a, b):
    steps = sorted(set(a["losses"]) & set(b["losses"]))
    if not steps or len(steps) != len(a["losses"]) or len(steps) != len(b["losses"]):
        return None
    return max(abs(a["losses"][s] - b["losses"][s]) / abs(b["losses"][s]) for s in steps)


lines = [
    f"## Llama-3-8B shape, {gpus} × H200, bf16-mixed, activation checkpointing, 4 × 2048 tokens per GPU",
    "",
    f"gpu tests: exit {tests_rc}: {tests_line}; total {seconds} s",
    "",
    "| arm | status | tok/s/GPU | MFU | peak alloc GiB | peak reserved GiB | final loss | wall s |",
    "|---|---|---|---|---|---|---|---|",
]
for name, arm in arms.items():
    final = arm["losses"][max(arm["losses"])] if arm["losses"] else None
    mfu = None if arm["mfu"] is None else 100 * arm["mfu"]
    lines.append(
        f"| {name} | {arm['status']} | {fmt(arm['tokens_per_s_per_gpu'], ',.0f')} | {fmt(mfu, '.1f', '%')} | "
        f"{fmt(arm['peak_mem_allocated_gib'], '.1f')} | {fmt(arm['peak_mem_reserved_gib'], '.1f')} | "
        f"{fmt(final, '.4f')} | {arm['wall_s']} |"
    )
lines += ["", "Loss agreement (max relative difference over the steps; bf16 tolerance 2e-2):", ""]
pairs = [(f"{a}-kernels-{k}", f"{b}-kernels-{k}") for k in ("all", "none") for a, b in [("deepspeed", "fsdp")]]
pairs += [(f"{s}-kernels-all", f"{s}-kernels-none") for s in ("fsdp", "deepspeed")]
pairs += [("fsdp-kernels-all-2x2", "fsdp-kernels-all")]
for a, b in pairs:
    if a in arms and b in arms:
        rel = max_rel(arms[a], arms[b])
        verdict = "n/a (an arm did not finish)" if rel is None else f"{rel:.2e} {'ok' if rel <= 2e-2 else 'DIVERGED'}"
        lines.append(f"- {a} vs {b}: {verdict}")
(out / "table.md").write_text("\n".join(lines) + "\n")
EOF

echo
cat "$OUT/table.md"
