#!/usr/bin/env bash
# Speed at scale on every GPU of one host (4 × H100 or H200), one device call at a time:
#
#   source .whl/install.sh && OUT=out PART=diag bash scripts/gpu_scale.sh
#   source .whl/install.sh && OUT=out PART="70b dpo" bash scripts/gpu_scale.sh
#
# PART is one part or several, run in the order given under one time budget:
# diag    where the time goes: profile_step of ligertune and ligertune-compile at the recipe's
#         setting (full activation checkpointing, 4 × 2048 per GPU), with dynamo's recompile and
#         graph-break log counted per rank; then e2e_bench without checkpointing at 4 × 2048 per
#         GPU of ours as it is, with parallel.fsdp.prefetch=2, with parallel.fsdp.reduce_dtype=bf16,
#         and with compile.
# rest    Liger and eager at their best settings, and ZeRO-3 (defaults, larger buckets, Liger).
# table   each provider at its own best setting that fits (e2e_bench, auto checkpointing and
#         micro-batch): eager, Liger, ours, ours + compile, ours + compile + FP8 tensorwise (its
#         weights all-gathered in float8) and rowwise, and HF + compile + FP8 (the FP8 loss control).
# 70b     Llama-3-70B shape, LoRA under FSDP2 (recipes/llama3-70b-alpaca-lora-bench.yaml): ours,
#         HF + peft + Liger, HF + peft; 6 steps, 2 left out, 240 s an arm.
# lora    Qwen3-30B-A3B LoRA under FSDP2 (ours against HF + peft with transformers' grouped_mm
#         experts), then Llama-3-8B LoRA under FSDP2 (ours, + Liger, HF + peft).
# dpo     Llama-3-8B shape, full fine-tune with the dpo objective under FSDP2 (frozen reference,
#         sharded too): 2 pairs of 2 × 2048 random-word tokens per GPU, ours, Liger, eager.
# long    context parallelism: the Llama-3.2-1B shape on one 1,048,576-token row over every GPU
#         (one step, its time includes the first step's compilation).
# longest Liger, then ours, on one row of 262,144 tokens a GPU (524,288 on two GPUs), CP over every
#         GPU, one step each (its time includes the compilation).
# long8b  Liger, then ours, on one 262,144-token row of the Llama-3-8B shape, CP over every GPU, one
#         step each (eager's loss head does not fit, by the plan).
# long32k the Llama-3-8B shape at 32,768 tokens, FSDP2 alone against CP over every GPU.
# long262k the Llama-3.2-1B shape on one 262,144-token row, CP over every GPU: eager, Liger, ours
#         (the same attention backend, flex_attention, for all three).
# moe     Qwen3-30B-A3B LoRA, ours and HF + peft with every layer kept gathered after its forward
#         (parallel.fsdp.reshard_after_forward=false), then where ours' step goes (profile_step).
# moe-ddp Qwen3-30B-A3B LoRA, ours and HF + peft, under DDP (the frozen base replicated) and under
#         FSDP2 with every layer kept gathered.
# tests   the GPU tests of context parallelism (2 GPUs), of drawing a random init on the GPU and
#         of the MoE families (one GPU each), side by side (on two GPUs, context parallelism first).
#
# Every arm: STEPS steps (default 8), the first WARMUP (3) left out of the rates, at most
# ARM_TIMEOUT_S (170 s) and never past the budget; arms that would start after BUDGET_S (480 s)
# are skipped. Results under $OUT: summary.md (printed last) and results.tar.gz (every arm's log,
# metrics, profile).
set -uo pipefail
source "$(dirname "$0")/report_header.sh"

: "${OUT:?set OUT to the folder for the results}"
: "${PART:?set PART to one or more of diag, table, rest, 70b, lora, dpo, long, long32k, long262k, longest, long8b, moe, moe-ddp, tests}"
PYTHON=${PYTHON:-python3}
STEPS=${STEPS:-8}
WARMUP=${WARMUP:-3}
ARM_TIMEOUT_S=${ARM_TIMEOUT_S:-170}
BUDGET_S=${BUDGET_S:-480}
RECIPE=recipes/llama3-8b-alpaca-bench.yaml
WORK=${WORK:-$(mktemp -d)}
mkdir -p "$WORK"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p "$OUT"
start=$(date +%s)
gpus=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')
left() { local l=$((BUDGET_S - ($(date +%s) - start))); echo $((l > 0 ? l : 0)); }

# bench NAME PROVIDERS [overrides...]: one e2e_bench table on every GPU, of $RECIPE (the 8B
# bench recipe unless the part sets another).
bench() {
  local name=$1 providers=$2
  shift 2
  tables+=("$name")
  "$PYTHON" scripts/e2e_bench.py "$RECIPE" --nproc-per-node "$gpus" --steps "$STEPS" --warmup "$WARMUP" \
    --providers "$providers" parallel.strategy=fsdp "$@" --timeout "$ARM_TIMEOUT_S" --time-budget "$(left)" \
    --out "$WORK/$name" > "$WORK/$name.log" 2>&1
  echo "$name: exit $? ($(( $(date +%s) - start )) s)"
}

