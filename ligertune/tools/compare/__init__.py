"""`ligertune compare`: what the kernels buy on *your* recipe, and proof they do not change training.

The recipe runs as several *arms*, one after another, each in a process of its own so that its
peak memory is its own: ``off`` (every kernel off), ``on`` (the chosen kernels on) and, with
``--ablate``, one arm per kernel with only that kernel on (a kernel for which the ``on`` arm
patched no module, such as LayerNorm in a Llama, gets no arm: it would only repeat ``off``;
the report's notes name it), and with ``--also key=value`` (repeatable) one arm per item: the
``on`` arm plus that override, which shows what one more setting buys on top of the kernels
(``training.compile=true``, ``model.attn_implementation=sdpa``). Every arm gets the same seed, hence
the same random initial weights (`ligertune.models.build.build_model` seeds the init before
patching) or the same loaded checkpoint, the same data order and the same number of steps, so
the per-step losses of two arms differ only by what the kernels compute differently.

Each arm is `train` with these overrides on top of the user's recipe and overrides::

    kernels=none [kernels.<k>=true ...]      training.max_steps=N     output_dir=<out>/<arm>
    training.eval_every=null   training.on_nonfinite=skip   checkpoint.every_steps=null
    checkpoint.resume=none     checkpoint.export_hf=false   logging.progress=plain

``on_nonfinite=skip`` keeps a NaN step in the record (it would otherwise end the arm), and the
arm stops right after its last step, before `train` writes its final checkpoint: the arms are
measurements, and an 8B model's weights and optimizer state would cost minutes and ~100 GB of
disk per arm. With more than one process per arm (``--nproc-per-node G``, or a compare that was
itself started by torchrun with G processes on one node) each arm is launched with
``python -m torch.distributed.run --standalone --nproc-per-node G``, so every arm has the same
world size; every rank writes a result file and the parent merges them (peak memory is the
maximum over ranks).

Arm result
    ``status``: ``ok``; ``oom`` (``torch.OutOfMemoryError``; the peak memory reached before it
    is kept: in the headline case the ``off`` arm does not fit and the ``on`` arm does);
    ``nonfinite`` (some step's loss or gradient norm was NaN/inf); ``error`` (anything else,
    with the message; the arm's full output is in ``<out>/<arm>/arm.log``). The parent never
    stops on an arm's failure: the other arms run and are reported.
    Speed: tokens/s and tokens/s/GPU over all input tokens, MFU and the median step time, all
    without the recipe's ``logging.throughput_warmup_steps`` first steps (the definitions of
    `ligertune.run.metrics`, computed by its `Throughput`). Memory: peak allocated and reserved by
    the CUDA caching allocator, and the process's peak host RSS (the only memory number on CPU).

Verdict (each arm against ``off``)
    Per step k, with L the token-mean training loss of the step:

        rel_k = |L_arm(k) − L_off(k)| / |L_off(k)|

    *parity* when both arms ran every step and rel_k ≤ rtol for all k (a step where both losses
    are non-finite counts as agreeing); *diverged at step k* at the first k with rel_k > rtol,
    or where exactly one of the two losses is non-finite; otherwise (an arm stopped early
    without a divergence before) *incomplete*. rtol depends on the precision:

    - ``fp32``: 1e-4. Both arms compute the same math in fp32 in a different order (fused
      reductions, recomputation in the backward); each op differs by a few fp32 ulps (~1e-7).
      Measured on the quickstart (CPU, 20 steps): at most 1.6e-7, one or two ulps of the
      loss. The ~500× margin absorbs longer runs and larger models; what it lets through is
      smaller than what the kernels' own float64-reference tests catch, while gross errors (a
      wrong scale, a mis-rotated channel, a wrong gradient) move the loss far beyond it.
    - ``bf16`` and ``bf16-mixed``: 2e-2. bf16 keeps 8 significant bits (one rounding: up to
      2⁻⁹ ≈ 2e-3 relative). The kernels keep fp32 intermediates where eager PyTorch rounds every
      op's output to bf16, so the arms legitimately round differently in every layer (~1e-3 on
      one forward's loss); the optimizer then feeds the differences back into the weights
      (with bf16 parameters an update rounds away or not depending on the last bit), and the
      two trajectories drift apart with the number of steps. 2e-2 (about ten bf16 roundings)
      is chosen to hold over the default 20 steps (the GPU tests check it on the quickstart
      and on a 4-layer Llama-3.2-1B shape). Compare over few steps: any two runs of chaotic
      training separate eventually, so a long comparison says less, not more. ``--rtol``
      overrides the rule.

Outputs in ``--out`` (default ``<run_dir>-compare``): ``compare.json`` (schema
`plan.SCHEMA`, described in docs/compare.md), ``compare.md``, ``compare.png`` and one directory per
arm with its metrics and log; a rich table on the terminal (`report`).

Modules: `plan` checks the options and every arm's recipe before anything runs; `runner` starts
each arm (a process, or torchrun) and merges its ranks' results; `arm` is what runs inside an
arm's process; `verdict` compares the arms and builds the report; `report` renders it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ligertune.distributed.env import launched_as
from ligertune.tools.compare import report as render
from ligertune.tools.compare.plan import ARM_LOG, CompareError, ComparePlan, make_plan
from ligertune.tools.compare.runner import run_arm_process, start_record, write_json
from ligertune.tools.compare.verdict import build_report, exit_status

__all__ = ["CompareError", "compare_command", "make_plan", "run_compare"]


def run_compare(plan: ComparePlan, console) -> dict[str, Any]:
    """Run every arm of the plan in turn, then write compare.json/.md/.png and print the table."""
    plan.out.mkdir(parents=True, exist_ok=True)
    launcher = f"torchrun × {plan.nproc}" if plan.nproc > 1 else "one process"
    arms, unused, notes = [], set(), []
    for arm in plan.arms:
        if arm.ablation and unused.intersection(arm.kernels):  # it would equal `off`
            notes.append(
                f"arm {arm.name} not run: the 'on' arm patched no module with it (this model has none)"
            )
            console.print(notes[-1], markup=False, highlight=False)
            continue
        console.print(
            f"arm {arm.name} (kernels: {', '.join(arm.kernels) or 'none'}): {plan.steps} steps, {launcher}; "
            f"log: {arm.directory / ARM_LOG}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        result = run_arm_process(arm, plan)
        line = f"  {result['status']}" + (f": {result['error']}" if result["error"] else "")
        console.print(line, markup=False, highlight=False, soft_wrap=True)
        arms.append(result)
        if arm.name == "on" and plan.ablate:
            # The on arm's patch report says which selected kernels found nothing to patch.
            patched = start_record(arm.directory).get("kernels_patched")
            unused = {k for k in arm.kernels if k not in patched} if patched is not None else set()
    report = build_report(plan, arms, notes)
    report["files"] = {
        "json": str(plan.out / "compare.json"),
        **render.write_outputs(report, plan.out, console),
    }
    write_json(plan.out / "compare.json", report)
    render.print_report(report, console)
    return report


def compare_command(recipe: Path, overrides: list[str], console, **options) -> int:
    """`ligertune compare`: plan, run, report; returns the exit status (see `exit_status`).

    Started by torchrun with G processes, only rank 0 runs the comparison (its arms get G
    processes each); the other ranks return at once."""
    if launched_as().rank != 0:
        return 0
    plan = make_plan(recipe, overrides, **options)
    return exit_status(run_compare(plan, console))
