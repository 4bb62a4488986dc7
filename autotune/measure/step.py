"""The AMP training step, written once (:class:`StepEngine`), and the run it belongs to: probes,
training runs and diagnoses are policies over it."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from loguru import logger
from torch import nn

from autotune.errors import WorkloadError
from autotune.infra.devices import prepare_batch
from autotune.measure.knobs import NothingCompiled, apply_knobs, compiled_graphs, mark_batch_dynamic
from autotune.measure.memory import is_oom, oom_message, release_memory, sync
from autotune.measure.precision import autocast, get_mode, make_scaler, skip_defect
from autotune.schema.spec import CUDA_GRAPH_MODES, Candidate
from autotune.workloads import Batch, Workload

__all__ = ["Block", "StepEngine", "check_loss", "prepare_batch"]

# The workloads whose optimizer's skip defect this process has warned of (once each).
_WARNED: set[str] = set()


def check_loss(loss: Any, workload: Workload) -> None:
    """Check the workload's loss is a scalar tensor (its contract), once, at the first step.

    Raises:
        WorkloadError: naming the workload, what it returned and the fix.

    Example:
        >>> from autotune.workloads import tiny_mlp
        >>> check_loss(torch.ones(3), tiny_mlp())
        Traceback (most recent call last):
        ...
        autotune.errors.WorkloadError: workload 'tiny_mlp': loss must be a scalar tensor, got shape (3,); reduce it with .mean()
    """
    if not isinstance(loss, torch.Tensor):
        raise WorkloadError(
            f"workload {workload.reference or workload.name!r}: loss must be a scalar tensor, got "
            f"{type(loss).__name__}; return e.g. F.cross_entropy(model(x), y)"
        )
    if loss.numel() != 1:
        raise WorkloadError(
            f"workload {workload.reference or workload.name!r}: loss must be a scalar tensor, got "
            f"shape {tuple(loss.shape)}; reduce it with .mean()"
        )


@dataclass(frozen=True)
class Block:
    """Steps run back to back between two device syncs, and their wall time."""

    first_step: int  # index of its first step in the run
    steps: int
    seconds: float
    skipped: int  # steps GradScaler skipped (non-finite gradients)

    @property
    def step_time(self) -> float:
        """Seconds per step."""
        return self.seconds / self.steps if self.steps else 0.0


class StepEngine:
    """One training run: model, optimizer, GradScaler, batches, and the AMP step over them.

    Nothing is built until :meth:`build` (inside :meth:`run`, so running out of memory while
    building is caught too). Leaving the ``with`` block (or :meth:`close`) drops the references
    and removes the step counter from the optimizer.

    Args:
        workload: what to train.
        candidate: precision, batch size, learning rate, GradScaler settings, channels_last
            (None: the workload's own choice), fp32 modules, torch.compile.
        device: the resolved device.
        seed: seeds the batch generator; seed torch's global RNG before :meth:`build` for the
            model's initial weights.
        scaler: a GradScaler to use (an AmpSession's); one is made from the candidate if None.
        prepare: turns the built model into the one trained (an AmpSession's ``prepare``); by
            default :func:`autotune.measure.knobs.apply_knobs`, compiling afresh (what a new
            training process pays), undone when the engine closes.

    Example:
        >>> from autotune.workloads import tiny_mlp
        >>> cand = Candidate(precision="bf16", batch_size=32, learning_rate=0.05)
        >>> with StepEngine(tiny_mlp(), cand, torch.device("cpu")) as engine:
        ...     oom = engine.run(lambda e: (e.build(), e.run_steps(3)))
        ...     oom, engine.steps, len(engine.read_losses())
        (None, 3, 3)
    """

    def __init__(
        self,
        workload: Workload,
        candidate: Candidate,
        device: torch.device,
        *,
        seed: int = 0,
        scaler: torch.amp.GradScaler | None = None,
        prepare: Callable[[nn.Module], nn.Module] | None = None,
    ) -> None:
        self.workload, self.candidate, self.device, self.seed = workload, candidate, device, seed
        self.mode = get_mode(candidate.precision)
        self.channels_last = bool(
            workload.channels_last if candidate.channels_last is None else candidate.channels_last
        )
        if scaler is None:
            scaler = make_scaler(
                self.mode,
                device,
                init_scale=candidate.init_scale,
                growth_interval=candidate.growth_interval,
            )
        self.scaler = scaler
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.batches: Any = None
        self.steps = 0  # steps taken
        self.losses: list[float] = []  # every loss read back so far, in step order
        self.pending: list[torch.Tensor] = []  # losses not read back yet, still on the device
        # Steps GradScaler skipped: counted on the device (no host sync per step), read back
        # with the losses; the count as last read, and the steps taken at that read.
        self._skips: torch.Tensor | None = None
        self._skips_read = 0
        self._steps_read = 0
        self._compiled = False  # the engine compiled the model: close() drops the compiled code
        self._copy_losses = False  # ... into CUDA graphs: the losses it keeps are copies
        self._prepare = prepare
        self._knobs = contextlib.ExitStack()  # undoes the fp32 islands
        # Why the workload's optimizer mistrains on the steps GradScaler skips, once built.
        self.defect: str | None = None

    # ---- building and stepping ------------------------------------------------------------

    def build(self) -> None:
        """Build the model on the device with the candidate's knobs (fp32 islands, channels_last,
        torch.compile: compiled at the first step), its optimizer at the candidate's lr, and the
        batches."""
        gen = torch.Generator().manual_seed(self.seed)
        model = self.workload.build_model()
        if self._prepare is not None:
            model = self._prepare(model)
        else:
            model = apply_knobs(
                model,
                self.candidate,
                self.device,
                self._knobs,
                channels_last=self.channels_last,
                fresh_compile=True,
            )
        # Compiled here or by the session's prepare, the model is this engine's: close() frees
        # its compiled code and CUDA-graph pools either way.
        self._compiled = self.candidate.compile
        self._copy_losses = self._compiled and self.candidate.compile_mode in CUDA_GRAPH_MODES
        model.train()
        self.model = model
        self.optimizer = self.workload.build_optimizer(
            model.parameters(), self.candidate.learning_rate
        )
        self.defect = skip_defect(self.optimizer, self.mode)
        if self.defect is not None and self.workload.name not in _WARNED:
            _WARNED.add(self.workload.name)
            logger.warning("{} under {}: {}", self.workload.name, self.mode.name, self.defect)
        self.batches = self.workload.make_batches(self.candidate.batch_size, self.device, gen)

    def next_batch(self) -> Batch:
        """The next batch, on the device and in the run's memory format (its batch dimension
        marked dynamic when the model is compiled)."""
        batch = prepare_batch(next(self.batches), self.device, self.channels_last)
        return mark_batch_dynamic(batch) if self.candidate.compile else batch

    def step(self, batch: Batch | None = None) -> torch.Tensor:
        """One AMP training step on ``batch`` (the next one if None).

        Returns:
            The loss, detached and still on the device (also kept for :meth:`read_losses`).

        Raises:
            WorkloadError: at the first step, the workload's loss is not a scalar tensor.
        """
        assert self.model is not None and self.optimizer is not None, "build() first"
        batch = self.next_batch() if batch is None else batch
        self.optimizer.zero_grad(set_to_none=True)
        # Both ways of building compile afresh: the first step must capture a graph.
        graphs = compiled_graphs() if self._compiled and self.steps == 0 else None
        with autocast(self.mode, self.device):
            loss = self.workload.loss(self.model, batch)
        if self.steps == 0:
            check_loss(loss, self.workload)
            if graphs is not None and compiled_graphs() == graphs:
                raise NothingCompiled(
                    "its first step captured no graph (torch.compile ran the model eager), so it "
                    "would be measured at eager speed"
                )
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self._update_scaler()
        # A copy where the model replays as CUDA graphs: the loss lives in the graph's memory
        # pool, which the next replay overwrites (torch 2.11 refuses to read it then).
        loss = loss.detach().clone() if self._copy_losses else loss.detach()
        self.pending.append(loss)
        self.steps += 1
        return loss

    def _update_scaler(self) -> None:
        """``scaler.update()``, adding the step's inf check to the skip count on the device.

        GradScaler checks the gradients once a step (found_inf, one flag per device), for an
        optimizer it skips itself and for a fused one that skips inside its kernel alike, and
        update() forgets the flags: they are added up just before, one op a step, no sync.
        """
        scaler = self.scaler
        if not scaler.is_enabled():
            scaler.update()
            return
        # GradScaler has no accessor for the flags of the step under way.
        states = getattr(scaler, "_per_optimizer_states", {})
        found = [
            f for state in states.values() for f in state.get("found_inf_per_device", {}).values()
        ]
        scaler.update()
        for flag in found:
            if self._skips is None:
                self._skips = torch.zeros(1, dtype=torch.float32, device=flag.device)
            self._skips.add_(flag.to(self._skips.device, non_blocking=True))

    def run_steps(self, n: int) -> Block:
        """``n`` steps back to back between two device syncs: a timed block.

        The losses stay on the device until :meth:`read_losses`; the block's skip count is
        read after its closing sync, outside its time.
        """
        self.sync()
        skipped, first, started = self.skipped, self.steps, time.perf_counter()
        for _ in range(n):
            self.step()
        self.sync()
        seconds = time.perf_counter() - started
        return Block(first, n, seconds, self.skipped - skipped)

    # ---- reading back -------------------------------------------------------------------------

    def read_losses(self) -> list[float]:
        """The losses of the steps since the last read, in one host sync (appended to
        ``losses`` too); non-finite values stay as they are."""
        if not self.pending:
            return []
        values = torch.stack(self.pending).float().reshape(-1)
        if self._skips is not None and self._steps_read != self.steps:
            # The skip count comes back in the same transfer.
            values = torch.cat([values, self._skips.to(values.device, torch.float32).reshape(1)])
            *out, skips = values.tolist()
            self._skips_read, self._steps_read = int(skips), self.steps
        else:
            out = values.tolist()
        self.pending.clear()
        self.losses.extend(out)
        return out

    def scale(self) -> float:
        """The GradScaler's scale now (a host sync); 1.0 for modes without one."""
        return float(self.scaler.get_scale()) if self.scaler.is_enabled() else 1.0

    @property
    def skipped(self) -> int:
        """Steps whose optimizer step was skipped (gradients not finite); 0 without a
        GradScaler. Read back with the losses; a host sync here only when steps ran since."""
        if self._skips is not None and self._steps_read != self.steps:
            self._skips_read, self._steps_read = int(self._skips.item()), self.steps
        return self._skips_read

    @property
    def applied(self) -> int:
        """Optimizer steps really applied."""
        return self.steps - self.skipped

    def sync(self) -> None:
        """Wait for the steps queued on the device."""
        sync(self.device)

    # ---- running a policy, and running out of memory --------------------------------------------

    def run(self, policy: Callable[[StepEngine], Any]) -> str | None:
        """Run ``policy(self)``; an out-of-memory error ends it and comes back as its message.

        After an OOM the engine drops its references, collects garbage and clears the device
        cache, outside the ``except`` block (whose traceback would keep the tensors alive), so
        the same process can run the next one. Any other exception propagates.

        Args:
            policy: drives the run: calls :meth:`build`, :meth:`step`, :meth:`read_losses`...

        Returns:
            None when the policy returned, else the first line of the OOM error.
        """
        message: str | None = None
        try:
            policy(self)
        except Exception as exc:
            if not is_oom(exc):
                raise
            message = oom_message(exc)
        if message is not None:
            self.close()
            release_memory(self.device)
        return message

    def close(self) -> None:
        """Drop the model, optimizer, batches and pending losses and undo the fp32 islands.

        A model the engine compiled also leaves its compiled code behind, and with CUDA graphs
        (``reduce-overhead``, ``max-autotune``) their memory pools, which outlive the model:
        the compiler's caches are reset and the device cache cleared, so the next run in this
        process starts with the memory this one took.
        """
        self._knobs.close()
        self.model = self.optimizer = self.batches = None
        self.pending.clear()
        if self._compiled:
            self._compiled = False
            torch._dynamo.reset()
            # After a CUDA error that left the context unusable this fails too: the error that
            # ended the run is the one to see.
            with contextlib.suppress(Exception):
                release_memory(self.device)

    def __enter__(self) -> StepEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
