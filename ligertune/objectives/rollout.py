"""Generation in the loop: completions sampled from the policy itself with a KV cache, and the
rows the policy loss trains on.

`generate` is a plain batched sampler over the model's own forward (so every patched kernel, a
LoRA adapter and the strategy's gathered weights are what samples): one prefill over the
left-padded prompts, then one forward of the newest token per step, reading and extending a
transformers KV cache: dynamic (`DynamicDecoder`), or static with each token's step a CUDA graph
on a GPU (`StaticDecoder`); the logits of the last position only (``logits_to_keep=1``). Per token:
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
that a token boundary splits is found too. Whether every row is done is asked every
`DONE_CHECK_EVERY` tokens (one host synchronisation each; every token with stop strings, whose
check is on the host anyway), and the completions are cut to the longest afterwards.

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
from transformers import StaticCache

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


# How often the loop asks the device whether every row is done (one host synchronisation): every
# token when stop strings are looked for (their check is on the host anyway), else every this many.
# A row that is done only adds padding outside its mask, so asking later changes no output: the
# completions are trimmed to their longest afterwards.
DONE_CHECK_EVERY = 16


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
    cache: str = "dynamic",
) -> Completions:
    """Sample completions of the left-padded prompts [R, P] (module docstring); `noise()` gives each
    token's uniform draws [R] (`RowNoise`), `tokenizer` decodes for the stop strings. `cache`:
    ``dynamic`` (`DynamicDecoder`) or ``static`` (`StaticDecoder`, under CUDA graphs on a GPU):
    the same completions either way, up to the last bits of the logits."""
    decoder_class = StaticDecoder if cache == "static" else DynamicDecoder
    decoder = decoder_class(model, input_ids, attention_mask, sampling)
    rows = input_ids.shape[0]
    done = torch.zeros(rows, dtype=torch.bool, device=input_ids.device)
    stopped = torch.zeros_like(done)
    every = 1 if sampling.stop else DONE_CHECK_EVERY
    tokens, masks = [], []
    token = decoder.first(noise())
    for step in range(sampling.max_new_tokens):
        if step:
            token = decoder.next(token, noise())
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
        if (step + 1) % every == 0 and bool(done.all()):
            break
    mask = torch.stack(masks, 1)
    # The columns after every row ended (asked every few tokens only) hold padding alone: cut them.
    length = int(mask.any(0).sum())  # every mask is a prefix, the first token always in
    return Completions(torch.stack(tokens, 1)[:, :length], mask[:, :length], stopped)


class DynamicDecoder:
    """The decode with transformers' dynamic KV cache: the cache, the attention mask and the
    positions grow by one column per token (a ``torch.cat`` each). Shapes change every token, so
    nothing can be captured: each token costs the forward's kernel launches from Python (on a GPU
    the decode is bound by them, not by the weights' reads). It works with anything that runs the
    model's forward, FSDP2's gathered weights included, and is what the CPU runs by default."""

    def __init__(
        self, model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, sampling: Sampling
    ):
        self.model, self.sampling, self.input_ids = model, sampling, input_ids
        self.mask = attention_mask
        self.positions = (attention_mask.cumsum(-1) - 1).clamp_min(0)
        self.past = None

    def first(self, uniform: torch.Tensor) -> torch.Tensor:
        """The prefill over the prompts, and the first token."""
        out = self.model(
            input_ids=self.input_ids,
            attention_mask=self.mask,
            position_ids=self.positions,
            use_cache=True,
            logits_to_keep=1,
        )
        self.past, self.positions = out.past_key_values, self.positions[:, -1:]
        return sample_next(out.logits[:, -1], self.sampling, uniform)

    def next(self, token: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
        """The forward of the newest token [R] and the token after it."""
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        self.positions = self.positions + 1
        out = self.model(
            input_ids=token[:, None],
            attention_mask=self.mask,
            position_ids=self.positions,
            past_key_values=self.past,
            use_cache=True,
            logits_to_keep=1,
        )
        self.past = out.past_key_values
        return sample_next(out.logits[:, -1], self.sampling, uniform)


class StaticDecoder:
    """The decode with every shape fixed, so that on a GPU one token's step is a CUDA graph: a
    launch of the whole forward and sampler instead of a few hundred kernels from Python (the
    dynamic decode of a 1.5B model at 64 rows spent ~36 ms a token on launches, its weights'
    reads ~1.5 ms).

    - The KV cache is transformers' `StaticCache`, allocated for the whole batch at prompt length
      + max_new_tokens; each forward writes its keys at the cache's own position counter (a
      device tensor), so the step reads no Python state that changes between tokens.
    - The attention mask is a preallocated [R, P + T] tensor: the prompts' columns, then zeros;
      each step sets its column to one in place (the column index and the positions are device
      tensors counted up inside the step). Every query attends over all P + T keys, the empty
      ones masked: more reads than the dynamic cache early on, the same at the end.
    - The step (forward of one token + `sample_next`) reads its token and its uniform draws from
      fixed buffers: the draws are made outside, by `RowNoise`, as in the dynamic decode, so
      the completions are the same.

    On CUDA the first decode step runs eagerly on a side stream (the warm-up a capture needs: lazy
    cuBLAS and Triton initialisation), the second is captured into a `torch.cuda.CUDAGraph`, and
    every later one replays it. The graph is captured again for every call (every generation
    batch): its cache, mask and prompt length are that batch's, and keeping them between batches
    would hold the KV cache through the training step. A capture costs about one eager forward;
    a batch of 256 tokens replays it 254 times. Why not ``torch.compile(mode="reduce-overhead")``:
    the prompt length changes with every window, and each new shape would recompile (or fall back
    once the recompile limit is reached); the capture has no such limit and nothing to trace.
    On the CPU the same fixed-shape step runs eagerly (what the tests compare with the dynamic
    decode). The forward must not synchronise with the host (no ``.item()``, no data-dependent
    branch): our kernels are custom ops that launch without one, and so are transformers'
    static-cache paths (mask creation skips its ``is_causal`` probe for a compileable cache).
    Under ``bf16-mixed`` the graph reads the weights' bf16 copies that autocast cached in the
    warm-up step: they live until the autocast region ends, and the whole generation runs inside
    one (`ligertune.training.windows`), so they outlive every replay."""

    def __init__(
        self, model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, sampling: Sampling
    ):
        rows, prompt = input_ids.shape
        length = prompt + sampling.max_new_tokens
        self.model, self.sampling, self.input_ids = model, sampling, input_ids
        self.cache = StaticCache(config=model.config, max_cache_len=length)
        self.mask = attention_mask.new_zeros(rows, length)
        self.mask[:, :prompt] = attention_mask
        positions = (attention_mask.cumsum(-1) - 1).clamp_min(0)
        self.prefill_positions = positions
        self.position = positions[:, -1:].clone()  # the newest token's, counted up by the step
        self.column = torch.full((1,), prompt - 1, dtype=torch.int64, device=input_ids.device)
        self.token = torch.zeros(rows, dtype=torch.int64, device=input_ids.device)
        self.uniform = torch.zeros(rows, dtype=torch.float32, device=input_ids.device)
        self.graphs = input_ids.device.type == "cuda"
        self.graph, self.out, self.warm = None, None, False

    def first(self, uniform: torch.Tensor) -> torch.Tensor:
        """The prefill (eager: its shape is the prompts'), filling the cache's first P columns."""
        out = self.model(
            input_ids=self.input_ids,
            attention_mask=self.mask,
            position_ids=self.prefill_positions,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return sample_next(out.logits[:, -1], self.sampling, uniform)

    def next(self, token: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
        """The step of the newest token [R]: eagerly, or as a replay of the captured graph."""
        self.token.copy_(token)
        self.uniform.copy_(uniform)
        if not self.graphs:
            return self._step()
        if not self.warm:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                out = self._step()
            torch.cuda.current_stream().wait_stream(stream)
            self.warm = True
            return out
        if self.graph is None:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.out = self._step()
        self.graph.replay()
        return self.out.clone()  # the graph's output buffer is overwritten by the next replay

    def _step(self) -> torch.Tensor:
        """One token's forward and draw, every shape fixed and every changing value on the device."""
        self.column.add_(1)
        self.position.add_(1)
        self.mask.index_fill_(1, self.column, 1)
        out = self.model(
            input_ids=self.token[:, None],
            attention_mask=self.mask,
            position_ids=self.position,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return sample_next(out.logits[:, -1], self.sampling, self.uniform)


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
