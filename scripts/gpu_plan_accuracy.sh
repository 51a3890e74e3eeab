#!/usr/bin/env bash
# `ligertune plan` against the measured peak: short runs (3 steps) of the 1B and 8B bench
# recipes in several settings (micro-batch, activation checkpointing, offload, kernels on/off);
# each run's peak allocated memory (metrics.jsonl, `peak_mem_allocated_gib`, the largest over
# the steps; rank 0 under torchrun) against the plan's prediction for the same recipe,
# overrides and world size. The target: within 10% in every line. Then the plan/checkpointing GPU
# tests. About 8 minutes on 4 GPUs (the 1B lines on one GPU, the 8B lines on NPROC).
#
#   OUT=runs/plan-accuracy bash scripts/gpu_plan_accuracy.sh            # everything
#   OUT=runs/plan-accuracy PARTS=1b bash scripts/gpu_plan_accuracy.sh   # one GPU: the 1B lines only
#   OUT=runs/plan-8b PARTS=8b1 STEPS=6 bash scripts/gpu_plan_accuracy.sh  # one H200: 8B full fine-tune,
#       bf16 weights, hand-picked settings against micro_batch_size/activation_checkpointing auto
#
# Knobs: PARTS (1b, 8b, 8b1, or several: "1b 8b"), LINES (names of the lines to run within those
# parts, default all), NPROC (8B world size, default 4), STEPS (default 3), LINE_TIMEOUT_S
# (default 200), TESTS (default 1: then the GPU tests), PYTHON.
# Results: $OUT/accuracy.md (the table) and one run directory per line.
set -uo pipefail

