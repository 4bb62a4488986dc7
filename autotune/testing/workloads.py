"""Workloads that misbehave on purpose, importable by reference: they let tests (and users) see
each outcome on a CPU."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from autotune.workloads import (
    Batch,
    Workload,
    class_images,
    resnet18,
    synthetic_batches,
    tiny_convnet,
    tiny_mlp,
)

__all__ = [
    "CAPPED_BYTES",
    "HUNGRY_ENV",
    "OOM_LIMIT",
    "cuda_context_lost",
    "diverging",
    "drifting",
    "fp16_overflow",
    "hungry",
    "make_oom_workload",
    "non_scalar_loss",
    "oom_above_64",
    "resnet18_capped",
    "skipping",
    "sleepy",
    "tiny_gradients",
]

OOM_LIMIT = 64


class _FakeOOM(nn.Module):
    """Raises ``torch.OutOfMemoryError`` for batches above ``limit``, as a full device would."""

    def __init__(self, inner: nn.Module, limit: int) -> None:
        super().__init__()
        self.inner = inner
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.limit:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {x.shape[0] * 4} MiB (fake, limit {self.limit})"
            )
        return self.inner(x)


def make_oom_workload(limit: int) -> Workload:
    """The tiny convnet, but any batch larger than ``limit`` runs out of memory."""
    base = tiny_convnet()
    base.name = f"oom_above_{limit}"
    inner = base.build_model
    base.build_model = lambda: _FakeOOM(inner(), limit)
    return base


def oom_above_64() -> Workload:
    """The tiny convnet with a fake memory ceiling at batch size 64."""
    return make_oom_workload(OOM_LIMIT)


def diverging() -> Workload:
    """Linear regression with plain SGD: fine at its base lr 0.01, explodes above lr ~0.5.

    SGD on a quadratic diverges once lr exceeds 2 / (largest Hessian eigenvalue); the inputs'
    scale puts that edge near 0.5.
    """
    gen = torch.Generator().manual_seed(7)
    w_true = torch.randn(32, 1, generator=gen)

    def make(bs: int, g: torch.Generator) -> Batch:
        x = 1.5 * torch.randn(bs, 32, generator=g)
        return x, x @ w_true

    def loss(model: nn.Module, batch: Batch) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(model(x), y)

    return Workload(
        name="diverging",
        build_model=lambda: nn.Linear(32, 1),
        make_batches=lambda bs, dev, g: synthetic_batches(make, bs, dev, g),
        build_optimizer=lambda params, lr: torch.optim.SGD(params, lr=lr),
        base_lr=0.01,
        base_batch_size=32,
        loss=loss,
        description="linear regression, plain SGD; diverges above lr ~0.5",
    )


# Typical |activation| after `amplify` is ~0.5 * 0.06 * sqrt(64) * gain: about 2e5 > 65504.
_GAIN = 1e6


class _Overflow(nn.Module):
    """Scales activations past fp16's largest value (65504) in one named layer: ``amplify``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(64, 64)
        self.amplify = nn.Linear(64, 64)
        self.head = nn.Linear(64, 10)
        with torch.no_grad():
            self.amplify.weight.mul_(_GAIN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.embed(x))
        h = self.amplify(h)
        return self.head(h / _GAIN)


def fp16_overflow() -> Workload:
    """Trains fine in fp32 and bf16; fp16 overflows to inf in the layer ``amplify``."""
    make = class_images(10, (64,), noise=1.5)
    return Workload(
        name="fp16_overflow",
        build_model=_Overflow,
        make_batches=lambda bs, dev, g: synthetic_batches(make, bs, dev, g),
        build_optimizer=lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9),
        base_lr=0.001,
        base_batch_size=64,
        description="MLP with one layer whose activations exceed fp16's range",
    )


def non_scalar_loss() -> Workload:
    """Breaks the contract: its loss is a vector, not a scalar."""
    wl = tiny_mlp()
    wl.name = "non_scalar_loss"

    def loss(model: nn.Module, batch: Batch) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(model(x), y, reduction="none")

    wl.loss = loss
    return wl


# The loss is multiplied by this: tiny_mlp's gradients (at most ~1e-2) shrink below ~1e-11, so at
# GradScaler's default 2^16 a third of the hidden layer's scaled values fall below fp16's smallest
# subnormal 2^-24 (6e-8) and flush to zero, while fp32 and bf16 (8 exponent bits) hold them.
_TINY_LOSS = 1e-9


def tiny_gradients() -> Workload:
    """The tiny MLP with its loss scaled by 1e-9: fp16's gradients underflow at init_scale 2^16.

    Adam ignores the gradients' scale (with an eps far below them), so fp32 and bf16 train as
    tiny_mlp does; fp16 keeps them only with a larger init_scale (diagnose says 2^23).
    """
    wl = tiny_mlp()
    wl.name = "tiny_gradients"
    wl.description = "tiny MLP, loss scaled by 1e-9, Adam: fp16 gradients underflow at 2^16"

    def loss(model: nn.Module, batch: Batch) -> torch.Tensor:
        x, y = batch
        return _TINY_LOSS * nn.functional.cross_entropy(model(x), y)

    wl.loss = loss
    wl.build_optimizer = lambda params, lr: torch.optim.Adam(params, lr=lr, eps=1e-30)
    wl.base_lr = 1e-3
    return wl


