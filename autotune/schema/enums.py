"""Named values autotune stores and compares: a trial's outcome and role, a search's phase, a
queued study's state.

Each is a ``str`` enum, as accelerate's ``DistributedType``: a member *is* its string, so it is
JSON-ready, compares equal to the string older studies stored (``Outcome.OOM == "oom"``), and
reads back from it (``Outcome("oom")``). ``str()`` and f-strings give the value, never
``Outcome.OOM``, so a message or a stored text reads as it always did.
"""

from __future__ import annotations

import enum

__all__ = ["Outcome", "Phase", "Role", "StudyState"]


class _Named(str, enum.Enum):
    """A str enum whose text is its value (what ``enum.StrEnum`` does from Python 3.11)."""

    def __str__(self) -> str:
        return str(self.value)


class Outcome(_Named):
    """How a probe or a trial ended, as stored on the trial (``outcome``) and shown."""

    # ran to the end (or to its time limit, then `truncated`); figures are valid
    COMPLETED = "completed"
    # completed, but a constraint failed (loss parity): shown, and stored on such a trial
    INFEASIBLE = "infeasible"
    # non-finite or blown-up loss, or a failing GradScaler; `reason` names step and value
    DIVERGED = "diverged"
    # the device ran out of memory at this batch size
    OOM = "oom"
    # the device cannot run this precision mode (or autocast silently fell back)
    UNSUPPORTED = "unsupported"
    # the worker died or the probe raised; a bug or a broken workload, not a measurement
    CRASHED = "crashed"
    # stopped early: its throughput's interval lay clearly below the best candidate's
    SLOWER = "slower"
    # stopped early: its loss was clearly off the fp32 reference's at equal samples seen
    OFF_PARITY = "off_parity"
    # torch.compile could not compile the model; `reason` says what the compiler said
    COMPILE_FAILED = "compile_failed"
    # not run: the batch size is above the mode's ceiling on this device
    ABOVE_CEILING = "above_ceiling"
    # killed at its time limit before one step finished: far too slow, not broken
    TOO_SLOW = "too_slow"
    # the search was stopped while the trial ran
    INTERRUPTED = "interrupted"
    # failed for a worker that stopped beating (nobody was left to record why)
    STALE = "stale"
    # queued by the search (enqueue_trial), never run before it ended
    NOT_RUN = "not_run"
    # same parameters as an earlier trial: its measurement was reused (an event, not stored)
    REUSED = "reused"


class Role(_Named):
    """Why a trial was run beside the sampler's own picks (a trial's ``role``).

    A mode run at the reference's own settings has a role per mode: :meth:`at_base`.
    """

    # fp32 at the base batch size and learning rate
    REFERENCE = "reference"
    # fp16 with the default GradScaler: what a person gets from the AMP recipe
    AMP_RECIPE = "amp_recipe"
    # fp16 with the diagnosed modules kept in fp32
    FP32_ISLANDS = "fp32_islands"

    @staticmethod
    def at_base(mode: str) -> str:
        """The role of ``mode`` run at the reference's own settings.

        Example:
            >>> Role.at_base("bf16")
            'bf16_at_base'
        """
        return f"{mode}_at_base"


class Phase(_Named):
    """A part of a search: what a :class:`~autotune.search.PhaseStarted` event names, and what
    the job's clock counts time to (``SearchResult.spent``; the search phase was ``trials``
    there before, and reads back as ``search``)."""

    START = "start"
    CEILINGS = "ceilings"
    REFERENCE = "reference"
    DIAGNOSIS = "diagnosis"
    SEARCH = "search"
    REMEASURES = "re-measures"
    VALIDATION = "validation"
    WRITING = "writing"

    @classmethod
    def _missing_(cls, value: object) -> Phase | None:
        # Older studies' time_spent named the search phase "trials".
        return cls.SEARCH if value == "trials" else None


class StudyState(_Named):
    """Where a study the service holds stands (``paused`` is shown, never stored: a paused
    study's row stays ``running``)."""

    QUEUED = "queued"
    RUNNING = "running"
    PAUSED = "paused"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def finished(self) -> bool:
        """Done, failed or cancelled: the study will not run again unless resubmitted."""
        return self in (StudyState.DONE, StudyState.FAILED, StudyState.CANCELLED)
