"""What a run writes: logging, checkpoints and the final export."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from ligertune.catalog.section import HUB_REPO_ID, Section


class LoggingSection(Section):
    log_every: int = Field(10, gt=0, description="Print and record metrics every N optimizer steps.")
    progress: Literal["auto", "rich", "plain"] = Field(
        "auto", description="auto: a rich progress bar on a terminal, plain lines otherwise."
    )
    loggers: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=list,
        description="Experiment trackers that also receive the metrics, e.g. [tensorboard, wandb]. Each is "
        "an extra (pip install 'ligertune[wandb]'); a selected one that is not installed is a recipe error.",
    )
    run_name: str | None = Field(
        None, description="The run's name in W&B and MLflow (default: the run directory's name)."
    )
    wandb_project: str | None = Field(None, description="W&B project (default: ligertune).")
    wandb_entity: str | None = Field(None, description="W&B entity (team or user; default: yours).")
    mlflow_tracking_uri: str | None = Field(
        None, description="MLflow tracking URI (default: MLFLOW_TRACKING_URI, else ./mlruns)."
    )
    mlflow_experiment: str | None = Field(None, description="MLflow experiment (default: ligertune).")
    tensorboard: bool = Field(
        False, description="Deprecated spelling of loggers: [tensorboard]; still honoured."
    )
    throughput_warmup_steps: int = Field(2, ge=0, description="Steps left out of tokens/s and MFU averages.")

    def selected_loggers(self) -> list[str]:
        """`loggers`, plus tensorboard when the deprecated `tensorboard: true` asks for it."""
        extra = ["tensorboard"] if self.tensorboard and "tensorboard" not in self.loggers else []
        return [*self.loggers, *extra]


class CheckpointSection(Section):
    every_steps: int | None = Field(
        None, gt=0, description="Save a resumable checkpoint every N steps (and at the end)."
    )
    save_every_epoch: bool = Field(
        False, description="Also save a resumable checkpoint at the step where each epoch of the data ends."
    )
    keep_last: int = Field(2, gt=0, description="Resumable checkpoints to keep; older ones are deleted.")
    save_final: bool = Field(
        True,
        description="Save a resumable checkpoint when the run ends (a stop by SIGTERM/SIGINT always saves).",
    )
    resume: str = Field(
        "auto", description="auto (newest complete checkpoint in output_dir), none, or a checkpoint path."
    )
    data_changed: Literal["refuse", "restart_epoch"] = Field(
        "refuse",
        description="When the data differs from what the checkpoint was trained on (its samples' digest): "
        "refuse the resume, or restart_epoch: keep the weights, optimizer and schedule and start the "
        "checkpoint's epoch over on the new data (rows trained on may land in validation).",
    )
    export_hf: bool = Field(
        True, description="Write a Hugging Face model (safetensors + config + tokenizer) at the end."
    )


class ExportSection(Section):
    push_to_hub: str | None = Field(
        None,
        description="Hub repository id (owner/name) to upload the Hugging Face export to at the end "
        "(needs checkpoint.export_hf; token from HF_TOKEN or `hf auth login`).",
    )
    private: bool = Field(True, description="Create the hub repository as private (when it does not exist).")
    merge_lora: bool = Field(
        False,
        description="With lora: besides the adapter (final/, peft format), the export (checkpoint.export_hf) "
        "writes final-merged/, a plain Hugging Face model with the adapters merged into the weights.",
    )

    @field_validator("push_to_hub")
    @classmethod
    def _repo_id(cls, value: str | None) -> str | None:
        if value is not None and not HUB_REPO_ID.fullmatch(value):
            raise ValueError(
                f"got {value!r}; a hub repository id is owner/name, e.g. my-org/llama3-8b-alpaca"
            )
        return value


class EvalSection(Section):
    tasks: list[str] = Field(
        default_factory=list,
        description="lm-evaluation-harness tasks to score the trained model on at the end of the run "
        "(pip install 'ligertune[eval]'), scores in metrics.jsonl and the summary: task names lm-eval "
        "knows (their datasets come from the hub) or local task YAML files, which work offline "
        "(ligertune://eval/tiny_qa.yaml is a tiny bundled one).",
    )
    limit: int | None = Field(None, gt=0, description="Score at most this many examples of each task.")
    num_fewshot: int | None = Field(
        None, ge=0, description="Few-shot examples per prompt (default: each task's own, else 0)."
    )
    batch_size: int = Field(8, gt=0, description="Sequences per forward while scoring.")
