"""Conversations → text segments with what to train on: chat templates and their loss masks.

A conversation is trained on its assistant turns only, and on each turn's *end-of-turn* marker
too (``<|eot_id|>``, ``<|im_end|>``, ``<end_of_turn>``, ``</s>``, ``<|end|>``): a model that never
saw its stop token in the loss never learns to stop, a common bug of trainers that mask by
template markers. How the assistant spans are found, by what the template offers:

1. **Generation markers.** A template that wraps assistant text in ``{% generation %}`` …
   ``{% endgeneration %}`` says itself what to train. We render a copy of it whose markers
   print sentinels, split the text at them, and extend each span by the end-of-turn marker
   when the template left it outside (the markers are often placed around the content only).
2. **Prefix rendering** (templates without markers, the common case). Assistant turn i's text
   is what the template adds between rendering turns < i with the generation prompt and
   rendering turns ≤ i: exactly what the model must produce at inference, header excluded and
   end-of-turn included. It needs a template that renders earlier turns the same once later
   ones are added.
3. **Content search** (templates that rewrite earlier turns: Mistral's puts the system prompt
   in the *last* user turn, Qwen 3's drops the reasoning of earlier assistant turns, Phi-3's
   ends a whole conversation with EOS). The whole conversation is rendered once; each
   assistant message's content (as written, trimmed, or without its reasoning) is found in
   order, and trained together with the end-of-turn marker that follows it.

Never all-ones: a conversation whose assistant turn cannot be found is an error naming the row.

The end-of-turn marker is read from the template itself (`end_of_turn`): the text it writes right
after an assistant message both when that message ends the conversation and when a user turn
follows.

Messages are ``{role, content}`` (``chat``) or ``{from, value}`` (``sharegpt``), with the key
names and role names a recipe maps (``data.columns: {role: speaker, content: text}``,
``data.roles: {bot: assistant}``; `ChatOptions`). Reasoning blocks (``<think>…</think>``) in
assistant turns are kept and trained (``data.think_blocks: keep``), kept but left out of the loss
(``mask``), or removed before rendering (``strip``).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ligertune.catalog.formats import ROLES
from ligertune.errors import DataError, shown

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# A sample before tokenization: text pieces, each with whether its tokens are trained on.
Segments = list[tuple[str, bool]]

# ShareGPT speakers → chat roles. user/assistant appear in some ShareGPT dumps too.
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}

THINK = re.compile(r"<think>.*?</think>\s*", re.DOTALL)
_OPEN, _CLOSE = "\x00<ligertune-train>\x00", "\x00</ligertune-train>\x00"


@dataclass(frozen=True)
class ChatOptions:
    """How a source's conversations read: the message keys, the role names, reasoning blocks."""

    sharegpt: bool = False
    role_key: str = "role"
    content_key: str = "content"
    roles: dict[str, str] = field(default_factory=dict)  # the dataset's name → ours
    think_blocks: str = "keep"

    @classmethod
    def for_source(
        cls, sharegpt: bool, columns: dict[str, str], roles: dict[str, str], think_blocks: str
    ) -> ChatOptions:
        keys = ("from", "value") if sharegpt else ("role", "content")
        return cls(
            sharegpt,
            columns.get("role", keys[0]),
            columns.get("content", keys[1]),
            {**(SHAREGPT_ROLES if sharegpt else {}), **roles},
            think_blocks,
        )


def read_messages(value: Any, field_name: str, where: str, options: ChatOptions) -> list[dict]:
    """A row's conversation as ``[{role, content}]`` with our role names, naming the message at
    fault; reasoning removed from assistant turns when ``think_blocks`` is ``strip``."""
    what = "turns" if options.sharegpt else "messages"
    keys = f"{options.role_key} and {options.content_key}"
    if not isinstance(value, list) or not value:
        raise DataError(
            f"{where}: {field_name} must be a non-empty list of {{{keys.replace(' and ', ', ')}}} {what}"
        )
    messages = []
    for turn, message in enumerate(value):
        role = message.get(options.role_key) if isinstance(message, dict) else None
        content = message.get(options.content_key) if isinstance(message, dict) else None
        noun = "turn" if options.sharegpt else "message"
        if not (isinstance(role, str) and isinstance(content, str)):
            raise DataError(
                f"{where}: {noun} {turn} of {field_name} needs text fields {keys}, got {message!r}"
                + _layout_hint(message, options)
            )
        ours = options.roles.get(role, role if not options.sharegpt else None)
        if ours not in ROLES:
            speakers = ", ".join(options.roles) if options.sharegpt else ", ".join(ROLES)
            raise DataError(
                f"{where}: {noun} {turn} of {field_name} is from {role!r}; "
                + (f"ShareGPT speakers are {speakers}" if options.sharegpt else f"roles are {speakers}")
                + f"; map it with data.roles: {{{role}: user}} (or assistant, system)"
            )
        if ours == "assistant" and options.think_blocks == "strip":
            content = THINK.sub("", content)
        messages.append({"role": ours, "content": content})
    return messages


