"""TunedConfig: the artifact a search emits and training loads: the winning settings, the
evidence behind them and the environment they hold for. A record: sessions and exports read
it (:mod:`autotune.amp_session`, :mod:`autotune.exports`)."""

from __future__ import annotations

import math
import platform
import re
import warnings
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from autotune.errors import (
    ConfigError,
    EnvironmentMismatchWarning,
    format_validation_error,
    short_repr,
)
from autotune.infra.files import make_dirs, write_text
from autotune.infra.inputs import file_problem, load_text, read_text
from autotune.schema.bounds import BOUNDS
from autotune.schema.spec import Candidate, CompileMode, PrecisionName
from autotune.version import __version__

if TYPE_CHECKING:
    import torch

__all__ = [
    "SCHEMA_VERSION",
    "Environment",
    "Evidence",
    "GradScalerSettings",
    "TrialCounts",
    "TunedConfig",
    "current_environment",
    "environment_differences",
    "is_lr_schedule",
    "is_optimizer_setting",
    "load_config",
    "read_config",
    "warn_if_environment_differs",
]

SCHEMA_VERSION: Final = 1
# A config is a few kilobytes (its evidence included); these bound a wrong or hostile file.
_MAX_CONFIG_BYTES = 4 << 20
_MAX_CONFIG_VALUES = 200_000


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


# Bounds on what a config may hold: a hand-edited or corrupted file is refused at load time
# with the field's name, not discovered as an allocation failure in the middle of training.
# The candidate's own (autotune.schema.bounds); a learning rate of 100 is already absurd.
MAX_BATCH_SIZE = int(BOUNDS["candidate.batch_size"].high)
MAX_LEARNING_RATE = 100.0
MAX_INIT_SCALE = BOUNDS["candidate.init_scale"].high
MAX_GROWTH_INTERVAL = int(BOUNDS["candidate.growth_interval"].high)
# An optimizer's constructor takes a handful of settings; a config holding more was not written
# by a search.
MAX_OPTIMIZER_KWARGS = 32
# An lr schedule's name: "constant", a transformers lr_scheduler_type ("linear") or a
# scheduler's class name ("CosineAnnealingLR"), several chained with "+".
_LR_SCHEDULE = re.compile(r"[A-Za-z_]\w{0,63}(\+[A-Za-z_]\w{0,63}){0,7}", re.ASCII)


def is_lr_schedule(value: Any) -> bool:
    """A schedule's name a config may hold: a word, or a few joined with ``+``.

    Example:
        >>> is_lr_schedule("linear"), is_lr_schedule("LinearLR+CosineAnnealingLR")
        (True, True)
        >>> is_lr_schedule("linear decay"), is_lr_schedule("")
        (False, False)
    """
    return isinstance(value, str) and _LR_SCHEDULE.fullmatch(value) is not None


def is_optimizer_setting(value: Any) -> bool:
    """An optimizer setting a config may hold: a JSON scalar, or a few numbers (Adam's betas).

    Example:
        >>> is_optimizer_setting(0.9), is_optimizer_setting([0.9, 0.999]), is_optimizer_setting({})
        (True, True, False)
    """
    if value is None or isinstance(value, bool):
        return True
    if isinstance(value, (int, float)):
        return math.isfinite(value)
    if isinstance(value, str):
        return len(value) <= 200
    if isinstance(value, list):
        return len(value) <= 8 and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            for v in value
        )
    return False


class GradScalerSettings(_Model):
    enabled: StrictBool
    init_scale: float = Field(
        default=2.0**16, gt=0, le=MAX_INIT_SCALE, allow_inf_nan=False, strict=True
    )
    growth_interval: StrictInt = Field(default=2000, gt=0, le=MAX_GROWTH_INTERVAL)


class TrialCounts(_Model):
    complete: int = Field(default=0, ge=0)
    pruned: int = Field(default=0, ge=0)
    failed: int = Field(default=0, ge=0)


