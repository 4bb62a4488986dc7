"""Write the six modelled GPU landscapes of ResNet-18 (``autotune/sim/landscapes/*-resnet18.yaml``)
from one step model and each GPU's published figures, so every number in them has a reason.

The step model, per precision mode and batch size ``b``:

- **Host**: eager PyTorch issues one kernel per op, each costing the host ``launch`` seconds.
  A ResNet-18 training step is 542 ops in fp32 and 589 under autocast (47 of them ``_to_copy``:
  the casts), with 4 more for fp16's GradScaler (scale, unscale with its inf check, update, the
  skip count). The built-in optimizers are fused on CUDA, so no step waits on the host.
- **Device**: every kernel takes at least ``kernel_floor``; the work grows with the batch at
  ``per_sample`` seconds: the training FLOPs (0.217 GFLOP a sample, counted with torch's
  ``FlopCounterMode``) at a share of the mode's peak, plus the activation traffic (ten passes over
  the saved activations: BN and ReLU read and write them forward and back) at a share of the
  memory bandwidth. fp16 also reads and writes every gradient once more (unscaling them).
- **Overlap**: the host queues kernels while the device runs earlier ones, so a step takes about
  the longer of the two (a smooth maximum): speedups stay near 1.0x while launches bind.
- fp16 and bf16 have the same tensor-core rate on every GPU here that has bf16; fp16 pays the
  scaler, so bf16 is never slower. tf32 is the faster of TF32 tensor cores and fp32 cores (cuDNN's
  benchmark picks per layer).
- **Memory** per sample is what ResNet-18 at 3x32x32 saves for backward (measured with
  ``torch.autograd.graph.saved_tensors_hooks``: 0.434 MiB in fp32, 0.232 MiB under bf16
  autocast), x1.3 for what backward holds beside it; fixed: weights, gradients and momentum
  (3 x 42.7 MiB), 128 MiB of cuDNN workspace and allocator slack, and autocast's weight casts.

Run ``python benchmarks/gpu_landscapes.py`` to rewrite the files (the sections the model does
not cover, from ``noise:`` on, are kept as they are); ``--check`` says whether they are current.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path
from typing import NamedTuple

LANDSCAPES = Path(__file__).resolve().parent.parent / "autotune" / "sim" / "landscapes"
LADDER = (16, 32, 64, 128, 256, 512, 1024, 2048)
BASE_BATCH = 128
MIB = 2**20

FLOPS_PER_SAMPLE = 0.217e9  # fwd + bwd, torchvision ResNet-18 at 3x32x32 (FlopCounterMode)
SAVED = {"fp32": 0.434 * MIB, "amp": 0.232 * MIB}  # saved for backward, a sample (measured)
HELD_BESIDE = 1.3  # what backward holds beside the saved tensors (gradients of activations)
TRAFFIC_PASSES = 10  # passes over the saved activations a step makes through memory
PARAM_BYTES = 44.7e6  # 11.2 M parameters in fp32
OPS = {"fp32": 542, "amp": 589, "scaler": 4}  # kernels a step (counted on a CUDA step)
COMPILED_OPS = 150  # inductor's fused kernels plus cuDNN's convolutions, about
COMPILED_TRAFFIC = 0.7  # fusing BN and ReLU into neighbours saves about a third of the traffic
CUDA_CORE_SHARE = 0.35  # of the fp32 peak small convolutions reach
TENSOR_CORE_SHARE = 0.30  # of the tensor-core peak (feature maps of 8x8 down to 1x1)
BANDWIDTH_SHARE = 0.6  # of the memory bandwidth elementwise kernels reach
OVERLAP_P = 4  # the smooth maximum's exponent: host and device overlap, not quite perfectly


class Gpu(NamedTuple):
    name: str
    fp32_tflops: float  # CUDA-core peak
    tf32_tflops: float | None  # dense tensor-core peak; None: no TF32
    half_tflops: float  # dense fp16 (and bf16, where it exists) tensor-core peak, fp32 accumulate
    bandwidth_tbs: float
    launch_us: float  # host seconds a kernel launch costs eager PyTorch, in microseconds
    floor_us: float  # the least a kernel takes on the device
    cite: str


GPUS = {
    "a100": Gpu("a100", 19.5, 156, 312, 2.039, 5.0, 2.5,
                "NVIDIA A100 datasheet (SXM4 80GB): FP32 19.5, TF32 156, FP16/BF16 312 TFLOPS dense, 2,039 GB/s"),
    "h100": Gpu("h100", 67, 495, 989, 3.35, 4.5, 2.0,
                "NVIDIA H100 datasheet (SXM5): FP32 67, TF32 495, FP16/BF16 989 TFLOPS dense, 3.35 TB/s"),
    "h200": Gpu("h200", 67, 495, 989, 4.8, 4.5, 2.0,
                "NVIDIA H200 datasheet (SXM): H100's compute (FP32 67, TF32 495, FP16/BF16 989 TFLOPS dense), 4.8 TB/s"),
    "rtx4090": Gpu("rtx4090", 82.6, 82.6, 165.2, 1.008, 4.0, 2.0,
                   "NVIDIA Ada whitepaper, RTX 4090: FP32 82.6, TF32 82.6, FP16/BF16 165.2 TFLOPS dense with FP32 accumulate, 1,008 GB/s"),
    "t4": Gpu("t4", 8.1, None, 65, 0.32, 7.0, 3.0,
              "NVIDIA T4 datasheet: FP32 8.1, FP16 65 TFLOPS (mixed), 320 GB/s; no TF32 or BF16"),
    "v100": Gpu("v100", 15.7, None, 125, 0.9, 6.0, 3.0,
                "NVIDIA V100 datasheet (SXM2): FP32 15.7, FP16 125 TFLOPS (tensor), 900 GB/s; no TF32 or BF16"),
}  # fmt: skip


def _smooth_max(a: float, b: float, p: float) -> float:
    return (a**p + b**p) ** (1 / p)


def per_sample(gpu: Gpu, mode: str, *, compiled: bool = False) -> float:
    """Device seconds a sample adds to a step."""
    traffic = TRAFFIC_PASSES * SAVED["fp32" if mode in ("fp32", "tf32") else "amp"]
    traffic *= COMPILED_TRAFFIC if compiled else 1.0
    memory = traffic / (BANDWIDTH_SHARE * gpu.bandwidth_tbs * 1e12)
    fp32 = FLOPS_PER_SAMPLE / (CUDA_CORE_SHARE * gpu.fp32_tflops * 1e12)
    if mode == "fp32":
        return fp32 + memory
    if mode == "tf32":
        assert gpu.tf32_tflops is not None
        return min(fp32, FLOPS_PER_SAMPLE / (TENSOR_CORE_SHARE * gpu.tf32_tflops * 1e12)) + memory
    return FLOPS_PER_SAMPLE / (TENSOR_CORE_SHARE * gpu.half_tflops * 1e12) + memory


def step_seconds(gpu: Gpu, mode: str, batch: int, *, compiled: bool = False) -> float:
    """A training step's seconds: host and device overlapped."""
    ops = OPS["fp32"] if mode in ("fp32", "tf32") else OPS["amp"]
    if mode == "fp16":
        ops += OPS["scaler"]
    if compiled:
        ops = COMPILED_OPS
    host = ops * gpu.launch_us * 1e-6
    fixed = ops * gpu.floor_us * 1e-6
    if mode == "fp16":
        # Unscaling reads and writes every gradient once more.
        fixed += 2 * PARAM_BYTES / (BANDWIDTH_SHARE * gpu.bandwidth_tbs * 1e12)
    device = _smooth_max(fixed, per_sample(gpu, mode, compiled=compiled) * batch, 2)
    return _smooth_max(host, device, OVERLAP_P)


