"""LoRA and QLoRA on a GPU: QLoRA 4-bit build and training with our kernels on vs off (needs
bitsandbytes), and LoRA on a Llama at a real layer size with every kernel on.

    python -m pytest -m gpu tests/test_lora_gpu.py
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from ligertune.config import load_recipe
from ligertune.training import train
from tests.helpers import ROOT

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
pytest.importorskip("peft")

QUICKSTART_LORA = ROOT / "recipes" / "quickstart-lora.yaml"
# A Llama with Llama-3-8B's layer sizes (hidden 4096, MLP 14336, GQA 32/8, vocab 128256) and 2
# layers: the kernels and the adapters at their real shapes, in seconds.
REAL_SIZE = [
    "model.config=llama3-8b",
    "model.config_overrides={num_hidden_layers: 2}",
    "tokenizer.name_or_path=ligertune://tokenizer",
    "data.max_seq_len=2048",
    "data.validation_fraction=0.0",
    "training.micro_batch_size=2",
    "training.device=cuda",
    "training.precision=bf16-mixed",
    "training.lr=2e-4",
    "training.max_steps=6",
    "training.eval_every=null",
    "logging.log_every=1",
    "logging.progress=plain",
    "checkpoint.every_steps=null",
    "checkpoint.export_hf=false",
    "export.merge_lora=false",
]


def _losses(run_dir) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r["event"] == "train"]


def _kernels_on_vs_off(tmp_path, *overrides: str) -> tuple[list[float], list[float], object]:
    runs = {}
    for kernels in ("none", "all"):
        result = train(
            load_recipe(
                QUICKSTART_LORA,
                [*REAL_SIZE, *overrides, f"kernels={kernels}", f"output_dir={tmp_path / kernels}"],
            )
        )
        runs[kernels] = (_losses(tmp_path / kernels), result)
    return runs["none"][0], runs["all"][0], runs["all"][1]


def _assert_parity(off: list[float], on: list[float], rtol: float) -> None:
    assert len(off) == len(on) == 6
    for step, (a, b) in enumerate(zip(off, on, strict=True), 1):
        assert abs(a - b) / abs(a) <= rtol, f"step {step}: off {a} vs on {b}"
    assert on[-1] < on[0]  # it trains


def test_lora_at_real_size_kernels_on_match_off(tmp_path):
    off, on, result = _kernels_on_vs_off(
        tmp_path,
        "lora.target_modules=[q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, lm_head]",
    )
    _assert_parity(off, on, rtol=2e-2)  # bf16-mixed: compare's bf16 tolerance
    model = result.model
    assert all(".lora_" in n for n, p in model.named_parameters() if p.requires_grad)


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes")
def test_qlora_4bit_builds_and_trains_at_parity_kernels_on_vs_off(tmp_path):
    import bitsandbytes as bnb

    off, on, result = _kernels_on_vs_off(tmp_path, "model.quantize=4bit", "lora.target_modules=all-linear")
    _assert_parity(off, on, rtol=2e-2)
    model = result.model
    quantized = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(quantized) == 2 * 7  # every decoder-layer projection, not the lm_head
    assert quantized[0].weight.quant_state.quant_type == "nf4"
    assert all(".lora_" in n for n, p in model.named_parameters() if p.requires_grad)
