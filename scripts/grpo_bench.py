"""grpo on one GPU against its peers: the policy loss alone, and whole training steps.

``loss``: the GRPO policy loss, forward + backward, on R completions × T tokens, hidden H and
vocabulary V (default 8 × 1024 = 8k completion tokens × 1536 × 151,936: Qwen2.5-1.5B), bf16
hidden states and lm_head weight, old and reference log-probs given (μ > 1, β = 0.04), one of
every provider on the same inputs:

- ``ours``:     `ligertune.kernels.fused_linear_policy_loss` (per chunk of whole completions:
                logits, log-probs, clipped loss and KL, the gradient in the same pass);
- ``eager``:    the same loss from materialised logits (its reference: what TRL computes);
- ``compile``:  ``torch.compile`` of ``eager``;
- ``liger-chunkC``: Liger-Kernel's ``LigerFusedLinearGRPOLoss`` (chunked, torch.compile'd per
                chunk), when installed, once per ``--liger-chunk-sizes`` value C (completions per
                chunk: its default of 1, which TRL's ``use_liger_kernel`` constructs, and larger);
                its arguments are read from its signature, and its loss type set to ours
                (``--loss-type``) when it knows it.

Time is `triton.testing.do_bench`'s median; memory is the peak allocated above the inputs. The
matmul floor: three [N × H] × [H × V] products (logits, dh, dW), timed with torch.mm on the same
GPU, reported as "% of matmul floor".

``e2e``: whole steps (generation + rewards + update) of ``recipes/qwen2.5-1.5b-grpo-bench.yaml``
(Qwen2.5-1.5B shape, random init, bundled arithmetic prompts, 8 prompts × 8 completions × 256
new tokens per step, β = 0, bf16) in our loop, against TRL's ``GRPOTrainer`` without vLLM on the
same model shape, prompts, group size, completion length, batch (completions per optimizer
step), learning rate and reward. Each arm runs in a process of its own; TRL's micro-batch
(``per_device_train_batch_size``, completions) is tried from ``--trl-micro`` largest first until
one fits (then with gradient checkpointing), and ours at the recipe's micro-batch. Reported:
completion tokens/s over the timed steps (generation and update), the time of each part, and
the peak allocated memory after the warm-up steps. A random-init model almost never draws
its EOS, so both generate the full 256 tokens per completion: the same work.

    python scripts/grpo_bench.py loss --out runs/grpo-loss.json
    python scripts/grpo_bench.py e2e --steps 6 --warmup 2 --out runs/grpo-e2e.json

TRL is not part of the project: install it on the GPU machine for this script only
(``pip install trl==1.16.0``; the e2e mode needs it, the loss mode does not).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "qwen2.5-1.5b-grpo-bench.yaml"


# --------------------------------------------------------------------------------------------
# The loss alone
# --------------------------------------------------------------------------------------------


def loss_inputs(rows, seq, hidden, vocab, seed=0):
    """Hidden states ~N(0, 1) and an lm_head ~N(0, 0.05²) in bf16 (a trained model's logit range),
    completion tokens with the last eighth of every other row padding, advantages, and old and
    reference log-probs near the current ones."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(rows * seq, hidden, device="cuda", generator=g).bfloat16()
    w = (torch.randn(vocab, hidden, device="cuda", generator=g) * 0.05).bfloat16()
    target = torch.randint(0, vocab, (rows * seq,), device="cuda", generator=g)
    target.view(rows, seq)[::2, -seq // 8 :] = -100
    with torch.no_grad():
        from ligertune.kernels.fused_linear_logprobs import fused_linear_logprobs

        logps = fused_linear_logprobs(h, w, target).view(rows, seq)
    old = logps + 0.1 * torch.randn(rows, seq, device="cuda", generator=g)
    ref = logps + 0.1 * torch.randn(rows, seq, device="cuda", generator=g)
    advantages = torch.randn(rows, device="cuda", generator=g)
    return h, w, target, advantages, old.float(), ref.float()


def _ours(spec):
    from ligertune.kernels.fused_linear_policy_loss import fused_linear_policy_loss

    def run(h, w, target, advantages, old, ref):
        return fused_linear_policy_loss(h, w, target, advantages, old, ref, spec=spec).loss

    return run


def _eager(spec):
    from ligertune.kernels.fused_linear_policy_loss import fused_linear_policy_loss_reference

    def run(h, w, target, advantages, old, ref):
        return fused_linear_policy_loss_reference(h, w, target, advantages, old, ref, spec=spec).loss

    return run


def _liger(spec, rows, chunk_size):
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    wanted = dict(
        chunk_size=chunk_size,
        beta=spec.beta,
        epsilon_low=spec.epsilon,
        epsilon_high=spec.high,
        use_ref_model=True,
        loss_type=spec.loss_type,
        max_completion_length=None,
    )
    accepted = inspect.signature(LigerFusedLinearGRPOLoss.__init__).parameters
    module = LigerFusedLinearGRPOLoss(**{k: v for k, v in wanted.items() if k in accepted})
    note = "loss_type " + (spec.loss_type if "loss_type" in accepted else "its default (token mean)")
    note += f", chunk_size {chunk_size}" if "chunk_size" in accepted else ", chunk_size not an argument"

    def run(h, w, target, advantages, old, ref):
        mask = (target != -100).view(rows, -1)
        out = module(
            h.view(rows, -1, h.shape[-1]), w, target.clamp_min(0).view(rows, -1), mask.float(), advantages,
            None, ref, old,
        )  # fmt: skip
        return out[0] if isinstance(out, tuple) else out

    return run, note


def matmul_floor_ms(tokens, hidden, vocab) -> float:
    """Three [tokens × hidden] × [hidden × vocab]-sized bf16 products, timed."""
    from triton.testing import do_bench

    a = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(hidden, vocab, device="cuda", dtype=torch.bfloat16)
    return 3 * do_bench(lambda: a @ b)


def bench_loss(args) -> dict:
    from triton.testing import do_bench

    from ligertune.kernels.fused_linear_policy_loss import PolicyLoss

    torch.backends.cuda.matmul.allow_tf32 = True
    spec = PolicyLoss(args.loss_type, 0.2, 0.28 if args.loss_type == "dapo" else 0.2, beta=0.04)
    inputs = loss_inputs(args.rows, args.seq, args.hidden, args.vocab)
    providers = {"ours": _ours(spec), "eager": _eager(spec)}
    providers["compile"] = torch.compile(_eager(spec))
    notes = {}
    for chunk in args.liger_chunk_sizes:
        name = f"liger-chunk{chunk}"
        try:
            providers[name], notes[name] = _liger(spec, args.rows, chunk)
        except ImportError as e:
            notes[name] = f"not installed ({e})"
            break
    floor = matmul_floor_ms(args.rows * args.seq, args.hidden, args.vocab)
    results = {}
    for name, fn in providers.items():
        h, w = (x.detach().clone().requires_grad_() for x in inputs[:2])

        def step(fn=fn, h=h, w=w):
            h.grad = w.grad = None
            fn(h, w, *inputs[2:]).backward()

        try:
            loss = fn(h, w, *inputs[2:]).float().item()
            step()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            ms = do_bench(step, warmup=5, rep=50)
            peak = (torch.cuda.max_memory_allocated() - base) / 2**30
            results[name] = {
                "ms": ms,
                "peak_gib_above_inputs": peak,
                "loss": loss,
                "floor_pct": 100 * floor / ms,
            }
        except torch.OutOfMemoryError:
            results[name] = {"error": "out of memory"}
        torch.cuda.empty_cache()
    return {
        "shape": {k: getattr(args, k) for k in ("rows", "seq", "hidden", "vocab", "loss_type")},
        "matmul_floor_ms": floor,
        "device": torch.cuda.get_device_name(),
        "results": results,
        "notes": notes,
    }


# --------------------------------------------------------------------------------------------
# Whole steps: ours
# --------------------------------------------------------------------------------------------


def _peak_gib() -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(function, seconds: list[float]):
    """`function`, appending the wall time of each call (the GPU synchronised) to `seconds`."""

    def timed(*args, **kwargs):
        _sync()
        start = time.perf_counter()
        out = function(*args, **kwargs)
        _sync()
        seconds.append(time.perf_counter() - start)
        return out

    return timed


def _reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def arm_ours(args) -> dict:
    """Our loop on the bench recipe; each step's seconds and completion tokens from the step
    records, generation time from the objective's `prepare` (wrapped here, for the report)."""
    from ligertune.config import load_recipe
    from ligertune.training.trainer import Trainer

    overrides = [f"training.max_steps={args.warmup + args.steps}", f"output_dir={args.work}"]
    overrides += [
        f"training.micro_batch_size={args.micro}",
        f"training.gradient_accumulation_steps={args.accumulation}",
    ]
    recipe = load_recipe(RECIPE, [*args.overrides, *overrides])  # the arm's own settings last
    records, prepare_seconds = [], []

    def on_step_end(record):
        records.append(record)
        if len(records) == args.warmup:
            _reset_peak()

    trainer, finished = Trainer(recipe, on_step_end), False
    try:
        trainer.setup()
        objective = trainer.parts.objective
        objective.prepare = _timed(objective.prepare, prepare_seconds)
        trainer.train()
        finished = True
    finally:
        trainer.cleanup(finished)
    timed_steps = records[args.warmup :]
    seconds = sum(r.seconds for r in timed_steps)
    tokens = sum(r.label_tokens for r in timed_steps)
    return {
        "arm": "ours",
        "micro_completions": args.micro * recipe.objective.num_generations,
        "accumulation": args.accumulation,
        "step_s": statistics.median(r.seconds for r in timed_steps),
        "generation_s": statistics.median(prepare_seconds[args.warmup :]),
        "completion_tokens_per_s": tokens / seconds,
        "peak_gib": _peak_gib(),
        "mean_completion_tokens": tokens
        / len(timed_steps)
        / (args.micro * args.accumulation * recipe.objective.num_generations),
    }


# --------------------------------------------------------------------------------------------
# Whole steps: TRL
# --------------------------------------------------------------------------------------------


def arm_trl(args) -> dict:
    """TRL's GRPOTrainer (no vLLM) on the bench recipe's model shape, prompts and settings."""
    import datasets
    import transformers
    import trl

    from ligertune.config import load_recipe
    from ligertune.data import load_tokenizer
    from ligertune.models.build import build_model

    recipe = load_recipe(RECIPE, list(args.overrides))
    objective = recipe.objective
    tokenizer = load_tokenizer(recipe)
    tokenizer.padding_side = "left"
    torch.manual_seed(recipe.seed)
    cuda = torch.cuda.is_available()
    # The same random-init model (Qwen2.5-1.5B shape), in the recipe's precision.
    model = build_model(recipe, torch.device("cuda" if cuda else "cpu"))
    model.config.use_cache = True
    rows = [json.loads(line) for line in (ROOT / "ligertune" / "assets" / "arithmetic_sample.jsonl").open()]
    dataset = datasets.Dataset.from_list([{"prompt": r["prompt"]} for r in rows])

    def format_reward(prompts, completions, **_):
        return [float(c.lstrip()[:1].isdigit()) for c in completions]

    completions_per_step = recipe.training.micro_batch_size * recipe.training.gradient_accumulation_steps
    completions_per_step *= objective.num_generations
    wanted = dict(
        output_dir=str(args.work),
        per_device_train_batch_size=args.micro,
        gradient_accumulation_steps=completions_per_step // args.micro,
        num_generations=objective.num_generations,
        max_completion_length=objective.max_new_tokens,
        max_prompt_length=recipe.data.max_seq_len - objective.max_new_tokens,
        temperature=objective.temperature,
        beta=objective.beta,
        loss_type=objective.loss_type,
        learning_rate=recipe.training.lr,
        max_steps=args.warmup + args.steps,
        bf16=recipe.training.precision != "fp32",
        use_cpu=not cuda,
        use_liger_kernel=args.liger,
        gradient_checkpointing=args.checkpointing,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_vllm=False,
        seed=recipe.seed,
    )
    fields = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    config = trl.GRPOConfig(**{k: v for k, v in wanted.items() if k in fields})
    steps, logs = [], []

    class Timer(transformers.TrainerCallback):
        def on_step_begin(self, *_, **__):
            _sync()
            self.start = time.perf_counter()

        def on_step_end(self, *_, **__):
            _sync()
            steps.append(time.perf_counter() - self.start)
            if len(steps) == args.warmup:
                _reset_peak()

        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs and any(k.startswith("completions/") for k in logs):
                completion_logs.append(dict(logs))

    completion_logs = logs
    trainer = trl.GRPOTrainer(
        model=model, reward_funcs=[format_reward], args=config, train_dataset=dataset,
        processing_class=tokenizer, callbacks=[Timer()],
    )  # fmt: skip
    generation_seconds = []
    trainer._generate_and_score_completions = _timed(
        trainer._generate_and_score_completions, generation_seconds
    )
    trainer.train()
    lengths = [log.get("completions/mean_length", objective.max_new_tokens) for log in logs[args.warmup :]]
    timed_steps = steps[args.warmup :]
    tokens = sum(lengths) * completions_per_step
    return {
        "arm": "trl+liger" if args.liger else "trl",
        "trl": trl.__version__,
        "micro_completions": args.micro,
        "accumulation": completions_per_step // args.micro,
        "gradient_checkpointing": args.checkpointing,
        "config_ignored": sorted(k for k in wanted if k not in fields),
        "step_s": statistics.median(timed_steps),
        "generation_s": statistics.median(generation_seconds[args.warmup :]) if generation_seconds else None,
        "completion_tokens_per_s": tokens / sum(timed_steps),
        "peak_gib": _peak_gib(),
        "mean_completion_tokens": statistics.mean(lengths) if lengths else None,
    }


def run_arm(name: str, args, micro: int, extra: list[str]) -> dict:
    """One arm in a fresh process (its own CUDA memory); the error, when it fails."""
    out = Path(args.work) / f"{name}-{micro}-{'-'.join(extra) or 'plain'}.json"
    command = [sys.executable, __file__, "arm", name, "--micro", str(micro), "--json-out", str(out)]
    command += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--work", str(out.with_suffix(""))]
    command += extra + [f"--override={o}" for o in args.overrides] + (["--cpu"] if args.cpu else [])
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode == 0 and out.is_file():
        return json.loads(out.read_text())
    tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
    oom = any("out of memory" in line.lower() for line in tail)
    return {"arm": name, "micro": micro, "error": "out of memory" if oom else " | ".join(tail)[-500:]}


def _best_trl(args, extra: list[str]) -> list[dict]:
    """TRL at the largest micro-batch of ``--trl-micro`` that fits, then with gradient
    checkpointing: every attempt's result, the one that ran last."""
    attempts = []
    for checkpointing in (False, True):
        for micro in args.trl_micro:
            attempts.append(
                run_arm("trl", args, micro, [*extra, *(["--checkpointing"] if checkpointing else [])])
            )
            if "error" not in attempts[-1]:
                return attempts
    return attempts


def bench_e2e(args) -> dict:
    from ligertune.config import load_recipe

    recipe = load_recipe(RECIPE, list(args.overrides))
    group = recipe.objective.num_generations
    per_step = recipe.training.micro_batch_size * recipe.training.gradient_accumulation_steps * group
    results = [run_arm("ours", args, recipe.training.micro_batch_size, [])]
    results += _best_trl(args, [])
    trl_micro = results[-1].get("micro_completions")
    if trl_micro and trl_micro < recipe.training.micro_batch_size * group:
        # Ours at TRL's micro-batch too: the memory of the same rows per forward.
        accumulation = ["--accumulation", str(per_step // trl_micro)]
        results.append(run_arm("ours", args, trl_micro // group, accumulation))
    try:
        import liger_kernel  # noqa: F401  (TRL's use_liger_kernel: its fused GRPO loss)

        results += _best_trl(args, ["--liger"])
    except ImportError:
        pass
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"recipe": str(RECIPE.relative_to(ROOT)), "device": device, "results": results}


def table(report: dict) -> str:
    lines = []
    for r in (
        report["results"]
        if isinstance(report["results"], list)
        else [{"arm": k, **v} for k, v in report["results"].items()]
    ):
        fields = ", ".join(
            f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items() if k != "arm"
        )
        lines.append(f"{r['arm']:>8}: {fields}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["loss", "e2e", "arm"])
    parser.add_argument("arm_name", nargs="?", choices=["ours", "trl"])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--loss-type", default="grpo")
    parser.add_argument(
        "--liger-chunk-sizes",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 8],
        help="loss: Liger's chunk_size values to time (completions per compiled chunk; its default is 1)",
    )
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--trl-micro", type=lambda s: [int(x) for x in s.split(",")], default=[64, 32, 16, 8])
    parser.add_argument("--checkpointing", action="store_true", help="trl arm: gradient checkpointing")
    parser.add_argument(
        "--liger", action="store_true", help="trl arm: use_liger_kernel (Liger's fused GRPO loss)"
    )
    parser.add_argument(
        "--cpu", action="store_true", help="e2e on the CPU: a smoke run with tiny --override's"
    )
    parser.add_argument(
        "--override", dest="overrides", action="append", default=[], help="a recipe key=value"
    )
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--work", default=os.environ.get("TMPDIR", "/tmp") + "/grpo-bench")
    parser.add_argument("--json-out")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not (args.cpu and args.mode != "loss"):
        print("grpo_bench needs a CUDA GPU (e2e --cpu: a smoke run on the CPU)", file=sys.stderr)
        return 2
    Path(args.work).mkdir(parents=True, exist_ok=True)
    if args.mode == "arm":
        result = (arm_ours if args.arm_name == "ours" else arm_trl)(args)
        Path(args.json_out).write_text(json.dumps(result, indent=2))
        return 0
    report = bench_loss(args) if args.mode == "loss" else bench_e2e(args)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
