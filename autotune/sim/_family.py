"""A generated family of landscapes, drawn from a physical prior (docs/simulate.md, "A generated
family"): the shapes a search must hold on, and their mixtures, none written for it."""

from __future__ import annotations

import math
import random
from typing import Any

from autotune.sim._landscape import Landscape

__all__ = ["family"]

GiB = 2**30
MiB = 2**20
# Every table covers the default ladder (16 to 1024) and its neighbours; flat past the ends.
_BATCHES = tuple(2**k for k in range(3, 13))
# ResNet-18's modules, as model.named_modules() names them: where an island may lie.
_ISLANDS = (["fc"], ["layer4.1.bn2"], ["layer4.1.conv2", "fc"], ["layer3.1.conv2"])
_PRIOR = "docs/simulate.md, 'A generated family' (2026-12-02)"


def family(n: int, *, seed: int = 0) -> list[Landscape]:
    """``n`` landscapes drawn from the prior: the same ``seed`` gives the same family, and
    landscape ``i`` is the same whatever ``n`` is (a family of 20 starts with the one of 10).

    Every one is modelled (schema version 2) on the workload ``autotune.workloads:resnet18``.

    Raises:
        ValueError: ``n`` is negative.

    Example:
        >>> lands = family(3, seed=7)
        >>> [x.name for x in lands] == [x.name for x in family(3, seed=7)]
        True
        >>> lands[0].kind, lands[0].schema_version
        ('modelled', 2)
    """
    if n < 0:
        raise ValueError(f"a family has at least 0 landscapes, got n={n}; try n=100")
    return [_draw(random.Random(f"autotune.sim.family|{seed}|{i}"), seed, i) for i in range(n)]


def _log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def _draw(rng: random.Random, seed: int, i: int) -> Landscape:
    """One landscape: its device, then each shape in turn (one generator, in this order, so a
    change to one section's draws leaves the sections before it as they were)."""
    device, notes = _device(rng)
    modes, speed = _modes(rng, bf16=not device["unsupported"])
    notes.append(speed)
    bound = "input-bound" in speed
    fp16, overflow = _fp16(rng)
    notes.append(overflow)
    noise, noisy = _noise(rng)
    notes.append(noisy)
    knobs = _knobs(rng, input_bound=bound)
    notes.append(f"compile {knobs['compile_speedup']:.2f}x in {knobs['compile_seconds']:.0f}s")
    # Drawn from a generator of their own: the draws above stay as they were before they came.
    lr_limits, unstable = _lr_limits(random.Random(f"autotune.sim.family|{seed}|{i}|lr"))
    if unstable:
        notes.append(unstable)
    data: dict[str, Any] = {
        "schema_version": 2,
        "name": f"family{seed}-{i:04d}",
        "kind": "modelled",
        "description": f"Modelled, not measured: drawn from autotune.sim.family's prior "
        f"({_PRIOR}), seed {seed}, number {i}: {'; '.join(notes)}.",
        **device,
        "workload": "autotune.workloads:resnet18",
        # Exactly what autotune.workloads:resnet18 reports, as the shipped landscapes say.
        "facts": {
            "base_lr": 0.1,
            "base_batch_size": 128,
            "lr_scaling": "linear",
            "channels_last": True,
            "optimizer": "SGD",
        },
        "modes": modes,
        "noise": noise,
        "loss": {
            "initial": 2.3,  # ln(10): ten classes
            "final": 0.3,
            "samples_scale": 20000.0,
            "step_noise": rng.uniform(0.01, 0.04),
            "seed_spread": rng.uniform(0.002, 0.008),
        },
        "parity": _parity(rng) | lr_limits,
        "fp16": fp16,
        "knobs": knobs,
        "timing": {
            "worker_start_seconds": rng.uniform(3.0, 8.0),  # import torch, a CUDA context
            "build_seconds": rng.uniform(0.3, 1.5),
            "first_step_seconds": rng.uniform(0.3, 2.0),  # cuDNN autotune on a new shape
            "warmup_extra": rng.uniform(0.2, 1.0),
            "warmup_steps": rng.uniform(2.0, 5.0),
        },
        "sources": [
            {"id": "family-prior", "cite": _PRIOR, "used_for": "every figure: its range"},
            {
                "id": "autotune-resnet18",
                "cite": "autotune.workloads:resnet18 (autotune/workloads/_builtin.py)",
                "used_for": "facts: base lr 0.1 at batch 128, linear lr rule, SGD",
            },
        ],
    }
    _lag_fade(data["parity"], seed, i)
    return Landscape.model_validate(data)


