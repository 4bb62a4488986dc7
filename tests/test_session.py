"""load_config and the AMP session (``autotune.session``): what a training script does with a config,
on CPU."""

from __future__ import annotations

import importlib
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from _configs import make_config, write_config
from _docs import code_block
from torch import nn

import autotune
from autotune import load_config
from autotune.amp_session import AmpSession, check_supported
from autotune.errors import (
    AutotuneWarning,
    ConfigError,
    DeviceError,
    EnvironmentMismatchWarning,
)
from autotune.execution.probe_worker import InProcessRunner
from autotune.measure.precision import restore_backend_flags, snapshot_backend_flags
from autotune.schema.spec import Candidate, load_spec
from autotune.search import run_search
from autotune.workloads import load_workload

ROOT = Path(__file__).resolve().parent.parent
# The module, to patch its names: `autotune.session` itself is the function.
SESSION = importlib.import_module("autotune.amp_session")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def mismatch_warnings(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, EnvironmentMismatchWarning)]


def train_steps(amp: AmpSession, steps: int = 3) -> tuple[nn.Module, list[float]]:
    """The docs' training loop on tiny_mlp's data; asserts the tuned dtype inside autocast."""
    wl = load_workload("tiny_mlp")
    model = amp.prepare(wl.build_model())
    opt = torch.optim.SGD(model.parameters(), lr=amp.learning_rate)
    batches = wl.make_batches(amp.batch_size, torch.device("cpu"), torch.Generator().manual_seed(0))
    # One batch again and again: its loss must fall if the steps really update the weights.
    batch = next(batches)
    losses = []
    for _ in range(steps):
        x, y = amp.prepare_batch(batch)
        opt.zero_grad()
        with amp.autocast():
            logits = model(x)
            assert logits.dtype == DTYPES[amp.precision]
            loss = nn.functional.cross_entropy(logits, y)
        amp.backward(loss)
        amp.step(opt)
        losses.append(loss.item())
    # Weights stay fp32 in every mode: autocast casts per op, the optimizer steps fp32 masters.
    assert all(p.dtype == torch.float32 for p in model.parameters())
    return model, losses


def test_round_trip_search_to_training_under_the_tuned_precision(tmp_path: Path) -> None:
    """The real path: a short search writes best.json; training loads it and runs its mode."""
    spec = load_spec(ROOT / "studies" / "tiny.yaml").with_overrides(
        {"storage": f"sqlite:///{tmp_path / 'study.db'}", "device": "cpu", "budget": "15s"}
    )
    result = run_search(spec, out_dir=tmp_path / "out", runner=InProcessRunner("cpu"))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        cfg = load_config(result.path)
    assert mismatch_warnings(record) == []  # tuned here, loaded here
    assert cfg == result.config
    before = snapshot_backend_flags()
    with autotune.session(cfg, "cpu") as amp:
        assert (amp.precision, amp.batch_size, amp.learning_rate) == (
            cfg.precision,
            cfg.batch_size,
            cfg.learning_rate,
        )
        assert amp.scaler.is_enabled() == (cfg.precision == "fp16")
        wl = load_workload(cfg.workload)
        model = amp.prepare(wl.build_model())
        if cfg.channels_last:
            conv = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
            assert conv.weight.is_contiguous(memory_format=torch.channels_last)
        opt = wl.build_optimizer(model.parameters(), cfg.learning_rate)
        batches = wl.make_batches(cfg.batch_size, amp.device, torch.Generator().manual_seed(0))
        for _ in range(2):
            x, y = amp.prepare_batch(next(batches))
            with amp.autocast():
                logits = model(x)
                loss = nn.functional.cross_entropy(logits, y)
            assert logits.dtype == DTYPES[cfg.precision]
            amp.backward(loss)
            amp.step(opt)
            opt.zero_grad()
        assert torch.isfinite(loss)
    assert snapshot_backend_flags() == before


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_session_trains_under_the_tuned_precision_and_scaler(precision: str) -> None:
    cfg = make_config(precision, init_scale=1024.0, growth_interval=50)
    with autotune.session(cfg, "cpu") as amp:
        scaler = amp.scaler
        assert isinstance(scaler, torch.amp.GradScaler)
        if precision == "fp16":
            # The tuned init_scale, not torch's 65536; checked before any step can back it off.
            assert scaler.is_enabled()
            assert scaler.get_scale() == 1024.0
            assert scaler.get_growth_interval() == 50
        else:
            assert not scaler.is_enabled()
        model, losses = train_steps(amp)
        assert all(torch.isfinite(torch.tensor(losses)))
        assert losses[-1] < losses[0]


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_backend_flags_are_the_modes_inside_and_restored_after(precision: str) -> None:
    original = snapshot_backend_flags()
    # Start from settings a user might have: TF32 on, cudnn autotuning off.
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    torch.backends.cudnn.benchmark = False
    try:
        before = snapshot_backend_flags()
        amp = autotune.session(make_config(precision), "cpu")
        flags = snapshot_backend_flags()
        # What the search measured: IEEE fp32 outside autocast, cudnn autotuning on.
        assert flags["matmul.fp32_precision"] == "ieee"
        assert flags["cudnn.conv.fp32_precision"] == "ieee"
        assert flags["cudnn.rnn.fp32_precision"] == "ieee"
        assert flags["cudnn.benchmark"] is True
        # Code between opening and prepare() changes a flag: prepare() sets the mode's again.
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        amp.prepare(nn.Linear(2, 2))
        assert snapshot_backend_flags() == flags
        amp.close()
        assert amp.closed
        assert snapshot_backend_flags() == before
        amp.close()  # twice is harmless and changes nothing
        assert snapshot_backend_flags() == before
    finally:
        restore_backend_flags(original)


