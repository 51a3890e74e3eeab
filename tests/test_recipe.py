"""Recipe schema: shipped recipes validate; broken recipes fail with messages that say what to fix."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ligertune.catalog.kernels import KERNEL_NAMES
from ligertune.config import (
    Recipe,
    RecipeError,
    apply_overrides,
    load_recipe,
    machine_problems,
    recipe_to_yaml,
    validate_recipe,
)

ROOT = Path(__file__).resolve().parent.parent
BROKEN = Path(__file__).resolve().parent / "recipes"
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"
SHIPPED = sorted((ROOT / "recipes").glob("*.yaml"))

# Each broken recipe in tests/recipes and a fragment its error must contain. Problems that
# depend on the machine (paths) are matched by their stable part.
EXPECTED = {
    "unknown_key.yaml": "training.lr_shedule: unknown key; did you mean training.lr_schedule?",
    "unknown_section.yaml": "trainig: unknown key; did you mean training?",
    "wrong_type.yaml": "training.micro_batch_size: got 'four'; input should be a valid integer",
    "bad_choice.yaml": "training.lr_schedule: got 'exponential'; allowed: 'cosine', 'linear' or 'constant'",
    "missing_file.yaml": "data.path: file not found: ./no-such-data.jsonl (looked for",
    "loss_kernel_conflict.yaml": "kernels.cross_entropy and kernels.fused_linear_cross_entropy are both on",
    "missing_data.yaml": "data: required key is missing",
    "two_model_sources.yaml": "set exactly one of model.name_or_path (weights) or model.config (random init)",
    "unknown_config_name.yaml": "model.config: unknown shipped config 'llama3-8 b'; did you mean llama3-8b?",
    "bad_kernel_name.yaml": "kernels.rmsnorm: unknown key; did you mean kernels.rms_norm?",
    "bad_kernel_preset.yaml": "kernels: expected 'all', 'none' or a mapping of kernel: true/false, got 'some'",
    "offload_needs_zero3.yaml": "parallel.deepspeed.offload_params needs parallel.deepspeed.zero_stage: 3",
    "negative_lr.yaml": "training.lr: got -1; input should be greater than 0",
    "not_yaml.yaml": "not valid YAML at line 3, column 2",
    "not_mapping.yaml": "the recipe must be a YAML mapping of sections, got str",
}


def test_every_broken_recipe_has_an_expected_message():
    assert sorted(EXPECTED) == sorted(p.name for p in BROKEN.glob("*.yaml"))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_broken_recipe_message(name):
    with pytest.raises(RecipeError) as info:
        load_recipe(BROKEN / name)
    assert any(EXPECTED[name] in p for p in info.value.problems), info.value.problems


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_recipes_validate(path):
    recipe = load_recipe(path)
    assert recipe.description, "every shipped recipe needs a one-line description"
    assert recipe.name == path.stem


def test_every_hub_recipe_has_an_offline_bench_variant():
    names = {p.stem for p in SHIPPED}
    for name in names:
        recipe = load_recipe(ROOT / "recipes" / f"{name}.yaml")
        if recipe.model.name_or_path is not None:
            assert f"{name}-bench" in names, (
                f"{name} needs a {name}-bench variant that runs without hub access"
            )


def test_overrides_are_yaml_typed_and_validated():
    recipe = load_recipe(
        ROOT / "recipes" / "llama3.2-1b-alpaca.yaml",
        [
            "training.lr=2e-5",
            "kernels.rope=false",
            "data.max_seq_len=4096",
            "training.adam_betas=[0.9, 0.99]",
        ],
    )
    assert recipe.training.lr == 2e-5
    assert recipe.kernels.rope is False and recipe.kernels.rms_norm is True
    assert recipe.data.max_seq_len == 4096
    assert recipe.training.adam_betas == (0.9, 0.99)


def test_override_typo_is_named():
    with pytest.raises(RecipeError) as info:
        load_recipe(ROOT / "recipes" / "llama3.2-1b-alpaca.yaml", ["training.lr_shedule=cosine"])
    assert "training.lr_shedule: unknown key; did you mean training.lr_schedule?" in info.value.problems[0]


@pytest.mark.parametrize("bad", ["training.lr", "=3", "training..lr=1", "training.lr=[1,"])
def test_malformed_overrides(bad):
    with pytest.raises(RecipeError) as info:
        apply_overrides({}, [bad])
    assert bad.partition("=")[0] in info.value.problems[0] or "override is written" in info.value.problems[0]


def test_override_into_a_scalar_is_rejected():
    with pytest.raises(RecipeError) as info:
        apply_overrides({"seed": 3}, ["seed.value=1"])
    assert "seed.value: seed is 3, not a section with keys" in info.value.problems[0]


def test_kernel_presets():
    base = yaml.safe_load((BROKEN / "unknown_key.yaml").read_text())
    base.pop("training")
    everything = validate_recipe({**base, "kernels": "all"}, base_dir=BROKEN)
    nothing = validate_recipe({**base, "kernels": "none"}, base_dir=BROKEN)
    assert "fused_linear_cross_entropy" in everything.kernels.enabled()
    assert "cross_entropy" not in everything.kernels.enabled(), "all must not enable both loss kernels"
    assert nothing.kernels.enabled() == []
    assert set(everything.kernels.enabled()) == set(KERNEL_NAMES) - {"cross_entropy"}
    # An override can switch one kernel off after a preset.
    raw = apply_overrides({**base, "kernels": "all"}, ["kernels.rope=false"])
    assert "rope" not in validate_recipe(raw, base_dir=BROKEN).kernels.enabled()


def test_every_field_has_a_description():
    def walk(model, prefix):
        for name, field in model.model_fields.items():
            assert field.description, f"{prefix}{name} has no description"
            annotation = field.annotation
            if isinstance(annotation, type) and issubclass(annotation, Recipe.__mro__[1]):
                walk(annotation, f"{prefix}{name}.")

    walk(Recipe, "")


def test_deepspeed_missing_names_the_install(tmp_path):
    """With deepspeed hidden from the import system, the recipe names the fix and exits 2."""
    recipe = tmp_path / "ds.yaml"
    recipe.write_text((ROOT / "recipes" / "qwen2.5-7b-alpaca-deepspeed.yaml").read_text())
    hide = (
        "import sys\n"
        "sys.modules['deepspeed'] = None  # what an environment without deepspeed looks like to find_spec\n"
        "sys.argv = ['ligertune', 'validate', sys.argv[1]]\n"
        "from ligertune.cli import main; main()\n"
    )
    proc = subprocess.run([sys.executable, "-c", hide, str(recipe)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "parallel.strategy: deepspeed is chosen but not installed" in proc.stderr
    assert "pip install 'ligertune[deepspeed]'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_output_dir_expands_home():
    """`output_dir: ~/x` is the home folder's x, as data paths are; not a literal ./~ folder."""
    recipe = load_recipe(ROOT / "recipes" / "quickstart.yaml", ["output_dir=~/ligertune-runs/q"])
    assert recipe.run_dir == Path.home() / "ligertune-runs" / "q"
    assert load_recipe(ROOT / "recipes" / "quickstart.yaml").run_dir == Path("runs") / "quickstart"


