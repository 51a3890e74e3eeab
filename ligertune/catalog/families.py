"""Which Hugging Face classes each supported model family uses, in one table.

`ligertune.patching` reads this table to find modules *by type* in an instantiated model; it never
copies a modeling file. One row per ``config.model_type``. Everything that differs between
families and matters to a kernel is a field here:

* the RMSNorm class and its semantics. Llama-style norms compute ``w * (x̂ in the input
  dtype)``; Gemma-style norms compute ``((1 + w) * x̂)`` in fp32 and cast once at the end,
  where ``x̂ = x / sqrt(mean(x²) + eps)``. The name of the eps attribute differs as well.
* the decoder layer class, the unit of activation checkpointing, compile and FSDP2 sharding
  (a multimodal model also has vision blocks in ``_no_split_modules``; this names the
  language model's), and any other layer class in the same stack (Mllama interleaves
  cross-attention layers with its self-attention layers: ``other_decoder_layers``);
* the attention class, whose forward calls the modeling module's ``apply_rotary_pos_emb``
  (Phi3's version rotates only the first ``cos.shape[-1]`` channels: partial rotary);
* the gated MLP class, whether gate and up come from one fused projection (Phi3's
  ``gate_up_proj``, split in half: gate first) and the attribute holding the activation;
* the causal-LM class and the config attribute of its final-logit softcap (Gemma 2/3:
  ``logits = cap · tanh(logits / cap)`` before the loss).

Classes are named, not imported, so that importing this table costs nothing (it is part of the
torch-free catalog); `resolve` imports the modeling module on demand.

A family with other parts keeps to one row: a mixture-of-experts family adds a record of its
expert and router classes (and how it routes, `Experts`), a vision-language family one of its
vision tower and projector (`VisionTower`), each a field of `Family` that is None for the dense
text families. GPT-OSS differs from the Llama layout twice in ways a kernel sees: its RMSNorm
multiplies the weight in fp32 before the one cast (the "gemma" casting with offset 0), and its
rotary cos/sin carry half the rotary width, each value used for both halves (``rope_half_cos``).
DeepSeek-V3 differs in its attention (multi-head latent attention, with RoPE on interleaved pairs:
``rope_interleave``, ``latent_attention``) and its routing (its row says how).
For a vision-language family the text fields above name the language model's classes (its
decoder layer, attention, MLP) and ``causal_lm`` the ``...ForConditionalGeneration`` class that
holds the lm_head; the vision tower's own RMSNorm is the same class as the language model's
where the modeling file shares it (Qwen2.5-VL), so ``rms_norm`` patches both.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Experts:
    """The mixture-of-experts part of a family: what routes, what computes, which config
    attributes size it, and how a token's experts and their weights are chosen.

    ``routing``: "softmax_topk": softmax over all experts' logits, then the top k of those
    probabilities (renormalised to sum to 1 when ``renormalise`` says so: True, or the name of
    the config attribute that decides it, Qwen's ``norm_topk_prob``); "topk_softmax": the top k
    logits, then a softmax over those k (GPT-OSS; the weights sum to 1 by construction);
    "sigmoid_group_topk" (DeepSeek-V3): scores ``s = sigmoid(logits)``; the choice is made on
    ``s + b``, ``b`` the router's ``e_score_correction_bias`` buffer: the E experts fall into
    ``n_group`` groups of consecutive experts, each group scored by the sum of its two best
    ``s + b``, the ``topk_group`` best groups kept, and the k best ``s + b`` among their experts
    chosen; the weights are the chosen experts' ``s`` (without ``b``), renormalised as
    ``renormalise`` says, times ``routed_scaling_factor``. The router computes it all: our
    kernel takes its indices and weights as given, so the record only describes it (checked
    against the router in ``tests/test_moe.py``).
    The experts module (``experts``) is what the ``moe_experts`` kernel patches; ``expert_activation``
    picks its layout (docs/moe.md).
    """

    sparse_block: str  # the module that routes and combines (GPT-OSS calls it GptOssMLP)
    router: str
    experts: str
    router_attr: str  # the router's attribute in the sparse block
    num_experts_attr: str
    expert_width_attr: str  # one expert's intermediate size
    routing: str  # "softmax_topk" | "topk_softmax" | "sigmoid_group_topk"
    renormalise: bool | str = False
    top_k_attr: str = "num_experts_per_tok"
    # None: transformers computes no load-balancing loss for the family (DeepSeek-V3 balances
    # without one, by moving its router's score bias between steps): no aux_loss term, no
    # ``model.router_aux_loss`` key, and the fused forward is the dense one.
    aux_loss_coef_attr: str | None = "router_aux_loss_coef"
    output_router_logits_attr: str = "output_router_logits"
    # A dense MLP every token goes through beside the routed experts; it is the family's `mlp`
    # class, so the gated kernel finds it. Qwen2-MoE scales it by sigmoid(shared_expert_gate(x))
    # and sizes it by its own attribute; DeepSeek-V3's has no gate and is as wide as
    # ``shared_experts_count_attr`` routed experts.
    shared_expert_attr: str | None = None
    shared_expert_gate_attr: str | None = None
    shared_expert_width_attr: str | None = None
    shared_experts_count_attr: str | None = None
    experts_biased: bool = False  # GPT-OSS: biases on both expert projections and the router
    expert_activation: str = "silu"  # GPT-OSS: "clamped_swiglu" (alpha 1.702, limit 7, (up + 1)·glu)
    # The experts module's 3-D weights, one [E, ·, ·] tensor per projection of every expert: what
    # ``lora.target_parameters`` puts adapters on (peft's ``target_parameters``). Qwen and Mixtral
    # store them [E, out, in], GPT-OSS [E, in, out]; peft reads that from the module's
    # ``is_transposed``, which transformers sets on GPT-OSS's experts class.
    weights: tuple[str, ...] = ("gate_up_proj", "down_proj")

    def shared_width(self, config) -> int:
        """The shared expert's intermediate size in `config` (0: the family has none)."""
        if self.shared_expert_width_attr:
            return getattr(config, self.shared_expert_width_attr)
        if self.shared_experts_count_attr:
            return getattr(config, self.shared_experts_count_attr) * getattr(config, self.expert_width_attr)
        return 0


@dataclass(frozen=True)
class VisionTower:
    """The vision side of a vision-language family: what the kernels, freezing, LoRA and the data
    pipeline need to know of it.

    ``tower``, ``projectors`` and ``language_model`` are attribute paths from the
    ``...ForConditionalGeneration`` model; a projector may sit inside the tower (Qwen2.5-VL's
    merger is ``model.visual.merger``, Qwen3-VL adds its deepstack mergers), and freezing the
    tower leaves it alone. ``block`` is the vision transformer block (the patch report counts
    them), ``mlp`` its gated MLP class when it has one (patched like the language model's).
    ``image_processor`` is the PIL image processor class, by dotted path: transformers 5.17's
    Auto image and processor classes need torchvision, which a CPU install lacks, and the PIL
    class computes the same pixels. ``image_token`` is the token the model fills with image
    features, one per feature (Qwen: one per merged patch; Gemma 3: a fixed count, the config's
    ``tokens_per_image_attr``); the chat template writes ``placeholder`` once per image (None:
    ``image_token`` itself), which the processor replaces by ``image_sequence`` with ``{tokens}``
    standing for the image tokens. ``vision_tokens`` are all of them, never trained on.
    ``token_type_key`` is the model's input marking image tokens with 1 (Qwen computes its 3-D
    positions from it, Gemma 3 its bidirectional attention over an image's tokens).
    ``rope_note`` is what the patch report says of the family's rotary embeddings (the language
    model's multimodal one, the tower's own). ``attention`` is the tower's attention class when
    it attends within ``cu_seqlens`` segments (images, windows) one call per segment, which the
    ``vision_attention`` kernel turns into one call per layer (None: SigLIP's whole-image call).

    ``cross_attention``: the language model reads the image features through cross-attention
    layers between its decoder layers (Llama 3.2 Vision) instead of image tokens among the text.
    The text then holds ``image_token`` once per image, never expanded; the image processor tiles
    each image (``pixel_values`` [images, tiles, 3, H, W], ``aspect_ratio_ids``,
    ``aspect_ratio_mask``), and each text token's ``cross_attention_mask`` says which images (and
    their tiles) it sees: from its image's token on, up to the next image's (the processor's rule,
    applied when a batch is collated). ``token_type_key`` is then None: the model takes no token
    types."""

    tower: str
    projectors: tuple[str, ...]
    language_model: str
    block: str
    mlp: str | None
    image_processor: str
    image_token: str
    vision_tokens: tuple[str, ...]
    rope_note: str = ""
    placeholder: str | None = None
    image_sequence: str = "{tokens}"
    tokens_per_image_attr: str | None = None  # None: one token per merged patch (image_grid_thw)
    token_type_key: str | None = "mm_token_type_ids"
    attention: str | None = None
    cross_attention: bool = False


@dataclass(frozen=True)
class Family:
    model_type: str
    module: str  # the transformers modeling module holding the classes below
    rms_norm: str
    norm_offset: float  # 0: w·x̂ (Llama);  1: (1 + w)·x̂ (Gemma)
    norm_casting: str  # "llama": cast x̂ to the input dtype before the weight; "gemma": all in fp32
    norm_eps_attr: str
    decoder_layer: str
    attention: str  # the self-attention (Mllama's cross-attention layers have no RoPE)
    mlp: str | None  # the dense gated MLP (None: Mixtral and GPT-OSS have none outside the experts)
    causal_lm: str
    mlp_act_attr: str = "act_fn"
    mlp_fused_gate_up: bool = False  # Phi3: gate_up_proj → (gate, up) halves
    logit_softcap_attr: str | None = None  # config attribute read at call time (None: no softcap)
    rope_half_cos: bool = False  # GPT-OSS: cos/sin hold half the rotary width, reused for both halves
    # DeepSeek-V3: the attention may also call ``apply_rotary_pos_emb_interleave`` (config
    # ``rope_interleave``), which the RoPE patch binds to our kernel after a permutation.
    rope_interleave: bool = False
    # DeepSeek-V3's multi-head latent attention: q and k/v come out of low-rank latents
    # (config q_lora_rank, kv_lora_rank) with q/k heads of qk_nope_head_dim + qk_rope_head_dim and
    # v heads of v_head_dim; the memory plan and the FLOPs count read those (`ModelShape.latent`).
    latent_attention: bool = False
    experts: Experts | None = None  # mixture-of-experts families only
    vision: VisionTower | None = None  # a vision-language family's vision tower and projector
    # Decoder layer classes interleaved with ``decoder_layer`` in the same stack (Mllama's
    # cross-attention layers): units of checkpointing, compile and FSDP2 as it is.
    other_decoder_layers: tuple[str, ...] = ()

    @property
    def balancing_loss(self) -> bool:
        """Whether transformers' forward adds a load-balancing loss: a mixture of experts whose
        record names its coefficient (not DeepSeek-V3, balanced by its router's score bias)."""
        return self.experts is not None and self.experts.aux_loss_coef_attr is not None

    def resolve(self, name: str) -> type:
        """The class (or function) called `name` in this family's modeling module."""
        return getattr(importlib.import_module(self.module), name)


def _llama_like(model_type: str, prefix: str, package: str | None = None, **changes) -> Family:
    package = package or model_type
    fields = dict(
        model_type=model_type,
        module=f"transformers.models.{package}.modeling_{package}",
        rms_norm=f"{prefix}RMSNorm",
        norm_offset=0.0,
        norm_casting="llama",
        norm_eps_attr="variance_epsilon",
        decoder_layer=f"{prefix}DecoderLayer",
        attention=f"{prefix}Attention",
        mlp=f"{prefix}MLP",
        causal_lm=f"{prefix}ForCausalLM",
    )
    fields.update(changes)
    return Family(**fields)


def _gemma_like(model_type: str, prefix: str, package: str, **changes) -> Family:
    return _llama_like(
        model_type, prefix, package, norm_offset=1.0, norm_casting="gemma", norm_eps_attr="eps", **changes
    )


def _qwen_experts(prefix: str, **changes) -> Experts:
    fields = dict(
        sparse_block=f"{prefix}SparseMoeBlock",
        router=f"{prefix}TopKRouter",
        experts=f"{prefix}Experts",
        router_attr="gate",
        num_experts_attr="num_experts",
        expert_width_attr="moe_intermediate_size",
        routing="softmax_topk",
        renormalise="norm_topk_prob",
    )
    fields.update(changes)
    return Experts(**fields)


# Qwen-VL's multimodal RoPE: the rotary module composes the 3-D (temporal, height, width)
# frequencies into cos/sin, which the language model's RoPE kernel takes as given; parity with HF's
# own model on image rows is tested (tests/test_vision.py).
MROPE_NOTE = (
    "rope: the language model's kernel rotates HF's multimodal 3-D cos/sin as given; the vision "
    "tower's 2-D RoPE (apply_rotary_pos_emb_vision) is not patched"
)

FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        _llama_like("llama", "Llama"),
        _llama_like("mistral", "Mistral"),
        _llama_like("qwen2", "Qwen2"),
        _llama_like("qwen3", "Qwen3"),  # q_norm / k_norm are Qwen3RMSNorm: found by type
        _llama_like("phi3", "Phi3", mlp_act_attr="activation_fn", mlp_fused_gate_up=True),
        _gemma_like("gemma", "Gemma", "gemma"),
        _gemma_like("gemma2", "Gemma2", "gemma2", logit_softcap_attr="final_logit_softcapping"),
        # Gemma 3 text-only checkpoints; the multimodal `gemma3` model type is the row below.
        _gemma_like("gemma3_text", "Gemma3", "gemma3", logit_softcap_attr="final_logit_softcapping"),
        # Gemma 3 image + text: the language model is Gemma3TextModel (the classes of the row above;
        # local and global layers get their own cos/sin from the rotary module, each a plain
        # rotate-half rotation). Gemma3ForConditionalGeneration's forward applies no final-logit
        # softcap (it never reads the text config's final_logit_softcapping, None in Gemma 3
        # checkpoints anyway), so the fused loss applies none either. The vision tower is SigLIP's
        # (nn.LayerNorm: the layer_norm kernel; an ungated tanh-GELU MLP: no kernel of ours); the
        # projector outside it pools to mm_tokens_per_image and normalises with a Gemma3RMSNorm.
        _gemma_like(
            "gemma3",
            "Gemma3",
            "gemma3",
            causal_lm="Gemma3ForConditionalGeneration",
            vision=VisionTower(
                tower="model.vision_tower",
                projectors=("model.multi_modal_projector",),
                language_model="model.language_model",
                block="SiglipEncoderLayer",
                mlp=None,
                image_processor="transformers.models.gemma3.image_processing_pil_gemma3.Gemma3ImageProcessorPil",
                image_token="<image_soft_token>",
                vision_tokens=("<start_of_image>", "<end_of_image>", "<image_soft_token>"),
                rope_note=(
                    "rope: the language model's kernel rotates the local and global layers' cos/sin as "
                    "given; the vision tower (SigLIP) has no RoPE"
                ),
                placeholder="<start_of_image>",
                # Gemma3Processor's full_image_sequence: the image between blank lines.
                image_sequence="\n\n<start_of_image>{tokens}<end_of_image>\n\n",
                tokens_per_image_attr="mm_tokens_per_image",
                token_type_key="token_type_ids",
            ),
        ),
        # Qwen3MoeMLP: the dense layers of mlp_only_layers / decoder_sparse_step.
        _llama_like(
            "qwen3_moe",
            "Qwen3Moe",
            experts=_qwen_experts("Qwen3Moe"),
        ),
        _llama_like(
            "qwen2_moe",
            "Qwen2Moe",
            experts=_qwen_experts(
                "Qwen2Moe",
                shared_expert_attr="shared_expert",
                shared_expert_gate_attr="shared_expert_gate",
                shared_expert_width_attr="shared_expert_intermediate_size",
            ),
        ),
        _llama_like(
            "mixtral",
            "Mixtral",
            mlp=None,
            experts=Experts(
                sparse_block="MixtralSparseMoeBlock",
                router="MixtralTopKRouter",
                experts="MixtralExperts",
                router_attr="gate",
                num_experts_attr="num_local_experts",
                expert_width_attr="intermediate_size",
                routing="softmax_topk",
                renormalise=True,
            ),
        ),
        _llama_like(
            "gpt_oss",
            "GptOss",
            mlp=None,
            norm_casting="gemma",  # (w · x̂) in fp32, one cast: GptOssRMSNorm
            rope_half_cos=True,
            experts=Experts(
                sparse_block="GptOssMLP",
                router="GptOssTopKRouter",
                experts="GptOssExperts",
                router_attr="router",
                num_experts_attr="num_local_experts",
                expert_width_attr="intermediate_size",
                routing="topk_softmax",
                experts_biased=True,
                expert_activation="clamped_swiglu",
            ),
        ),
        # DeepSeek-V3 (and models of its architecture: Moonlight, Kimi-K2). What differs from the
        # rows above, and why it matters to a kernel:
        # - routing: sigmoid scores, a score bias and group-limited top-k (`Experts.routing`),
        #   computed by HF's router; our experts kernel takes its indices and weights as given;
        # - no balancing loss in transformers (its experts are balanced by the router's bias,
        #   updated outside the gradient), so no aux_loss and the dense fused forward;
        # - a shared expert without a gate (DeepseekV3MLP, moe_intermediate_size × n_shared_experts:
        #   the SwiGLU kernel), and dense MLPs (the same class) in the first first_k_dense_replace layers;
        # - multi-head latent attention: q_a_layernorm and kv_a_layernorm are DeepseekV3RMSNorm
        #   (found by type); RoPE rotates only the qk_rope_head_dim part, in interleaved pairs
        #   when config.rope_interleave (the default) says so.
        _llama_like(
            "deepseek_v3",
            "DeepseekV3",
            rope_interleave=True,
            latent_attention=True,
            experts=Experts(
                sparse_block="DeepseekV3MoE",
                router="DeepseekV3TopkRouter",
                experts="DeepseekV3Experts",
                router_attr="gate",
                num_experts_attr="n_routed_experts",
                expert_width_attr="moe_intermediate_size",
                routing="sigmoid_group_topk",
                renormalise="norm_topk_prob",
                aux_loss_coef_attr=None,
                shared_expert_attr="shared_experts",
                shared_experts_count_attr="n_shared_experts",
            ),
        ),
        # Qwen2.5-VL: the language model is Qwen2's (its MLP class is Qwen2MLP in this modeling
        # file); its multimodal 3-D RoPE is computed in the rotary module (mrope_section picks
        # the temporal, height or width frequency per channel of cos/sin), and the attention then
        # calls a plain rotate-half `apply_rotary_pos_emb` on those cos/sin: our kernel's math.
        _llama_like(
            "qwen2_5_vl",
            "Qwen2_5_VL",
            mlp="Qwen2MLP",
            causal_lm="Qwen2_5_VLForConditionalGeneration",
            vision=VisionTower(
                tower="model.visual",
                projectors=("model.visual.merger",),
                language_model="model.language_model",
                block="Qwen2_5_VLVisionBlock",
                mlp="Qwen2_5_VLMLP",
                attention="Qwen2_5_VLVisionAttention",
                image_processor="transformers.models.qwen2_vl.image_processing_pil_qwen2_vl.Qwen2VLImageProcessorPil",
                image_token="<|image_pad|>",
                vision_tokens=("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"),
                rope_note=MROPE_NOTE,
            ),
        ),
        # Qwen3-VL: a Qwen3 language model (q_norm/k_norm are Qwen3VLTextRMSNorm) with interleaved
        # 3-D RoPE, again composed into cos/sin by the rotary module. Its vision blocks use
        # nn.LayerNorm (the layer_norm kernel) and an ungated GELU MLP (no kernel of ours); the
        # deepstack mergers feed vision features into early decoder layers.
        _llama_like(
            "qwen3_vl",
            "Qwen3VL",
            rms_norm="Qwen3VLTextRMSNorm",
            decoder_layer="Qwen3VLTextDecoderLayer",
            attention="Qwen3VLTextAttention",
            mlp="Qwen3VLTextMLP",
            causal_lm="Qwen3VLForConditionalGeneration",
            vision=VisionTower(
                tower="model.visual",
                projectors=("model.visual.merger", "model.visual.deepstack_merger_list"),
                language_model="model.language_model",
                block="Qwen3VLVisionBlock",
                mlp=None,
                # Its SDPA call per image (no windows) beat one flex call per layer on an H100:
                # 0.185 s against 0.219 s per tower forward + backward at four 896×896 images
                # (tests/test_vision_gpu.py's 7B-size tower), so vision_attention leaves it alone.
                image_processor="transformers.models.qwen2_vl.image_processing_pil_qwen2_vl.Qwen2VLImageProcessorPil",
                image_token="<|image_pad|>",
                vision_tokens=("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"),
                rope_note=MROPE_NOTE,
            ),
        ),
        # Llama 3.2 Vision: the language model (MllamaTextModel) is Llama's with cross-attention
        # layers between its self-attention layers. The RMSNorm (both layer kinds' norms, the
        # cross-attention's q_norm/k_norm, the final norm) is Llama's; the MLP is Llama's SwiGLU in
        # both layer kinds; only the self-attention rotates (plain rotate-half), the cross-attention
        # has no RoPE; the tanh gates on the cross-attention layers' outputs stay HF's (they
        # multiply outside the kernels). The vision tower (a local and a global encoder of
        # MllamaVisionEncoderLayer) normalises with nn.LayerNorm (the layer_norm kernel) and has an
        # ungated GELU MLP (no kernel of ours); the projector is one Linear.
        _llama_like(
            "mllama",
            "MllamaText",
            package="mllama",
            decoder_layer="MllamaSelfAttentionDecoderLayer",
            other_decoder_layers=("MllamaCrossAttentionDecoderLayer",),
            attention="MllamaTextSelfAttention",
            causal_lm="MllamaForConditionalGeneration",
            vision=VisionTower(
                tower="model.vision_model",
                projectors=("model.multi_modal_projector",),
                language_model="model.language_model",
                block="MllamaVisionEncoderLayer",
                mlp=None,
                image_processor="transformers.models.mllama.image_processing_pil_mllama.MllamaImageProcessorPil",
                image_token="<|image|>",
                vision_tokens=("<|image|>",),
                rope_note=(
                    "rope: the self-attention layers' kernel rotates Llama's cos/sin; the cross-attention "
                    "layers and the vision tower have no RoPE"
                ),
                token_type_key=None,
                cross_attention=True,
            ),
        ),
    )
}
