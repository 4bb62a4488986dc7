"""Training runs under a tuned config, measured the way people compare AMP.

A run is a measurement policy over :class:`~autotune.measure.step.StepEngine` (the AMP step,
the loss read-back, the OOM recovery):
1. opens an :class:`~autotune.session.AmpSession` (backend flags restored afterwards) and forks
   the RNG, so the caller's random state is untouched and every run starts from the same seed;
2. builds the model, the optimizer at the run's learning rate and the batches at its size;
3. trains; the first ``warmup_steps`` are real steps but untimed (kernel selection, building the
   data pool), and the losses are read back every ``check_every`` steps (one host sync each);
4. measures peak memory, the final loss (mean over the last tenth of the steps) and, when the
   workload has an accuracy function, accuracy on held-out batches.

:func:`compare` runs the tuned config and a baseline (IEEE fp32, or the plain AMP recipe: fp16
with a default GradScaler) at the workload's base batch size and lr. Both see the same number of
samples, so losses and accuracies compare sample for sample: a larger tuned batch does not look
better, or worse, only by seeing more data.

The package, one file per concept: ``_models`` (settings, results, the comparison), ``_run``
(one run over the step engine), ``_compare`` (the tuned run against a baseline).
"""

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
