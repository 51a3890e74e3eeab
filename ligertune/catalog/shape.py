"""`ModelShape`: the sizes of a model that decide its memory and its FLOPs, in one place.

Read once from a model (``ligertune.models.shape.model_shape``, on the meta device: no memory,
no weights) and then used by torch-free arithmetic: the memory plan (`ligertune.plan`) and the
model FLOPs behind MFU (`ligertune.run.metrics`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VisionShape:
    """A vision-language model's vision tower, as the memory plan counts it
    (`ligertune.plan.vision`): its blocks' sizes, whether they train, and how many patches the
    recipe's largest image makes.

    ``tokens_per_image`` and ``patches_per_image`` are those of the largest image a row can
    carry: Qwen-VL's ``data.image_max_pixels`` in patches of ``patch_size``², merged
    ``merge``² to a token; Gemma 3's fixed ``mm_tokens_per_image`` over its fixed
    ``image_size``. None where the recipe sets no bound (Qwen-VL without
    ``data.image_max_pixels``: the image processor's own bound, which the plan does not read).
    Llama 3.2 Vision (a cross-attention family): ``max_num_tiles`` tiles of ``image_size``², each
    its patches and a class token, padded to a multiple of 8 as its tower pads them; its text
    holds one token per image, which bounds nothing, so ``images_per_row`` is an assumption of one
    image per row (None: as many as the row's tokens hold)."""

    layers: int
    hidden: int
    intermediate: int
    gated: bool  # its MLP: gate, up and their product (Qwen2.5-VL), or one up projection (SigLIP, Qwen3-VL)
    trains: bool  # its blocks have trainable parameters (not model.freeze: vision, not LoRA)
    patches_per_token: int  # patches merged into one image token (Qwen-VL: merge²)
    tokens_per_image: int | None
    patches_per_image: int | None
    max_pixels: int | None = None  # data.image_max_pixels, where it bounds the image (for the plan's note)
    images_per_row: int | None = None


@dataclass(frozen=True)
class LatentAttention:
    """DeepSeek's multi-head latent attention (MLA), as the memory plan counts it
    (`ligertune.plan.activations`). Per token: ``q = q_b(norm(q_a(x)))`` through a latent of
    ``q_rank`` (0: one ``q_proj`` from x), and ``[c | k_rope] = kv_a(x)``, ``[k_nope | v] =
    kv_b(norm(c))`` through a latent c of ``kv_rank``; every head's q and k are
    ``head_dim = nope + rope_dim`` wide, the last ``rope_dim`` rotated (k's rotated part is one
    for all heads), its v ``v_head_dim`` wide."""

    q_rank: int
    kv_rank: int
    rope_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class ModelShape:
    """The sizes that decide memory and FLOPs, read from a (meta-device) model and its config
    (a multimodal model's ``text_config`` for the language model's geometry)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    params: int  # all parameters
    layer_params: int  # the largest decoder layer (an MoE layer where the first ones are dense)
    embed_params: int  # the input embedding
    head_params: int  # the lm_head (0 when tied to the embedding)
    lora_params: int = 0  # trainable adapter parameters (0: full fine-tuning)
    expert_lora_params: int = 0  # of which on the routed experts' weights (lora.target_parameters)
    # Mixture of experts (0 for a dense model). `intermediate` is then the MLP width one token
    # goes through: top_k routed experts' widths plus a shared expert's, which is what its
    # activations are sized by (the memory plan's approximation: it counts a token's k expert
    # rows as one row k times as wide, and the dense layers of mlp_only_layers, if any, alike).
    experts: int = 0  # routed experts per MoE layer
    top_k: int = 0  # experts per token
    expert_params: int = 0  # the routed experts' weights, all layers (all of them in `params`)
    expert_layers: int = 0  # the layers holding them (DeepSeek's first layers are dense)
    # Parameters `model.freeze` leaves untrained (a vision-language model's named parts): like
    # LoRA's frozen base, weights without gradients or AdamW moments.
    frozen_params: int = 0
    vision: VisionShape | None = None  # a vision-language model's vision tower
    # Why context parallelism cannot split this model's rows (mixture of experts, sliding
    # windows, softcapping, attention dropout, images: `ligertune.models.attention.context_parallel_problem`),
    # or None. The memory plan proposes ``parallel.context_parallel`` only where it is None.
    row_split_problem: str | None = None
    latent: LatentAttention | None = None  # multi-head latent attention (DeepSeek-V3); head_dim is q/k's

    @property
    def v_head_dim(self) -> int:
        """One head's width of v and of the attention's output (q/k's, `head_dim`, but in MLA)."""
        return self.latent.v_head_dim if self.latent else self.head_dim

    @property
    def rotary_dim(self) -> int:
        """The rotated part of a q/k head: all of it, but in MLA (where cos/sin are this wide)."""
        return self.latent.rope_dim if self.latent else self.head_dim

    @property
    def trainable(self) -> int:
        """Parameters with gradients and optimizer state: LoRA's adapters, else every parameter
        `model.freeze` leaves training."""
        return self.lora_params or self.params - self.frozen_params

    @property
    def active_params(self) -> int:
        """Parameters one token computes with: all but the routed experts it is not sent to
        (each token uses top_k of the `experts` of every MoE layer)."""
        if not self.experts:
            return self.params
        return self.params - self.expert_params * (self.experts - self.top_k) // self.experts

    @property
    def layer_active_params(self) -> int:
        """The largest decoder layer's parameters a token computes with (its MoE layers taken as
        alike: each holds 1/expert_layers of the routed experts' weights)."""
        if not self.experts:
            return self.layer_params
        inactive = self.expert_params // self.expert_layers * (self.experts - self.top_k) // self.experts
        return self.layer_params - inactive

    @property
    def matmul_params(self) -> int:
        """Active parameters taking part in matmuls: all but the input embedding's lookup and
        the experts a token is not routed to, with the output projection counted once even when
        it shares the embedding's weight."""
        return self.active_params - (0 if self.head_params == 0 else self.embed_params)

    @property
    def attention_width(self) -> int:
        """d_attn = heads × head_dim: the width of QKᵀ and PV; their mean where v heads are
        narrower than q/k's (MLA: QKᵀ is heads × head_dim wide, PV heads × v_head_dim)."""
        return self.heads * (self.head_dim + self.v_head_dim) // 2

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, 6·N + 12·L·d_attn·S (`ligertune.run.metrics` explains the
        convention)."""
        return 6.0 * self.matmul_params + 12.0 * self.layers * self.attention_width * seq_len
