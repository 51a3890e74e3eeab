"""``fsdp``: FSDP2 ``fully_shard`` per decoder layer and on the root; parameters, gradients and
optimizer state sharded over the ranks (`ligertune.distributed.fsdp` is the engine)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field

from ligertune.catalog.rules import Rule, runs_on_cuda
from ligertune.catalog.section import Section
from ligertune.catalog.shape import ModelShape
from ligertune.catalog.strategies.base import (
    PRECISION_SAVED,
    WEIGHT_BYTES,
    ParallelOptions,
    ResumeRule,
    scale_out,
)

if TYPE_CHECKING:
    from ligertune.config.schema import Recipe


class FSDPOptions(Section):
    reshard_after_forward: bool = Field(
        True,
        description="Free gathered parameters after forward (ZeRO-3 style); the last decoder layer, "
        "whose backward comes first, stays gathered either way.",
    )
    cpu_offload: bool = Field(False, description="Keep sharded parameters and gradients on the CPU.")
    mixed_precision: bool = Field(
        True,
        description="bf16 parameters in compute (with training.precision bf16-mixed), reduction in reduce_dtype.",
    )
    reduce_dtype: Literal["fp32", "bf16"] = Field(
        "fp32",
        description="dtype of the gradients' reduce-scatter: fp32 (sums exact to fp32) or bf16 (half the "
        "bytes on the wire; each rank's partial sums rounded to bf16, check the loss with compare).",
    )
    prefetch: int = Field(
        1,
        ge=1,
        le=4,
        description="Decoder layers gathered ahead of the one computing, in forward and in backward: more "
        "hides more all-gather time behind compute, and holds that many more layers' weights.",
    )


def cpu_offload_needs_gpu(recipe: Recipe) -> list[str]:
    """FSDP CPU offload needs a GPU on this machine."""
    if recipe.parallel.fsdp.cpu_offload and not runs_on_cuda(recipe):
        return [
            "parallel.fsdp.cpu_offload: offloading moves the shards off the GPU and needs training.device cuda; "
            "set parallel.fsdp.cpu_offload=false on the CPU"
        ]
    return []


class FSDPParallel(ParallelOptions):
    strategy: Literal["fsdp"] = Field("fsdp", description="The parallel strategy.")
    fsdp: FSDPOptions = Field(default_factory=FSDPOptions, description="Options of FSDP2.")

    summary: ClassVar[str] = "FSDP2 fully_shard: parameters, gradients and optimizer state sharded"
    label: ClassVar[str] = "FSDP2"
    checkpoint_format: ClassVar[str] = "dcp"
    checkpoint_files: ClassVar[tuple[str, ...]] = ("dcp/.metadata",)
    resume_rules: ClassVar[dict[str, ResumeRule]] = {
        "fsdp.reshard_after_forward": None,
        "fsdp.cpu_offload": None,
        "fsdp.reduce_dtype": None,
        "fsdp.prefetch": None,
        "fsdp.mixed_precision": PRECISION_SAVED,
    }
    unsupported: ClassVar[dict[str, str]] = {
        "quantized": "quantised weights cannot be sharded",
        "eval.tasks": "the model is sharded over the processes",
        # The generation's decode captured as a CUDA graph (objective.generation_cache: static)
        # over the weights `Runtime.gathered` holds unsharded: FSDP2's forward hooks run inside
        # the capture, never tried.
        "graphed generation": "CUDA graphs over its gathered weights are untried",
    }
    gathers_float8: ClassVar[bool] = True  # torchao's float8 tensors implement FSDP2's all-gather hooks
    rules: ClassVar[tuple[Rule, ...]] = (
        *ParallelOptions.rules,
        Rule("parallel.fsdp_cpu_offload_needs_gpu", cpu_offload_needs_gpu, "machine"),
    )

    def shards_parameters(self) -> bool:
        return True

    def sharded_init_problem(self) -> str | None:
        if self.fsdp.cpu_offload:
            # The shards would be made in CPU memory, from which NCCL cannot broadcast rank 0's weights.
            return (
                "parallel.sharded_init: true is not supported with parallel.fsdp.cpu_offload yet; set it to "
                "auto or false"
            )
        return None

    # -- memory ---------------------------------------------------------------------------------

    def gathered_bytes(self, precision: str) -> int:
        """Bytes per element of a layer FSDP2 gathers: bf16 with ``mixed_precision`` (unless fp32)."""
        return 2 if self.fsdp.mixed_precision and precision != "fp32" else WEIGHT_BYTES[precision]

    def bf16_parameters(self, precision: str) -> bool:
        return self.fsdp.mixed_precision

    def memory_states(self, shape: ModelShape, precision: str, world_size: int) -> tuple[dict[str, int], int]:
        """Weights, moments and gradients sharded (none on the GPU with ``cpu_offload``); one
        layer gathered and ``prefetch`` more; the root (embeddings, final norm, lm_head) gathered
        from forward to backward. Without ``reshard_after_forward`` every layer stays gathered
        from its forward to its backward, so at the start of the backward (the peak) all of them
        are: counted as a state, which over-counts the end of the backward, where the layers
        are resharded again."""
        sharded, grads = self._sharded_states(shape, precision, world_size)
        if self.fsdp.cpu_offload:  # on the host (`memory_host`)
            sharded, grads = dict.fromkeys(sharded, 0), 0
        gathered = self.gathered_bytes(precision)
        states = {
            **sharded,
            "FSDP2 gathered layers (current + prefetch)": (1 + self.fsdp.prefetch)
            * shape.layer_params
            * gathered,
            "FSDP2 gathered root (embeddings, lm_head, norm)": (shape.embed_params + shape.head_params)
            * gathered,
        }
        if not self.fsdp.reshard_after_forward:
            states["FSDP2 other layers kept gathered (reshard_after_forward: false)"] = (
                self._other_layers_bytes(shape, precision)
            )
        return states, grads

    def memory_host(self, shape: ModelShape, precision: str, world_size: int) -> dict[str, int]:
        """With ``cpu_offload``: this rank's shards of the weights, the AdamW moments and the
        gradients (FSDP2 keeps the gradients' shards on the CPU for AdamW's step there)."""
        if not self.fsdp.cpu_offload:
            return {}
        sharded, grads = self._sharded_states(shape, precision, world_size)
        return {**sharded, "gradients (sharded)": grads}

    def _sharded_states(
        self, shape: ModelShape, precision: str, world_size: int
    ) -> tuple[dict[str, int], int]:
        """This rank's shards of the weights and AdamW moments, by name, and of the gradients."""
        ew = WEIGHT_BYTES[precision]
        states = {
            "weights (sharded)": shape.params * ew // world_size,
            "AdamW moments (sharded)": 2 * shape.trainable * ew // world_size,
        }
        return states, shape.trainable * ew // world_size

    def reduce_bytes(self, precision: str) -> int:
        """Bytes per element of the gradients' reduce-scatter (`reduce_dtype`; without
        ``mixed_precision`` the parameters' own dtype)."""
        if self.fsdp.mixed_precision:
            return 2 if self.fsdp.reduce_dtype == "bf16" else 4
        return WEIGHT_BYTES[precision]

    def memory_temporaries(self, shape: ModelShape, precision: str) -> dict[str, int]:
        return {
            "FSDP2 reduce-scatter of one layer's gradients": shape.layer_params * self.reduce_bytes(precision)
        }

    def lm_head_gradient_share(self, world_size: int) -> int:
        return world_size

    def _other_layers_bytes(self, shape: ModelShape, precision: str) -> int:
        """The decoder layers besides the current and prefetched ones, gathered."""
        return (
            max(0, shape.layers - 1 - self.fsdp.prefetch)
            * shape.layer_params
            * self.gathered_bytes(precision)
        )

    def memory_whole_gathered(self, shape: ModelShape, precision: str) -> int:
        """Every decoder layer gathered (the states count the root and 1 + prefetch layers, and
        without ``reshard_after_forward`` the others too)."""
        return self._other_layers_bytes(shape, precision) if self.fsdp.reshard_after_forward else 0

    def frozen_memory(self, frozen: ModelShape, precision: str, world_size: int) -> tuple[int, int, str]:
        """Sharded like the policy (always resharded after forward): 1/world of its weights, and
        while its forward runs the gathered layers (current + prefetch) and its root."""
        where = "sharded, on the CPU" if self.fsdp.cpu_offload else "sharded"
        weights = 0 if self.fsdp.cpu_offload else frozen.params * WEIGHT_BYTES[precision] // world_size
        layers = (1 + self.fsdp.prefetch) * frozen.layer_params
        gathered = (layers + frozen.embed_params + frozen.head_params) * self.gathered_bytes(precision)
        return weights, gathered, f"{'bf16' if WEIGHT_BYTES[precision] == 2 else 'fp32'}, {where}"

    def memory_fixes(self, precision: str, world_size: int) -> list[tuple[str, dict]]:
        offload = self.model_copy(update={"fsdp": self.fsdp.model_copy(update={"cpu_offload": True})})
        return [scale_out(world_size), ("parallel.fsdp.cpu_offload=true", {"parallel": offload})]


def shard_with_fsdp(world_size: int) -> tuple[str, dict]:
    """The fix of a replica strategy that does not fit: FSDP2 on twice the GPUs."""
    more = max(2, world_size * 2)
    return f"parallel.strategy=fsdp with --nproc-per-node {more}", {
        "parallel": FSDPParallel(),
        "world_size": more,
    }