def memory(mode: str) -> tuple[int, int]:
    """(fixed, per-sample) bytes of a mode's peak."""
    amp = mode in ("fp16", "bf16")
    fixed = 3 * PARAM_BYTES + 128 * MIB + (PARAM_BYTES / 2 if amp else 0)  # + bf16/fp16 casts
    return int(fixed), int(HELD_BESIDE * SAVED["amp" if amp else "fp32"])


def modes_of(gpu: Gpu) -> list[str]:
    return [
        "fp32",
        *(["tf32"] if gpu.tf32_tflops else []),
        "fp16",
        *(["bf16"] if gpu.tf32_tflops else []),
    ]


def compile_speedup(gpu: Gpu) -> float:
    """Compiled over eager for the half-precision mode: the schema has one factor for every mode
    and batch, taken as the geometric mean over the base batch and above (where a search ends;
    smaller batches, launch-bound, gain more, the largest less)."""
    mode = "bf16" if gpu.tf32_tflops else "fp16"
    sizes = [b for b in LADDER if b >= BASE_BATCH]
    gains = [step_seconds(gpu, mode, b) / step_seconds(gpu, mode, b, compiled=True) for b in sizes]
    return math.exp(sum(math.log(g) for g in gains) / len(gains))


PARITY = {"fp32": "0.0  # the reference itself",
          "tf32": "0.0  # TF32's 10-bit mantissa matches fp32 training (pytorch-tf32)",
          "fp16": "0.002  # fp16 autocast+GradScaler tracks fp32 closely (torch-amp-docs)",
          "bf16": "0.005  # bf16's 8-bit mantissa, noisier than fp16 (torch-amp-docs)"}  # fmt: skip


