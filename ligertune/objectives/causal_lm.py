"""``sft``: next-token cross entropy on the label tokens, through the model's own causal-LM loss.

The model's forward computes the loss (Hugging Face's ``ForCausalLMLoss``, or our fused linear
cross entropy when that kernel is patched in, which never materialises the logits). Both take
``num_items_in_batch=N`` and return the micro-batch's summed token loss divided by N, the
objective's contract. Labels are counted the way the loss counts them: shifted by one
(position t predicts token t+1), without the ignore index −100.
"""

from __future__ import annotations

import torch
from torch import nn

from ligertune.catalog.objectives.sft import SFTOptions
from ligertune.data.formats import IGNORE_INDEX
from ligertune.objectives.base import Batch, Objective, ObjectiveOutput

# The last three are a vision-language model's (ligertune.data.vision): its images and which
# tokens are image tokens (from which it computes its 3-D rotary positions).
MODEL_INPUTS = (
    "input_ids",
    "labels",
    "position_ids",
    "attention_mask",
    "pixel_values",
    "image_grid_thw",
    "mm_token_type_ids",
)


def count_label_tokens(labels: torch.Tensor) -> int:
    """Tokens the causal-LM loss is computed on: labels shifted by one, minus ignored ones."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


class CausalLM(Objective):
    options_model = SFTOptions

    def count(self, batch: Batch) -> int:
        return count_label_tokens(batch["labels"])

    def __call__(self, model: nn.Module, batch: Batch, num_items: torch.Tensor) -> ObjectiveOutput:
        inputs = {k: batch[k] for k in MODEL_INPUTS if k in batch}
        return ObjectiveOutput(model(**inputs, num_items_in_batch=num_items).loss)
