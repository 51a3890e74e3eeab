"""Put the Triton kernels into an instantiated Hugging Face model, per instance.

``patch_model(model, kernels)`` finds modules *by type* (using the per-family table in
`ligertune.families`) and rebinds the ``forward`` of those instances only. Nothing in the
transformers package, in ``torch.nn.functional`` or in any class is modified, so two models in
one process can be patched differently (or not at all), and since no module is replaced or
renamed, ``state_dict`` keys, checkpoints and ``save_pretrained`` stay exactly Hugging Face's.
A patched module carries the name of its kernel in ``_ligertune_kernel``; a second call finds
the marks and patches nothing twice. Patching never undoes an earlier patch.

What each kernel does to the model:

* ``rms_norm``: every RMSNorm of the family (decoder norms, the final norm, Qwen3/Gemma3
  ``q_norm``/``k_norm``, Gemma2/3 pre/post-feedforward norms) computes
  ``rms_norm(x, self.weight, eps, offset, casting_mode)``: Llama casting for Llama-style norms,
  ``offset=1`` and all-fp32 math for Gemma's ``(1 + w)`` norms. The eps attribute is read at
  every call, like the module itself does.
* ``rope``: HF attention forwards call their modeling file's module-level
  ``apply_rotary_pos_emb``, looked up in the function's globals at call time; transformers 5.17
  has no per-instance hook for it (``use_kernelized_func`` only acts with the hub ``kernels``
  package and ``use_kernels=True``). So the patched attention runs *the same code object* as HF's
  forward, in a function whose globals are a copy of the modeling module's namespace with
  ``apply_rotary_pos_emb`` bound to our kernel. No attention code is copied, the modeling module
  is untouched, and every other name the forward uses resolves as before (the namespace is
  copied when a class is first patched; later rebinding of module globals is not seen). The
  kernel takes HF's signature and rotates only ``cos.shape[-1]`` channels, which covers Phi3's
  partial rotary; Gemma3's local/global layers pass their own cos/sin, so nothing is needed.
* ``swiglu`` / ``geglu``: the family's gated MLP computes ``down_proj(act(gate) * up)`` with the
  fused kernel (SiLU → swiglu, tanh-GELU → geglu, chosen from the MLP's activation module).
  ``gate_proj``/``up_proj``/``down_proj`` (Phi3: ``gate_up_proj``) are called as modules, so LoRA
  adapters on them keep working. The kernel's backward overwrites gate and up with their
  gradients (they are private intermediates of the MLP), saving one activation-sized buffer.
* ``layer_norm``: every plain ``nn.LayerNorm`` over one trailing dimension, in any model.
* ``fused_linear_cross_entropy``: see `_fused_causal_lm_forward`. In training with labels the
  causal-LM forward returns the loss and ``logits=None``; otherwise it is HF's forward.
* ``cross_entropy``: the causal LM's ``loss_function`` (a per-instance attribute in
  transformers) becomes `_kernel_causal_lm_loss`, over the logits HF materialises.

For a ``model_type`` missing from the table only kernels that can be recognised by type apply:
``layer_norm``, ``cross_entropy`` (when the model's loss is HF's causal-LM loss), and RMSNorm and
gated-MLP modules whose forward a probe on a small random input shows to compute exactly our
kernel's function (see `_probe_rms_norm` and `_probe_gated_mlp`). ``rope`` and the fused loss
need a family entry.

`parity_check` runs a patched and an unpatched copy of a model on one batch and compares loss,
eval-path logits and every gradient (``ligertune validate --check``).
"""

from __future__ import annotations

import copy
import inspect
import math
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.activations import FastGELUActivation, GELUTanh, NewGELUActivation, SiLUActivation
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.modeling_outputs import CausalLMOutputWithPast

from ligertune.families import FAMILIES, Family
from ligertune.kernels import cross_entropy as ce_kernel
from ligertune.kernels import fused_linear_cross_entropy as flce_kernel
from ligertune.kernels import layer_norm as ln_kernel
from ligertune.kernels import rms_norm as rms_kernel
from ligertune.kernels import rope as rope_kernel
from ligertune.kernels import swiglu as gated_kernel
from ligertune.kernels._utils import INTERPRET
from ligertune.recipe import KERNEL_NAMES, KernelsSection

__all__ = ["ParityCheck", "ParityResult", "PatchReport", "parity_check", "patch_model"]

_MARK = "_ligertune_kernel"
_ROPE_NAME = "apply_rotary_pos_emb"
# Gated activation (the kernel module's name for it) → the recipe kernel that implements it.
_GATED_KERNELS = {"silu": "swiglu", "gelu_tanh": "geglu"}


