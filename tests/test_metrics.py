"""Metrics: FLOPs per token, the peak table, throughput windows, and what the sinks write."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from ligertune.models.shape import model_shape
from ligertune.run import metrics
from ligertune.run.metrics import MetricsLogger, RunSummary, Throughput, format_train_line
from tests.helpers import tiny_llama


@pytest.mark.parametrize("tied", [False, True])
def test_flops_per_token_counts_every_matmul(tied):
    model = tiny_llama(
        vocab_size=300,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=3,
        num_attention_heads=4,  # the counts below read these sizes
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=tied,
    )
    V, H, inter, L, heads, kv, hd, S = 300, 48, 80, 3, 4, 2, 16, 37
    # Counted by hand from the architecture: per layer q, k, v, o projections, the three MLP
    # matrices and two norm vectors; then the final norm and the lm_head (V×H, a matmul even
    # when tied). The input embedding lookup is not a matmul.
    per_layer = H * heads * hd + 2 * H * kv * hd + heads * hd * H + 3 * H * inter + 2 * H
    n = L * per_layer + H + V * H
    attention = 12 * L * (heads * hd) * S
    assert model_shape(model).flops_per_token(S) == 6 * n + attention


def test_flops_per_token_reads_a_multimodal_models_text_config():
    """A model whose language model's sizes are under ``config.text_config`` (a vision-language
    model) is counted from them, as the memory plan counts it."""
    model = tiny_llama(num_hidden_layers=2, num_attention_heads=4, head_dim=16)
    plain = model_shape(model).flops_per_token(64)
    model.config = SimpleNamespace(text_config=model.config)
    assert model_shape(model).flops_per_token(64) == plain


def test_peak_table_prefers_the_most_specific_name(monkeypatch):
    cuda = torch.device("cuda", 0)
    names = {
        "NVIDIA H100 80GB HBM3": 989.4,
        "NVIDIA H100 PCIe": 756.0,
        "NVIDIA H200": 989.4,
        "NVIDIA A100-SXM4-80GB": 312.0,
        "NVIDIA L40S": 362.0,
        "NVIDIA L4": 121.0,
    }
    for name, tflops in names.items():
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device, name=name: name)
        assert metrics.peak_bf16_flops(cuda) == tflops * 1e12, name
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "Some Future GPU")
    assert metrics.peak_bf16_flops(cuda) is None
    assert metrics.peak_bf16_flops(torch.device("cpu")) is None


def test_throughput_leaves_out_warmup_and_splits_per_gpu():
    t = Throughput(warmup_steps=2, world_size=4, flops_per_token=1e9, peak_flops=1e15)
    t.add_step(10.0, 1, 1)  # warm-up steps: slow, must not count
    t.add_step(10.0, 1, 1)
    assert t.take_window()["tokens_per_s"] is None  # only warm-up so far: n/a
    t.add_step(2.0, 300, 800)
    t.add_step(2.0, 100, 800)
    rates = t.take_window()
    assert rates["tokens_per_s"] == pytest.approx(1600 / 4.0)
    assert rates["label_tokens_per_s"] == pytest.approx(400 / 4.0)
    assert rates["tokens_per_s_per_gpu"] == pytest.approx(400 / 4 / 1)
    assert rates["label_tokens_per_s_per_gpu"] == pytest.approx(100 / 4)
    assert rates["mfu"] == pytest.approx(100 * 1e9 / 1e15)
    t.add_step(1.0, 50, 100)
    assert t.take_window()["tokens_per_s"] == pytest.approx(100.0)  # a new window
    run = t.rates(t.run)
    assert run["tokens_per_s"] == pytest.approx(1700 / 5.0)
    assert Throughput(0, 1, 1e9, None).rates(t.run)["mfu"] is None  # no known peak: n/a


def _train_record(**changes):
    record = {
        "step": 10,
        "epoch": 0.5,
        "loss": 2.5,
        "lr": 1e-4,
        "grad_norm": 0.7,
        "tokens_per_s": 1234.0,
        "label_tokens_per_s": 600.0,
        "tokens_per_s_per_gpu": 1234.0,
        "label_tokens_per_s_per_gpu": 600.0,
        "mfu": None,
        "peak_mem_allocated_gib": None,
        "peak_mem_reserved_gib": None,
        "skipped_steps": 0,
    }
    return record | changes


def test_plain_line_shows_na_on_cpu():
    line = format_train_line(_train_record(), total_steps=20)
    assert line.startswith("step 10/20 | loss 2.5000 | lr 1.000e-04 | grad norm 0.700")
    assert "1.23k tok/s (600.0 label)" in line
    assert "MFU n/a" in line and "GiB" not in line
    gpu = format_train_line(
        _train_record(mfu=0.4125, peak_mem_allocated_gib=12.3, peak_mem_reserved_gib=14.0), 20
    )
    assert "MFU 41.2%" in gpu and "mem 12.3/14.0 GiB" in gpu


def test_logger_writes_jsonl_records_and_summary(tmp_path, capsys):
    logger = MetricsLogger(tmp_path, total_steps=20, start_step=0, progress="plain")
    logger.write({"event": "start", "step": 0})
    logger.train(_train_record(loss=float("nan")))
    logger.eval({"step": 10, "eval_loss": 2.0, "eval_ppl": 7.39, "eval_label_tokens": 99})
    logger.summary(
        RunSummary(
            steps=20,
            seconds=3.0,
            rates=Throughput(0, 1, 1.0, None).rates(Throughput(0, 1, 1.0, None).run),
            peak_mem_allocated_gib=None,
            peak_mem_reserved_gib=None,
            final_loss=1.5,
            eval_loss=2.0,
        )
    )
    logger.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]  # strict JSON: a NaN would not parse in other readers
    assert "NaN" not in (tmp_path / "metrics.jsonl").read_text()
    assert [r["event"] for r in records] == ["start", "train", "eval", "summary"]
    assert records[1]["loss"] is None and records[1]["step"] == 10 and "time" in records[1]
    assert records[3]["final_loss"] == 1.5 and records[3]["steps"] == 20
    out = capsys.readouterr().out
    assert "step 10/20 | loss non-finite" in out
    assert "eval step 10 | loss 2.0000" in out
    assert "run summary" in out and "loss, last step" in out


@pytest.mark.parametrize(
    ("tail", "why"),
    [
        (b'{"event": "train", "step": 3, "lo', "has no newline"),  # killed mid-line
        (b'{"event": "train", "st\n', "is not a JSON object"),  # a line cut short, newline and all
        (b"\0\0\0\0\n", "is not a JSON object"),  # blocks the filesystem never filled in
    ],
)
def test_reopening_the_log_cuts_a_torn_last_line_with_a_warning(tmp_path, capsys, tail, why):
    path = tmp_path / "metrics.jsonl"
    whole = b'{"event": "start", "step": 0}\n{"event": "train", "step": 1}\n'
    path.write_bytes(whole + tail)
    logger = MetricsLogger(tmp_path, total_steps=20, start_step=1, progress="plain")
    logger.write({"event": "start", "step": 1})
    logger.close()
    assert f"warning: the last line of {path} {why}" in " ".join(capsys.readouterr().out.split())
    text = path.read_bytes()
    assert text.startswith(whole) and text.endswith(b"\n")
    assert [json.loads(line)["step"] for line in text.splitlines()] == [0, 1, 1]


def test_a_whole_log_is_left_as_it_is(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    whole = (
        b'{"event": "start", "step": 0}\n'
        + b'{"event": "train", "step": 1, "pad": "'
        + b"x" * 70000
        + b'"}\n'
    )
    path.write_bytes(whole)  # a last line longer than the 64 KiB blocks the repair reads backwards
    assert metrics.repair_torn_tail(path) is None and path.read_bytes() == whole
    path.write_bytes(whole[:-1])
    assert "has no newline" in metrics.repair_torn_tail(path)
    assert path.read_bytes() == b'{"event": "start", "step": 0}\n'
    assert metrics.repair_torn_tail(tmp_path / "absent.jsonl") is None
    assert "warning" not in capsys.readouterr().out


def test_each_record_is_one_append_write(tmp_path, monkeypatch):
    """One write() of the whole line on an O_APPEND descriptor: a crash cannot split a record
    between two writes, and the file never holds a partial line that a later write completes."""
    import fcntl
    import os

    logger = MetricsLogger(tmp_path, total_steps=20, start_step=0, progress="plain")
    writes = []
    real_write = os.write

    def recording_write(fd, data):
        writes.append((fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_APPEND, bytes(data)))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", recording_write)
    logger.write({"event": "train", "step": 1, "loss": 2.5})
    monkeypatch.undo()
    logger.close()
    ((append, line),) = writes
    assert append and line.endswith(b"\n") and json.loads(line)["loss"] == 2.5
    assert (tmp_path / "metrics.jsonl").read_bytes() == line


def test_tensorboard_missing_is_a_message_not_a_crash(tmp_path, capsys, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name == "torch.utils.tensorboard":
            raise ImportError("No module named 'tensorboard'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    logger = MetricsLogger(tmp_path, total_steps=5, start_step=0, progress="plain", tensorboard=True)
    logger.close()
    assert "tensorboard is not installed" in capsys.readouterr().out


def test_rich_progress_on_a_terminal(tmp_path):
    import io

    from rich.console import Console

    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120)
    logger = MetricsLogger(tmp_path, total_steps=8, start_step=2, progress="rich", console=console)
    logger.step_done(3, 2.25)
    logger.train(_train_record(step=3))
    logger.close()
    text = out.getvalue()
    assert "3/8" in text and "eta" in text and "loss 2.2500" in text  # bar, ETA column, status
    assert "step 3/8 | loss 2.5000" in text  # log lines still printed above the bar