def modes_text(gpu: Gpu) -> str:
    lines = ["modes:"]
    for mode in modes_of(gpu):
        fixed, per = memory(mode)
        c = per_sample(gpu, mode) * 1e6
        lines.append(f"  {mode}:")
        lines.append(
            f"    # modelled: {c:.2f} us a sample on the device; host and device overlap (header)"
        )
        lines.append("    throughput:  # samples/s")
        for b in LADDER:
            step = step_seconds(gpu, mode, b)
            ratio = step_seconds(gpu, "fp32", b) / step
            lines.append(
                f"      {b}: {b / step:.0f}  # modelled: {step * 1e3:.2f} ms/step, {ratio:.2f}x fp32"
            )
        lines.append(
            f"    memory_fixed_bytes: {fixed}  # modelled: weights, gradients, momentum, workspace{' and the casts' if mode in ('fp16', 'bf16') else ''}"
        )
        lines.append(
            f"    memory_per_sample_bytes: {per}  # modelled: {per / MIB:.2f} MiB, the saved activations x{HELD_BESIDE} (header)"
        )
        lines.append(f"    parity_gap: {PARITY[mode]}")
    return "\n".join(lines) + "\n"


def header(gpu: Gpu) -> str:
    c = {m: per_sample(gpu, m) * 1e6 for m in modes_of(gpu)}
    host = OPS["fp32"] * gpu.launch_us / 1e3
    cross = OPS["fp32"] * gpu.launch_us / c["fp32"]
    half = "bf16" if "bf16" in c else "fp16"
    return (
        "# MODELLED, not measured: written by benchmarks/gpu_landscapes.py from one step model and\n"
        "# this GPU's published figures (sources: gpu-datasheet, gpu-landscapes-model).\n"
        f"# Host: {OPS['fp32']} kernels an fp32 step ({OPS['amp']} under autocast, +{OPS['scaler']} for fp16's\n"
        f"# scaler) at {gpu.launch_us} us a launch = {host:.2f} ms; device: {gpu.floor_us} us a kernel at least,\n"
        f"# plus {c['fp32']:.1f} us a sample in fp32 and {c[half]:.2f} in {half}; a step is about the longer\n"
        f"# of the two (they overlap), so fp32 stops being launch-bound near batch {cross:.0f} and the\n"
        "# speedups stay near 1.0x below that. Memory: the saved activations, measured (header of\n"
        "# benchmarks/gpu_landscapes.py). What a real recording would most likely change: the\n"
        "# shares of peak (small convolutions: 8x8 feature maps down to 1x1), the launch cost of\n"
        "# this host's CPU, and compile's gain, here one factor over the base batch and above.\n"
    )


def render(gpu: Gpu, current: str) -> str:
    """The file's new text: the model's header and modes, the rest of ``current`` kept."""
    start = current.index("\nmodes:\n") + 1
    end = re.compile(r"^\w+:", re.M).search(current, start + len("modes:\n"))
    assert end is not None, "a landscape has sections after modes:"
    keep_top = current[current.index("schema_version:") : start]
    rest = current[end.start() :]
    rest = re.sub(
        r"  compile_speedup: [0-9.]+  #[^\n]*",
        f"  compile_speedup: {compile_speedup(gpu):.2f}  # modelled: {COMPILED_OPS} kernels a step"
        f" instead of {OPS['amp']}, the mean gain over the base batch and above (gpu_landscapes.py)",
        rest,
    )
    if "id: gpu-landscapes-model" not in rest:
        rest = rest.rstrip("\n") + "\n" + _SOURCES.format(cite=gpu.cite)
    return header(gpu) + keep_top + modes_text(gpu) + rest


_SOURCES = """  - id: gpu-datasheet
    cite: "{cite}"
    used_for: "the peaks and the bandwidth of the step model"
  - id: gpu-landscapes-model
    cite: "benchmarks/gpu_landscapes.py: 542 -> 589 kernels a step under autocast (47 casts) counted on a CUDA step; 0.217 GFLOP a training sample (FlopCounterMode); 0.434 / 0.232 MiB saved for backward a sample in fp32 / bf16 (saved_tensors_hooks)"
    used_for: "throughput tables (host and device overlapped), memory, compile's factor"
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="say whether the files are current")
    args = parser.parse_args(argv)
    stale = []
    for key, gpu in GPUS.items():
        path = LANDSCAPES / f"{key}-resnet18.yaml"
        current = path.read_text()
        text = render(gpu, current)
        if text != current:
            stale.append(path.name)
            if not args.check:
                path.write_text(text)
        fp32 = {b: b / step_seconds(gpu, "fp32", b) for b in LADDER}
        best = max(modes_of(gpu), key=lambda m: BASE_BATCH / step_seconds(gpu, m, BASE_BATCH))
        print(
            f"{key:8} fp32 bs=128 {fp32[128]:>8,.0f}/s; at bs=128 best {best} "
            f"{step_seconds(gpu, 'fp32', 128) / step_seconds(gpu, best, 128):.2f}x, "
            f"at bs=2048 {step_seconds(gpu, 'fp32', 2048) / step_seconds(gpu, best, 2048):.2f}x; "
            f"compile {compile_speedup(gpu):.2f}x"
        )
    if args.check and stale:
        print(f"not current: {', '.join(stale)} (run python benchmarks/gpu_landscapes.py)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