def read_every_tf32_getter() -> dict[str, object]:
    """What library code reads (inductor, transformers, cudnn.flags()); each raises in torch
    when the new and the legacy TF32 settings disagree."""
    out: dict[str, object] = {
        "matmul_precision": torch.get_float32_matmul_precision(),
        "matmul_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_tf32": torch.backends.cudnn.allow_tf32,
        "rnn": torch.backends.cudnn.rnn.fp32_precision,
    }
    with torch.backends.cudnn.flags(enabled=True):
        pass
    return out


# Where a user's process may stand when the session opens: torch's defaults, the new API alone
# (what torch recommends, and what transformers' tf32= does), the legacy API alone.
USER_FLAGS = {
    "defaults": lambda: None,
    "new API, TF32 matmul": lambda: setattr(torch.backends.cuda.matmul, "fp32_precision", "tf32"),
    "new API, IEEE everywhere": lambda: setattr(torch.backends, "fp32_precision", "ieee"),
    "legacy, high": lambda: torch.set_float32_matmul_precision("high"),
}


@pytest.mark.parametrize("start", list(USER_FLAGS))
@pytest.mark.parametrize("precision", ["fp32", "tf32", "fp16", "bf16"])
def test_every_tf32_getter_answers_inside_every_modes_session(
    precision: str, start: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = snapshot_backend_flags()
    try:
        USER_FLAGS[start]()
        before = snapshot_backend_flags()
        if precision == "tf32":  # a CUDA mode: open its session as if on a GPU
            monkeypatch.setattr(SESSION, "check_supported", lambda p, d: torch.device("cpu"))
        with autotune.session(make_config(precision), "cpu"):
            tf32 = precision == "tf32"
            assert read_every_tf32_getter() == {
                "matmul_precision": "high" if tf32 else "highest",
                "matmul_tf32": tf32,
                "cudnn_tf32": tf32,
                "rnn": "tf32" if tf32 else "ieee",
            }
        assert snapshot_backend_flags() == before
    finally:
        restore_backend_flags(original)


def test_with_block_restores_flags_when_training_raises() -> None:
    before = snapshot_backend_flags()
    with (
        pytest.raises(RuntimeError, match="user bug"),
        autotune.session(make_config("bf16"), "cpu"),
    ):
        raise RuntimeError("user bug")
    assert snapshot_backend_flags() == before


def test_a_failure_while_opening_leaves_no_flag_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    before = snapshot_backend_flags()

    def half_apply(mode: Any, *, cudnn_benchmark: bool = True) -> None:
        torch.backends.cudnn.benchmark = not before["cudnn.benchmark"]
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        raise RuntimeError("flag setter failed half way")

    monkeypatch.setattr(SESSION, "apply_backend_flags", half_apply)
    with pytest.raises(RuntimeError, match="half way"):
        autotune.session(make_config("bf16"), "cpu")
    assert snapshot_backend_flags() == before


@pytest.mark.parametrize(
    ("precision", "device", "needle"),
    [
        ("tf32", "cpu", "precision 'tf32' needs a CUDA device"),
        ("bf16", "tpu", "device 'tpu' is not"),
        ("bf16", "cuda:7", "device 'cuda:7' does not exist"),
    ],
)
def test_a_session_that_cannot_run_says_why_and_changes_nothing(
    precision: str, device: str, needle: str
) -> None:
    if torch.cuda.is_available() and device.startswith("cuda"):
        pytest.skip("asserts behaviour without CUDA")
    before = snapshot_backend_flags()
    cand = Candidate(precision=precision, batch_size=8, learning_rate=0.1)
    with pytest.raises(DeviceError, match=needle):
        AmpSession(cand, device)
    assert snapshot_backend_flags() == before


def test_autocast_that_falls_back_to_fp32_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch only warns when autocast cannot use a dtype: training would silently run fp32.
    monkeypatch.setattr(SESSION, "check_autocast", lambda device, dtype: torch.float32)
    before = snapshot_backend_flags()
    with pytest.raises(DeviceError, match="silently run in fp32"):
        autotune.session(make_config("fp16"), "cpu")
    assert snapshot_backend_flags() == before


def test_a_mode_below_its_capability_runs_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    # A 7.5 GPU (T4): bf16 autocast works there, emulated, so it is a warning, not an error.
    monkeypatch.setattr(SESSION, "resolve_device", lambda d: torch.device("cuda", 3))
    monkeypatch.setattr(SESSION, "check_autocast", lambda device, dtype: dtype)
    monkeypatch.setattr(SESSION, "device_capability", lambda device: (7, 5))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert check_supported("bf16", "cuda:3") == torch.device("cuda", 3)
        check_supported("bf16", "cuda:3")
        check_supported("fp16", "cuda:3")  # 7.0+: fine
    messages = [str(w.message) for w in record if issubclass(w.category, AutotuneWarning)]
    assert messages == [
        "precision 'bf16' needs compute capability 8.0+ to run natively; cuda:3 has 7.5, so it "
        "runs emulated or without tensor cores, likely slower than fp32"
    ]


def test_prepare_moves_to_channels_last_and_prepare_batch_follows() -> None:
    cfg = make_config("bf16", channels_last=True)
    with autotune.session(cfg, "cpu") as amp:
        model = amp.prepare(nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten()))
        assert model[0].weight.is_contiguous(memory_format=torch.channels_last)
        x, y = amp.prepare_batch((torch.randn(2, 3, 8, 8), torch.tensor([0, 1])))
        assert x.is_contiguous(memory_format=torch.channels_last)
        assert y.dtype == torch.int64 and y.dim() == 1
        batch = amp.prepare_batch({"image": torch.randn(2, 3, 8, 8), "name": "keep"})
        assert batch["image"].is_contiguous(memory_format=torch.channels_last)
        assert batch["name"] == "keep"
        assert "channels_last" in repr(amp)
    with autotune.session(make_config("bf16"), "cpu") as amp:
        x = amp.prepare_batch(torch.randn(2, 3, 8, 8))
        assert x.is_contiguous()  # not tuned channels_last: left as it is


