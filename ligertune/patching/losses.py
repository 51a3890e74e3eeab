"""Patch functions of the loss kernels: ``fused_linear_cross_entropy`` and ``cross_entropy``.

``fused_linear_cross_entropy``: the causal LM's forward (`_fused_causal_lm_forward`) runs the
base model, then the lm_head *module* in its loss mode, and returns the loss with
``logits=None``: in training with labels the [tokens, vocab] logits never exist. Otherwise (no
labels, eval mode, an lm_head wrapped after patching) it is HF's forward. Needs the family's
causal-LM class (and its final-logit softcap, Gemma 2/3).

``cross_entropy``: the causal LM's ``loss_function`` (a per-instance attribute in transformers)
becomes `_kernel_causal_lm_loss`, over the logits HF materialises. For a family the table does
not know it applies to any transformers model whose loss is HF's ``ForCausalLMLoss``.

Both keep HF's targets and normalisation: labels shifted by one (or ``shift_labels`` as given),
``ignore_index`` (−100) skipped, ``sum / num_items_in_batch`` when the caller passes that count
(gradient accumulation), else the mean over non-ignored tokens.

Mixture-of-experts families: with ``output_router_logits`` on (the forward's argument, else the
config's), the fused forward adds the router's load-balancing loss exactly as HF's
``*MoeForCausalLM`` does, with the modeling module's own ``load_balancing_loss_func``, times the
config's ``router_aux_loss_coef``, once per forward (the SFT objective reweights it over an
accumulation window: `ligertune.objectives.causal_lm`). No family of the table has a router
z-loss in transformers 5.17. DeepSeek-V3 has no balancing loss there at all (its router's score
bias balances the experts): its fused forward is the dense families'.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

from ligertune.catalog.families import Experts
from ligertune.kernels import cross_entropy as ce_kernel
from ligertune.kernels import fused_linear_cross_entropy as flce_kernel
from ligertune.patching.common import MARK, Patcher, is_marked, partial_forward, patches, set_forward

# The keyword of the patched causal LM's forward that swaps the fused cross entropy for another
# function of the lm_head's hidden states, ``loss_fn(hidden [N, H], weight [V, H], target [N], bias,
# *, ignore_index, num_items_in_batch, softcap)``, computed inside the lm_head's call (so sharded
# strategies have its weight gathered) in training and eval mode alike; whatever it returns is the
# output's ``loss``. The preference and distillation objectives (`ligertune.objectives`) use it to
# get per-sequence log-probs or a teacher divergence without the [tokens × vocab] logits.
LM_HEAD_LOSS_FN = "lm_head_loss_fn"


def shift_targets(labels: torch.Tensor, ignore_index: int, shift_labels: torch.Tensor | None) -> torch.Tensor:
    """Flat next-token targets, as HF's ForCausalLMLoss builds them: position t predicts labels[t+1];
    the last position gets ignore_index. ``shift_labels`` (already shifted) wins when given."""
    if shift_labels is None:
        shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return shift_labels.reshape(-1)


def _kernel_causal_lm_loss(
    logits, labels, vocab_size: int, num_items_in_batch=None, ignore_index: int = -100, shift_labels=None, **_
):
    """HF's ``ForCausalLMLoss`` on the cross-entropy kernel: same signature, same shifting, same
    normalisation (sum / num_items_in_batch when given, else the mean over non-ignored targets).
    The one difference: an all-ignored batch gives 0 (HF: NaN). The logits are returned to the
    caller by the model, so the kernel must not overwrite them with the gradient."""
    target = shift_targets(labels, ignore_index, shift_labels).to(logits.device)
    return ce_kernel.cross_entropy(
        logits.reshape(-1, vocab_size),
        target,
        ignore_index=ignore_index,
        num_items_in_batch=num_items_in_batch,
    )


def _fused_lm_head_forward(self, hidden_states, target=None, loss_fn=None, **loss_options):
    """The lm_head's forward: ``F.linear`` as usual, or, given ``target``, the fused linear cross
    entropy over this module's weight. Running the loss *inside the lm_head's call* means the
    module's forward hooks run around it: FSDP2 and ZeRO-3 gather the full weight first and
    release it after, exactly as for the logits. ``loss_fn`` replaces the cross entropy with
    another function of the same signature (`LM_HEAD_LOSS_FN`)."""
    if target is None:
        return nn.functional.linear(hidden_states, self.weight, self.bias)
    return (loss_fn or flce_kernel.fused_linear_cross_entropy)(
        hidden_states.reshape(-1, hidden_states.shape[-1]), self.weight, target, self.bias, **loss_options
    )


def _lm_head_is_fused(lm_head: nn.Module) -> bool:
    forward = lm_head.__dict__.get("forward")
    return getattr(forward, "__func__", None) is _fused_lm_head_forward


# -- the lm_head after peft (lora) wrapped it ------------------------------------------------
#
# peft is duck-typed here (the patching layer does not depend on it): a LoRA layer has
# ``base_layer``, ``lora_A``/``lora_B`` (ModuleDicts by adapter name), ``scaling``, ``lora_dropout``;
# a ``modules_to_save`` wrapper has ``original_module`` and ``modules_to_save``.


def _lora_head_loss(head: nn.Module, adapter: str, hidden_states, target=None, loss_fn=None, **loss_options):
    """The fused linear cross entropy of a LoRA-adapted lm_head, exactly, dropout included.

    The adapted logits are ``h·Wᵀ + s·(drop(h)·Aᵀ)·Bᵀ`` (A: r × H, B: V × r, s = alpha/r). That
    is one matmul over concatenated operands::

        [h | s·drop(h)·Aᵀ] · [W | B]ᵀ        hidden N × (H + r), weight V × (H + r)

    so the kernel runs unchanged on r more columns, and the [N, V] logits still never exist.
    Merging instead (W + s·B·A per call) costs the same V × H copy but is wrong with dropout,
    which applies to the adapter's input only. The price, against a frozen lm_head: the copy of
    W (V × (H + r), 1 GB at Llama-3's 128256 × 4096 in bf16) and the kernel's weight gradient,
    V × (H + r) (one more N·V·H matmul, as large as the logits' own, and its fp32 accumulator),
    of which only B's r columns are used. Against HF's loss it saves the [N, V] logits and their
    gradient (4.2 GB in fp32 at 8192 tokens). Under FSDP2 the lm_head belongs to the root unit,
    whose parameters are all gathered while the causal LM's forward runs, as for a plain head."""
    base = head.base_layer
    a, b = head.lora_A[adapter], head.lora_B[adapter]
    flat = hidden_states.reshape(-1, hidden_states.shape[-1])
    low = a(head.lora_dropout[adapter](flat).to(a.weight.dtype)) * head.scaling[adapter]
    widened = torch.cat([flat, low.to(flat.dtype)], dim=-1)
    weight = torch.cat([base.weight, b.weight.to(base.weight.dtype)], dim=1)
    return (loss_fn or flce_kernel.fused_linear_cross_entropy)(
        widened, weight, target, base.bias, **loss_options
    )


def fused_head(head: nn.Module):
    """(how to compute the loss from the hidden states through the fused kernel, a description)
    for the module at ``lm_head``, or (None, why it cannot) — then HF's own loss runs.

    Handled: our patched Linear (frozen or trained); peft's ``modules_to_save`` copy of it (a
    fully trained lm_head); a peft LoRA layer over it with one active, unmerged, plain adapter
    (`_lora_head_loss`). DoRA, a LoRA bias, several active adapters or a merged adapter fall
    back to HF's forward, which calls the wrapper and materialises the logits."""
    if _lm_head_is_fused(head):
        return head, "fused"
    copies = getattr(head, "modules_to_save", None)
    if isinstance(copies, nn.ModuleDict) and hasattr(head, "original_module"):
        active = head.original_module if head.disable_adapters else copies[head.active_adapters[0]]
        if _lm_head_is_fused(active):
            return active, "fused (a trained copy of the lm_head, modules_to_save)"
        return None, f"the lm_head's trained copy is {type(active).__name__}"
    if isinstance(getattr(head, "lora_A", None), nn.ModuleDict) and hasattr(head, "base_layer"):
        if not _lm_head_is_fused(head.base_layer):
            return None, "the LoRA layer's base is not our patched lm_head"
        adapters = [a for a in head.active_adapters if a in head.lora_A]
        why = None
        if head.disable_adapters or head.merged or not adapters:
            return head.base_layer, "fused (adapter merged or disabled)"
        if len(adapters) > 1:
            why = f"{len(adapters)} active adapters"
        elif head.use_dora.get(adapters[0]):
            why = "DoRA (its magnitude rescales every output row)"
        elif getattr(head, "lora_bias", {}).get(adapters[0]):
            why = "a LoRA bias"
        if why:
            return None, f"LoRA on the lm_head with {why}: HF's loss over materialised logits"
        loss = functools.partial(_lora_head_loss, head, adapters[0])
        return loss, "fused with the LoRA adapter ([h | s·A·h]·[W | B]ᵀ)"
    return None, f"lm_head is {type(head).__name__}"


def _fused_causal_lm_forward(
    self,
    input_ids=None,
    attention_mask=None,
    position_ids=None,
    past_key_values=None,
    inputs_embeds=None,
    labels=None,
    use_cache=None,
    logits_to_keep=0,
    *,
    _softcap_attr: str | None = None,
    _experts: Experts | None = None,
    _balancing: Callable | None = None,
    **kwargs,
):
    """The causal LM's forward with the fused linear cross entropy.

    Training with labels: run the base model, then the lm_head *module* in its loss mode
    (`_fused_lm_head_forward`), and return ``CausalLMOutputWithPast(loss, logits=None, ...)``;
    the [tokens, vocab] logits never exist. The targets and the normalisation are HF's
    ``ForCausalLMLoss``'s: labels shifted by one (or ``shift_labels`` as given), ``ignore_index``
    (−100 by default) skipped, ``sum / num_items_in_batch`` when the caller passes that count
    (gradient accumulation), else the mean over non-ignored tokens. Gemma 2/3's final-logit
    softcap is applied inside the kernel. ``kwargs`` go to the base model, as in HF.

    An lm_head that peft wrapped after patching (LoRA, modules_to_save) goes through the kernel
    too where `fused_head` can compute it exactly. Anything else (no labels, eval mode, an lm_head
    the kernel cannot compute) runs HF's own forward unchanged.

    A mixture-of-experts family (``_experts``, its modeling module's load-balancing function
    ``_balancing``) returns HF's ``MoeCausalLMOutputWithPast``; with ``output_router_logits`` on
    it has ``aux_loss`` and ``router_logits``, and the loss includes ``coef · aux_loss`` as HF's
    (not when ``LM_HEAD_LOSS_FN`` replaces the loss: that loss is the caller's own).
    """
    hf_forward = type(self).forward
    router_outputs = False
    if _experts is not None:
        router_outputs = kwargs.get("output_router_logits")
        if router_outputs is None:
            router_outputs = getattr(self.config, _experts.output_router_logits_attr)
        kwargs["output_router_logits"] = router_outputs
    loss_fn = kwargs.pop(LM_HEAD_LOSS_FN, None)
    fuse = labels is not None and (self.training or loss_fn is not None)
    head_loss = fused_head(self.lm_head)[0] if fuse else None
    if head_loss is None and loss_fn is not None:
        raise ValueError(f"{LM_HEAD_LOSS_FN} needs labels and an lm_head the fused kernel computes")
    if head_loss is None:
        return hf_forward(
            self,
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            labels=labels,
            use_cache=use_cache,
            logits_to_keep=logits_to_keep,
            **kwargs,
        )
    return_dict = kwargs.pop("return_dict", None)
    outputs = self.model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
        inputs_embeds=inputs_embeds,
        use_cache=use_cache,
        **kwargs,
    )
    hidden_states = outputs.last_hidden_state
    slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    ignore_index = kwargs.get("ignore_index", -100)
    target = shift_targets(labels, ignore_index, kwargs.get("shift_labels")).to(hidden_states.device)
    loss = head_loss(
        hidden_states[:, slice_indices, :],
        target=target,
        ignore_index=ignore_index,
        num_items_in_batch=kwargs.get("num_items_in_batch"),
        softcap=getattr(self.config, _softcap_attr) if _softcap_attr else None,
        **({"loss_fn": loss_fn} if loss_fn is not None else {}),
    )
    common = dict(
        logits=None,
        past_key_values=outputs.past_key_values,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
    )
    if _experts is None:
        output = CausalLMOutputWithPast(loss=loss, **common)
    else:
        aux_loss = None
        if router_outputs:
            config = self.config
            aux_loss = _balancing(
                outputs.router_logits,
                getattr(config, _experts.num_experts_attr),
                getattr(config, _experts.top_k_attr),
                attention_mask,
            )
            if loss_fn is None:
                loss = loss + getattr(config, _experts.aux_loss_coef_attr) * aux_loss.to(loss.device)
        output = MoeCausalLMOutputWithPast(
            loss=loss, aux_loss=aux_loss, router_logits=outputs.router_logits, **common
        )
    if return_dict is None:
        return_dict = self.config.return_dict
    return output if return_dict else output.to_tuple()


def _fused_moe_causal_lm_forward(
    self,
    input_ids=None,
    attention_mask=None,
    position_ids=None,
    past_key_values=None,
    inputs_embeds=None,
    labels=None,
    use_cache=None,
    output_router_logits=None,
    logits_to_keep=0,
    *,
    _softcap_attr: str | None = None,
    _experts: Experts | None = None,
    _balancing: Callable | None = None,
    **kwargs,
):
    """`_fused_causal_lm_forward` under the signature of HF's MoE causal LMs, which take
    ``output_router_logits`` (generate() and trainers inspect the signature)."""
    return _fused_causal_lm_forward(
        self,
        input_ids,
        attention_mask,
        position_ids,
        past_key_values,
        inputs_embeds,
        labels,
        use_cache,
        logits_to_keep,
        _softcap_attr=_softcap_attr,
        _experts=_experts,
        _balancing=_balancing,
        output_router_logits=output_router_logits,
        **kwargs,
    )


def _set_loss_function(module: nn.Module, loss_function) -> None:
    # PreTrainedModel.loss_function is a property whose setter stores a per-instance override.
    module.loss_function = loss_function


def _causal_lms(patcher: Patcher, kernel: str) -> tuple[list[tuple[str, nn.Module]], list[tuple[str, str]]]:
    """(name, module) of the causal LMs the loss ``kernel`` can take over, and (name, reason)
    for those it cannot."""
    if patcher.family is not None:
        candidates = patcher.family_instances(patcher.family.causal_lm)
    else:
        candidates = [(n, m) for n, m in patcher.model.named_modules() if _uses_hf_causal_lm_loss(m)]
    targets, failures = [], []
    for name, lm in candidates:
        mark = lm.__dict__.get(MARK)
        if mark is not None and mark != kernel:
            failures.append((name, f"already patched with {mark}"))
        else:
            targets.append((name, lm))
    return targets, failures


@patches("fused_linear_cross_entropy")
def patch_fused_linear_cross_entropy(patcher: Patcher) -> None:
    kernel = "fused_linear_cross_entropy"
    if patcher.family is None:
        patcher.skip(
            kernel, "needs a family entry in ligertune/catalog/families.py (cross_entropy can apply)"
        )
        return
    lms, failures = _causal_lms(patcher, kernel)
    targets = []
    family = patcher.family
    # A mixture of experts without a balancing loss in transformers (DeepSeek-V3) has HF's dense
    # causal-LM forward: nothing to add, no output_router_logits in its signature.
    experts = family.experts if family.balancing_loss else None
    forward = partial_forward(
        _fused_causal_lm_forward if experts is None else _fused_moe_causal_lm_forward,
        _softcap_attr=family.logit_softcap_attr,
        _experts=experts,
        _balancing=family.resolve("load_balancing_loss_func") if experts else None,
    )
    for name, lm in lms:
        head = getattr(lm, "lm_head", None)
        if type(head) is nn.Linear or _lm_head_is_fused(head):
            targets.append((lm, forward))
        else:
            failures.append((name, f"lm_head is {type(head).__name__}, not a plain nn.Linear"))
    none_reason = f"no {patcher.family.causal_lm} in the model (a base model has no lm_head)"
    for lm in patcher.apply(kernel, targets, failures, none_reason):
        set_forward(lm.lm_head, _fused_lm_head_forward)
        setattr(lm.lm_head, MARK, kernel)


@patches("cross_entropy")
def patch_cross_entropy(patcher: Patcher) -> None:
    kernel = "cross_entropy"
    lms, failures = _causal_lms(patcher, kernel)
    none_reason = "no causal-LM module computing its loss with transformers' ForCausalLMLoss"
    targets = [(lm, _kernel_causal_lm_loss) for _, lm in lms]
    patcher.apply(kernel, targets, failures, none_reason, install=_set_loss_function)


def _uses_hf_causal_lm_loss(module: nn.Module) -> bool:
    """A transformers model with an lm_head whose forward computes its loss with
    ``self.loss_function`` and that function is HF's ForCausalLMLoss (generic families)."""
    if not isinstance(module, PreTrainedModel) or not hasattr(module, "lm_head"):
        return False
    code = getattr(inspect.unwrap(type(module).forward), "__code__", None)
    if code is None or "loss_function" not in code.co_names:
        return False
    return is_marked(module) or module.loss_function is ForCausalLMLoss