# --------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------


@dataclass
class PatchReport:
    """What `patch_model` did, per kernel.

    ``patched[k]``: modules patched by this call (every kernel name is present, 0 when none).
    ``already_patched[k]``: modules found patched by an earlier call (left as they were).
    ``skipped[k]``: why kernel ``k`` was not applied, or which modules were not patched and why
    when it was applied to some. ``notes``: model-level remarks (an unknown family).
    """

    model_class: str
    model_type: str | None
    known_family: bool
    patched: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KERNEL_NAMES, 0))
    already_patched: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.patched.values())

    def __str__(self) -> str:
        family = self.model_type if self.known_family else f"{self.model_type} (not in the family table)"
        lines = [f"kernel patching: {self.model_class}, family {family}"]
        lines += [f"  note: {note}" for note in self.notes]
        width = max(map(len, KERNEL_NAMES))
        for kernel in KERNEL_NAMES:
            parts = []
            if self.patched[kernel]:
                parts.append(_plural(self.patched[kernel], "module") + " patched")
            if self.already_patched.get(kernel):
                parts.append(_plural(self.already_patched[kernel], "module") + " already patched")
            if kernel in self.skipped:
                parts.append(("not patched: " if not parts else "") + self.skipped[kernel])
            lines.append(f"  {kernel:<{width}}  {'; '.join(parts)}")
        return "\n".join(lines)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


# --------------------------------------------------------------------------------------------
# Helpers shared by every kernel
# --------------------------------------------------------------------------------------------


def _is_marked(module: nn.Module) -> bool:
    return _MARK in module.__dict__


def _set_forward(module: nn.Module, forward: Callable) -> None:
    """Give this one instance its own ``forward`` (a function taking ``self``)."""
    module.forward = types.MethodType(forward, module)


def _set_loss_function(module: nn.Module, loss_function: Callable) -> None:
    # PreTrainedModel.loss_function is a property whose setter stores a per-instance override.
    module.loss_function = loss_function


def _instances(model: nn.Module, cls: type) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, cls)]


def _names(pairs: list[tuple[str, Any]], limit: int = 4) -> str:
    shown = ", ".join(name or "<root>" for name, _ in pairs[:limit])
    return shown + (f" and {len(pairs) - limit} more" if len(pairs) > limit else "")


def _shift_targets(
    labels: torch.Tensor, ignore_index: int, shift_labels: torch.Tensor | None
) -> torch.Tensor:
    """Flat next-token targets, as HF's ForCausalLMLoss builds them: position t predicts labels[t+1];
    the last position gets ignore_index. ``shift_labels`` (already shifted) wins when given."""
    if shift_labels is None:
        shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return shift_labels.reshape(-1)


# --------------------------------------------------------------------------------------------
# Forwards bound to patched instances
# --------------------------------------------------------------------------------------------


def _rms_norm_forward(self, hidden_states, *, eps_attr: str, offset: float, casting_mode: str):
    return rms_kernel.rms_norm(hidden_states, self.weight, getattr(self, eps_attr), offset, casting_mode)


def _layer_norm_forward(self, x):
    return ln_kernel.layer_norm(x, self.weight, self.bias, self.eps)


def _gated_mlp_forward(self, x, *, activation: str):
    gate, up = self.gate_proj(x), self.up_proj(x)
    return self.down_proj(gated_kernel.gated_act(gate, up, activation, inplace_backward=True))


def _fused_gated_mlp_forward(self, x, *, activation: str):
    gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
    return self.down_proj(gated_kernel.gated_act(gate, up, activation, inplace_backward=True))


def _kernel_causal_lm_loss(
    logits, labels, vocab_size: int, num_items_in_batch=None, ignore_index: int = -100, shift_labels=None, **_
):
    """HF's ``ForCausalLMLoss`` on the cross-entropy kernel: same signature, same shifting, same
    normalisation (sum / num_items_in_batch when given, else the mean over non-ignored targets).
    The one difference: an all-ignored batch gives 0 (HF: NaN). The logits are returned to the
    caller by the model, so the kernel must not overwrite them with the gradient."""
    target = _shift_targets(labels, ignore_index, shift_labels).to(logits.device)
    return ce_kernel.cross_entropy(
        logits.reshape(-1, vocab_size),
        target,
        ignore_index=ignore_index,
        num_items_in_batch=num_items_in_batch,
    )


