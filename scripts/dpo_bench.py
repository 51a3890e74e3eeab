"""DPO loss paths side by side on one GPU (issue: preference objectives), same batches and weights.

Llama-3.2-1B shape (random init, bf16 weights as the bench recipe trains it, under autocast), ``--pairs`` pairs of 2 × ``--seq``-token rows per micro-batch, a frozen reference model
of the same shape, each step = reference forward (no grad) + policy forward + backward:

- ``trl``:   Hugging Face model; reference and policy logits materialised [2B, S, V], fp32
             log_softmax + gather (the loss path of TRL's DPOTrainer with a reference model);
- ``liger``: Liger-Kernel's instance patch on both models and its ``LigerFusedLinearDPOLoss``
             on the final hidden states (its chunked loss takes the reference's hidden states
             and lm_head weight and computes the reference log-probs itself);
- ``ours``:  our kernels (``kernels: all``) and the ``dpo`` objective with a frozen reference
             (the pair loss and its gradient computed inside the lm_head chunk by chunk, never
             the logits).

Reports tokens/s (4·B·S per step / median step time), peak allocated memory and the loss of the
first step (same batch, same weights: the three must agree to bf16 tolerance).

    python scripts/dpo_bench.py --pairs 4 --seq 1024 --steps 10 [--out runs/dpo-bench]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from ligertune.catalog.objectives.dpo import DPOOptions
from ligertune.config import load_recipe
from ligertune.models.build import build_model
from ligertune.objectives.dpo import DPO, dpo_losses
from ligertune.objectives.logps import logps_from_logits, shifted_targets
from ligertune.objectives.reference import Reference
from ligertune.patching import patch_model

RECIPE = "recipes/llama3.2-1b-alpaca-bench.yaml"
BETA = 0.1


def batch_of(pairs: int, seq: int, vocab: int, device) -> dict[str, torch.Tensor]:
    """Random token rows, the first quarter of each a prompt (label −100)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2 * pairs, seq), generator=g).to(device)
    labels = ids.clone()
    labels[:, : seq // 4] = -100
    return {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}


def trl_step(policy, reference, batch):
    target = shifted_targets(batch["labels"])
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with torch.no_grad():
        ref = logps_from_logits(reference(**inputs).logits, target).sum(-1)
    logps = logps_from_logits(policy(**inputs).logits, target).sum(-1)
    (c, r), (rc, rr) = logps.chunk(2), ref.chunk(2)
    return dpo_losses(c, r, rc, rr, BETA)[0].mean()


def liger_step(policy, reference, batch, loss_fn):
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with torch.no_grad():
        ref_hidden = reference.model(**inputs).last_hidden_state[:, :-1]
    hidden = policy.model(**inputs).last_hidden_state[:, :-1]
    out = loss_fn(
        policy.lm_head.weight,
        hidden,
        batch["labels"][:, 1:],
        ref_input=ref_hidden,
        ref_weight=reference.lm_head.weight,
    )
    return out[0] if isinstance(out, tuple) else out


def ours_step(policy, objective, batch):
    pairs = torch.tensor(batch["input_ids"].shape[0] // 2, device=batch["input_ids"].device)
    return objective(policy, batch, pairs).loss


def run_arm(name, recipe, batch, steps, device):
    policy = build_model(recipe, device)
    reference = build_model(recipe, device).eval().requires_grad_(False)
    if name == "ours":
        patch_model(policy, "all")
        patch_model(reference, "all")
        objective = DPO(DPOOptions(beta=BETA), Reference("frozen", model=reference), fused=True)
        step = lambda: ours_step(policy, objective, batch)  # noqa: E731
    elif name == "liger":
        from liger_kernel.chunked_loss import LigerFusedLinearDPOLoss
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=policy)
        _apply_liger_kernel_to_instance(model=reference)
        loss_fn = LigerFusedLinearDPOLoss(beta=BETA, use_ref_model=True)
        step = lambda: liger_step(policy, reference, batch, loss_fn)  # noqa: E731
    else:
        step = lambda: trl_step(policy, reference, batch)  # noqa: E731
    policy.train()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    times, first = [], None
    for i in range(steps + 3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", torch.bfloat16):
            loss = step()
        loss.backward()
        policy.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i == 0:
            first = loss.item()
        if i >= 3:  # the first steps compile (Liger's chunk loop, our flex/Triton kernels)
            times.append(time.perf_counter() - t0)
    tokens = batch["input_ids"].numel()
    median = statistics.median(times)
    return {
        "arm": name,
        "loss_step1": first,
        "median_step_s": median,
        "tokens_per_s": tokens / median,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "peak_above_models_gib": (torch.cuda.max_memory_allocated() - base) / 2**30,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--arms", default="trl,liger,ours")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    recipe = load_recipe(RECIPE, ["training.device=cuda", "model.attn_implementation=sdpa"])
    batch = batch_of(args.pairs, args.seq, 128256, device)
    rows = []
    for name in args.arms.split(","):
        try:
            rows.append(run_arm(name, recipe, batch, args.steps, device))
        except Exception as e:  # one arm failing (OOM, an API change) still reports the others
            rows.append({"arm": name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
        torch.cuda.empty_cache()
        print(json.dumps(rows[-1]), flush=True)
    trl = next((r for r in rows if r["arm"] == "trl" and "error" not in r), None)
    lines = [
        f"DPO, Llama-3.2-1B shape, {args.pairs} pairs × 2 × {args.seq} tokens, frozen reference, "
        f"{torch.cuda.get_device_name()}",
        "",
        "| arm | loss (step 1) | median step | tokens/s | × trl | peak GiB | peak above models GiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['arm']} | failed: {r['error']} | | | | | |")
            continue
        speed = f"{r['tokens_per_s'] / trl['tokens_per_s']:.2f}×" if trl else "—"
        lines.append(
            f"| {r['arm']} | {r['loss_step1']:.5f} | {r['median_step_s'] * 1e3:.1f} ms | "
            f"{r['tokens_per_s']:,.0f} | {speed} | {r['peak_gib']:.2f} | {r['peak_above_models_gib']:.2f} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "dpo_bench.json").write_text(json.dumps(rows, indent=1))
        (args.out / "dpo_bench.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