# summary.md and results.tar.gz are written on the way out, also when the run is interrupted
# (timeout -s INT): whatever finished is kept.
finish() {
  {
    report_header "Speed at scale, part $PART"
    if [[ -f $WORK/profile.log ]]; then
      echo "## profiles (full checkpointing, 4 × 2048 per GPU)"; echo
      cat "$WORK"/profile/*.md 2>/dev/null || tail -n 30 "$WORK/profile.log"
      recompiles=$(grep -c '\[__recompiles\] Recompiling' "$WORK/profile.log")
      breaks=$(grep -c '\[__graph_breaks\]' "$WORK/profile.log")
      echo; echo "dynamo, all ranks: $recompiles recompiles, $breaks graph-break log lines"
      grep -A3 '\[__recompiles\] Recompiling' "$WORK/profile.log" | grep -E 'rank0.*- ' | sort | uniq -c | head -20
      grep '\[__graph_breaks\]' "$WORK/profile.log" | grep rank0 | sed 's/.*\[__graph_breaks\]//' | sort | uniq -c | sort -rn | head -20
    fi
    if [[ -n ${tests_run:-} ]]; then
      echo "## GPU tests"; echo
      for log in "$WORK"/tests-*.log; do echo "$(basename "$log"): $(tail -n 1 "$log")"; done
    fi
    report_tables "$WORK" "${tables[@]}"
    echo; echo "total: $(( $(date +%s) - start )) s"
  } > "$OUT/summary.md"
  tar -czf "$OUT/results.tar.gz" -C "$WORK" --exclude='random-tokens.jsonl' --exclude='*.pt' --exclude='dcp' .
  cat "$OUT/summary.md"
}
tables=()
trap finish EXIT
trap 'exit 130' INT TERM
for part in $PART; do
  case $part in
  diag)
    TORCH_LOGS=recompiles,graph_breaks timeout --signal=INT --kill-after=20 240 \
      "$PYTHON" scripts/profile_step.py "$RECIPE" parallel.strategy=fsdp --nproc-per-node "$gpus" \
      --providers ligertune,ligertune-compile --wait 2 --active 2 --out "$WORK/profile" > "$WORK/profile.log" 2>&1
    echo "profile: exit $? ($(( $(date +%s) - start )) s)"
    no_ckpt=(training.activation_checkpointing=none training.micro_batch_size=4)
    bench ours ligertune "${no_ckpt[@]}"
    bench prefetch2 ligertune "${no_ckpt[@]}" parallel.fsdp.prefetch=2
    bench reduce-bf16 ligertune "${no_ckpt[@]}" parallel.fsdp.reduce_dtype=bf16
    bench compile ligertune-compile "${no_ckpt[@]}" ;;
  rest)
    # The providers whose own best setting auto cannot plan (Liger's kernels are a plugin the plan
    # does not count), and ZeRO-3 at the recipe's setting, DeepSpeed's defaults against larger
    # prefetch and reduce buckets (scripts/ds_zero3_prefetch.json).
    bench liger-best liger training.activation_checkpointing=none training.micro_batch_size=4
    bench eager-best eager training.activation_checkpointing=none training.micro_batch_size=2
    zero3=(parallel.strategy=deepspeed parallel.deepspeed.zero_stage=3)
    bench zero3 ligertune "${zero3[@]}"
    bench zero3-buckets ligertune "${zero3[@]}" parallel.deepspeed.config=scripts/ds_zero3_prefetch.json
    bench zero3-liger liger "${zero3[@]}" ;;
  table)
    bench table eager,liger,ligertune,ligertune-compile,ligertune-compile-fp8-tensorwise,ligertune-compile-fp8,eager-compile-fp8 \
      training.activation_checkpointing=auto training.micro_batch_size=auto ;;
  70b)
    RECIPE=recipes/llama3-70b-alpaca-lora-bench.yaml STEPS=6 WARMUP=2 ARM_TIMEOUT_S=240
    bench 70b-lora ligertune,liger,eager ;;
  lora)
    RECIPE=recipes/qwen3-30b-a3b-alpaca-lora-bench.yaml STEPS=8 WARMUP=3 ARM_TIMEOUT_S=200
    bench 30b-a3b-lora ligertune,eager
    RECIPE=recipes/llama3-8b-alpaca-lora-bench.yaml ARM_TIMEOUT_S=120
    bench 8b-lora ligertune,liger,eager ;;
  dpo)
    RECIPE=recipes/llama3-8b-alpaca-bench.yaml STEPS=6 WARMUP=2 ARM_TIMEOUT_S=150
    bench 8b-dpo ligertune,liger,eager objective.name=dpo objective.reference=frozen \
      training.micro_batch_size=2 --random-pairs 64 ;;
  long)
    RECIPE=recipes/llama3.2-1b-alpaca-bench.yaml STEPS=1 WARMUP=0 ARM_TIMEOUT_S=520
    bench 1b-1m ligertune parallel.context_parallel="$gpus" training.micro_batch_size=1 \
      training.activation_checkpointing=full model.attn_implementation=flex_attention \
      --random-rows 1 --seq-lens 1048576 ;;
  longest)
    # 262,144 tokens a GPU, the per-GPU length of the 1M row on 4 GPUs: Liger, then ours.
    RECIPE=recipes/llama3.2-1b-alpaca-bench.yaml STEPS=1 WARMUP=0 ARM_TIMEOUT_S=${ARM_TIMEOUT_S_LONGEST:-260}
    bench "1b-$((262144 * gpus / 1024))k" liger,ligertune parallel.context_parallel="$gpus" training.micro_batch_size=1 \
      training.activation_checkpointing=full model.attn_implementation=flex_attention \
      --random-rows 1 --seq-lens $((262144 * gpus)) ;;
  long8b)
    RECIPE=recipes/llama3-8b-longctx-bench.yaml STEPS=1 WARMUP=0 ARM_TIMEOUT_S=${ARM_TIMEOUT_S_LONGEST:-260}
    bench 8b-262k liger,ligertune parallel.context_parallel="$gpus" --random-rows 1 --seq-lens 262144 ;;
  long32k)
    RECIPE=recipes/llama3-8b-longctx-bench.yaml STEPS=5 WARMUP=2 ARM_TIMEOUT_S=150
    bench 8b-32k-fsdp ligertune parallel.context_parallel=1 --seq-lens 32768 --random-rows 8
    bench 8b-32k-cp ligertune --seq-lens 32768 --random-rows 8 parallel.context_parallel="$gpus" ;;
  long262k)
    RECIPE=recipes/llama3.2-1b-alpaca-bench.yaml STEPS=3 WARMUP=1 ARM_TIMEOUT_S=150
    bench 1b-262k eager,liger,ligertune parallel.context_parallel="$gpus" training.micro_batch_size=1 \
      training.activation_checkpointing=full model.attn_implementation=flex_attention \
      --random-rows 2 --seq-lens 262144 ;;
  moe)
    RECIPE=recipes/qwen3-30b-a3b-alpaca-lora-bench.yaml STEPS=6 WARMUP=2 ARM_TIMEOUT_S=170
    bench 30b-a3b-lora-keep ligertune,eager parallel.fsdp.reshard_after_forward=false
    timeout --signal=INT --kill-after=20 "$(left)" "$PYTHON" scripts/profile_step.py "$RECIPE" parallel.strategy=fsdp \
      --nproc-per-node "$gpus" --providers ligertune --wait 1 --active 2 --out "$WORK/profile" > "$WORK/profile.log" 2>&1
    echo "profile: exit $? ($(( $(date +%s) - start )) s)" ;;
  moe-ddp)
    # LoRA leaves the base frozen: replicated on every GPU (DDP) it is never gathered, and only
    # the adapters' gradients are all-reduced. Against FSDP2 with every layer kept gathered.
    RECIPE=recipes/qwen3-30b-a3b-alpaca-lora-bench.yaml STEPS=6 WARMUP=2 ARM_TIMEOUT_S=170
    bench 30b-a3b-lora-ddp ligertune,eager parallel.strategy=ddp
    bench 30b-a3b-lora-keep ligertune,eager parallel.fsdp.reshard_after_forward=false ;;
  tests)
    # Four GPUs: the three files side by side. Two: context parallelism first, then the others.
    cp=(timeout 240 "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider tests/test_context_parallel.py)
    if ((gpus >= 4)); then
      CUDA_VISIBLE_DEVICES=0,1 "${cp[@]}" > "$WORK/tests-cp.log" 2>&1 &
      one=2 other=3
    else
      CUDA_VISIBLE_DEVICES=0,1 "${cp[@]}" > "$WORK/tests-cp.log" 2>&1
      one=0 other=1
    fi
    CUDA_VISIBLE_DEVICES=$one timeout 240 "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider \
      tests/test_draw_init.py > "$WORK/tests-draw-init.log" 2>&1 &
    CUDA_VISIBLE_DEVICES=$other timeout 240 "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider \
      tests/test_moe_gpu.py > "$WORK/tests-moe.log" 2>&1
    wait
    echo "tests: ($(( $(date +%s) - start )) s)"
    tests_run=1 ;;
  *) echo "unknown part $part"; exit 2 ;;
  esac
done


