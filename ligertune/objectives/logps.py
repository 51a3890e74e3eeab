"""Per-sequence log-probs of the label tokens, from the policy (with gradients) and from frozen
models (reference, teacher), for the preference and distillation objectives.

    log π(y | x) = Σ_t log softmax(z_t)[y_t+1]     over the sequence's label tokens (labels ≠ −100)

Two paths, chosen once per model when the objective is built:

- *fused* (``kernels.fused_linear_cross_entropy`` patched in, the default): the model's forward
  gets ``lm_head_loss_fn`` (`ligertune.patching.losses.LM_HEAD_LOSS_FN`), so the lm_head module
  computes per-token log-probs with `ligertune.kernels.fused_linear_logprobs` inside its own call
  (DDP, and the gathers of sharded strategies, see the same call as for the plain loss), and the
  [tokens × vocab] logits never exist. A LoRA adapter on the lm_head is handled as for SFT.
  A loss that is a sum over pairs of rows, each term reading only its pair's log-probs (DPO,
  ORPO, SimPO), goes one step further with `pair_sequence_loss`: the same call evaluates the
  loss per chunk of pairs and computes its gradient in the same pass (three lm_head matmuls
  instead of four: the backward needs no logits again).
- *materialised* (kernels off, or an lm_head the kernel cannot compute): the HF forward's
  logits, ``log_softmax`` in fp32 and a gather: what TRL computes.

Frozen models take the same two paths through their own forward: they are patched with the
recipe's kernels and placed by the strategy like the policy (a plain replica, or sharded under
FSDP2 and ZeRO-3, see `ligertune.objectives.reference.build_frozen`), so their lm_head weight is
gathered by the same hooks around the same module call; only the gradients are missing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ligertune.data.formats import IGNORE_INDEX
from ligertune.kernels.fused_linear_logprobs import GroupedLogprobs, GroupLoss, fused_linear_logprobs
from ligertune.objectives.base import Batch
from ligertune.patching.common import MARK
from ligertune.patching.losses import LM_HEAD_LOSS_FN, fused_head

MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids")


def model_inputs(batch: Batch) -> dict[str, torch.Tensor]:
    return {k: batch[k] for k in MODEL_INPUTS if k in batch}


def shifted_targets(labels: torch.Tensor) -> torch.Tensor:
    """[R, S] next-token targets: position t is scored against labels[t + 1]; the last gets −100."""
    return nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def label_tokens(labels: torch.Tensor) -> torch.Tensor:
    """[R] label tokens per row (the targets that count), on the labels' device."""
    return (shifted_targets(labels) != IGNORE_INDEX).sum(-1)


def lm_head_is_fused(model: nn.Module) -> bool:
    """Whether the model's causal LM runs our fused linear cross entropy with an lm_head the
    kernel can compute (so `LM_HEAD_LOSS_FN` works)."""
    for module in model.modules():
        if module.__dict__.get(MARK) == "fused_linear_cross_entropy" and hasattr(module, "lm_head"):
            return fused_head(module.lm_head)[0] is not None
    return False


def _token_logps(hidden, weight, target, bias=None, *, ignore_index=IGNORE_INDEX, softcap=None, **_):
    """`LM_HEAD_LOSS_FN` for the policy: per-token log-probs [N], 0 on ignored targets."""
    return fused_linear_logprobs(hidden, weight, target, bias, ignore_index=ignore_index, softcap=softcap)


def logps_from_logits(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[R, S] per-token log-probs from materialised logits [R, S, V] (fp32), 0 on ignored targets."""
    valid = target != IGNORE_INDEX
    logp = logits.float().log_softmax(-1).gather(-1, torch.where(valid, target, 0)[..., None])[..., 0]
    return torch.where(valid, logp, 0.0)


def sequence_logps(model: nn.Module, batch: Batch, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ log-probs, label tokens) of every row of the batch, fp32 [R] each, through the model's
    own forward (so the strategy's wrapper sees it)."""
    labels = batch["labels"]
    target = shifted_targets(labels)
    if fused:
        out = model(**model_inputs(batch), labels=labels, **{LM_HEAD_LOSS_FN: _token_logps})
        token = out.loss.view(target.shape)
    else:
        token = logps_from_logits(model(**model_inputs(batch)).logits, target)
    return token.sum(-1), label_tokens(labels)


def completion_positions(batch: Batch) -> tuple[slice, torch.Tensor]:
    """(the positions whose hidden states predict the completion tokens, their targets [R, T]) of
    a batch of prompt + completion rows (`ligertune.objectives.rollout`): the completion is the
    last T = ``completion_mask.shape[1]`` positions, so positions S − T − 1 … S − 2 predict it,
    and a padded completion token's target is −100."""
    mask = batch["completion_mask"]
    seq, length = batch["input_ids"].shape[1], mask.shape[1]
    targets = torch.where(mask, batch["input_ids"][:, seq - length :], IGNORE_INDEX)
    return slice(seq - length - 1, seq - 1), targets


def completion_forward(model: nn.Module, batch: Batch, head: Callable):
    """The model's forward over prompt + completion rows with `head` (`LM_HEAD_LOSS_FN`) run on the
    completion positions only (``logits_to_keep``; their targets as ``shift_labels``), inside the
    lm_head's call: the prompt's positions never reach the lm_head."""
    keep, targets = completion_positions(batch)
    return model(
        **model_inputs(batch),
        labels=targets,
        shift_labels=targets,
        logits_to_keep=keep,
        **{LM_HEAD_LOSS_FN: head},
    )


def completion_logps(model: nn.Module, batch: Batch, fused: bool) -> torch.Tensor:
    """[R, T] fp32 log-probs of the completion tokens (0 on padding), through the model's own
    forward: fused, or from the completion positions' materialised logits."""
    keep, targets = completion_positions(batch)
    if fused:
        return completion_forward(model, batch, _token_logps).loss.view(targets.shape)
    return logps_from_logits(model(**model_inputs(batch), logits_to_keep=keep).logits, targets)


def pair_sequence_loss(model: nn.Module, batch: Batch, loss: Callable) -> GroupedLogprobs:
    """The fused path's forward of a loss of pairs of rows, row i and row i + R/2 (chosen and
    rejected), each pair's term reading only its own rows' log-probs. `loss` is `GroupLoss.fn`:
    called per chunk of pairs with their rows' Σ log-probs [2, g] and the chunk's slice of pair
    indices, inside the lm_head's call (the weight gathered, as for the per-token path), and
    differentiated there, so whatever else it reads must be known before the forward (the
    reference's log-probs). Returns `GroupedLogprobs` whose ``loss`` is the model output's: the
    tensor a wrapper (DDP) hands back, which the backward must start from."""
    labels = batch["labels"]
    spec = GroupLoss(loss, rows=labels.shape[0], size=2)
    found = {}

    def head(hidden, weight, target, bias=None, *, ignore_index=IGNORE_INDEX, softcap=None, **_):
        found["out"] = fused_linear_logprobs(
            hidden, weight, target, bias, ignore_index=ignore_index, softcap=softcap, group_loss=spec
        )
        return found["out"].loss

    out = model(**model_inputs(batch), labels=labels, **{LM_HEAD_LOSS_FN: head})
    return found["out"]._replace(loss=out.loss)