# ---- loading: tampered and truncated files ----------------------------------------------


def _tamper(data: dict[str, Any], change: str) -> dict[str, Any] | str:
    if change == "truncated":
        return json.dumps(data)[:200]
    if change == "schema_version":
        data["schema_version"] = 2
    elif change == "batch_size":
        data["batch_size"] = -32
    elif change == "precision":
        data["precision"] = "fp8"
    elif change == "extra":
        data["colour"] = "blue"
    elif change == "scaler":
        data["grad_scaler"]["enabled"] = True  # on a bf16 config
    elif change == "init_scale":
        data["grad_scaler"]["init_scale"] = 0
    elif change == "not_object":
        return "[1, 2, 3]"
    return data


@pytest.mark.parametrize(
    ("change", "needles"),
    [
        ("truncated", ["is not valid JSON", "truncated"]),
        ("schema_version", ["schema_version=2", "reads schema_version=1"]),
        ("batch_size", ["batch_size: Input should be greater than 0", "batch_size=-32"]),
        ("precision", ["precision: Input should be 'fp32', 'tf32', 'fp16' or 'bf16'", "'fp8'"]),
        ("extra", ["colour: unknown field"]),
        ("scaler", ["grad_scaler: grad_scaler.enabled=true does not match precision='bf16'"]),
        ("init_scale", ["grad_scaler.init_scale: Input should be greater than 0"]),
        ("not_object", ["must hold a JSON object, got list"]),
    ],
)
def test_a_tampered_config_names_the_field(tmp_path: Path, change: str, needles: list[str]) -> None:
    data = _tamper(make_config("bf16").model_dump(mode="json"), change)
    path = tmp_path / "best.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    for needle in needles:
        assert needle in message
    assert str(path) in message
    assert "\n" not in message  # one field wrong: one line


