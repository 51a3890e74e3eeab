"""`draw_init_on`: a random init drawn one module at a time on another device, into a model built
without an init (what a sharded init's rank 0 does with a model too large for its GPU).

On the CPU the "other device" is the CPU itself: transformers' traversal, every family's
`_init_weights`, the moves there and back and the weight tying run as on a GPU. The result must
be the plain build's distribution, parameter by parameter: the constant inits (norm weights,
biases) equal, every random one random with the plain build's spread, buffers equal, tied
weights still one parameter. A parameter the init missed would keep `torch.empty`'s contents.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.initialization import no_init_weights

from ligertune.config import load_recipe
from ligertune.models.build import build_model, draw_init_on
from tests.helpers import QUICKSTART, TINY_MODEL
from tests.test_moe import FAMILIES as MOE
from tests.test_moe import MOE as ROUTING
from tests.test_patching import FAMILIES as DENSE
from tests.test_patching import TINY

# Every dense and MoE family of the patching tests, at their tiny sizes.
CONFIGS = {
    **{name: {**TINY, **extra} for name, (extra, _, _) in DENSE.items()},
    **{name: {**TINY, **ROUTING, **extra} for name, (extra, _, _) in MOE.items()},
}


def assert_same_distribution(plain: torch.nn.Module, drawn: torch.nn.Module) -> None:
    params, others = dict(plain.named_parameters()), dict(drawn.named_parameters())
    assert params.keys() == others.keys()
    for name, p in params.items():
        q = others[name]
        assert (q.shape, q.dtype, q.device) == (p.shape, p.dtype, p.device), name
        assert torch.isfinite(q).all(), name
        if p.numel() == 1:  # one draw (mllama's gates): nothing to tell a spread from
            continue
        if torch.all(p == p.flatten()[0]):
            assert torch.equal(q, p), f"{name}: the constant init differs"
            continue
        assert not torch.all(q == q.flatten()[0]), f"{name}: not initialised"
        assert not torch.equal(q, p), f"{name}: the same numbers (expected another generator state)"
        if p.numel() >= 2048:
            spread = p.float().std()
            assert abs(q.float().std() / spread - 1) < 0.1, name
            assert abs(q.float().mean() - p.float().mean()) < 0.1 * spread, name
    buffers = dict(drawn.named_buffers())
    for name, b in plain.named_buffers():
        assert torch.equal(buffers[name], b), name
    tied = plain.get_input_embeddings().weight is plain.get_output_embeddings().weight
    assert (drawn.get_input_embeddings().weight is drawn.get_output_embeddings().weight) == tied


def build_both(config) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_config(config)
    torch.manual_seed(0)
    with no_init_weights():
        drawn = AutoModelForCausalLM.from_config(config)
    draw_init_on(drawn, torch.device("cpu"))
    return plain, drawn


@pytest.mark.parametrize("model_type", CONFIGS)
def test_drawn_init_has_the_plain_builds_distribution(model_type):
    config = AutoConfig.for_model(model_type, **CONFIGS[model_type])
    plain, drawn = build_both(config)
    assert_same_distribution(plain, drawn)
    # The wrappers are gone: a later init (or save) sees transformers' own methods.
    assert all("_initialize_weights" not in vars(m) for m in drawn.modules())


@pytest.mark.parametrize(
    "architecture", ["tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-gemma3-vl", "tiny-mllama"]
)
def test_drawn_init_of_vision_language_models(architecture):
    """Composite models: a sub-model (vision tower, language model) dispatches its own init."""
    recipe = load_recipe(QUICKSTART, [f"model.config={architecture}", "training.precision=fp32"])
    plain = build_model(recipe, torch.device("cpu"))
    torch.manual_seed(0)
    with no_init_weights():
        drawn = type(plain)._from_config(plain.config, dtype=torch.float32)
    draw_init_on(drawn, torch.device("cpu"))
    assert_same_distribution(plain, drawn)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_build_draws_on_the_gpu_into_cpu_memory():
    """`build_model(..., draw_on=cuda)`: the model stays in CPU memory, its init is the plain GPU
    build's distribution (moved to the CPU to compare), and the GPU holds nothing afterwards."""
    recipe = load_recipe(QUICKSTART, [*TINY_MODEL, "training.precision=fp32"])
    plain = build_model(recipe, torch.device("cuda")).cpu()
    before = torch.cuda.memory_allocated()
    drawn = build_model(recipe, torch.device("cpu"), draw_on=torch.device("cuda"))
    assert all(p.device.type == "cpu" for p in drawn.parameters())
    assert torch.cuda.memory_allocated() == before
    assert_same_distribution(plain, drawn)
