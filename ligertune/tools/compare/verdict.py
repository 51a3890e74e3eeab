"""Comparing arms: speed and memory ratios, the per-step loss verdict, the whole report and the exit status."""

from __future__ import annotations

import math
from typing import Any

from ligertune.tools.compare.plan import SCHEMA, ComparePlan


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def _status_phrase(arm: dict[str, Any], steps: int) -> str:
    if arm["status"] == "oom":
        return f"{arm['name']} ran out of memory at step {arm['steps_completed'] + 1}"
    if arm["status"] == "error" or arm["steps_completed"] < steps:
        return f"{arm['name']} stopped after {arm['steps_completed']} of {steps} steps ({arm['status']})"
    return ""


def loss_verdict(base: dict[str, Any], arm: dict[str, Any], steps: int, rtol: float) -> dict[str, Any]:
    """Compare the per-step losses of `arm` with those of `base` (see the module docstring)."""
    n = min(len(base["losses"]), len(arm["losses"]))
    max_abs = max_rel = None
    worst_step = diverged = None
    for k in range(n):
        b, a = base["losses"][k], arm["losses"][k]
        if b is None and a is None:
            continue  # both non-finite: the arms agree
        if b is None or a is None:
            diverged = diverged or (k + 1, b, a, math.inf)
            continue
        abs_diff = abs(a - b)
        rel = abs_diff / abs(b) if b else (0.0 if a == b else math.inf)
        max_abs = abs_diff if max_abs is None else max(max_abs, abs_diff)
        if max_rel is None or rel > max_rel:
            max_rel, worst_step = rel, k + 1
        if rel > rtol and diverged is None:
            diverged = (k + 1, b, a, rel)

    def show(value: float | None) -> str:
        return f"{value:.6g}" if value is not None else "non-finite"

    verdict: dict[str, Any] = {
        "status": "",
        "parity": False,
        "step": None,
        "baseline_loss": None,
        "arm_loss": None,
    }
    if diverged is not None:
        step, b, a, rel = diverged
        verdict |= {"status": "diverged", "step": step, "baseline_loss": b, "arm_loss": a}
        how = f"relative difference {rel:.2e} > {rtol:g}" if math.isfinite(rel) else "one loss is non-finite"
        verdict["message"] = (
            f"diverged at step {step}: {base['name']} {show(b)}, {arm['name']} {show(a)} ({how})"
        )
    elif n == steps and all(x["status"] in ("ok", "nonfinite") for x in (base, arm)):
        verdict |= {"status": "parity", "parity": True}
        worst = f"; largest {max_rel:.2e} at step {worst_step}" if max_rel is not None else ""
        verdict["message"] = f"parity: every one of the {n} steps within relative {rtol:g}{worst}"
    else:
        verdict["status"] = "incomplete"
        reasons = "; ".join(p for p in (_status_phrase(base, steps), _status_phrase(arm, steps)) if p)
        agree = f"the {n} steps both ran agree within {rtol:g}" if n else "no step ran in both arms"
        verdict["message"] = f"no verdict: {reasons}; {agree}"
    return {
        "steps_compared": n,
        "max_abs_loss_diff": max_abs,
        "max_rel_loss_diff": max_rel,
        "max_rel_loss_diff_step": worst_step,
        "verdict": verdict,
    }


def _fits_phrase(arm: dict[str, Any]) -> str:
    peak = arm["peak_mem_allocated_gib"]
    return f" ({peak:.2f} GiB peak allocated)" if peak is not None else ""


def compare_arms(base: dict[str, Any], arm: dict[str, Any], steps: int, rtol: float) -> dict[str, Any]:
    """Speed, memory and loss agreement of `arm` against `base`, with a one-line summary."""
    losses = loss_verdict(base, arm, steps, rtol)
    result = {
        "arm": arm["name"],
        "baseline": base["name"],
        "speedup": _ratio(arm["tokens_per_s"], base["tokens_per_s"]),
        "memory_ratio_allocated": _ratio(arm["peak_mem_allocated_gib"], base["peak_mem_allocated_gib"]),
        "memory_ratio_reserved": _ratio(arm["peak_mem_reserved_gib"], base["peak_mem_reserved_gib"]),
        **losses,
    }
    if base["status"] == "oom" and arm["status"] in ("ok", "nonfinite"):
        reached = _fits_phrase(base).replace("peak allocated", "allocated when it failed")
        summary = f"{base['name']} runs out of memory{reached}; {arm['name']} fits{_fits_phrase(arm)}"
    else:
        parts = [f"{arm['name']} vs {base['name']}:"]
        if result["speedup"] is not None:
            parts.append(f"{result['speedup']:.2f}× tokens/s,")
        if result["memory_ratio_allocated"] is not None:
            parts.append(f"{result['memory_ratio_allocated']:.2f}× peak memory,")
        parts.append(losses["verdict"]["message"])
        summary = " ".join(parts)
    result["summary"] = summary
    return result


def build_report(
    plan: ComparePlan, arms: list[dict[str, Any]], notes: list[str] | None = None
) -> dict[str, Any]:
    """The whole comparison as one JSON-ready mapping (schema `SCHEMA`); `notes` are added to
    the report's own."""
    base = arms[0]
    comparisons = [compare_arms(base, arm, plan.steps, plan.rtol) for arm in arms[1:]]
    reporting = next((a for a in arms if a["device"] is not None), base)
    device = reporting["device"]
    notes = list(notes or [])
    if device == "cpu":
        notes.append(
            f"CPU run (kernels: {reporting['kernel_mode']}): speed numbers only check the path and say nothing "
            "about GPU performance; memory is host RSS"
        )
    warmup = plan.recipe.logging.throughput_warmup_steps
    if plan.steps <= warmup:
        notes.append(
            f"--steps {plan.steps} leaves no step after logging.throughput_warmup_steps ({warmup}): no speed numbers"
        )
    return {
        "schema": SCHEMA,
        "recipe": str(plan.recipe_path),
        "overrides": plan.overrides,
        "steps": plan.steps,
        "world_size": plan.nproc,
        "precision": plan.recipe.training.precision,
        "kernels": plan.kernels,
        "ablate": plan.ablate,
        "device": device,
        "device_name": reporting["device_name"],
        "kernel_mode": reporting["kernel_mode"],
        "speed_meaningful": device == "cuda",
        "tolerance": {"rtol": plan.rtol, "rule": plan.rtol_rule},
        "arms": arms,
        "comparisons": comparisons,
        "verdict": next(c for c in comparisons if c["arm"] == "on")["verdict"],
        "notes": notes,
        "out_dir": str(plan.out),
    }


def exit_status(report: dict[str, Any]) -> int:
    """0 when nothing is wrong; 1 when the kernels changed the training (a divergence) or an
    arm failed for a reason other than memory (an OOM is a finding, not a failure)."""
    diverged = any(c["verdict"]["status"] == "diverged" for c in report["comparisons"])
    failed = any(a["status"] == "error" for a in report["arms"])
    return 1 if diverged or failed else 0