def test_a_missing_config_or_a_folder_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist; run `autotune search`"):
        load_config(tmp_path / "best.json")
    with pytest.raises(ConfigError, match="is a folder; pass the JSON file in it"):
        load_config(tmp_path)


# ---- loading elsewhere: the environment check ----------------------------------------------


def _elsewhere(tmp_path: Path, **env: Any) -> Path:
    data = make_config("bf16").model_dump(mode="json")
    data["environment"].update(env)
    return write_config(tmp_path / "best.json", data)


def test_loading_on_another_gpu_and_torch_warns_once_naming_each_difference(
    tmp_path: Path,
) -> None:
    path = _elsewhere(tmp_path, device="NVIDIA H200", capability=[9, 0], torch="2.1.2")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        cfg = load_config(path)
        load_config(path)  # every DataLoader worker loads it: still one warning
        autotune.session(cfg, "cpu").close()  # the session's check finds the same differences
    found = mismatch_warnings(record)
    assert len(found) == 1, found
    message = found[0]
    assert "tuned on 'NVIDIA H200', this is 'cpu (" in message
    assert "compute capability: tuned on 9.0" in message
    assert "torch: tuned with 2.1.2" in message
    assert "speedup (2.00x) may not hold" in message
    assert str(path) in message
    # Pointing at the caller, not at autotune's internals.
    first = next(w for w in record if issubclass(w.category, EnvironmentMismatchWarning))
    assert first.filename == __file__


@pytest.mark.parametrize(
    "env",
    [
        {},
        # A patch release of torch (and a different CUDA runtime) does not change the picture.
        {"torch": f"{torch.__version__.split('+')[0].rsplit('.', 1)[0]}.99", "cuda": "11.8"},
    ],
)
def test_loading_where_it_was_tuned_does_not_warn(tmp_path: Path, env: dict[str, Any]) -> None:
    path = _elsewhere(tmp_path, **env)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        autotune.session(load_config(path), "cpu").close()
    assert mismatch_warnings(record) == []


# The loops the pages show: docs/training.md's tuned loop and short form, and the README's.
LOOPS = {
    "tuned loop": ("docs/training.md", "amp = autotune.session(cfg, "),
    "short form": ("docs/training.md", "with autotune.session(cfg, "),
    "README": ("README.md", "with autotune.session(cfg, "),
}


@pytest.mark.gpu
@pytest.mark.parametrize("loop", list(LOOPS))
@pytest.mark.parametrize("precision", ["fp32", "tf32", "fp16", "bf16"])
def test_the_docs_training_loops_run_verbatim_on_a_gpu(
    precision: str, loop: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from autotune.schema.config import current_environment

    path, needle = LOOPS[loop]
    block = code_block(path, needle)
    cfg = make_config(precision, batch_size=16, init_scale=1024.0, growth_interval=500)
    cfg = cfg.model_copy(update={"environment": current_environment(torch.device("cuda"))})
    monkeypatch.chdir(tmp_path)
    (tmp_path / "studies" / "resnet18").mkdir(parents=True)
    write_config(tmp_path / "studies" / "resnet18" / "best.json", cfg)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    seen: list[torch.dtype] = []
    model[0].register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    data = torch.utils.data.TensorDataset(torch.randn(64, 16), torch.randint(0, 4, (64,)))
    before = snapshot_backend_flags()
    ns: dict[str, Any] = {
        "autotune": autotune,
        "torch": torch,
        "DataLoader": torch.utils.data.DataLoader,
        "model": model,
        "dataset": data,
        "loss_fn": nn.functional.cross_entropy,
    }
    exec(compile(block, f"{path} ({loop})", "exec"), ns)
    assert seen and set(seen) == {DTYPES.get(precision, torch.float32)}
    if precision == "fp16":
        assert ns["amp"].scaler.get_scale() == 1024.0  # the tuned init_scale, not torch's
    assert snapshot_backend_flags() == before  # closing the session put the flags back
