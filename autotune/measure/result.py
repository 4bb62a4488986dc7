"""ProbeResult: what one probe measured and how it ended."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from autotune.measure.stats import claimed, median_interval, ratio_estimate, spread
from autotune.schema.enums import Outcome
from autotune.schema.spec import Candidate

__all__ = ["Outcome", "PairedResult", "ProbeResult", "knob_text", "pooled"]


def knob_text(c: Candidate, *, nchw: bool = True) -> str:
    """A candidate's knobs beside its precision, for logs: `` compile fp32[amplify]``
    (``nchw=False``: say channels_last only when it is on).

    Example:
        >>> knob_text(Candidate(precision="fp16", batch_size=8, learning_rate=0.1, compile=True,
        ...                     channels_last=False, fp32_modules=["amplify"]))
        ' compile nchw fp32[amplify]'
    """
    out = ""
    if c.compile:
        out += " compile" if c.compile_mode == "default" else f" compile={c.compile_mode}"
    if c.channels_last is not None:
        out += " channels_last" if c.channels_last else " nchw" if nchw else ""
    if c.fp32_modules:
        out += f" fp32[{','.join(c.fp32_modules)}]"
    return out


class ProbeResult(BaseModel):
    """The measurements and the outcome of one probe.

    Losses keep every step (warmup included); non-finite values survive a JSON round trip as
    the strings ``"NaN"``/``"Infinity"``.
    """

    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="strings")

    candidate: Candidate
    workload: str
    device: str
    # completed, diverged, oom, unsupported, crashed, slower, off_parity or compile_failed
    outcome: Outcome
    reason: str = ""
    # samples/s over the timed steps only: the median over timed blocks, with its 95% interval
    throughput: float = 0.0
    throughput_low: float | None = None
    throughput_high: float | None = None
    # Each timed block's (steps, seconds), in order.
    blocks: list[tuple[int, float]] = Field(default_factory=list)
    # Relative spread of the blocks' rates (interquartile range over the median).
    spread: float | None = None
    step_time: float | None = None
    warmup_steps: int = 0
    timed_steps: int = 0
    planned_steps: int = 0
    timed_seconds: float = 0.0
    wall_seconds: float = 0.0
    # A compiled candidate: what compiling added to the untimed warm-up (in wall_seconds, never
    # in timed_seconds). None when the candidate does not compile.
    compile_seconds: float | None = None
    # Host time spent in divergence checks inside the timed window (includes the sync they cause).
    check_seconds: float = 0.0
    truncated: bool = False
    # Killed at its hard time limit without a result (outcome "crashed"): too slow, not broken.
    timed_out: bool = False
    peak_memory_allocated: int | None = None
    peak_memory_reserved: int | None = None
    losses: list[float] = Field(default_factory=list)
    # (step, GradScaler scale) at each check point; empty without a scaler.
    scales: list[tuple[int, float]] = Field(default_factory=list)
    skipped_steps: int = 0
    seed: int = 0
    autocast_dtype: str | None = None
    batch_size: int = 0
    # Samples seen when the parity check that stopped it early was made (off_parity only).
    parity_samples: int | None = None
    # What the workload wrote to stdout and stderr meanwhile: the end of it, and how many bytes
    # (a probe worker's; autotune.execution.output).
    output: str = ""
    output_bytes: int = 0

    @property
    def ok(self) -> bool:
        """True when the probe completed and its figures can be used."""
        return self.outcome == Outcome.COMPLETED

    @property
    def peak_memory(self) -> int | None:
        """Reserved peak where known (what the device really gave up), else allocated."""
        return (
            self.peak_memory_reserved
            if self.peak_memory_reserved is not None
            else self.peak_memory_allocated
        )

    def rates(self) -> list[float]:
        """Each timed block's throughput, samples/s, in the order they ran."""
        return [steps * self.batch_size / seconds for steps, seconds in self.blocks if seconds > 0]

    def summary(self) -> str:
        """One line for logs: ``fp16 bs=128 lr=0.1 → completed 812.3 samples/s``."""
        c = self.candidate
        head = f"{c.precision} bs={c.batch_size} lr={c.learning_rate:.3g}"
        if c.precision == "fp16":
            head += f" init_scale={c.init_scale:g}"
        head += knob_text(c)
        if self.outcome == Outcome.COMPLETED:
            tail = f"{self.throughput:.1f} samples/s"
            if self.compile_seconds is not None:
                tail += f" (compiled in {self.compile_seconds:.1f}s, untimed)"
            if self.truncated:
                steps = (
                    "1 timed step" if self.timed_steps == 1 else f"{self.timed_steps} timed steps"
                )
                tail += f" (time limit, {steps})"
            return f"{head} → {tail}"
        return f"{head} → {self.outcome}: {self.reason}"