def _lag_fade(parity: dict[str, Any], seed: int, i: int) -> None:
    """An early lag fades linearly or as a relaxation, half and half, drawn from a generator
    of its own (the draws before it stay as they were)."""
    if "lag_per_batch_ratio" in parity:
        fade = random.Random(f"autotune.sim.family|{seed}|{i}|lag").random() < 0.5
        parity["lag_fade"] = "exponential" if fade else "linear"


def _device(rng: random.Random) -> tuple[dict[str, Any], list[str]]:
    """Its memory and whether it has bf16 (and tf32): compute capability 8.0 brought both;
    the devices before it (a T4, a V100) top out at 32 GB."""
    bf16 = rng.random() < 0.75
    gb = _log_uniform(rng, 16.0, 141.0 if bf16 else 32.0)
    kind = "Ampere-or-later" if bf16 else "T4-like"
    cap = [8, 0] if bf16 else [7, 5]
    why = "needs compute capability 8.0+, this device has 7.5"
    unsupported = {} if bf16 else {"bf16": f"bf16 {why}", "tf32": f"tf32 {why}"}
    device = {
        "device": f"Generated GPU ({kind}, {gb:.0f} GB)",
        "device_type": "cuda",
        "capability": cap,
        "memory_total_bytes": int(gb * 1e9),
        "unsupported": unsupported,
    }
    return device, [f"{kind}, {gb:.0f} GB"]


def _modes(rng: random.Random, *, bf16: bool) -> tuple[dict[str, Any], str]:
    """Each mode's step time and memory (see :func:`_step`)."""
    per_sample = _log_uniform(rng, 8e-6, 2e-4)  # fp32: an H100 to a T4 at ResNet-18's size
    # The launch floor (eager dispatch of a few hundred kernels a step) as the batch whose
    # compute covers it: a faster GPU comes with a faster host (the shipped A100's is 50, the
    # T4's 59), within what a host takes to launch them.
    launch = min(max(per_sample * _log_uniform(rng, 16, 256), 0.5e-3), 10e-3)
    overlap_loss = rng.uniform(0.05, 0.25)  # the share of the shorter part not overlapped
    fp16 = rng.uniform(1.5, 3.5)  # tensor cores and half the bytes, per sample
    speedups = {"fp32": 1.0, "fp16": fp16}
    if bf16:
        speedups["bf16"] = fp16 * rng.uniform(0.85, 1.0)  # fp16's peak, a little slower
        speedups["tf32"] = 1 + rng.uniform(0.2, 0.6) * (fp16 - 1)  # fp32's bytes, TF32 math
    amp_launch = launch * rng.uniform(1.0, 1.15)  # the casts' own kernels
    # Past a middle batch the activations spill out of the caches: the per-sample cost grows
    # per doubling (half the bytes in the autocast modes: their peak one doubling later).
    peak = 2 ** rng.randint(7, 9) if rng.random() < 0.3 else None
    fall = rng.uniform(0.1, 0.3)
    # A slow input pipeline: the loader delivers a fixed rate from the base batch on, and
    # every mode waits for it (a little of the GPU step is not hidden behind it).
    pipeline = 0.0 if peak is not None or rng.random() >= 0.12 else rng.uniform(1.05, 1.5)
    hidden = rng.uniform(0.0, 0.02)
    mem_sample = _log_uniform(rng, 2 * MiB, 40 * MiB)  # activations kept for the backward
    mem_fixed = _log_uniform(rng, 0.3 * GiB, 4 * GiB)  # weights, grads, momentum, workspace
    amp_sample, amp_fixed = rng.uniform(0.5, 0.7), rng.uniform(1.0, 1.15)
    gpu = {
        mode: {
            b: _step(
                amp_launch if mode in ("fp16", "bf16") else launch,
                per_sample / s,
                b,
                overlap_loss,
                None if peak is None else peak * (2 if mode in ("fp16", "bf16") else 1),
                fall,
            )
            for b in _BATCHES
        }
        for mode, s in speedups.items()
    }
    # The loader's seconds per sample: slower than any mode's GPU step from the base batch on.
    loader = pipeline * max(steps[128] for steps in gpu.values()) / 128
    modes: dict[str, Any] = {}
    for mode, steps in gpu.items():
        half = mode in ("fp16", "bf16")
        rates = {}
        for b, t in steps.items():
            step = max(t, loader * b) + hidden * t if loader else t
            rates[b] = round(b / step, 1)
        modes[mode] = {
            "throughput": rates,
            "memory_fixed_bytes": int(mem_fixed * (amp_fixed if half else 1.0)),
            "memory_per_sample_bytes": int(mem_sample * (amp_sample if half else 1.0)),
            "parity_gap": {"fp32": 0.0, "tf32": 0.0005, "fp16": 0.002, "bf16": 0.005}[mode]
            * rng.uniform(0.0, 2.0),
        }
    shape = "input-bound" if loader else f"peaks at {peak}" if peak else "saturating"
    return modes, f"fp16 {fp16:.2f}x per sample, {shape}"


