"""Attention for packed rows (ligertune/models/attention.py): the backend `auto` picks, and the
document mask we build without a host sync, checked against transformers' own packed-row mask
and for isolation (a sample's logits do not depend on what is packed before it), for every
family and backend."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from ligertune.models.attention import (
    choose_attention,
    document_ids,
    document_mask_problem,
    install_document_mask,
    unsupported_backends,
)
from ligertune.tools.providers import PROVIDERS

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3"]
# FlexAttention without a GPU runs its unfused reference (tens of seconds for some families): slow.
BACKENDS = ["sdpa", "eager", pytest.param("flex_attention", marks=pytest.mark.slow)]


def tiny_config(model_type: str, **overrides):
    config = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=1,
    )
    if model_type in ("mistral", "gemma2", "gemma3_text"):
        config["sliding_window"] = 8  # shorter than the samples: the window must survive our mask
    return AutoConfig.for_model(model_type, **{**config, **overrides})


def tiny_model(model_type: str, attn: str, **overrides):
    config = tiny_config(model_type, **overrides)
    refused = unsupported_backends(config).get(attn)
    if refused:
        pytest.skip(f"auto never builds it: {refused}")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    model.config.use_cache = False
    return model.float().eval()


def test_document_ids_start_a_sample_wherever_the_positions_do_not_continue():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3], [5, 6, 7, 0, 1, 2, 3, 0, 0]])
    expected = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2], [0, 0, 0, 1, 1, 1, 1, 2, 3]])
    assert torch.equal(document_ids(positions), expected)


@pytest.mark.parametrize(
    ("requested", "on_cuda", "packing", "expected"),
    [
        ("auto", False, True, "sdpa"),
        ("auto", False, False, "sdpa"),
        ("auto", True, True, "flex_attention"),
        ("auto", True, False, "sdpa"),
        ("eager", True, True, "eager"),
        ("flex_attention", False, True, "flex_attention"),
    ],
)
def test_auto_picks_flex_for_packed_rows_on_cuda_and_sdpa_otherwise(requested, on_cuda, packing, expected):
    # flash-attn is not installed here; with it, auto on CUDA would pick flash_attention_2.
    chosen, why = choose_attention(requested, on_cuda, packing, tiny_config("llama"))
    assert chosen == expected
    assert why.startswith("auto:" if requested == "auto" else "as the recipe says")


@pytest.mark.parametrize("model_type", FAMILIES)
def test_auto_builds_every_family_with_a_backend_the_installed_transformers_supports(model_type):
    """For every machine auto decides for (CPU or CUDA, packed or padded rows), the backend it picks
    is one the family supports on this transformers, as transformers itself checks when it builds
    the model; on the CPU the model also runs. (transformers 5.23 refuses SDPA for Gemma 2, whose
    attention softcap SDPA cannot apply: auto must not pick it there, nor under 5.17.)"""
    config = tiny_config(model_type)
    refused = unsupported_backends(config)
    if model_type == "gemma2":
        assert "sdpa" in refused  # the softcap, whatever transformers declares
    ids = torch.randint(2, 128, (1, 12), generator=torch.Generator().manual_seed(4))
    for on_cuda in (False, True):
        for packing in (False, True):
            chosen, why = choose_attention("auto", on_cuda, packing, config)
            assert chosen not in refused, (on_cuda, packing, why)
            if chosen == "flash_attention_2":
                continue  # flash-attn is a CUDA build; not installed on a CPU machine
            model = AutoModelForCausalLM.from_config(config, attn_implementation=chosen)
            assert model.config._attn_implementation == chosen
            if not on_cuda:
                with torch.no_grad():
                    assert torch.isfinite(model(input_ids=ids).logits).all()
            for passed_over in [b for b in refused if f"passed over {b}" in why]:
                assert refused[passed_over] in why


@pytest.mark.parametrize("attn", BACKENDS)
@pytest.mark.parametrize("model_type", FAMILIES)
def test_packed_samples_are_isolated_and_the_mask_is_transformers_own(model_type, attn):
    """Sample b packed after sample a (and a padding tail) gets the logits it gets alone, and the
    whole row matches the mask transformers builds from the position ids itself."""
    model = tiny_model(model_type, attn)
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randint(2, 128, (13,), generator=gen), torch.randint(2, 128, (11,), generator=gen)
    ids = torch.cat([a, b, torch.zeros(8, dtype=torch.long)])[None]
    positions = torch.cat([torch.arange(13), torch.arange(11), torch.arange(8)])[None]

    def logits(input_ids, position_ids=None):
        with torch.no_grad():
            return model(input_ids=input_ids, position_ids=position_ids).logits[0].double()

    alone = logits(b[None])
    theirs = logits(ids, positions)
    leaky = logits(ids, torch.arange(32)[None])  # continuous positions: b sees a
    assert "document mask" in install_document_mask(model)
    ours = logits(ids, positions)
    assert (ours[13:24] - alone).abs().max() <= 1e-5
    assert (ours - theirs).abs().max() <= 1e-6
    assert (leaky[13:24] - alone).abs().max() > 1e-3  # the check can fail


def test_padded_batches_and_generation_go_through_untouched():
    model = tiny_model("llama", "sdpa")
    ids = torch.randint(2, 128, (2, 12), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask).logits
        generated = model.generate(ids[:1, :5], max_new_tokens=6, do_sample=False, use_cache=True)
    install_document_mask(model)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, before)
        again = model.generate(ids[:1, :5], max_new_tokens=6, do_sample=False, use_cache=True)
    assert torch.equal(again, generated)


def test_flash_attention_and_bidirectional_models_keep_transformers_path():
    bidirectional = tiny_model("gemma3_text", "sdpa", use_bidirectional_attention=True)
    assert document_mask_problem(bidirectional) == "the model attends bidirectionally"
    assert install_document_mask(bidirectional).startswith("packed rows: transformers' own mask")
    assert not bidirectional._forward_pre_hooks


def test_hf_baseline_providers_run_the_backend_transformers_would_pick():
    assert PROVIDERS["eager"].recipe_overrides("auto")[-1] == "model.attn_implementation=sdpa"
    assert "model.attn_implementation=sdpa" not in PROVIDERS["eager"].recipe_overrides("eager")
    assert not any("attn_implementation" in o for o in PROVIDERS["ligertune"].recipe_overrides("auto"))


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_gpu_flex_document_mask_is_isolated_and_needs_no_host_sync(model_type):
    """On CUDA, FlexAttention with our mask: isolation at a real row length, and a forward and
    backward with CUDA's sync debug mode set to raise on any device-to-host synchronisation."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = tiny_model(
        model_type, "flex_attention", hidden_size=256, intermediate_size=512, num_attention_heads=8
    )
    model = model.cuda()
    install_document_mask(model)
    gen = torch.Generator().manual_seed(3)
    lengths = [700, 300, 900, 148]  # 2048 tokens in four samples
    ids = torch.randint(2, 128, (1, sum(lengths)), generator=gen).cuda()
    positions = torch.cat([torch.arange(n) for n in lengths])[None].cuda()
    model.train()
    model(input_ids=ids, position_ids=positions, labels=ids).loss.backward()  # compile, outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        model(input_ids=ids, position_ids=positions, labels=ids).loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    model.eval()
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions).logits[0]
        start = 0
        for n in lengths:
            alone = model(input_ids=ids[:, start : start + n]).logits[0]
            assert (packed[start : start + n] - alone).abs().max() <= 1e-3
            start += n


def test_train_gemma2_with_auto_attention_through_the_cli(tmp_path):
    """`ligertune train` on a Gemma 2 with the default attention: it trains, and the start log
    says auto took eager and why (transformers 5.23 refuses SDPA for Gemma 2 with a traceback)."""
    from typer.testing import CliRunner

    from ligertune.cli import app
    from tests.helpers import PLAIN_RUN, QUICKSTART

    gemma2 = (
        "model.config={model_type: gemma2, hidden_size: 64, intermediate_size: 96, num_hidden_layers: 2, "
        "num_attention_heads: 4, num_key_value_heads: 2, head_dim: 16, vocab_size: 2048, sliding_window: 16}"
    )
    args = ["train", str(QUICKSTART), gemma2, *PLAIN_RUN, "training.max_steps=2", "data.max_seq_len=64"]
    result = CliRunner().invoke(app, [*args, f"output_dir={tmp_path}"])
    assert result.exit_code == 0, result.output
    assert "attention: eager (auto: CPU; passed over sdpa: " in result.output