class PairedResult(BaseModel):
    """A candidate and the fp32 reference measured in one worker, their timed blocks
    interleaved (candidate, reference, candidate, …), so drift and a neighbour's load hit both.

    ``speedup`` is the median of the per-pair throughput ratios, with its 95% interval.
    """

    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="strings")

    candidate: ProbeResult
    reference: ProbeResult
    speedup: float | None = None
    speedup_low: float | None = None
    speedup_high: float | None = None
    pairs: int = 0

    @property
    def ok(self) -> bool:
        """Both arms completed and at least one pair was measured."""
        return self.candidate.ok and self.reference.ok and self.speedup is not None

    def summary(self) -> str:
        """One line for logs: ``bf16 bs=256 … → 1.93x (1.85–2.01) over 12 pairs``."""
        c = self.candidate.candidate
        head = f"{c.precision} bs={c.batch_size} lr={c.learning_rate:.3g}" + knob_text(c)
        if not self.candidate.ok:
            return f"{head} → {self.candidate.outcome}: {self.candidate.reason}"
        if not self.reference.ok:
            return f"{head} → reference arm {self.reference.outcome}: {self.reference.reason}"
        if self.speedup is None:
            return f"{head} → no speedup: {_pairs(self.pairs)} of timed blocks measured"
        return (
            f"{head} → {self.speedup:.2f}x ({self.speedup_low:.2f}–{self.speedup_high:.2f}) the "
            f"fp32 reference over {_pairs(self.pairs)}"
        )


def pooled(first: PairedResult, second: PairedResult) -> PairedResult:
    """Two paired runs of the same settings as one measurement: their pairs' blocks in the
    order they ran (the first run's blocks alone after its pairs last), the speedup the median
    of the per-pair ratios over all of them, each arm's throughput over all its blocks; the
    first run's losses, seed and everything else stand.

    Example:
        >>> from autotune.schema.spec import Candidate
        >>> def arm(rate):
        ...     c = Candidate(precision="fp32", batch_size=1, learning_rate=0.1)
        ...     return ProbeResult(candidate=c, workload="w", device="cpu", outcome="completed",
        ...                        batch_size=1, blocks=[(1, 1 / rate)] * 6)
        >>> a = PairedResult(candidate=arm(2.0), reference=arm(1.0), speedup=2.0, pairs=6)
        >>> b = PairedResult(candidate=arm(2.2), reference=arm(1.0), speedup=2.2, pairs=6)
        >>> both = pooled(a, b)
        >>> both.pairs, len(both.candidate.blocks), round(both.speedup, 2)
        (12, 12, 2.1)
    """
    arms = {}
    for name in ("candidate", "reference"):
        a, b = getattr(first, name), getattr(second, name)
        extra = b.blocks[: second.pairs]
        blocks = a.blocks[: first.pairs] + extra + a.blocks[first.pairs :]
        update: dict[str, object] = {
            "blocks": blocks,
            "timed_steps": a.timed_steps + sum(steps for steps, _ in extra),
            "timed_seconds": a.timed_seconds + sum(seconds for _, seconds in extra),
        }
        rates = a.model_copy(update={"blocks": blocks}).rates()
        if rates:
            est = median_interval(rates)
            update.update(throughput=est.value, throughput_low=est.low, throughput_high=est.high,
                          step_time=a.batch_size / est.value, spread=spread(rates))  # fmt: skip
        arms[name] = a.model_copy(update=update)
    # The speedup as a paired run's own is taken (and as the winner's is widened), over the
    # blocks in the order they ran.
    n = first.pairs + second.pairs
    ratio = ratio_estimate(arms["candidate"].rates()[:n], arms["reference"].rates()[:n])
    out = first.model_copy(update=arms)
    if ratio is not None:
        ratio = claimed(ratio)
        out = out.model_copy(update={"speedup": ratio.value, "speedup_low": ratio.low,
                                     "speedup_high": ratio.high, "pairs": ratio.n})  # fmt: skip
    return out


def _pairs(n: int) -> str:
    return f"{n} pair" if n == 1 else f"{n} pairs"