def _step(
    launch: float, per_sample: float, batch: int, loss: float, peak: int | None, fall: float
) -> float:
    """A step's seconds: eager launches overlap the GPU's work, so the longer of the launch
    floor and the batch's compute, plus the share of the shorter that is not hidden."""
    if peak is not None and batch > peak:
        per_sample *= 1 + fall * math.log2(batch / peak)
    work = per_sample * batch
    return max(launch, work) + loss * min(launch, work)


def _fp16(rng: random.Random) -> tuple[dict[str, Any], str]:
    """fp16's overflow (none, late, or late and sooner at larger batches), where it lies, and
    the largest init_scale its gradients allow."""
    k = 16 if rng.random() < 0.5 else rng.randint(5, 15)  # GradScaler's default, or below
    out: dict[str, Any] = {"safe_init_scale": 2.0**k}
    draw = rng.random()
    if draw < 0.55:
        return out, f"fp16 never overflows, safe init_scale 2^{k}"
    at = round(_log_uniform(rng, 30, 500))
    # A larger lr grows the weights, and the activations they make, in fewer steps.
    out |= {"diverges_at_step": at, "diverge_lr_exponent": rng.uniform(-1.5, -0.5)}
    what = f"fp16 overflows at step {at}"
    if draw >= 0.85:
        # ... and so does a larger batch at the rule's larger lr; a small one may never.
        out["diverge_batch_exponent"] = rng.uniform(-1.2, -0.3)
        what += " (sooner at larger batches)"
        if rng.random() < 0.5:
            out["diverge_min_batch"] = 2 ** rng.randint(7, 9)
            what += f" from batch {out['diverge_min_batch']}"
    # In named modules (fp32 islands fix it), or in functional code between them.
    out["islands"] = list(rng.choice(_ISLANDS)) if rng.random() < 0.5 else []
    where = ", ".join(out["islands"]) or "functional code"
    return out, f"{what} in {where}, safe init_scale 2^{k}"


