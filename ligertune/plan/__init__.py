"""The memory plan: how much GPU memory a training step needs, torch-free arithmetic over a
`ModelShape` and a `Setting`, behind ``ligertune plan`` and the ``auto`` choices of
``training.activation_checkpointing`` and ``training.micro_batch_size``.

`setting` (the terms), `activations` (what autograd saves, the loss head), `vision` (a
vision-language model's vision tower: the images' patches, what its blocks hold), `estimate` (the
moments of a step and the peak), `choose` (the candidates, their order, the pick, the cheapest
fix) and `recipe` (a recipe read as a `Setting`). How a strategy spreads the model states and
what an objective's loss head holds are declared by each (`ligertune.catalog`). The shape comes
from an empty model build (`ligertune.models.shape`); the GPU's budget from the run
(`ligertune.training.auto`).
"""