def _layout_hint(message: Any, options: ChatOptions) -> str:
    if not options.sharegpt and isinstance(message, dict) and "from" in message and "value" in message:
        return "; these are ShareGPT turns: set data.format: sharegpt"
    if isinstance(message, dict) and message:
        return f"; if its keys are named otherwise, map them: data.columns: {{role: ..., content: ...}} (it has {', '.join(map(shown, message))})"
    return ""


# --------------------------------------------------------------------------------------------
# The template's end-of-turn marker
# --------------------------------------------------------------------------------------------


def end_of_turn(tokenizer: PreTrainedTokenizerBase) -> str:
    """What the chat template writes right after an assistant message, read from the template:
    the text common to a conversation that ends with the message and one where a user turn
    follows it (``<|eot_id|>``, ``<|im_end|>\\n``, ``</s>``). Empty when the template writes
    nothing there or cannot render the probe."""
    return _end_of_turn(tokenizer.chat_template, tokenizer.bos_token, tokenizer.eos_token, tokenizer)


@functools.lru_cache(maxsize=8)
def _end_of_turn(template: str | None, bos: str | None, eos: str | None, tokenizer) -> str:
    from jinja2 import TemplateError

    marker = "LIGERTUNEXREPLYX"
    turns = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": marker}]
    try:
        alone = tokenizer.apply_chat_template(turns, tokenize=False)
        followed = tokenizer.apply_chat_template([*turns, {"role": "user", "content": "R"}], tokenize=False)
    except (TemplateError, ValueError, TypeError):
        return ""
    if marker not in alone or marker not in followed:
        return ""
    # Compared token by token: "<|end|>\n<|endoftext|>" and "<|end|>\n<|user|>" share "<|end|>\n",
    # not the "<|" a character comparison would add.
    a, b = (
        tokenizer(text.split(marker, 1)[1], add_special_tokens=False)["input_ids"]
        for text in (alone, followed)
    )
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    return tokenizer.decode(a[:common])


def stop_tokens(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The token ids generation should stop at for a chat model: EOS and the template's
    end-of-turn token (trained in every assistant turn, see the module docstring)."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    marker = end_of_turn(tokenizer).strip()
    if marker:
        encoded = tokenizer(marker, add_special_tokens=False)["input_ids"]
        if len(encoded) == 1 and encoded[0] not in ids:
            ids.append(encoded[0])
    return ids


# --------------------------------------------------------------------------------------------
# Segments
# --------------------------------------------------------------------------------------------


def chat_segments(
    rows: Iterable[tuple[str, dict[str, Any]]],
    tokenizer: PreTrainedTokenizerBase,
    messages_field: str,
    train_on_inputs: bool,
    options: ChatOptions,
) -> list[Segments]:
    """Each row's conversation rendered and split into trained and untrained text (see the
    module docstring); with `train_on_inputs`, the whole conversation trained. `rows` are
    (where the row is, as messages name it; the row)."""
    if tokenizer.chat_template is None:
        raise DataError(
            f"data.format {'sharegpt' if options.sharegpt else 'chat'} needs a chat template, and this "
            "tokenizer has none; set tokenizer.chat_template in the recipe"
        )
    samples = []
    for where, row in rows:
        messages = read_messages(row[messages_field], messages_field, where, options)
        if not train_on_inputs and messages[0]["role"] == "assistant":
            raise DataError(
                f"{where}: the conversation starts with an assistant turn, which has no prompt to be the "
                "answer to; start it with a user or system message, or set data.train_on_inputs: true"
            )
        segments = template_segments(tokenizer, messages, where, train_on_inputs)
        if options.think_blocks == "mask":
            segments = _mask_think(segments)
        samples.append(segments)
    return samples


def template_segments(tokenizer, messages: list[dict], where: str, train_on_inputs: bool) -> Segments:
    """One conversation rendered by the chat template and split into trained and untrained text
    (the module docstring's three ways). Messages whose content is a list of parts (text and
    images, `ligertune.data.vision`) need generation markers or a prefix-stable template: the
    content search looks for text as written."""
    from jinja2 import TemplateError

    try:
        if train_on_inputs:
            return [(_render(tokenizer, messages), True)]
        if "{% generation %}" in tokenizer.chat_template or "{%- generation %}" in tokenizer.chat_template:
            return _marked(tokenizer, messages)
        segments = _by_prefix(tokenizer, messages)
        if segments is not None:
            return segments
        if any(not isinstance(m["content"], str) for m in messages):
            raise DataError(
                f"{where}: the chat template renders earlier turns differently once later ones are added, "
                "so the assistant turns of a conversation with images cannot be found; use a template with "
                "{% generation %} markers (tokenizer.chat_template)"
            )
        return _by_content(tokenizer, messages, where)
    except DataError:
        raise
    except (TemplateError, ValueError) as e:  # the template's own raise_exception, or transformers'
        raise DataError(f"{where}: the chat template rejected the conversation: {e}") from None


def _render(
    tokenizer, messages: list[dict], generation_prompt: bool = False, template: str | None = None
) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt, chat_template=template
    )


