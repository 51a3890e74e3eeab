"""The training loop and what it is made of.

`trainer` holds the loop (`Trainer`: setup / train / cleanup, and `train(recipe)`), `step` one
optimizer step's forward and backward and evaluation, `transforms` the ordered list of model
transforms applied before the strategy wraps the model, `optim` the optimizer and schedule,
`resume` what a checkpoint restores, `signals` the SIGTERM/SIGINT handling, and `export` the
final Hugging Face model.
"""

from ligertune.errors import TrainingError
from ligertune.training.trainer import StepRecord, Trainer, TrainResult, train

__all__ = ["StepRecord", "TrainResult", "Trainer", "TrainingError", "train"]