def test_max_grad_norm_zero_is_no_clipping():
    recipe = load_recipe(ROOT / "recipes" / "quickstart.yaml", ["training.max_grad_norm=0"])
    assert recipe.training.max_grad_norm is None
    assert load_recipe(ROOT / "recipes" / "quickstart.yaml").training.max_grad_norm == 1.0


def test_floats_without_a_dot_read_as_numbers(tmp_path):
    """YAML 1.1 reads `2e-5` as a string; recipes read it as the number people mean, in the file
    and in an override, while a quoted '2e-5' stays a string (refused by the strict schema)."""
    text = (ROOT / "recipes" / "quickstart.yaml").read_text().replace("lr: 3.0e-3", "lr: 3e-3")
    assert "lr: 3e-3" in text
    (tmp_path / "r.yaml").write_text(text)
    recipe = load_recipe(tmp_path / "r.yaml", ["training.weight_decay=1e-2"])
    assert recipe.training.lr == 3e-3 and recipe.training.weight_decay == 1e-2


def test_train_runs_the_model_rules_before_any_work():
    """`train` checks `machine_problems` first (Trainer.setup): the model rules are part of it, so
    an unknown model_type stops train where validate stops it, before any model work."""
    raw = yaml.safe_load((BROKEN / "unknown_key.yaml").read_text())
    raw.pop("training")
    raw["model"] = {"config": {"model_type": "not_a_model"}}
    recipe = validate_recipe(raw, base_dir=BROKEN)  # the recipe rules do not import transformers
    problems = machine_problems(recipe)
    assert any(p.startswith("model.config.model_type: model_type 'not_a_model' is not one") for p in problems)


@pytest.mark.parametrize("path", sorted((ROOT / "recipes").glob("*.yaml")), ids=lambda p: p.stem)
def test_a_saved_recipe_reads_back_as_the_same_recipe(path):
    """Checkpoints keep `recipe_to_yaml(recipe)`, every key written out; resume and `generate`
    read it back. A rule that looks at which keys were written would refuse it."""
    recipe = load_recipe(path)
    again = validate_recipe(yaml.safe_load(recipe_to_yaml(recipe)), base_dir=path.parent)
    assert again.model_dump() == recipe.model_dump()


PREVIOUS_LAYOUT = ROOT / "tests" / "data" / "previous_layout"


@pytest.mark.parametrize("path", sorted(PREVIOUS_LAYOUT.glob("*.yaml")), ids=lambda p: p.stem)
def test_a_recipe_saved_by_the_previous_layout_reads_as_the_shipped_recipe(path):
    """Before objectives and strategies were one options model each, `recipe_to_yaml` wrote every
    objective's and every strategy's options into every recipe.yaml a checkpoint keeps (these
    files are what that code wrote for the shipped recipes). They read as the shipped recipes:
    the options of objectives and strategies not chosen, at the values that had no effect, are
    dropped. quickstart-lora's file says ``sharded_init: false``: ``auto`` was resolved in place
    with lora then, and an explicit value now reads as what it says."""
    resolved_then = {"quickstart-lora": ["parallel.sharded_init=false"]}.get(path.stem, [])
    shipped = load_recipe(ROOT / "recipes" / path.name, resolved_then)
    assert load_recipe(path).model_dump() == shipped.model_dump()


def test_an_option_of_another_objective_or_strategy_names_the_ones_it_belongs_to():
    """A key that had no effect under the old layout with a value other than its default is an
    error now, naming the objectives (or strategies) that read it."""
    with pytest.raises(RecipeError) as e:
        load_recipe(QUICKSTART, ["objective.beta=0.3"])
    assert e.value.problems == [
        "objective.beta: objective.name sft has no option beta (an option of dpo, orpo, simpo, kto and grpo); "
        "remove it, or set objective.name to one of dpo, orpo, simpo, kto, grpo"
    ]
    with pytest.raises(RecipeError) as e:
        load_recipe(QUICKSTART, ["parallel.strategy=ddp", "parallel.fsdp.cpu_offload=true"])
    assert e.value.problems[0].startswith("parallel.fsdp: parallel.strategy ddp has no option fsdp")
    with pytest.raises(RecipeError, match=r"objective.name: got 'dppo'; did you mean dpo\?"):
        load_recipe(QUICKSTART, ["objective.name=dppo"])
