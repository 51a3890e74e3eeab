"""Generation in the loop: completions sampled from the policy itself with a KV cache, and the
rows the policy loss trains on.

`generate` is a plain batched sampler over the model's own forward (so every patched kernel, a
LoRA adapter and the strategy's gathered weights are what samples): one prefill over the
left-padded prompts, then one forward of the newest token per step, reading and extending the
transformers KV cache; the logits of the last position only (``logits_to_keep=1``). Per token:
temperature, then nucleus (top-p: the smallest set of tokens holding ``top_p`` of the mass,
renormalised), then one draw by the inverse of the cumulative distribution at a uniform number.

A window's micro-batches are generated as one batch (the decode is bound by the weights' reads and
the kernel launches, not by the rows), and each row's uniform numbers come from the generator of
its micro-batch (`RowNoise`), seeded by (seed, generation, the micro-batch's place in the data
order). Why not ``model.generate``: its draws come from the global random state, for the whole
batch at once. Here a resumed run draws exactly the completions an uninterrupted one draws
without saving any random state, and a prompt's completions do not depend on what is generated
beside it nor on the number of processes (up to the last bits of the logits, which the batch's
padding can move); and generate's per-call setup (stopping criteria, logits processors, cache
class choices) is none of this needs.

A completion ends with the tokenizer's EOS or with the token that completes one of the stop
strings (both kept in the completion, and trained on: stopping is an action); later tokens are
padding outside its mask. Stop strings are looked for in the decoded text of a row's last tokens
(as many as the longest stop string has characters: a token is at least one), so a stop string
that a token boundary splits is found too. Each step asks once whether every row is done (one
host synchronisation per token, as ``generate`` has).

The rows (`completion_rows`): each prompt repeated G times (its group, consecutive rows),
followed by its completion, ``[prompt (left-padded to P) | completion (right-padded to T)]``, with
the attention mask of both, position ids counting real tokens (as in generation, so RoPE sees the
same positions), labels on the completion tokens only, and ``completion_mask`` [R, T], from which
the loss finds the completion positions (`ligertune.objectives.logps.completion_positions`).
`split_rows` cuts a window's generation back into its micro-batches, each trimmed to its own
longest prompt and completion.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ligertune.data.formats import IGNORE_INDEX


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()


@dataclass
class Completions:
    ids: torch.Tensor  # [R, T] int64: the generated tokens, padding after the end
    mask: torch.Tensor  # [R, T] bool: the completion's tokens (its stop token included)
    stopped: torch.Tensor  # [R] bool: ended by EOS or a stop string (else cut at max_new_tokens)


def generator_seed(seed: int, generation: int, place: int) -> int:
    """The seed of generation batch `generation`'s micro-batch at `place` in the data order:
    independent streams from the recipe's seed (numpy's SeedSequence mixing), the same on a
    resume and whatever the number of processes."""
    return int(np.random.SeedSequence([seed, generation, place]).generate_state(1, np.uint64)[0] >> 1)


class RowNoise:
    """The uniform draws of a generation batch made of several micro-batches: one generator per
    micro-batch, seeded by its place in the data order (`generator_seed`), drawing one number per
    row of it per token. A row's draws then depend on its micro-batch alone, not on what else is
    generated with it, nor on how many processes share the window."""

    def __init__(self, seeds: list[int], rows: list[int], device: torch.device):
        self.generators = [torch.Generator(device).manual_seed(seed) for seed in seeds]
        self.rows, self.device = rows, device

    def __call__(self) -> torch.Tensor:
        draws = [
            torch.rand(n, generator=g, device=self.device)
            for g, n in zip(self.generators, self.rows, strict=True)
        ]
        return torch.cat(draws)


def sample_next(logits: torch.Tensor, sampling: Sampling, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row [B] from the last position's logits [B, V] and one uniform draw per row
    [B] (module docstring): the token where the cumulative distribution passes the draw."""
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # A token stays when the mass before it is below top_p (the first always does).
        outside = sorted_probs.cumsum(-1) - sorted_probs >= sampling.top_p
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    cdf = probs.cumsum(-1)
    token = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True)[:, 0]
    return token.clamp_max(probs.shape[-1] - 1)


