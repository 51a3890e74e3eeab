"""``sft``: next-token cross entropy on the label tokens, through the model's own causal-LM loss.

The model's forward computes the loss (Hugging Face's ``ForCausalLMLoss``, or our fused linear
cross entropy when that kernel is patched in, which never materialises the logits). Both take
``num_items_in_batch=N`` and return the micro-batch's summed token loss divided by N, the
objective's contract. Labels are counted the way the loss counts them: shifted by one
(position t predicts token t+1), without the ignore index −100.

**Mixture of experts.** With the router's outputs on (``model.router_aux_loss``, on by default),
the model's forward adds ``coef · aux`` (the load-balancing loss, `ligertune.patching.losses`)
once per forward, as transformers does, to a loss that is a share of the window's. This
objective reweights it to ``coef · aux · n / N`` (n: the micro-batch's label tokens, N: the
window's over every rank), so that

    loss = Σ token losses / N  +  coef · aux · n / N

- one micro-batch on one process (n = N): exactly HF's loss and gradients;
- over a window: the backward passes add up to the token-weighted mean of the micro-batches'
  balancing losses, the weighting the token loss gets, where HF's per-forward term would weigh
  M·R times more under M micro-batches on R ranks;
- the same whether the forward is ours (the fused linear cross entropy) or HF's (kernels off);
- in evaluation (eval mode, N = 1: plain sums) the term is taken out: the validation loss is the
  token loss alone.

It also adds three metrics (`router_metrics`): ``aux_loss``, the balancing loss before its
coefficient, and the expert load, tokens per expert of each MoE layer as max / mean (1 is
perfectly balanced, E/k the worst: every token on the same k experts), as ``expert_load_max``
(the worst layer) and ``expert_load_mean`` (the layers' mean). Each is weighted by n / N, so the
logged value is the window's token-weighted mean; everything stays on the device until the
step's one host synchronisation.

A family that balances without a loss (DeepSeek-V3: its router moves a score bias between
steps, transformers computes no aux_loss) logs the expert load alone, and reads it from the
experts each token was actually sent to (`ChosenExperts`): its group-limited choice on
bias-corrected scores is not the top k of its logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ligertune.catalog.families import FAMILIES
from ligertune.catalog.objectives.base import ObjectiveOptions
from ligertune.catalog.objectives.sft import SFTOptions
from ligertune.data.formats import IGNORE_INDEX
from ligertune.objectives.base import Batch, Building, Objective, ObjectiveOutput
from ligertune.patching.common import instances

# The last seven are a vision-language model's (ligertune.data.vision): its images and which
# tokens are image tokens (Qwen-VL computes its 3-D rotary positions from mm_token_type_ids,
# Gemma 3 its bidirectional attention over an image's tokens from token_type_ids); Llama 3.2
# Vision's tiles (aspect_ratio_ids, aspect_ratio_mask) and which text tokens see which images
# (cross_attention_mask).
MODEL_INPUTS = (
    "input_ids",
    "labels",
    "shift_labels",  # a context-parallel shard's targets, shifted before the split
    "position_ids",
    "attention_mask",
    "pixel_values",
    "image_grid_thw",
    "mm_token_type_ids",
    "token_type_ids",
    "aspect_ratio_ids",
    "aspect_ratio_mask",
    "cross_attention_mask",
)


def count_label_tokens(batch: Batch) -> int:
    """Tokens the causal-LM loss is computed on: labels shifted by one (or ``shift_labels``, a
    context-parallel shard's targets, shifted before the split), minus ignored ones."""
    targets = batch["shift_labels"] if "shift_labels" in batch else batch["labels"][:, 1:]
    return int((targets != IGNORE_INDEX).sum())


@dataclass(frozen=True)
class Router:
    """What the objective needs of a mixture-of-experts policy: experts per token and the
    balancing loss's coefficient."""

    top_k: int
    aux_loss_coef: float


def _family_of(model: nn.Module | None):
    """The model's config and its family table row (None for a family the table lacks)."""
    config = getattr(model, "config", None)
    return config, FAMILIES.get(getattr(config, "model_type", None))


def router_of(model: nn.Module | None) -> Router | None:
    """The `Router` of a mixture-of-experts model of the family table with a balancing loss, or
    None (dense, unknown, or balanced without a loss: DeepSeek-V3, whose forward returns none)."""
    config, family = _family_of(model)
    if family is None or not family.balancing_loss:
        return None
    experts = family.experts
    return Router(getattr(config, experts.top_k_attr), getattr(config, experts.aux_loss_coef_attr))


def layer_load(indices: torch.Tensor, experts: int, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """One MoE layer's expert load (module docstring) from its [tokens, k] chosen experts. Token
    counts use ``scatter_add`` into a fixed [experts] vector: ``bincount`` would read its size
    back from the GPU."""
    top_k = indices.shape[-1]
    flat = indices.reshape(-1)
    weight = torch.ones_like(flat, dtype=torch.float32)
    if attention_mask is not None:  # padding tokens route too, but are not the data's load
        weight = attention_mask.reshape(-1, 1).expand(-1, top_k).reshape(-1).float()
    counts = torch.zeros(experts, device=flat.device).scatter_add_(0, flat, weight)
    return counts.max() / counts.mean().clamp(min=1e-9)


def router_metrics(output, top_k: int, attention_mask: torch.Tensor | None, share: torch.Tensor) -> dict:
    """The balancing loss and the expert load of one forward (module docstring), times `share`.
    Every family with a balancing loss routes each token to the k largest logits (a softmax
    first keeps the order)."""
    experts = output.router_logits[0].shape[-1]
    loads = torch.stack(
        [layer_load(logits.topk(top_k, dim=-1).indices, experts, attention_mask) for logits in output.router_logits]
    )
    return {
        "aux_loss": output.aux_loss.detach().float() * share,
        "expert_load_max": loads.max() * share,
        "expert_load_mean": loads.mean() * share,
    }


class ChosenExperts:
    """The load of the experts each token was sent to in one forward, over the MoE layers, as
    the routed-experts modules receive them: a forward pre-hook on each reads its ``[tokens, k]``
    indices (the family table's experts contract, ``(hidden, top_k_index, top_k_weights)``, the
    same for our kernel and transformers' experts) and folds that layer's load into a running
    maximum and sum. `start` resets them before each forward: a checkpointed layer's
    recomputation in backward calls the hooks again, into totals the next forward resets.

    No list of the layers' indices is kept: under ``training.compile`` the hook is traced into
    each layer's graph, and a list the graph appends to is guarded on its length, which compiles
    the layer again for every MoE layer (past dynamo's recompile limit the rest run eagerly). The
    two totals are tensors, rebound rather than changed in place, so the graph is guarded on
    their shapes only."""

    def __init__(self, model: nn.Module, family):
        self.experts = getattr(model.config, family.experts.num_experts_attr)
        modules = [module for _, module in instances(model, family.resolve(family.experts.experts))]
        self.layers = len(modules)
        for module in modules:
            module.register_forward_pre_hook(self._record)
        self.start(None, torch.device("cpu"))

    def _record(self, module: nn.Module, args: tuple) -> None:
        load = layer_load(args[1].detach(), self.experts, self.attention_mask)
        self.load_max = torch.maximum(self.load_max, load)
        self.load_sum = self.load_sum + load

    def start(self, attention_mask: torch.Tensor | None, device: torch.device) -> None:
        self.attention_mask = attention_mask
        self.load_max = torch.zeros((), device=device)  # a layer's load is at least 1
        self.load_sum = torch.zeros((), device=device)


def chosen_experts_of(model: nn.Module | None) -> ChosenExperts | None:
    """A `ChosenExperts` record for a mixture-of-experts model of the family table that balances
    without a loss (DeepSeek-V3), or None (also when every layer is dense: no load to log)."""
    _, family = _family_of(model)
    if family is None or family.experts is None or family.balancing_loss:
        return None
    record = ChosenExperts(model, family)
    return record if record.layers else None


class CausalLM(Objective):
    options_model = SFTOptions

    def __init__(self, router: Router | None = None, chosen: ChosenExperts | None = None):
        self.router = router  # a mixture-of-experts policy's (module docstring)
        self.chosen = chosen  # one without a balancing loss

    @classmethod
    def build(cls, options: ObjectiveOptions, building: Building) -> CausalLM:
        return cls(router_of(building.policy), chosen_experts_of(building.policy))

    def count(self, batch: Batch) -> int:
        return count_label_tokens(batch)

    def __call__(self, model: nn.Module, batch: Batch, num_items: torch.Tensor) -> ObjectiveOutput:
        inputs = {k: batch[k] for k in MODEL_INPUTS if k in batch}
        if self.chosen is not None:
            self.chosen.start(batch.get("attention_mask"), batch["labels"].device)
        output = model(**inputs, num_items_in_batch=num_items)
        loss, metrics = output.loss, {}
        aux = getattr(output, "aux_loss", None)
        balanced = self.router is not None and aux is not None
        recorded = self.chosen is not None and model.training
        if not (balanced or recorded):  # a dense model: nothing more to compute
            return ObjectiveOutput(loss, metrics)
        share = (batch["labels"][:, 1:] != IGNORE_INDEX).sum() / num_items
        if balanced:
            weight = share if model.training else 0.0
            loss = loss + self.router.aux_loss_coef * aux.to(loss.device) * (weight - 1)
            if model.training:
                metrics = router_metrics(output, self.router.top_k, batch.get("attention_mask"), share)
        if recorded:
            metrics = {
                "expert_load_max": self.chosen.load_max * share,
                "expert_load_mean": self.chosen.load_sum / self.chosen.layers * share,
            }
        return ObjectiveOutput(loss, metrics)