: "${OUT:?set OUT to the folder for the results}"
PYTHON=${PYTHON:-python3}
PARTS=${PARTS:-"1b 8b"}
NPROC=${NPROC:-4}
STEPS=${STEPS:-3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
COMMON="training.max_steps=$STEPS logging.log_every=1 logging.throughput_warmup_steps=$(( STEPS > 3 ? 2 : 1 )) logging.progress=plain checkpoint.save_final=false checkpoint.export_hf=false data.validation_fraction=0.0 training.eval_every=null"
R1B=recipes/llama3.2-1b-alpaca-bench.yaml
R8B=recipes/llama3-8b-alpaca-bench.yaml
: > "$OUT/lines.tsv"

# line NAME RECIPE WORLD OVERRIDES...: one short run, then its prediction.
line() {
  local name=$1 recipe=$2 world=$3
  shift 3
  [[ -n "${LINES:-}" && " $LINES " != *" $name "* ]] && return 0
  local dir="$OUT/$name"
  rm -rf "$dir"
  local launch=()
  (( world > 1 )) && launch=(--nproc-per-node "$world")
  echo "== $name: $recipe × $world: $*"
  timeout --signal=INT "${LINE_TIMEOUT_S:-200}" "$PYTHON" -m ligertune train "$recipe" "${launch[@]}" $COMMON "output_dir=$dir" "$@" \
    > "$dir.log" 2>&1
  local status=$?
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$recipe" "$world" "$status" "$*" >> "$OUT/lines.tsv"
}

if [[ " $PARTS " == *" 1b "* ]]; then
  line 1b-ours-bs8 "$R1B" 1
  line 1b-eager-bs8 "$R1B" 1 kernels=none
  line 1b-ours-bs16-selective "$R1B" 1 training.micro_batch_size=16 training.activation_checkpointing=selective
  line 1b-ours-bs16-full "$R1B" 1 training.micro_batch_size=16 training.activation_checkpointing=full
  line 1b-ours-bs16-attention "$R1B" 1 training.micro_batch_size=16 training.activation_checkpointing=selective \
    training.activation_checkpointing_every=1 "training.activation_checkpointing_modules=[attention]"
  line 1b-eager-bs4-full "$R1B" 1 kernels=none training.micro_batch_size=4 training.activation_checkpointing=full
  line 1b-ours-bs8-offload "$R1B" 1 training.activation_offload=true
  line 1b-ours-seq16k "$R1B" 1 training.micro_batch_size=1 data.max_seq_len=16384
  line 1b-ours-auto "$R1B" 1 training.micro_batch_size=auto training.activation_checkpointing=auto
fi
if [[ " $PARTS " == *" 8b "* ]]; then
  line 8b-ours-full-bs4 "$R8B" "$NPROC"
  line 8b-eager-full-bs4 "$R8B" "$NPROC" kernels=none
  line 8b-ours-none-bs4 "$R8B" "$NPROC" training.activation_checkpointing=none
  line 8b-eager-none-bs4 "$R8B" "$NPROC" kernels=none training.activation_checkpointing=none
  line 8b-ours-selective-bs4 "$R8B" "$NPROC" training.activation_checkpointing=selective
fi

if [[ " $PARTS " == *" 8b1 "* ]]; then
  ONE="parallel.strategy=none training.precision=bf16"
  line 8b1-ours-bs4-none "$R8B" 1 $ONE training.activation_checkpointing=none
  line 8b1-ours-bs8-selective "$R8B" 1 $ONE training.micro_batch_size=8 training.activation_checkpointing=selective
  line 8b1-ours-bs16-full "$R8B" 1 $ONE training.micro_batch_size=16 training.activation_checkpointing=full
  line 8b1-ours-auto "$R8B" 1 $ONE training.micro_batch_size=auto training.activation_checkpointing=auto
fi

"$PYTHON" - "$OUT" <<'PY'
import json, shlex, sys
from pathlib import Path

from ligertune.config import load_recipe
from ligertune.plan.choose import base_setting
from ligertune.plan.estimate import GIB, estimate
from ligertune.models.shape import recipe_shape

out = Path(sys.argv[1])
rows, misses = [], 0
for entry in (out / "lines.tsv").read_text().splitlines():
    name, recipe_path, world, status, overrides = entry.split("\t")
    run = out / name
    measured = speed = None
    metrics = run / "metrics.jsonl"
    if metrics.exists():
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        peaks = [r["peak_mem_allocated_gib"] for r in records if r.get("peak_mem_allocated_gib") is not None]
        measured = max(peaks) if peaks else None
        speed = next((r.get("tokens_per_s") for r in records if r.get("event") == "summary"), None)
    tok_s = f"{speed:,.0f}" if speed else "—"
    recipe = load_recipe(recipe_path, shlex.split(overrides))
    # auto is resolved by the run against its GPU: report what it chose, its peak and speed.
    if recipe.training.micro_batch_size == "auto" or recipe.training.activation_checkpointing == "auto":
        log = (out / f"{name}.log").read_text() if (out / f"{name}.log").exists() else ""
        chosen = [l for l in log.splitlines() if "auto: " in l and "predicted peak" in l]
        rows.append(f"| {name} | {world} | auto: {chosen[-1].split('auto: ')[-1] if chosen else '?'} | {measured} | | | {tok_s} |")
        continue
    predicted = estimate(recipe_shape(recipe), base_setting(recipe, int(world))).peak / GIB
    if measured is None:
        rows.append(f"| {name} | {world} | {predicted:.1f} | exit {status} (see {name}.log) | — | | |")
        continue
    error = predicted / measured - 1
    if speed is None:
        # No summary: the run stopped early. Its first step's peak precedes the AdamW moments
        # (allocated by the first optimizer step), so it is not the run's peak.
        rows.append(f"| {name} | {world} | {predicted:.1f} | {measured:.1f} | {error:+.1%} | incomplete run | — |")
        continue
    misses += abs(error) > 0.10
    rows.append(
        f"| {name} | {world} | {predicted:.1f} | {measured:.1f} | {error:+.1%} | {'ok' if abs(error) <= 0.10 else 'MISS'} | {tok_s} |"
    )
table = ["| line | GPUs | predicted GiB | measured GiB | error | ≤ 10% | tok/s |", "|---|---|---|---|---|---|---|", *rows]
(out / "accuracy.md").write_text("\n".join(table) + "\n")
print("\n".join(table))
print(f"{misses} line(s) off by more than 10%")
PY

[[ "${TESTS:-1}" == 1 ]] && "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider tests/test_plan.py tests/test_checkpointing.py tests/test_offload_gpu.py 2>&1 | tail -15 | tee "$OUT/tests.log"