class Evidence(_Model):
    """What the search and the validation measured for the winner and the baselines."""

    # samples/s of the winner's validation run, and of the fp32 reference run beside it
    throughput: float = Field(ge=0)
    baseline_throughput: float = Field(ge=0)
    speedup: float = Field(ge=0)
    # 95% intervals: the speedup's from the paired blocks of validation (None for a fallback).
    throughput_low: float | None = Field(default=None, ge=0)
    throughput_high: float | None = Field(default=None, ge=0)
    speedup_low: float | None = Field(default=None, ge=0)
    speedup_high: float | None = Field(default=None, ge=0)
    # Pairs of interleaved timed blocks (candidate, reference) behind the speedup.
    paired_blocks: int = Field(default=0, ge=0)
    # What the search measured for the winner, and how optimistic that was (0.10: 10% higher
    # than validation's figure, which corrects the best noisy figure's upward bias).
    search_speedup: float | None = Field(default=None, ge=0)
    search_optimism: float | None = None
    # This device's timing noise: the relative spread of the reference's timed blocks; the
    # cores other processes kept busy on average meanwhile (None: not measured, as on a GPU).
    noise: float | None = Field(default=None, ge=0)
    others_cores: float | None = Field(default=None, ge=0)
    # the plain AMP recipe (fp16, default GradScaler, base batch and lr), from the search probes
    amp_throughput: float | None = Field(default=None, ge=0)
    speedup_vs_amp: float | None = Field(default=None, ge=0)
    peak_memory_bytes: int | None = Field(default=None, ge=0)
    baseline_peak_memory_bytes: int | None = Field(default=None, ge=0)
    # 1 - winner/baseline peak memory; negative when the winner uses more (a larger batch)
    memory_saving: float | None = None
    loss: float | None = None
    baseline_loss: float | None = None
    parity_gap: float | None = None
    # The samples seen at which the validated gap was read: the horizon its parity holds for;
    # the real run's samples (the spec's run) and the gap projected to them (an early lag).
    parity_samples: int | None = Field(default=None, ge=0)
    run_samples: int | None = Field(default=None, ge=0)
    parity_projected: float | None = None
    parity_tolerance: float = Field(ge=0)
    skipped_steps: int = Field(default=0, ge=0)
    trials: TrialCounts = Field(default_factory=TrialCounts)
    validated: bool = False
    validation_note: str = ""
    lr_scaling: str = "linear"
    base_learning_rate: float | None = None
    base_batch_size: int | None = None
    rejected: list[str] = Field(default_factory=list)
    cut: dict[str, str] = Field(default_factory=dict)
    ceilings: dict[str, int] = Field(default_factory=dict)
    # When fp16 trials diverged: the worst one's per-layer diagnosis and its fp32 islands.
    fp16_diagnosis: dict[str, Any] | None = None
    # A compiled winner: what compiling took in the search (untimed warm-up, charged to the
    # budget), the same mode and batch measured uncompiled, and the training steps after which
    # the steady-state gain repays the compile time (None: it never does, or nothing to say).
    compile_seconds: float | None = Field(default=None, ge=0)
    uncompiled_throughput: float | None = Field(default=None, ge=0)
    compile_break_even_steps: int | None = Field(default=None, ge=0)


class Environment(_Model):
    device: str
    capability: list[int] | None = None
    torch: str
    cuda: str | None = None
    autotune: str
    python: str = ""


