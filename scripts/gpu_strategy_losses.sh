#!/usr/bin/env bash
# Loss curves of one recipe under several parallel strategies and DeepSpeed settings, side by
# side, on every GPU of one host: the experiment that isolates why two strategies train
# differently. Each arm is one `scripts/e2e_bench.py --providers eager` run (HF eager, so the
# kernels are not a factor) with the arm's overrides; the table has every arm's loss per step
# and its largest relative difference from the first arm.
#
#   source .whl/install.sh && OUT=out ARMS=1b bash scripts/gpu_strategy_losses.sh
#
# ARMS=1b  the Llama-3.2-1B shape in bf16-mixed with activation checkpointing (the 8B recipe's
#          precision, schedule and checkpointing): fsdp, ddp, ZeRO-3, ZeRO-2, ZeRO-3 with its
#          optimizer split into sub-groups, ZeRO-3 reducing gradients in fp32.
# ARMS=1b-bf16-weights  the 1b arms fsdp, ddp, ZeRO-3, ZeRO-2 fine-tuning saved weights instead of
#          a random init: the 1b recipe's random init (fp32, seeded) rounded to bf16 and saved, as
#          most hub checkpoints are. DeepSpeed's bf16 mode builds its fp32 master weights from
#          the bf16 module; loading bf16 weights gives every strategy such master weights.
# STEPS (default 6) steps per arm; ARM_TIMEOUT_S (default 150) per arm; arms that would start
# later than BUDGET_S (default 480) after the start are skipped. Results under $OUT: summary.md
# and results.tar.gz (every arm's log and e2e.json).
set -uo pipefail
source "$(dirname "$0")/report_header.sh"

: "${OUT:?set OUT to the folder for the results}"
: "${ARMS:?set ARMS to 1b or 1b-bf16-weights}"
PYTHON=${PYTHON:-python3}
STEPS=${STEPS:-6}
ARM_TIMEOUT_S=${ARM_TIMEOUT_S:-150}
BUDGET_S=${BUDGET_S:-480}
WORK=$(mktemp -d)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p "$OUT"
start=$(date +%s)
gpus=${GPUS:-$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')}

# ds_json NAME JSON: a DeepSpeed config file merged over the recipe's (parallel.deepspeed.config).
ds_json() {
  echo "$2" > "$WORK/$1.json"
  echo "parallel.deepspeed.config=$WORK/$1.json"
}

if [[ $ARMS == 1b ]]; then
  RECIPE=recipes/llama3.2-1b-alpaca-bench.yaml
  COMMON=(training.precision=bf16-mixed training.activation_checkpointing=true training.micro_batch_size=4)
  names=(fsdp ddp zero3 zero2 zero3-subgroups zero3-fp32-comm)
  arms=(
    "parallel.strategy=fsdp"
    "parallel.strategy=ddp"
    "parallel.strategy=deepspeed"
    "parallel.strategy=deepspeed parallel.deepspeed.zero_stage=2"
    "parallel.strategy=deepspeed $(ds_json subgroups '{"zero_optimization": {"sub_group_size": 100000000}}')"
    "parallel.strategy=deepspeed $(ds_json fp32comm '{"communication_data_type": "fp32"}')"
  )
elif [[ $ARMS == 1b-bf16-weights ]]; then
  RECIPE=recipes/llama3.2-1b-alpaca-bench.yaml
  "$PYTHON" - "$RECIPE" "$WORK/bf16-weights" <<'EOF' || exit 1
import sys
import torch
from ligertune.models.build import build_model
from ligertune.config import load_recipe

recipe = load_recipe(sys.argv[1], ["training.precision=bf16-mixed"])
build_model(recipe, torch.device("cuda")).to(torch.bfloat16).save_pretrained(sys.argv[2])
EOF
  COMMON=(training.precision=bf16-mixed training.activation_checkpointing=true training.micro_batch_size=4
          model.config=null "model.name_or_path=$WORK/bf16-weights")
  names=(fsdp ddp zero3 zero2)
  arms=(
    "parallel.strategy=fsdp"
    "parallel.strategy=ddp"
    "parallel.strategy=deepspeed"
    "parallel.strategy=deepspeed parallel.deepspeed.zero_stage=2"
  )
else
  echo "ARMS must be 1b or 1b-bf16-weights, not $ARMS" >&2
  exit 2
fi

for i in "${!names[@]}"; do
  name=${names[$i]}
  if (( $(date +%s) - start > BUDGET_S )); then
    echo "$name: skipped (budget)"
    continue
  fi
  # shellcheck disable=SC2086  # the arm's overrides are words
  "$PYTHON" scripts/e2e_bench.py "$RECIPE" --providers eager --nproc-per-node "$gpus" --steps "$STEPS" --warmup 1 \
    --timeout "$ARM_TIMEOUT_S" --out "$WORK/$name" "${COMMON[@]}" ${arms[$i]} > "$WORK/$name.log" 2>&1
  echo "$name: exit $? ($(( $(date +%s) - start )) s)"
done

{
  report_header "Loss per step by strategy ($ARMS, $gpus GPUs)"
  echo "recipe: $RECIPE ${COMMON[*]}"
  echo
  for i in "${!names[@]}"; do echo "- ${names[$i]}: ${arms[$i]}"; done
  echo
  "$PYTHON" - "$WORK" "${names[@]}" <<'EOF'
import json, sys
from pathlib import Path

work, names = Path(sys.argv[1]), sys.argv[2:]
curves = {}
for name in names:
    try:
        result = json.loads((work / name / "e2e.json").read_text())["results"][0]
        curves[name] = result.get("losses") or []
    except (OSError, KeyError, IndexError, ValueError):
        curves[name] = []
steps = max((len(c) for c in curves.values()), default=0)
reference = curves[names[0]]
print("| arm | " + " | ".join(f"step {s + 1}" for s in range(steps)) + " | max rel Δ vs " + names[0] + " |")
print("|---" * (steps + 2) + "|")
for name, curve in curves.items():
    cells = [f"{x:.4f}" for x in curve] + ["–"] * (steps - len(curve))
    deltas = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(curve, reference)]
    largest = f"{max(deltas):.2e}" if deltas else "–"
    print(f"| {name} | " + " | ".join(cells) + f" | {largest} |")
EOF
  echo; echo "total: $(( $(date +%s) - start )) s"
} > "$OUT/summary.md"
tar -czf "$OUT/results.tar.gz" -C "$WORK" --exclude=bf16-weights .
cat "$OUT/summary.md"
for name in "${names[@]}"; do
  if ! [[ -s $WORK/$name/e2e.json ]]; then echo "== $name log tail"; tail -n 15 "$WORK/$name.log"; fi
done
