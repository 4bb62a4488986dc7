"""Precision modes: the table, autocast dtypes, backend flags and the hardware filter."""

from __future__ import annotations

import pytest
import torch

from autotune.errors import DeviceError, SpecError
from autotune.measure.precision import (
    MODES,
    autocast,
    backend_flags,
    check_autocast,
    get_mode,
    make_scaler,
    resolve_device,
    snapshot_backend_flags,
    unsupported_modes,
)

CPU = torch.device("cpu")
FAKE_CUDA = torch.device("cuda", 0)  # a device object only: nothing runs on it
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="asserts behaviour without CUDA")


def test_table_holds_the_four_modes() -> None:
    assert list(MODES) == ["fp32", "tf32", "fp16", "bf16"]
    assert [m.name for m in MODES.values() if m.scales_loss] == ["fp16"]
    assert [m.name for m in MODES.values() if m.tf32] == ["tf32"]


def test_unknown_mode_lists_the_known_ones() -> None:
    with pytest.raises(
        SpecError, match="unknown precision 'fp8'; use one of fp32, tf32, fp16, bf16"
    ):
        get_mode("fp8")


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        ("fp32", torch.float32),
        ("tf32", torch.float32),
        ("fp16", torch.float16),
        ("bf16", torch.bfloat16),
    ],
)
def test_matmul_inside_autocast_really_runs_in_the_modes_dtype(
    name: str, dtype: torch.dtype
) -> None:
    a = torch.randn(8, 8)
    with autocast(get_mode(name), CPU):
        assert (a @ a).dtype == dtype
    assert (a @ a).dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_check_autocast_reports_the_produced_dtype_on_cpu(dtype: torch.dtype) -> None:
    assert check_autocast(CPU, dtype) == dtype


@pytest.mark.parametrize(
    ("name", "enabled"), [("fp32", False), ("tf32", False), ("bf16", False), ("fp16", True)]
)
def test_only_fp16_gets_an_enabled_grad_scaler(name: str, enabled: bool) -> None:
    scaler = make_scaler(get_mode(name), CPU, init_scale=2.0**10)
    assert scaler.is_enabled() == enabled
    if enabled:
        assert scaler.get_scale() == 2.0**10


@pytest.mark.parametrize(
    ("name", "inside"), [("fp32", "ieee"), ("tf32", "tf32"), ("fp16", "ieee"), ("bf16", "ieee")]
)
def test_backend_flags_set_inside_and_restored_after(name: str, inside: str) -> None:
    before = snapshot_backend_flags()
    with backend_flags(get_mode(name), cudnn_benchmark=True):
        flags = snapshot_backend_flags()
        assert flags["cudnn.benchmark"] is True
        assert flags["matmul.fp32_precision"] == inside
        assert flags["cudnn.conv.fp32_precision"] == inside
    assert snapshot_backend_flags() == before


@pytest.mark.parametrize("name", list(MODES))
def test_a_probes_flags_keep_torchs_legacy_tf32_getters_answering(name: str) -> None:
    # The probe's block (backend_flags): inductor reads get_float32_matmul_precision(), library
    # code cudnn.allow_tf32 and cudnn.flags(); each raises when torch's two TF32 views disagree.
    before = snapshot_backend_flags()
    tf32 = MODES[name].tf32
    with backend_flags(get_mode(name)):
        assert torch.backends.cudnn.rnn.fp32_precision == ("tf32" if tf32 else "ieee")
        assert torch.get_float32_matmul_precision() == ("high" if tf32 else "highest")
        assert torch.backends.cuda.matmul.allow_tf32 is tf32
        assert torch.backends.cudnn.allow_tf32 is tf32
        with torch.backends.cudnn.flags(enabled=True):
            pass
    assert snapshot_backend_flags() == before


def test_backend_flags_restored_after_an_exception() -> None:
    before = snapshot_backend_flags()
    with pytest.raises(RuntimeError, match="boom"), backend_flags(get_mode("tf32")):
        assert snapshot_backend_flags() != before
        raise RuntimeError("boom")
    assert snapshot_backend_flags() == before


def test_cpu_supports_everything_but_tf32() -> None:
    assert unsupported_modes(CPU) == {
        "tf32": "tf32 is a CUDA feature: CPU matmuls have no TF32 mode"
    }


@pytest.mark.parametrize(
    ("capability", "unsupported"),
    [
        ((6, 1), {"tf32", "fp16", "bf16"}),
        ((7, 0), {"tf32", "bf16"}),
        ((7, 5), {"tf32", "bf16"}),
        ((8, 0), set()),
        ((8, 9), set()),
        ((9, 0), set()),
    ],
)
def test_hardware_filter_by_compute_capability(
    capability: tuple[int, int], unsupported: set[str]
) -> None:
    out = unsupported_modes(FAKE_CUDA, capability, probe=False)
    assert set(out) == unsupported
    have = ".".join(map(str, capability))
    for name, reason in out.items():
        need = ".".join(map(str, MODES[name].min_capability))
        assert reason == f"{name} needs compute capability {need}+, this device has {have}"


@no_cuda
def test_auto_device_is_cpu_without_cuda() -> None:
    assert resolve_device("auto") == CPU


@pytest.mark.parametrize("text", ["cpu", " CPU "])
def test_cpu_device_resolves(text: str) -> None:
    assert resolve_device(text) == CPU


@no_cuda
@pytest.mark.parametrize("text", ["cuda", "cuda:0"])
def test_cuda_without_cuda_says_use_cpu(text: str) -> None:
    with pytest.raises(DeviceError, match=f"device {text!r} does not exist.*--device cpu"):
        resolve_device(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("gpu0", "is not a device"), ("meta", "is not supported")],
)
def test_unknown_device_is_named(text: str, expected: str) -> None:
    with pytest.raises(DeviceError, match=f"device {text!r} {expected}"):
        resolve_device(text)


@pytest.mark.gpu
def test_real_gpu_filter_matches_its_capability() -> None:
    dev = resolve_device("cuda")
    capability = torch.cuda.get_device_capability(dev)
    out = unsupported_modes(dev)
    assert set(out) == {n for n, m in MODES.items() if capability < m.min_capability}
    for name, mode in MODES.items():
        if name not in out and mode.autocast_dtype is not None:
            assert check_autocast(dev, mode.autocast_dtype) == mode.autocast_dtype