class TunedConfig(_Model):
    """The validated settings for one workload on one kind of device.

    Example:
        >>> cfg = load_config("studies/tiny/best.json")  # doctest: +SKIP
        >>> cfg.precision, cfg.batch_size  # doctest: +SKIP
        ('bf16', 256)
    """

    schema_version: Literal[1] = SCHEMA_VERSION
    study: str
    workload: str
    precision: PrecisionName
    batch_size: StrictInt = Field(gt=0, le=MAX_BATCH_SIZE)
    learning_rate: float = Field(gt=0, le=MAX_LEARNING_RATE, allow_inf_nan=False, strict=True)
    grad_scaler: GradScalerSettings
    channels_last: StrictBool = False
    # torch.compile the model (in place, batch dimension dynamic) in this mode.
    compile: StrictBool = False
    compile_mode: CompileMode = "default"
    # Modules (as in model.named_modules()) that run in fp32 inside the autocast region: the
    # fp32 islands that keep fp16 in range. Empty: none.
    fp32_modules: list[str] = Field(default_factory=list)
    # The class name of the optimizer the learning rate was tuned for ("SGD", "AdamW"); the rule
    # that rescales it with the batch is evidence.lr_scaling. None in configs written before.
    optimizer: str | None = None
    # Its other constructor arguments as the workload built it (momentum, betas, eps,
    # weight_decay, ...), without lr and the switches that change only how it runs (foreach,
    # fused): an export rebuilds the same optimizer from them. None in configs written before.
    optimizer_kwargs: dict[str, Any] | None = None
    # The lr schedule the learning rate was tuned under: "constant", the lr_scheduler_type of a
    # Hugging Face workload's TrainingArguments ("linear"), or the class names of a
    # LightningModule's schedulers. None in configs written before: a constant lr.
    lr_schedule: str | None = None
    evidence: Evidence
    environment: Environment
    created_at: datetime = Field(default_factory=lambda: datetime.now(timezone.utc))

    @field_validator("optimizer_kwargs", mode="before")
    @classmethod
    def _kwargs_are_settings(cls, value: Any) -> Any:
        # They become keyword arguments and command-line flags: a handful of named numbers,
        # flags and short strings, as JSON holds them.
        if not isinstance(value, dict):
            return value  # None, or not a mapping: the type check says which
        if len(value) > MAX_OPTIMIZER_KWARGS:
            raise ValueError(
                f"holds {len(value)} arguments, at most {MAX_OPTIMIZER_KWARGS} are read; "
                "write the config again with `autotune search`"
            )
        out = {}
        for key, item in value.items():
            if not isinstance(key, str) or not key.isidentifier() or len(key) > 64:
                raise ValueError(
                    f"argument name {short_repr(key)} is not a Python identifier; "
                    "write the config again with `autotune search`"
                )
            item = list(item) if isinstance(item, tuple) else item
            if not is_optimizer_setting(item):
                raise ValueError(
                    f"{key}={short_repr(item)} is not a number, true/false, a short string, null "
                    "or a list of up to 8 numbers; write the config again with `autotune search`"
                )
            out[key] = item
        return out

    @field_validator("lr_schedule")
    @classmethod
    def _schedule_is_a_name(cls, value: str | None) -> str | None:
        # It becomes a TrainingArguments value and a command-line flag: a word, not a sentence.
        if value is not None and not is_lr_schedule(value):
            raise ValueError(
                f"{short_repr(value)} is not a schedule's name (a word such as 'constant', "
                "'linear' or 'CosineAnnealingLR'); write the config again with `autotune search`"
            )
        return value

    @field_validator("grad_scaler")
    @classmethod
    def _scaler_matches_precision(
        cls, value: GradScalerSettings, info: ValidationInfo
    ) -> GradScalerSettings:
        # A search writes enabled=True exactly for fp16; anything else was edited by hand and
        # is not what validation measured.
        precision = info.data.get("precision")
        if precision is None:  # precision itself is invalid and already reported
            return value
        wanted = precision == "fp16"
        if value.enabled != wanted:
            raise ValueError(
                f"grad_scaler.enabled={str(value.enabled).lower()} does not match "
                f"precision={precision!r}: only fp16 scales the loss; set it to "
                f"{str(wanted).lower()} or write the config again with `autotune search`"
            )
        return value

    def candidate(self) -> Candidate:
        """The config's settings as a Candidate (what a probe or a training run takes)."""
        return Candidate(
            precision=self.precision,
            batch_size=self.batch_size,
            learning_rate=self.learning_rate,
            init_scale=self.grad_scaler.init_scale,
            growth_interval=self.grad_scaler.growth_interval,
            channels_last=self.channels_last,
            compile=self.compile,
            compile_mode=self.compile_mode,
            fp32_modules=list(self.fp32_modules),
        )

    def save(self, path: str | Path) -> Path:
        """Write the config as indented JSON; returns the path."""
        path = Path(path)
        # The owner's only, unless AUTOTUNE_UMASK says otherwise (autotune.infra.files).
        make_dirs(path.parent)
        write_text(path, self.model_dump_json(indent=2) + "\n")
        return path


