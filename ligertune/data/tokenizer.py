"""Loading the tokenizer a recipe names, and the special tokens of the bundled one.

The bundled tokenizer (``ligertune://tokenizer``, written by scripts/train_tokenizer.py) is a
byte-level BPE with 2048 tokens, the vocabulary size of the shipped ``tiny-llama`` config. Its
chat template wraps each turn in ``<|im_start|>role\\n … <|im_end|>\\n`` after one BOS token;
``add_generation_prompt`` opens an assistant turn.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ligertune.errors import DataError
from ligertune.paths import looks_local

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from ligertune.config import Recipe

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
TURN_START, TURN_END = "<|im_start|>", "<|im_end|>"
# The order fixes their ids (0–4) in the bundled vocabulary.
SPECIAL_TOKENS = [PAD, BOS, EOS, TURN_START, TURN_END]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' ~ message['role'] ~ ': use system, user or assistant') }}"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def load_tokenizer(recipe: Recipe) -> PreTrainedTokenizerBase:
    """The recipe's tokenizer, with its chat template override and a pad token set.

    Source: ``tokenizer.name_or_path``, else ``model.name_or_path``. When the tokenizer has no
    pad token, ``tokenizer.pad_token`` (default: the EOS token) becomes it; padding is always
    masked out of the loss and attention, so reusing EOS is safe. The pad token must already be
    in the vocabulary: adding one would need a resized embedding matrix.
    """
    from transformers import AutoTokenizer

    source = recipe.tokenizer.name_or_path or recipe.model.name_or_path
    if source is None:
        raise DataError(
            "tokenizer.name_or_path is not set and model.config (random init) has no tokenizer; "
            "set tokenizer.name_or_path, e.g. ligertune://tokenizer"
        )
    key = "tokenizer.name_or_path" if recipe.tokenizer.name_or_path else "model.name_or_path"
    location = str(recipe.resolve(source)) if looks_local(source) else source
    # The model's revision only applies when the tokenizer comes from the same hub repository.
    revision = recipe.model.revision if source == recipe.model.name_or_path else None
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            location, trust_remote_code=recipe.model.trust_remote_code, revision=revision
        )
    except (OSError, ValueError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"{key}: cannot load a tokenizer from {location}: {first_line}") from None

    if recipe.tokenizer.chat_template is not None:
        tokenizer.chat_template = recipe.tokenizer.chat_template
    if tokenizer.pad_token is None:
        pad = recipe.tokenizer.pad_token or tokenizer.eos_token
        if pad is None:
            raise DataError(
                f"{key}: the tokenizer at {location} has neither a pad nor an EOS token; "
                "set tokenizer.pad_token to a token in its vocabulary"
            )
        if tokenizer.convert_tokens_to_ids(pad) in (None, tokenizer.unk_token_id):
            raise DataError(
                f"tokenizer.pad_token: {pad!r} is not in the vocabulary of {location}; "
                "choose an existing token (the EOS token works)"
            )
        tokenizer.pad_token = pad
    return tokenizer
