"""Training runs under a tuned config, measured the way people compare AMP: :func:`train`, and
:func:`compare` against a baseline on the same samples."""

from autotune.train._compare import baseline_candidate, compare
from autotune.train._models import (
    BASELINES,
    Comparison,
    Progress,
    TrainResult,
    TrainSettings,
    parse_train_settings,
)
from autotune.train._training_run import held_out_batches, train

__all__ = [
    "BASELINES",
    "Comparison",
    "Progress",
    "TrainResult",
    "TrainSettings",
    "baseline_candidate",
    "compare",
    "held_out_batches",
    "parse_train_settings",
    "train",
]