def current_environment(device: str | torch.device) -> Environment:
    """Describe this machine: device name and capability, torch, CUDA and autotune versions.

    Raises:
        DeviceError: the device does not exist.
    """
    # The one place a config reads torch: a config is written and read (by the search's parent,
    # the service, the report) without it; only describing this machine's device needs it.
    import torch

    from autotune.infra.devices import resolve_device

    device = resolve_device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        capability = list(torch.cuda.get_device_capability(device))
    else:
        name = f"cpu ({platform.processor() or platform.machine()})"
        capability = None
    return Environment(
        device=name,
        capability=capability,
        torch=torch.__version__.split("+")[0],
        cuda=torch.version.cuda,
        autotune=__version__,
        python=platform.python_version(),
    )


def one_line(message: str) -> str:
    """A validation message with a single bad field on one line: ``invalid X: field: why``."""
    lines = message.splitlines()
    if len(lines) != 2:
        return message
    return f"{lines[0]} {lines[1].strip().removeprefix('(root): ')}"


def _major_minor(version: str) -> tuple[int, ...] | str:
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else version


def _capability(cap: list[int] | None) -> str:
    return "none (not a CUDA device)" if cap is None else ".".join(map(str, cap))


def environment_differences(recorded: Environment, current: Environment) -> list[str]:
    """What differs between where a config was tuned and here, one phrase each.

    Compared: the device model, the CUDA compute capability and torch's major.minor version;
    a patch release of torch, a CUDA runtime or a Python version does not count.

    Args:
        recorded: the config's ``environment``.
        current: this machine's, from :func:`current_environment`.

    Returns:
        Phrases like ``"GPU model: tuned on 'NVIDIA H200', this is 'NVIDIA A100'"``; empty when
        nothing that matters differs.

    Example:
        >>> environment_differences(cfg.environment, current_environment(device))  # doctest: +SKIP
        ["torch: tuned with 2.9.0, this is 2.14.1"]
    """
    out: list[str] = []
    if recorded.device != current.device:
        kind = "GPU model" if recorded.capability and current.capability else "device"
        out.append(f"{kind}: tuned on {recorded.device!r}, this is {current.device!r}")
    if recorded.capability != current.capability:
        out.append(
            f"compute capability: tuned on {_capability(recorded.capability)}, "
            f"this device has {_capability(current.capability)}"
        )
    if _major_minor(recorded.torch) != _major_minor(current.torch):
        out.append(f"torch: tuned with {recorded.torch}, this is {current.torch}")
    return out


# (study, created_at, differences) already warned about: a config loaded in every DataLoader
# worker or every epoch, then opened as a session, says it once per process.
_WARNED: set[tuple[str, str, tuple[str, ...]]] = set()