def skipping() -> Workload:
    """The tiny MLP whose gradients are not finite on every other step at any scale (a term
    whose derivative is 0/0 there): fp16's GradScaler skips half its steps however low its
    scale falls, a lasting skip rate, not a back-off from a high init_scale. fp16 only: fp32 and
    bf16 would apply the NaN."""
    wl = tiny_mlp()
    wl.name = "skipping"
    wl.description = "tiny MLP whose every other step's gradients are NaN: fp16 skips half"
    calls = [0]

    def loss(model: nn.Module, batch: Batch) -> torch.Tensor:
        x, y = batch
        out = nn.functional.cross_entropy(model(x), y)
        calls[0] += 1
        if calls[0] % 2 == 0:
            p = next(model.parameters())
            zero = (p - p.detach()).sum()
            out = out + torch.sqrt(zero * zero)  # sqrt(z^2)' = z / |z|: 0/0 at z = 0
        return out

    wl.loss = loss
    return wl


# The bytes hungry()'s model allocates as it is built (default 8 GiB): read in the worker.
HUNGRY_ENV = "AUTOTUNE_TEST_HUNGRY_BYTES"


def hungry() -> Workload:
    """The tiny MLP, whose model takes ``AUTOTUNE_TEST_HUNGRY_BYTES`` (default 8 GiB) more as
    it is built: a workload that wants more memory than its worker may have.

    The bytes are allocated, not touched (``torch.empty``): under the worker's memory limit the
    allocation itself fails; without one it costs address space, not the machine's memory.
    """
    import os

    wl = tiny_mlp()
    wl.name = "hungry"
    inner = wl.build_model

    def build() -> nn.Module:
        model = inner()
        size = int(os.environ.get(HUNGRY_ENV, str(8 * 2**30)))
        model.register_buffer("ballast", torch.empty(size, dtype=torch.uint8), persistent=False)
        return model

    wl.build_model = build
    return wl


def _sleep_seconds() -> float:
    import os

    return float(os.environ.get("AUTOTUNE_SLEEPY_SECONDS", "0.05"))


def _waiting_mlp(
    name: str, wait: Callable[[], None], *, samples: int, base_batch_size: int, description: str
) -> Workload:
    """The tiny MLP on ``samples`` synthetic images, each loss call after ``wait()``: a step's
    time is what it sleeps."""
    base = tiny_mlp()

    def loss(model: nn.Module, batch: Batch) -> torch.Tensor:
        wait()
        x, y = batch
        return nn.functional.cross_entropy(model(x), y)

    return Workload(
        name=name,
        build_model=base.build_model,
        make_batches=lambda bs, dev, g: synthetic_batches(
            class_images(10, (64,), noise=1.5), bs, dev, g, samples=samples
        ),
        build_optimizer=base.build_optimizer,
        base_lr=base.base_lr,
        base_batch_size=base_batch_size,
        loss=loss,
        description=description,
    )


def sleepy() -> Workload:
    """A step that takes a fixed wall time and almost no compute: for scale-out measurements.

    Each loss call sleeps ``AUTOTUNE_SLEEPY_SECONDS`` (default 0.05 s), so a probe's time is
    known in advance and workers on one machine do not compete for its cores.
    """
    import time

    return _waiting_mlp(
        "sleepy",
        lambda: time.sleep(_sleep_seconds()),
        samples=256,
        base_batch_size=32,
        description="tiny MLP whose every step sleeps a fixed time",
    )


def drifting(
    step_seconds: float = 0.004,
    drift_per_second: float = 1.0,
    *,
    clock: Callable[[], float] | None = None,
    sleep: Callable[[float], None] | None = None,
) -> Workload:
    """A machine that slows down as you measure it: every step sleeps ``step_seconds``, times
    ``1 + drift_per_second × seconds since the workload was made``, whatever its batch size.

    So a batch twice as large is exactly twice as fast in samples/s at any moment, while the
    machine itself drifts: a paired measurement sees the 2x, one run after the other does not.
    ``clock`` and ``sleep`` replace ``time.monotonic`` and ``time.sleep`` (a test passes a
    virtual clock, so the drift is exact whatever else the machine is doing).
    """
    import time

    now = clock or time.monotonic
    wait = sleep or time.sleep
    made = now()
    return _waiting_mlp(
        "drifting",
        lambda: wait(step_seconds * (1 + drift_per_second * (now() - made))),
        samples=512,
        base_batch_size=16,
        description="tiny MLP whose steps sleep longer and longer: a drifting machine",
    )


def cuda_context_lost() -> Workload:
    """The tiny MLP whose loss raises what a corrupted CUDA context raises (an illegal memory
    access, as ``torch.AcceleratorError``): after it the probe worker must be replaced."""
    wl = tiny_mlp()
    wl.name = "cuda_context_lost"
    error = getattr(torch, "AcceleratorError", RuntimeError)

    def loss(model: nn.Module, batch: Batch) -> torch.Tensor:
        raise error(
            "CUDA error: an illegal memory access was encountered (faked on purpose by "
            "autotune.testing.workloads:cuda_context_lost)"
        )

    wl.loss = loss
    return wl


# What resnet18_capped lets its process's allocator hold on the GPU.
CAPPED_BYTES = 2 * 2**30


def resnet18_capped() -> Workload:
    """ResNet-18, in a process whose CUDA allocator may hold only ``CAPPED_BYTES`` (2 GiB).

    Loading it caps the process (``torch.cuda.set_per_process_memory_fraction``), so a probe in
    the worker that loaded it runs out of memory for real, early, even on a GPU with 140 GB
    free. Call it only in a worker: the cap stays for the process's life.
    """
    if torch.cuda.is_available():
        index = torch.cuda.current_device()
        total = torch.cuda.get_device_properties(index).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, CAPPED_BYTES / total), index)
    wl = resnet18()
    wl.name = "resnet18_capped"
    return wl
