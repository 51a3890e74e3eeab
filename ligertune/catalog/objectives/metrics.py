"""Metric names the preference objectives share (TRL's names, '/' → '_')."""

PAIR_METRICS = (
    "rewards_chosen",
    "rewards_rejected",
    "rewards_margin",
    "rewards_accuracy",
    "logps_chosen",
    "logps_rejected",
)