def _fused_lm_head_forward(self, hidden_states, target=None, **loss_options):
    """The lm_head's forward: ``F.linear`` as usual, or, given ``target``, the fused linear cross
    entropy over this module's weight. Running the loss *inside the lm_head's call* means the
    module's forward hooks run around it: FSDP2 and ZeRO-3 gather the full weight first and
    release it after, exactly as for the logits."""
    if target is None:
        return nn.functional.linear(hidden_states, self.weight, self.bias)
    return flce_kernel.fused_linear_cross_entropy(
        hidden_states.reshape(-1, hidden_states.shape[-1]), self.weight, target, self.bias, **loss_options
    )


def _lm_head_is_fused(lm_head: nn.Module) -> bool:
    forward = lm_head.__dict__.get("forward")
    return getattr(forward, "__func__", None) is _fused_lm_head_forward


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

    Anything else (no labels, eval mode, or an lm_head that is no longer our patched Linear,
    e.g. wrapped by PEFT after patching) runs HF's own forward unchanged.
    """
    hf_forward = type(self).forward
    if labels is None or not self.training or not _lm_head_is_fused(self.lm_head):
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
    target = _shift_targets(labels, ignore_index, kwargs.get("shift_labels")).to(hidden_states.device)
    loss = self.lm_head(
        hidden_states[:, slice_indices, :],
        target=target,
        ignore_index=ignore_index,
        num_items_in_batch=kwargs.get("num_items_in_batch"),
        softcap=getattr(self.config, _softcap_attr) if _softcap_attr else None,
    )
    output = CausalLMOutputWithPast(
        loss=loss,
        logits=None,
        past_key_values=outputs.past_key_values,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
    )
    if return_dict is None:
        return_dict = self.config.return_dict
    return output if return_dict else output.to_tuple()


# --------------------------------------------------------------------------------------------
# RoPE: HF's attention code object with our apply_rotary_pos_emb in its globals
# --------------------------------------------------------------------------------------------

_ROPE_FORWARDS: dict[Callable, Callable] = {}


def _rope_forward_for(hf_forward: Callable) -> Callable | str:
    """The attention forward that calls our RoPE kernel, or the reason there cannot be one."""
    if not isinstance(hf_forward, types.FunctionType) or hasattr(hf_forward, "__wrapped__"):
        return f"{hf_forward.__qualname__} is wrapped or not a plain function; its globals cannot be rebound"
    if _ROPE_NAME not in hf_forward.__code__.co_names:
        return f"{hf_forward.__qualname__} does not call {_ROPE_NAME} by name"
    forward = _ROPE_FORWARDS.get(hf_forward)
    if forward is None:
        scope = dict(hf_forward.__globals__)
        scope[_ROPE_NAME] = rope_kernel.apply_rotary_pos_emb
        forward = types.FunctionType(
            hf_forward.__code__, scope, hf_forward.__name__, hf_forward.__defaults__, hf_forward.__closure__
        )
        forward.__kwdefaults__ = hf_forward.__kwdefaults__
        forward.__qualname__ = hf_forward.__qualname__
        forward.__doc__ = hf_forward.__doc__
        _ROPE_FORWARDS[hf_forward] = forward
    return forward


# --------------------------------------------------------------------------------------------
# Probes: does an unknown module compute exactly what a kernel computes?
# --------------------------------------------------------------------------------------------


def _probe_input(rows: int, cols: int, like: torch.Tensor) -> torch.Tensor:
    """Random probe rows from a private generator: patching never moves the global RNG."""
    generator = torch.Generator().manual_seed(0)
    return torch.randn(rows, cols, generator=generator).to(device=like.device, dtype=like.dtype)


def _matches(out: torch.Tensor, ref: torch.Tensor) -> bool:
    """Same values up to rounding: 1e-5 relative in fp32, two units in the last place in 16-bit
    (per element, relative to the element plus the mean magnitude, as in the kernel tests)."""
    if out.shape != ref.shape or out.dtype != ref.dtype:
        return False
    tol = 1e-5 if torch.finfo(out.dtype).bits >= 32 else 2.0**-7
    out, ref = out.double(), ref.double()
    return bool(((out - ref).abs() <= tol * (ref.abs() + ref.abs().mean())).all())


@torch.no_grad()
def _probe_rms_norm(module: nn.Module) -> dict | str:
    """Options for `_rms_norm_forward` under which it reproduces ``module``, or why not.

    The candidate semantics are the two in the wild: ``w·x̂`` with Llama casting and
    ``(1 + w)·x̂`` in fp32 (Gemma). The module is run on random rows and compared with the
    kernel's reference for each; the weight is the module's own, and since a fresh Llama weight
    is ones and a fresh Gemma weight zeros, the two never agree by accident.
    """
    weight = getattr(module, "weight", None)
    eps_attr = next(
        (a for a in ("variance_epsilon", "eps") if isinstance(getattr(module, a, None), float)), None
    )
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1 or eps_attr is None:
        return "not a 1-D weight with an eps or variance_epsilon attribute"
    x = _probe_input(4, weight.shape[0], weight)
    try:
        out = module(x)
    except Exception as e:  # a module we cannot run standalone (sharded, meta, ...)
        return f"probe failed: {type(e).__name__}: {e}"
    for offset, casting_mode in ((0.0, "llama"), (1.0, "gemma")):
        ref = rms_kernel.rms_norm_reference(x, weight, getattr(module, eps_attr), offset, casting_mode)
        if _matches(out, ref):
            return dict(eps_attr=eps_attr, offset=offset, casting_mode=casting_mode)
    return "its output matches neither w·x̂ (Llama) nor (1+w)·x̂ (Gemma) on a random probe"


def _activation_of(act: nn.Module) -> str | None:
    """The kernel's name for an activation module, or None when no kernel computes it."""
    if isinstance(act, (nn.SiLU, SiLUActivation)):
        return "silu"
    if isinstance(act, (GELUTanh, NewGELUActivation, FastGELUActivation)):
        return "gelu_tanh"
    if isinstance(act, nn.GELU) and act.approximate == "tanh":
        return "gelu_tanh"
    return None