def _stop_hits(tokenizer, ids: torch.Tensor, rows: list[int], stop: tuple[str, ...]) -> list[int]:
    """The rows among `rows` whose newest token completes one of the `stop` strings."""
    width = max(len(s) for s in stop)
    tails = ids[rows, -width:].tolist()
    # Any occurrence in the tail is new: an earlier one would have ended the row when it appeared.
    return [
        row for row, tail in zip(rows, tails, strict=True) if any(s in tokenizer.decode(tail) for s in stop)
    ]


@torch.no_grad()
def generate(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    sampling: Sampling,
    noise: Callable[[], torch.Tensor],
    *,
    eos_token_id: int | None,
    pad_token_id: int,
    tokenizer=None,
) -> Completions:
    """Sample completions of the left-padded prompts [R, P] (module docstring); `noise()` gives each
    token's uniform draws [R] (`RowNoise`), `tokenizer` decodes for the stop strings."""
    rows = input_ids.shape[0]
    device = input_ids.device
    positions = (attention_mask.cumsum(-1) - 1).clamp_min(0)
    done = torch.zeros(rows, dtype=torch.bool, device=device)
    stopped = torch.zeros(rows, dtype=torch.bool, device=device)
    tokens, masks = [], []
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=positions,
        use_cache=True,
        logits_to_keep=1,
    )
    last = positions[:, -1:]
    for _ in range(sampling.max_new_tokens):
        token = sample_next(out.logits[:, -1], sampling, noise())
        token = torch.where(done, pad_token_id, token)
        masks.append(~done)
        tokens.append(token)
        ended = ~done & (token == eos_token_id) if eos_token_id is not None else torch.zeros_like(done)
        if sampling.stop:
            live = (~done & ~ended).nonzero()[:, 0].tolist()
            hits = _stop_hits(tokenizer, torch.stack(tokens, 1), live, sampling.stop) if live else []
            ended[hits] = True
        stopped |= ended
        done |= ended
        if bool(done.all()):
            break
        attention_mask = torch.cat([attention_mask, torch.ones_like(attention_mask[:, :1])], dim=1)
        last = last + 1
        out = model(
            input_ids=token[:, None],
            attention_mask=attention_mask,
            position_ids=last,
            past_key_values=out.past_key_values,
            use_cache=True,
            logits_to_keep=1,
        )
    return Completions(torch.stack(tokens, 1), torch.stack(masks, 1), stopped)


def split_rows(ids: torch.Tensor, mask: torch.Tensor, done: Completions, rows: list[int]) -> list[tuple]:
    """A generation batch's prompts [R, P], their mask and completions, cut into the micro-batches
    of `rows` rows each, every one trimmed to its own longest prompt and completion (the columns
    its rows all leave empty dropped): what generating each micro-batch alone would give."""
    parts = []
    for part_ids, part_mask, ids_done, mask_done, stopped in zip(
        *(x.split(rows) for x in (ids, mask, done.ids, done.mask, done.stopped)), strict=True
    ):
        first = int(part_mask.any(0).int().argmax())  # the first column a prompt of the part reaches
        length = int(mask_done.any(0).sum())  # every mask is a prefix, the first token always in
        completed = Completions(ids_done[:, :length], mask_done[:, :length], stopped)
        parts.append((part_ids[:, first:], part_mask[:, first:], completed))
    return parts


def completion_rows(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, done: Completions
) -> dict[str, torch.Tensor]:
    """The training rows of prompts [R, P] (already repeated per completion) and their
    completions (module docstring): input_ids, attention_mask, position_ids, labels [R, P + T],
    completion_mask [R, T]."""
    mask = torch.cat([prompt_mask, done.mask.to(prompt_mask.dtype)], dim=1)
    return {
        "input_ids": torch.cat([prompt_ids, done.ids], dim=1),
        "attention_mask": mask,
        "position_ids": (mask.cumsum(-1) - 1).clamp_min(0),
        "labels": torch.cat(
            [torch.full_like(prompt_ids, IGNORE_INDEX), torch.where(done.mask, done.ids, IGNORE_INDEX)], dim=1
        ),
        "completion_mask": done.mask,
    }
