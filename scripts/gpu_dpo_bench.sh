#!/usr/bin/env bash
# DPO loss paths on the Llama-3.2-1B shape, 2 × 1024-token pairs per row: tokens/s and peak memory of
#   (a) trl:   HF model forward → materialised logits → log_softmax (fp32) → gather  (TRL's path)
#   (b) liger: liger_kernel.chunked_loss.LigerFusedLinearDPOLoss on the final hidden states (if installed)
#   (c) ours:  ligertune's dpo objective (per-token log-probs inside the lm_head, never the logits)
# on the same batches, same random-init weights, bf16, one GPU. Next session:
#   bash scripts/gpu_dpo_bench.sh [pairs_per_micro_batch=4] [steps=10]
set -euo pipefail
cd "$(dirname "$0")/.."
PAIRS=${1:-4} STEPS=${2:-10} python - <<'PY'
import os, time, torch
from ligertune.config import load_recipe
from ligertune.models.build import build_model
from ligertune.objectives.dpo import dpo_losses
from ligertune.objectives.logps import frozen_logps, logps_from_logits, shifted_targets
from ligertune.patching import patch_model

pairs, steps, seq = int(os.environ["PAIRS"]), int(os.environ["STEPS"]), 1024
recipe = load_recipe("recipes/llama3.2-1b-alpaca-bench.yaml", ["training.precision=bf16", "training.device=cuda"])
dev = torch.device("cuda")
g = torch.Generator(device="cpu").manual_seed(0)
vocab = 128256
ids = torch.randint(0, vocab, (2 * pairs, seq), generator=g).to(dev)
labels = ids.clone(); labels[:, : seq // 4] = -100  # a quarter prompt
batch = {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}
reference = build_model(recipe, dev).eval().requires_grad_(False)
with torch.no_grad():
    ref = frozen_logps(reference, batch)
del reference

def trl(model):
    logits = model(input_ids=ids, attention_mask=batch["attention_mask"]).logits
    lp = logps_from_logits(logits, shifted_targets(labels)).sum(-1)
    c, r = lp.chunk(2); rc, rr = ref.chunk(2)
    return dpo_losses(c, r, rc, rr, 0.1)[0].mean()

def ours(model):
    from ligertune.objectives.dpo import DPO
    from ligertune.objectives.reference import Reference
    objective = DPO(0.1, Reference("precomputed"), fused=True)
    return objective(model, {**batch, "ref_logps": ref}, torch.tensor(pairs, device=dev)).loss

def liger(model):
    from liger_kernel.chunked_loss import LigerFusedLinearDPOLoss
    hidden = model.model(input_ids=ids, attention_mask=batch["attention_mask"]).last_hidden_state
    loss_fn = LigerFusedLinearDPOLoss(beta=0.1, use_ref_model=True)
    rc, rr = ref.chunk(2)
    out = loss_fn(model.lm_head.weight, hidden, shifted_targets(labels), ref_chosen_logps=rc, ref_rejected_logps=rr) \
        if "ref_chosen_logps" in loss_fn.forward.__code__.co_varnames else None
    if out is None:
        raise RuntimeError("this liger-kernel's LigerFusedLinearDPOLoss takes no precomputed reference log-probs")
    return out[0] if isinstance(out, tuple) else out

arms = {"trl": (trl, False), "ours": (ours, True)}
try:
    import liger_kernel.chunked_loss  # noqa: F401
    arms["liger"] = (liger, False)
except ImportError:
    print("liger-kernel not installed: arm (b) skipped")
for name, (fn, patched) in arms.items():
    model = build_model(recipe, dev)
    if patched:
        patch_model(model, "all")
    model.train()
    torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
    try:
        for i in range(steps + 2):
            if i == 2:
                torch.cuda.synchronize(); t0 = time.perf_counter()
            with torch.autocast("cuda", torch.bfloat16):
                loss = fn(model)
            loss.backward()
            model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / steps
        print(f"{name:6s} loss {loss.item():.4f} | {2 * pairs * seq / dt:,.0f} tok/s | peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
    except Exception as e:  # an arm that fails (OOM, API) still lets the others report
        print(f"{name:6s} failed: {type(e).__name__}: {str(e)[:200]}")
    del model
PY