@torch.no_grad()
def _probe_gated_mlp(module: nn.Module) -> str:
    """The gated activation with which ``module`` is ``down(act(gate(x)) * up(x))``, or raise
    ValueError saying why it is not."""
    parts = [getattr(module, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(isinstance(p, nn.Linear) for p in parts):
        raise ValueError("no gate_proj/up_proj/down_proj Linear layers")
    activation = _activation_of(getattr(module, "act_fn", None))
    if activation is None:
        raise ValueError(f"act_fn {type(getattr(module, 'act_fn', None)).__name__} has no fused kernel")
    gate, up, down = parts
    x = _probe_input(4, gate.in_features, gate.weight)
    try:
        out = module(x)
    except Exception as e:
        raise ValueError(f"probe failed: {type(e).__name__}: {e}") from None
    reference = gated_kernel.swiglu_reference if activation == "silu" else gated_kernel.geglu_reference
    ref = down(reference(gate(x), up(x)))
    if not _matches(out, ref):
        raise ValueError("its output is not down_proj(act_fn(gate_proj(x)) * up_proj(x)) on a random probe")
    return activation


# --------------------------------------------------------------------------------------------
# One function per kernel: patch what applies, record the rest
# --------------------------------------------------------------------------------------------


class _Patcher:
    """Collects targets per kernel, patches them and writes the report."""

    def __init__(self, model: nn.Module, kernels: KernelsSection, family: Family | None, report: PatchReport):
        self.model, self.kernels, self.family, self.report = model, kernels, family, report

    def enabled(self, kernel: str) -> bool:
        if not getattr(self.kernels, kernel):
            self.report.skipped[kernel] = "off in the recipe"
            return False
        return True

    def apply(
        self,
        kernel: str,
        targets: list[tuple[nn.Module, Callable | None]],
        failures: list[tuple[str, str]],
        none_reason: str,
        install: Callable[[nn.Module, Callable], None] = _set_forward,
    ) -> list[nn.Module]:
        """Install each (module, function) unless the module is patched already, and mark it;
        record the failures (module name, reason). Returns the modules patched by this call."""
        if not targets and not failures:
            self.report.skipped[kernel] = none_reason
        done = []
        for module, forward in targets:
            if _is_marked(module):
                self.report.already_patched[kernel] = self.report.already_patched.get(kernel, 0) + 1
            else:
                install(module, forward)
                setattr(module, _MARK, kernel)
                self.report.patched[kernel] += 1
                done.append(module)
        if failures:
            by_reason: dict[str, list[tuple[str, None]]] = {}
            for name, reason in failures:
                by_reason.setdefault(reason, []).append((name, None))
            self.report.skipped[kernel] = "; ".join(
                f"{_names(names)}: {why}" for why, names in by_reason.items()
            )
        return done

    def family_instances(self, class_name: str) -> list[tuple[str, nn.Module]]:
        return _instances(self.model, self.family.resolve(class_name))

    # RMSNorm --------------------------------------------------------------------------------

    def rms_norm(self) -> None:
        if not self.enabled("rms_norm"):
            return
        f = self.family
        if f is not None:
            forward = _partial_forward(
                _rms_norm_forward, eps_attr=f.norm_eps_attr, offset=f.norm_offset, casting_mode=f.norm_casting
            )
            targets = [(m, forward) for _, m in self.family_instances(f.rms_norm)]
            self.apply("rms_norm", targets, [], f"no {f.rms_norm} modules in the model")
            return
        targets, failures = [], []
        for name, module in self.model.named_modules():
            if not type(module).__name__.endswith("RMSNorm"):
                continue
            probed = {} if _is_marked(module) else _probe_rms_norm(module)
            if isinstance(probed, str):
                failures.append((name, f"{type(module).__name__} {probed}"))
            else:
                targets.append((module, _partial_forward(_rms_norm_forward, **probed)))
        self.apply("rms_norm", targets, failures, "no module whose class name ends in RMSNorm")

    # RoPE -----------------------------------------------------------------------------------

    def rope(self) -> None:
        if not self.enabled("rope"):
            return
        if self.family is None:
            self.report.skipped["rope"] = "needs a family entry in ligertune/families.py"
            return
        targets, failures = [], []
        for name, module in self.family_instances(self.family.attention):
            forward = _rope_forward_for(type(module).forward)
            if isinstance(forward, str):
                failures.append((name, forward))
            else:
                targets.append((module, forward))
        self.apply("rope", targets, failures, f"no {self.family.attention} modules in the model")

    # Gated MLPs -----------------------------------------------------------------------------

    def gated_mlps(self) -> None:
        wanted = [k for k in ("swiglu", "geglu") if self.enabled(k)]
        if not wanted:
            return
        found: dict[str, list] = {"swiglu": [], "geglu": []}
        failures: list[tuple[str, str]] = []
        f = self.family
        if f is not None:
            body = _fused_gated_mlp_forward if f.mlp_fused_gate_up else _gated_mlp_forward
            where = f"{f.mlp} modules"
            for name, module in self.family_instances(f.mlp):
                act = getattr(module, f.mlp_act_attr, None)
                activation = _activation_of(act)
                if activation is None:
                    failures.append((name, f"activation {type(act).__name__} has no fused kernel"))
                else:
                    found[_GATED_KERNELS[activation]].append(
                        (module, _partial_forward(body, activation=activation))
                    )
        else:
            where = "gated MLPs (gate_proj, up_proj, down_proj)"
            for name, module in self.model.named_modules():
                if not hasattr(module, "gate_proj"):
                    continue
                if _is_marked(module):
                    found[module.__dict__[_MARK]].append((module, None))
                    continue
                try:
                    activation = _probe_gated_mlp(module)
                except ValueError as e:
                    failures.append((name, f"{type(module).__name__} {e}"))
                    continue
                found[_GATED_KERNELS[activation]].append(
                    (module, _partial_forward(_gated_mlp_forward, activation=activation))
                )
        for kernel in wanted:
            other = "geglu" if kernel == "swiglu" else "swiglu"
            activation = "SiLU" if kernel == "swiglu" else "tanh-GELU"
            none_reason = f"no {where} with a {activation} activation" + (
                f" (this model's MLPs use {other})" if found[other] else ""
            )
            # Unsupported activations are reported under both kernels: either could have applied.
            self.apply(kernel, found[kernel], failures, none_reason)

    # LayerNorm ------------------------------------------------------------------------------

    def layer_norm(self) -> None:
        if not self.enabled("layer_norm"):
            return
        targets, failures = [], []
        for name, module in _instances(self.model, nn.LayerNorm):
            if type(module).forward is not nn.LayerNorm.forward:
                failures.append((name, f"{type(module).__name__} overrides nn.LayerNorm.forward"))
            elif len(module.normalized_shape) != 1:
                failures.append((name, f"normalises over {len(module.normalized_shape)} dimensions, not 1"))
            else:
                targets.append((module, _layer_norm_forward))
        self.apply("layer_norm", targets, failures, "no nn.LayerNorm in the model")

    # Losses ---------------------------------------------------------------------------------

    def causal_lms(self, kernel: str) -> tuple[list[tuple[str, nn.Module]], list[tuple[str, str]]]:
        """(name, module) of the causal LMs the loss ``kernel`` can take over, and (name, reason)
        for those it cannot."""
        if self.family is not None:
            candidates = self.family_instances(self.family.causal_lm)
        else:
            candidates = [(n, m) for n, m in self.model.named_modules() if _uses_hf_causal_lm_loss(m)]
        targets, failures = [], []
        for name, lm in candidates:
            mark = lm.__dict__.get(_MARK)
            if mark is not None and mark != kernel:
                failures.append((name, f"already patched with {mark}"))
            else:
                targets.append((name, lm))
        return targets, failures

    def fused_linear_cross_entropy(self) -> None:
        kernel = "fused_linear_cross_entropy"
        if not self.enabled(kernel):
            return
        if self.family is None:
            self.report.skipped[kernel] = (
                "needs a family entry in ligertune/families.py (cross_entropy can apply)"
            )
            return
        lms, failures = self.causal_lms(kernel)
        targets = []
        forward = _partial_forward(_fused_causal_lm_forward, _softcap_attr=self.family.logit_softcap_attr)
        for name, lm in lms:
            head = getattr(lm, "lm_head", None)
            if type(head) is nn.Linear or _lm_head_is_fused(head):
                targets.append((lm, forward))
            else:
                failures.append((name, f"lm_head is {type(head).__name__}, not a plain nn.Linear"))
        none_reason = f"no {self.family.causal_lm} in the model (a base model has no lm_head)"
        for lm in self.apply(kernel, targets, failures, none_reason):
            _set_forward(lm.lm_head, _fused_lm_head_forward)
            setattr(lm.lm_head, _MARK, kernel)

    def cross_entropy(self) -> None:
        kernel = "cross_entropy"
        if not self.enabled(kernel):
            return
        lms, failures = self.causal_lms(kernel)
        none_reason = "no causal-LM module computing its loss with transformers' ForCausalLMLoss"
        targets = [(lm, _kernel_causal_lm_loss) for _, lm in lms]
        self.apply(kernel, targets, failures, none_reason, install=_set_loss_function)


def _uses_hf_causal_lm_loss(module: nn.Module) -> bool:
    """A transformers model with an lm_head whose forward computes its loss with
    ``self.loss_function`` and that function is HF's ForCausalLMLoss (generic families)."""
    if not isinstance(module, PreTrainedModel) or not hasattr(module, "lm_head"):
        return False
    code = getattr(inspect.unwrap(type(module).forward), "__code__", None)
    if code is None or "loss_function" not in code.co_names:
        return False
    return _is_marked(module) or module.loss_function is ForCausalLMLoss


def _partial_forward(fn: Callable, **options) -> Callable:
    """``forward(self, *args, **kwargs)`` calling ``fn`` with fixed keyword ``options``. Its
    signature is ``fn``'s without them: generate() and trainers inspect ``model.forward``."""

    def forward(self, *args, **kwargs):
        return fn(self, *args, **kwargs, **options)

    signature = inspect.signature(fn)
    forward.__signature__ = signature.replace(
        parameters=[p for p in signature.parameters.values() if p.name not in options]
    )
    forward.__name__ = forward.__qualname__ = fn.__name__
    forward.__doc__ = fn.__doc__
    return forward


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def _as_kernels(kernels: KernelsSection | Mapping | str | None) -> KernelsSection:
    if kernels is None:
        return KernelsSection()
    if isinstance(kernels, KernelsSection):
        return kernels
    if isinstance(kernels, str):
        if kernels not in ("all", "none"):
            raise ValueError(
                f"kernels={kernels!r}: use 'all', 'none', a KernelsSection or a mapping kernel→bool"
            )
        return KernelsSection.preset(kernels)
    if isinstance(kernels, Mapping):
        return KernelsSection(**kernels)
    raise TypeError(
        f"kernels must be a KernelsSection, a mapping, 'all' or 'none', got {type(kernels).__name__}"
    )


def patch_model(model: nn.Module, kernels: KernelsSection | Mapping | str | None = None) -> PatchReport:
    """Patch the kernels selected by ``kernels`` into this model instance, in place.

    ``kernels``: the recipe's `KernelsSection` (default: all defaults), a mapping of kernel name
    to bool, or ``"all"``/``"none"``. Patch before wrapping the model (PEFT, FSDP, DeepSpeed,
    torch.compile): patching looks for Hugging Face's own module types. Calling it again is safe:
    patched modules are recognised and counted in ``already_patched``.
    """
    kernels = _as_kernels(kernels)
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if not isinstance(model, nn.Module) or model_type is None:
        raise TypeError(
            f"patch_model needs a transformers model with a config.model_type, got {type(model).__name__}; "
            "pass the model returned by AutoModelForCausalLM (before wrapping it)"
        )
    family = FAMILIES.get(model_type)
    report = PatchReport(type(model).__name__, model_type, family is not None)
    if family is None:
        report.notes.append(
            f"model_type {model_type!r} is not in the family table ({', '.join(FAMILIES)}): only kernels "
            "recognised by module type can apply (rms_norm and swiglu/geglu after a probe of each module, "
            "layer_norm, cross_entropy); rope and fused_linear_cross_entropy need a family entry"
        )
    patcher = _Patcher(model, kernels, family, report)
    patcher.rms_norm()
    patcher.rope()
    patcher.gated_mlps()
    patcher.layer_norm()
    patcher.fused_linear_cross_entropy()
    patcher.cross_entropy()
    if family is None and report.total == 0 and not report.already_patched:
        report.notes.append("none of the enabled kernels applies to this model")
    return report


# --------------------------------------------------------------------------------------------
# Parity self-check
# --------------------------------------------------------------------------------------------

# fp32: patched and unpatched run the same math with different summation orders and fusion;
# measured differences are ~1e-7 relative, 1e-5 leaves room for depth and vocabulary size.
FP32_TOL = 1e-5
# 16-bit: the two models round at different places (the kernels keep fp32 intermediates that
# HF rounds to bf16), so they are compared through an fp32 run of the same weights: the patched
# model's error must be at most twice HF's own, plus 2⁻⁸ (one bf16 rounding) of slack for
# quantities where HF happens to land very close.
LOW_PRECISION_SLACK = 2.0**-8


@dataclass
class ParityCheck:
    name: str
    error: float  # relative error of the patched model (vs HF, or vs the fp32 run in 16-bit)
    tolerance: float
    hf_error: float | None = None  # 16-bit only: HF's own relative error vs the fp32 run

    @property
    def ok(self) -> bool:
        return math.isfinite(self.error) and self.error <= self.tolerance

    def __str__(self) -> str:
        hf = f", HF {self.hf_error:.2e}" if self.hf_error is not None else ""
        return f"{self.name}: {self.error:.2e} (tol {self.tolerance:.2e}{hf}) {'ok' if self.ok else 'FAIL'}"


@dataclass
class ParityResult:
    dtype: torch.dtype
    report: PatchReport
    checks: list[ParityCheck]
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def failures(self) -> list[ParityCheck]:
        return [c for c in self.checks if not c.ok]

    def __str__(self) -> str:
        against = "HF" if self.dtype == torch.float32 else "an fp32 run (HF's error shown)"
        lines = [
            f"parity {str(self.dtype).removeprefix('torch.')}, patched vs {against}: "
            f"{'PASS' if self.ok else 'FAIL'}"
        ]
        grads = [c for c in self.checks if c.name.startswith("grad ")]
        lines += [f"  {c}" for c in self.checks if not c.name.startswith("grad ")]
        if grads:
            worst = max(grads, key=lambda c: c.error / c.tolerance if c.tolerance else math.inf)
            lines.append(f"  grads: {len(grads)} tensors, worst {worst}")
            lines += [f"  {c}" for c in grads if not c.ok and c is not worst]
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double(), ref.detach().double()
    denom = ref.norm().item()
    return (out - ref).norm().item() / (denom if denom > 0 else 1.0)


def _run(model: nn.Module, batch: dict, seed: int) -> dict[str, torch.Tensor]:
    """Loss and gradients in train mode (with labels: the fused path), logits in eval mode."""
    model.zero_grad(set_to_none=True)
    model.train()
    devices = [model.device] if getattr(model, "device", torch.device("cpu")).type == "cuda" else []
    with torch.random.fork_rng(devices=devices):  # same dropout masks in every run
        torch.manual_seed(seed)
        loss = model(**batch).loss
    loss.backward()
    results = {"loss": loss.detach()}
    for name, p in model.named_parameters():
        if p.grad is not None:
            results[f"grad {name}"] = p.grad.detach().clone()
    model.zero_grad(set_to_none=True)
    model.eval()
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        results["logits (eval)"] = model(**inputs).logits
    return results


def _as_model(source, device, dtype) -> nn.Module:
    if isinstance(source, nn.Module):
        model = copy.deepcopy(source)
    elif callable(source):
        model = source()
    else:  # a transformers config
        model = AutoModelForCausalLM.from_config(source)
    return model.to(device=device, dtype=dtype)


def parity_check(
    model_factory_or_config,
    batch: Mapping[str, torch.Tensor],
    kernels: KernelsSection | Mapping | str | None = None,
    dtype: torch.dtype = torch.float32,
    *,
    device: torch.device | str | None = None,
    seed: int = 0,
) -> ParityResult:
    """Compare a patched and an unpatched copy of one model on one batch.

    ``model_factory_or_config``: a model (deep-copied, left untouched), a callable returning one,
    or a transformers config (random init). ``batch``: ``input_ids`` (``attention_mask``
    optional); ``labels`` default to ``input_ids``. Checked, as relative norms of the difference:
    the training loss (the fused path when that kernel is on), every parameter gradient, and the
    eval-mode logits (HF's path: no labels). Tolerances: `FP32_TOL` in fp32; in bf16/fp16 both
    models are compared with an fp32 run of the same weights (see `LOW_PRECISION_SLACK`).
    """
    if "input_ids" not in batch:
        raise ValueError("batch needs input_ids (and optionally attention_mask and labels)")
    device = torch.device(device) if device is not None else batch["input_ids"].device
    batch = {k: v.to(device) for k, v in batch.items()}
    batch.setdefault("labels", batch["input_ids"].clone())
    reference = _as_model(model_factory_or_config, device, dtype)
    patched = copy.deepcopy(reference)
    report = patch_model(patched, kernels)
    hf, ours = _run(reference, batch, seed), _run(patched, batch, seed)
    checks = []
    if dtype == torch.float32:
        for name, ref in hf.items():
            checks.append(
                ParityCheck(name, _rel_err(ours[name], ref) if name in ours else math.inf, FP32_TOL)
            )
    else:
        truth = _run(reference.float(), batch, seed)
        for name, ref in truth.items():
            hf_err = _rel_err(hf[name], ref)
            err = _rel_err(ours[name], ref) if name in ours else math.inf
            checks.append(ParityCheck(name, err, 2 * hf_err + LOW_PRECISION_SLACK, hf_err))
    checks += [ParityCheck(name, math.inf, 0.0) for name in ours.keys() - hf.keys()]
    return ParityResult(dtype, report, checks)


# Largest model `check_recipe` builds: it holds two (in 16-bit three) copies with gradients.
CHECK_MAX_PARAMS = {"cpu": 300_000_000, "cuda": 3_000_000_000}


def check_recipe(recipe, device: torch.device | str | None = None) -> ParityResult:
    """`parity_check` on the recipe's own model (``ligertune validate --check``).

    The model comes from `ligertune.models.build_model`, so ``model.config_overrides`` apply:
    that is how a big architecture is shrunk for the check (``num_hidden_layers=2``, ...). The
    batch is two random rows of ``min(data.max_seq_len, 128)`` tokens (32 on CPU) whose first
    quarter is masked with -100 like a prompt; the dtype is the precision's parameter dtype.
    """
    from ligertune.models import build_config, build_model, param_dtype
    from ligertune.recipe import RecipeError

    if device is None:
        wanted = recipe.training.device
        device = "cuda" if wanted == "cuda" or (wanted == "auto" and torch.cuda.is_available()) else "cpu"
    device = torch.device(device)
    config = build_config(recipe)
    with torch.device("meta"):
        meta_model = AutoModelForCausalLM.from_config(
            config, trust_remote_code=recipe.model.trust_remote_code
        )
        n_params = sum(p.numel() for p in meta_model.parameters())
    limit = CHECK_MAX_PARAMS[device.type]
    if n_params > limit:
        raise RecipeError(
            [
                f"validate --check: the model has {n_params / 1e9:.1f}B parameters, more than the check builds on "
                f"{device.type} ({limit / 1e9:.1f}B); shrink it for the check with model.config_overrides, e.g. "
                "model.config_overrides.num_hidden_layers=2 (on CPU also smaller hidden_size, "
                "intermediate_size and vocab_size)"
            ]
        )
    generator = torch.Generator().manual_seed(recipe.seed)
    seq_len = min(recipe.data.max_seq_len, 128 if device.type == "cuda" else 32)
    input_ids = torch.randint(0, config.vocab_size, (2, seq_len), generator=generator)
    labels = input_ids.clone()
    labels[:, : seq_len // 4] = -100
    batch = {"input_ids": input_ids, "labels": labels}
    dtype = param_dtype(recipe.training.precision)
    result = parity_check(
        lambda: build_model(recipe, device), batch, recipe.kernels, dtype, device=device, seed=recipe.seed
    )
    if device.type == "cpu" and not INTERPRET:
        result.notes.append(
            "no GPU: the kernels ran their PyTorch references; set TRITON_INTERPRET=1 to run the Triton code "
            "in its CPU interpreter (slow)"
        )
    return result
