"""The transformers config of the model a recipe asks for, with ``model.config_overrides`` applied
(`build_config`), and what makes a built config unusable (`config_problems`).

Apart from `ligertune.models.build` so that the recipe's model rules can build the config (cheap:
no weights, no torch) and refuse overrides such as ``hidden_size: -5`` in ``ligertune validate``,
before ``train`` would build the model from them.
"""

from __future__ import annotations

import copy
import difflib
import re
from typing import TYPE_CHECKING, Any

from ligertune.catalog.architectures import SHIPPED_CONFIGS
from ligertune.catalog.families import FAMILIES
from ligertune.errors import RecipeError, shown
from ligertune.paths import looks_local

if TYPE_CHECKING:  # the schema is a layer above: models are built from its values, never import it
    from ligertune.config import Recipe

# Config fields that size the model: each must be a positive integer.
SIZES = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
)
# Other integer fields named like counts or sizes (num_experts, moe_intermediate_size, ...): never negative.
_COUNT_LIKE = re.compile(r"^(num|n)_|_(size|dim|heads|layers|experts|embeddings)$")


def model_source(recipe: Recipe) -> str:
    name = recipe.model.name_or_path
    return str(recipe.resolve(name)) if looks_local(name) else name


def load_problem(recipe: Recipe, what: str, error: Exception) -> RecipeError:
    """A failed transformers load (no hub access, a wrong id, a gated repository, a folder without
    weights) as a recipe error naming ``model.name_or_path``. transformers' own messages span
    lines (and for an unrecognised model list every model type); the first line says what failed."""
    revision = f" at revision {recipe.model.revision}" if recipe.model.revision else ""
    reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
    if len(reason) > 300:
        reason = reason[:300] + "..."
    return RecipeError(
        [
            f"model.name_or_path: could not load the {what} of {recipe.model.name_or_path!r}{revision}: {reason} "
            "(a hub id needs hub access or a local copy in the cache; a local path needs a Hugging Face model folder)"
        ]
    )


def _unknown_keys_problem(unknown: list[str], known: list[str]) -> str:
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(key, known, n=1)
        hints.append(f"{shown(key)} (did you mean {close[0]}?)" if close else shown(key))
    return (
        f"model.config_overrides: not a field of this architecture's config: {', '.join(hints)}; "
        f"known fields: {', '.join(sorted(k for k in known if not k.startswith('_')))}"
    )


# The config field with which a transformers mixture-of-experts causal LM adds its router's
# load-balancing loss to the training loss (Mixtral, Qwen2/3-MoE, GPT-OSS, ...).
ROUTER_LOSS_FIELD = "output_router_logits"


def build_config(recipe: Recipe):
    """The transformers config of the model to train, with the recipe's overrides and its
    ``model.router_aux_loss`` applied."""
    config = _overridden_config(recipe)
    wanted = recipe.model.router_aux_loss
    family = FAMILIES.get(config.model_type)
    # DeepSeek-V3's config has the field from transformers 5.2x on, for its router logits alone:
    # its family record says no balancing loss comes with them.
    lossless = family is not None and family.experts is not None and not family.balancing_loss
    if lossless or not hasattr(config, ROUTER_LOSS_FIELD):
        if wanted:
            why = "it balances its experts without one" if lossless else "it has none"
            raise RecipeError(
                [
                    f"model.router_aux_loss: true needs a mixture-of-experts model with a router loss; "
                    f"model_type {config.model_type!r}: {why} in transformers (remove the key)"
                ]
            )
        return config
    if ROUTER_LOSS_FIELD in recipe.model.config_overrides and wanted is not None:
        raise RecipeError(
            [
                f"model.router_aux_loss and model.config_overrides.{ROUTER_LOSS_FIELD} both set the router loss; "
                "keep model.router_aux_loss"
            ]
        )
    if ROUTER_LOSS_FIELD not in recipe.model.config_overrides:
        # Fine-tuning keeps the balancing pressure of pre-training unless the recipe turns it off;
        # checkpoints ship with it off because it only matters while training.
        setattr(config, ROUTER_LOSS_FIELD, wanted is not False)
    return config


def _overridden_config(recipe: Recipe):
    from transformers import AutoConfig

    overrides = dict(recipe.model.config_overrides)
    if recipe.model.config is None:
        try:
            config, unused = AutoConfig.from_pretrained(
                model_source(recipe),
                trust_remote_code=recipe.model.trust_remote_code,
                revision=recipe.model.revision,
                return_unused_kwargs=True,
                **overrides,
            )
        except (OSError, ValueError) as e:
            raise load_problem(recipe, "config", e) from None
        if unused:
            raise RecipeError([_unknown_keys_problem(sorted(unused), list(config.to_dict()))])
        return config

    if isinstance(recipe.model.config, str):
        mapping = copy.deepcopy(SHIPPED_CONFIGS[recipe.model.config])
    else:
        mapping = copy.deepcopy(recipe.model.config)
    model_type = mapping.pop("model_type")
    try:
        base = AutoConfig.for_model(model_type, **mapping)
    except ValueError as e:
        raise RecipeError([f"model.config: {e}"]) from None
    # A config class stores any keyword it is given, so typos must be caught against the
    # fields the class itself defines (plus those the mapping already set),
    # and the aliases of its attribute_map (Qwen3-MoE's num_experts is num_local_experts).
    known = set(type(base)().to_dict()) | set(base.to_dict()) | set(type(base).attribute_map)
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise RecipeError([_unknown_keys_problem(unknown, sorted(known))])
    return AutoConfig.for_model(model_type, **{**mapping, **overrides})


def config_problems(config: Any, key: str) -> list[str]:
    """What makes `config` unusable although transformers built it: a size that is not a
    positive integer (`SIZES`), a count-like field that is negative; one line each, naming `key`."""
    problems = []
    for name, value in sorted(config.to_dict().items()):
        if not isinstance(value, int) or isinstance(value, bool):
            continue
        if name in SIZES and value <= 0 or _COUNT_LIKE.search(name) and value < 0:
            bound = "a positive integer" if name in SIZES else "0 or more"
            problems.append(f"{key}: {name} is {value}; it sizes the model and must be {bound}")
    return problems