def _by_prefix(tokenizer, messages: list[dict]) -> Segments | None:
    """Segments from prefix renderings, or None when the template is not prefix-stable here."""
    segments: Segments = []
    done = ""
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt, full = _render(tokenizer, messages[:turn], True), _render(tokenizer, messages[: turn + 1])
        if not (prompt.startswith(done) and full.startswith(prompt)):
            return None
        segments += [(prompt[len(done) :], False), (full[len(prompt) :], True)]
        done = full
    rest = _render(tokenizer, messages)
    if not rest.startswith(done):
        return None
    return segments + ([(rest[len(done) :], False)] if rest[len(done) :] else [])


def _by_content(tokenizer, messages: list[dict], where: str) -> Segments:
    """Segments from one rendering, each assistant message found by its content."""
    text, eot = _render(tokenizer, messages), end_of_turn(tokenizer)
    spans, position = [], 0
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        content = message["content"]
        for candidate in dict.fromkeys([content, content.strip(), THINK.sub("", content).strip()]):
            start = text.find(candidate, position) if candidate else -1
            if start >= 0:
                break
        else:
            raise DataError(
                f"{where}: assistant message {turn} does not appear in what the chat template renders, so it "
                "cannot be masked for the loss; set tokenizer.chat_template to a template that writes it, or "
                "data.train_on_inputs: true"
            )
        end = start + len(candidate)
        if "<think>" in text[position:start]:  # the turn's reasoning block, as the template wrote it
            start = text.rindex("<think>", position, start)
        if eot and text.startswith(eot, end):
            end += len(eot)
        spans.append((start, end))
        position = end
    return _split(text, spans)


def _marked(tokenizer, messages: list[dict]) -> Segments:
    """Segments from the template's own ``{% generation %}`` markers, each span extended by the
    end-of-turn marker when the template left it outside."""
    template = re.sub(r"\{%-?\s*generation\s*-?%\}", "{{- '" + _OPEN + "' -}}", tokenizer.chat_template)
    template = re.sub(r"\{%-?\s*endgeneration\s*-?%\}", "{{- '" + _CLOSE + "' -}}", template)
    text = _render(tokenizer, messages, template=template)
    spans, plain, position = [], [], 0
    for piece in re.split(f"({re.escape(_OPEN)}|{re.escape(_CLOSE)})", text):
        if piece == _OPEN:
            start = position
        elif piece == _CLOSE:
            spans.append((start, position))
        else:
            plain.append(piece)
            position += len(piece)
    text, eot = "".join(plain), end_of_turn(tokenizer)
    spans = [
        (s, e + len(eot) if eot and not text[s:e].endswith(eot) and text.startswith(eot, e) else e)
        for s, e in spans
    ]
    return _split(text, spans)


def _split(text: str, spans: list[tuple[int, int]]) -> Segments:
    segments: Segments = []
    position = 0
    for start, end in spans:
        if start > position:
            segments.append((text[position:start], False))
        segments.append((text[start:end], True))
        position = end
    if position < len(text):
        segments.append((text[position:], False))
    return segments


def _mask_think(segments: Segments) -> Segments:
    """``think_blocks: mask``: the reasoning inside trained segments becomes untrained text."""
    out: Segments = []
    for text, trained in segments:
        if not trained:
            out.append((text, False))
            continue
        position = 0
        for match in THINK.finditer(text):
            if match.start() > position:
                out.append((text[position : match.start()], True))
            out.append((match.group(), False))
            position = match.end()
        if position < len(text):
            out.append((text[position:], True))
    return out