def _noise(rng: random.Random) -> tuple[dict[str, Any], str]:
    """A dedicated device's few percent, up to a time-sliced one's 15%, with a neighbour's
    bursts (a share of blocks) and a slow drift."""
    out: dict[str, Any] = {"block_cv": _log_uniform(rng, 0.01, 0.15)}
    words = [f"block noise {out['block_cv']:.1%}"]
    if rng.random() < 0.35:
        share, blocks = rng.uniform(0.0, 0.08), rng.randint(1, 6)
        # The chance a block starts a burst that then lasts ``blocks``, for that share of
        # blocks in bursts: share = p * blocks / (1 + p * (blocks - 1)).
        out |= {
            "burst_probability": share / (blocks - share * (blocks - 1)),
            "burst_slowdown": rng.uniform(1.5, 3.0),
            "burst_blocks": blocks,
        }
        words.append(f"{share:.0%} of blocks in bursts of {blocks}")
    if rng.random() < 0.3:
        out |= {
            "drift_amplitude": rng.uniform(0.005, 0.05),
            "drift_period_s": _log_uniform(rng, 120.0, 1800.0),
        }
        words.append("drift")
    return out, ", ".join(words)


def _parity(rng: random.Random) -> dict[str, Any]:
    """A lasting gap per batch doubling, maybe shown only late; a larger batch's early lag."""
    out: dict[str, Any] = {
        "gap_per_batch_doubling": rng.uniform(0.0, 0.03),
        "gap_per_lr_log2": 0.05,  # an lr off the rule learns worse (see _lr_limits)
        "diverge_lr_multiplier": rng.uniform(2.0, 8.0),  # SGD with momentum blows up past it
    }
    if rng.random() < 0.3:
        out["gap_onset_samples"] = _log_uniform(rng, 3000.0, 40000.0)
    if rng.random() < 0.5:
        out |= {
            "lag_per_batch_ratio": rng.uniform(0.002, 0.02),
            "lag_steps": rng.uniform(100.0, 400.0),
        }
    return out


def _lr_limits(rng: random.Random) -> tuple[dict[str, Any], str]:
    """How much an lr off the rule costs, and, in some, an lr past which any batch diverges:
    without a warm-up the linear rule's larger lr blows up from some batch on while the base
    lr trains there (recorded on an H200 and on a CPU: lr 0.2 at bs=256 diverged, 0.1 did
    not), so only a larger batch at a kept lr is safe, at the cost of learning less a sample."""
    out: dict[str, Any] = {"gap_per_lr_log2": rng.uniform(0.0, 0.05)}
    if rng.random() >= 0.3:
        return out, ""
    above = rng.uniform(1.0, 3.0)
    out["diverge_lr_above"] = above
    return out, f"lr above {above:.1f}x the base diverges at any batch"


def _knobs(rng: random.Random, *, input_bound: bool) -> dict[str, Any]:
    """torch.compile per mode: reduce-overhead's CUDA graphs cut launches, max-autotune's
    kernel search gains a little more for several times the compile; channels_last; the
    cost of an fp32 island. Behind a slow input pipeline neither knob speeds the loader."""
    gain, seconds = rng.uniform(1.0, 1.5), rng.uniform(20.0, 120.0)
    graphs, kernels, search = rng.uniform(1.0, 1.15), rng.uniform(1.0, 1.1), rng.uniform(2, 5)
    layout = rng.uniform(1.0, 1.2)
    if input_bound:
        gain = graphs = kernels = layout = 1.0
    return {
        "compile_speedup": gain,
        "compile_seconds": seconds,
        "compile_modes": {
            "reduce-overhead": {
                "speedup": gain * graphs,
                "seconds": seconds * rng.uniform(1.1, 1.5),
            },
            "max-autotune": {"speedup": gain * graphs * kernels, "seconds": seconds * search},
            "max-autotune-no-cudagraphs": {"speedup": gain * kernels, "seconds": seconds * search},
        },
        "channels_last_speedup": layout,
        "fp32_module_cost": rng.uniform(0.02, 0.08),
    }
