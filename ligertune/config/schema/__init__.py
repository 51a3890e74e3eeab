"""The recipe schema: one pydantic model per YAML section, every field typed, defaulted and described.

The sections live in `model` (model, tokenizer, LoRA), `data`, `training` (training, kernels) and
`run` (logging, checkpoint, export); the ``objective`` and ``parallel`` sections are the
catalog's unions of one model per objective and per strategy (`ligertune.catalog.objectives`,
`ligertune.catalog.strategies`), and the strict `Section` base is the catalog's too. `Recipe`,
here, puts them together.

``docs/recipes.md`` is generated from these models (``python scripts/gen_recipe_docs.py``, checked
by a test). Rules that relate several keys live in `ligertune.config.rules`, not here: a field
validator checks its own value only.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import Field, field_validator, model_validator

from ligertune.catalog import objectives, strategies
from ligertune.catalog.formats import UNPACKED_FORMATS
from ligertune.catalog.objectives import OBJECTIVES, ObjectiveOptions
from ligertune.catalog.section import RUN_NAME, ModelSection, Section
from ligertune.catalog.strategies import STRATEGIES, ParallelOptions
from ligertune.config.schema.data import DataSection, DataSource
from ligertune.config.schema.model import LoraSection, TokenizerSection
from ligertune.config.schema.run import CheckpointSection, EvalSection, ExportSection, LoggingSection
from ligertune.config.schema.training import KernelsSection, TrainingSection
from ligertune.paths import resolve_path


class Recipe(Section):
    name: str = Field(
        "run",
        description="Run name (letters, digits, '.', '_', '-'); also the default output directory under runs/.",
    )
    description: str = Field("", description="One line shown by `ligertune recipes`.")
    seed: int = Field(
        42, ge=0, lt=2**32, description="Seed for weights (random init), data order and dropout; 0 to 2³²−1."
    )
    output_dir: str | None = Field(
        None, description="Where checkpoints, metrics and the export go (default runs/<name>); ~ expands."
    )
    model: ModelSection = Field(description="What to train.")
    plugins: list[str] = Field(
        default_factory=list,
        description="Functions applied to the model after our kernels, as 'module:function' (called with "
        "the model and the recipe) or a built-in name (liger: Liger-Kernel's patch, for comparisons).",
    )
    tokenizer: TokenizerSection = Field(
        default_factory=TokenizerSection, description="Tokenizer source and padding."
    )
    data: DataSection = Field(description="Dataset, format and sequence layout.")
    training: TrainingSection = Field(
        default_factory=TrainingSection, description="Optimizer, schedule and loop."
    )
    kernels: KernelsSection = Field(
        default_factory=KernelsSection,
        description="Which Triton kernels to patch in: all, none, or per kernel.",
    )
    parallel: STRATEGIES.annotation = Field(
        default_factory=STRATEGIES.default,
        description="Multi-GPU strategy: one of " + ", ".join(STRATEGIES.names) + ", with its options.",
    )
    logging: LoggingSection = Field(
        default_factory=LoggingSection, description="Metrics and progress output."
    )
    checkpoint: CheckpointSection = Field(
        default_factory=CheckpointSection, description="Saving and resuming."
    )
    export: ExportSection = Field(
        default_factory=ExportSection, description="Where the final export goes besides the run directory."
    )
    eval: EvalSection = Field(
        default_factory=EvalSection, description="Benchmarks (lm-evaluation-harness) at the end of the run."
    )
    objective: OBJECTIVES.annotation = Field(
        default_factory=OBJECTIVES.default,
        description="The loss: one of " + ", ".join(OBJECTIVES.names) + ", with its options.",
    )
    lora: LoraSection | None = Field(
        None,
        description="Train LoRA adapters instead of every weight (peft; pip install 'ligertune[lora]'). "
        "Absent: full fine-tuning.",
    )

    # The directory the recipe file lives in: relative paths resolve against it.
    _base_dir: Path | None = None
    # The recipe file itself (absolute), when it was read from one: a run records it, and an
    # automatic resume of a finished run from another file is refused (`ligertune.training.resume`).
    _source_file: Path | None = None

    @field_validator("name")
    @classmethod
    def _plain_name(cls, value: str) -> str:
        """The default output folder is runs/<name>: a name with a separator or ``..`` would write
        outside runs/, which is what output_dir is for."""
        if not RUN_NAME.fullmatch(value) or value in (".", ".."):
            raise ValueError(
                f"got {value!r}; a run name is a plain name (letters, digits, '.', '_', '-'); "
                "to choose where the run writes, set output_dir"
            )
        return value

    @model_validator(mode="after")
    def _pairs_unpacked(self) -> Recipe:
        """Preference and kto rows hold two sequences trained as a pair, which packing cannot keep
        together, and a prompt row is completed into its own row: data.packing defaults to off for
        them (the rule ``objective.pairs_unpacked`` refuses an explicit true)."""
        if self.data.format in UNPACKED_FORMATS and "packing" not in self.data.model_fields_set:
            self.data.packing = False
        return self

    @field_validator("objective", mode="before")
    @classmethod
    def _objective_section(cls, value):
        return objectives.read_section(value)

    @field_validator("parallel", mode="before")
    @classmethod
    def _parallel_section(cls, value):
        return strategies.read_section(value)

    @field_validator("kernels", mode="before")
    @classmethod
    def _kernel_preset(cls, value):
        if isinstance(value, str):
            if value not in ("all", "none"):
                raise ValueError(f"expected 'all', 'none' or a mapping of kernel: true/false, got {value!r}")
            return KernelsSection.preset(value)
        return value

    @property
    def run_dir(self) -> Path:
        """Where the run writes: output_dir (``~`` expanded, relative to the working directory),
        else runs/<name>."""
        return Path(os.path.expanduser(self.output_dir)) if self.output_dir else Path("runs") / self.name

    def resolve(self, path: str) -> Path:
        return resolve_path(path, self._base_dir)

    @property
    def base_dir(self) -> Path | None:
        """The folder of the recipe file (None for a recipe built in code): relative paths, and
        the modules of reward functions, are looked up there too."""
        return self._base_dir


__all__ = [
    "CheckpointSection",
    "DataSection",
    "DataSource",
    "EvalSection",
    "ExportSection",
    "KernelsSection",
    "LoggingSection",
    "LoraSection",
    "ModelSection",
    "ObjectiveOptions",
    "ParallelOptions",
    "Recipe",
    "Section",
    "TokenizerSection",
    "TrainingSection",
]