def warn_if_environment_differs(
    config: TunedConfig,
    device: str | torch.device = "auto",
    *,
    source: str | None = None,
    stacklevel: int = 2,
) -> list[str]:
    """Warn once when ``device`` here differs from where ``config`` was tuned.

    Args:
        config: the tuned config.
        device: the device training will use; ``auto`` picks as training would.
        source: how to name the config in the message, e.g. its path.
        stacklevel: passed to :func:`warnings.warn` so the warning points at the caller.

    Returns:
        The differences (also when the warning was already issued).

    Raises:
        DeviceError: the device does not exist.

    Example:
        >>> warn_if_environment_differs(cfg, "cuda:0")  # doctest: +SKIP
        []
    """
    diffs = environment_differences(config.environment, current_environment(device))
    key = (config.study, config.created_at.isoformat(), tuple(diffs))
    if diffs and key not in _WARNED:
        _WARNED.add(key)
        name = source or f"study {config.study!r}"
        speedup = config.evidence.speedup
        claim = f"its measured speedup ({speedup:.2f}x)" if speedup else "its measured speedup"
        warnings.warn(
            f"config {name} was tuned on another machine, so {claim} may not hold here: "
            + "; ".join(diffs)
            + ". Run `autotune search` on this machine to tune for it.",
            EnvironmentMismatchWarning,
            stacklevel=stacklevel + 1,
        )
    return diffs


def load_config(path: str | Path, *, device: str | torch.device = "auto") -> TunedConfig:
    """Read and validate a TunedConfig file; warn once if this machine differs from its own.

    Args:
        path: the JSON file a search wrote, e.g. ``studies/resnet18/best.json``.
        device: the device training will use, for the environment check; ``auto`` picks the
            current CUDA device, else the CPU.

    Returns:
        The validated TunedConfig.

    Raises:
        ConfigError: the file is missing, is not JSON, has another schema version, or a field is
            out of range; the message names the field and the fix.
        DeviceError: ``device`` does not exist.

    Warns:
        EnvironmentMismatchWarning: the GPU model, compute capability or torch major.minor
            differs from the config's ``environment`` (once per config and process).

    Example:
        >>> cfg = load_config("studies/tiny/best.json")  # doctest: +SKIP
        >>> cfg.precision, cfg.batch_size, cfg.learning_rate  # doctest: +SKIP
        ('bf16', 256, 0.4)
    """
    config = read_config(path)
    warn_if_environment_differs(config, device, source=repr(str(path)), stacklevel=2)
    return config


def read_config(path: str | Path) -> TunedConfig:
    """Read and validate a TunedConfig file, without looking at this machine: for what shows a
    config (the report, the service's page) rather than trains with it.

    Raises:
        ConfigError: as :func:`load_config`.
    """
    path = Path(path)
    if path.is_dir():
        raise ConfigError(
            f"config file {str(path)!r} is a folder; pass the JSON file in it, e.g. "
            f"{str(path / 'best.json')!r}"
        )
    problem = file_problem(path)
    if problem is not None:
        fix = (
            "run `autotune search` to write one"
            if problem == "does not exist"
            else "pass the best.json `autotune search` wrote"
        )
        raise ConfigError(f"config file {str(path)!r} {problem}; {fix}")
    source = f"config file {str(path)!r}"
    # Bounded before anything walks it: a config is a few kilobytes, nested a few levels.
    text = read_text(path, source, max_bytes=_MAX_CONFIG_BYTES, error=ConfigError)
    try:
        data = load_text(text, "json", source, max_nodes=_MAX_CONFIG_VALUES, error=ConfigError)
    except ConfigError as exc:
        if "not valid JSON" not in str(exc):
            raise
        raise ConfigError(
            f"{exc}; it may be truncated: write it again with `autotune search`"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {str(path)!r} must hold a JSON object, got {type(data).__name__}"
        )
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ConfigError(
            f"config file {str(path)!r} has schema_version={short_repr(version)}, this autotune reads "
            f"schema_version={SCHEMA_VERSION}; write it again with this version's `autotune search`"
        )
    try:
        config = TunedConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(
            one_line(format_validation_error(exc, f"config file {str(path)!r}"))
        ) from None
    return config
