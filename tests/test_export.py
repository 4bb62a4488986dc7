"""Exports without the libraries: what each mode becomes, on which device, and what is refused.

The libraries' own tests (the README's examples training for real, the files read by their own
loaders) are in test_integrations.py; these need none of them installed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from _configs import make_config, write_config
from typer.testing import CliRunner

import autotune
from autotune.cli import app
from autotune.errors import DeviceError, SpecError
from autotune.precision import restore_backend_flags, snapshot_backend_flags

# Lightning's MixedPrecision plugin and torch's GradScaler, as LightningCLI names them.
PLUGIN = "lightning.pytorch.plugins.precision.MixedPrecision"


def cuda_config(precision: str, **fields: Any) -> autotune.TunedConfig:
    """A config tuned on a CUDA device (its environment records a compute capability)."""
    cfg = make_config(precision, **fields)
    env = cfg.environment.model_copy(update={"device": "NVIDIA H200", "capability": [9, 0]})
    return cfg.model_copy(update={"environment": env})


def trainer_section(ex: autotune.Export) -> dict[str, Any]:
    return json.loads(ex.render("json"))["trainer"]


@pytest.mark.parametrize(
    ("precision", "device", "trainer"),
    [
        ("fp32", "cpu", {"accelerator": "cpu", "benchmark": True, "precision": "32-true"}),
        ("bf16", "cpu", {"accelerator": "cpu", "benchmark": True, "precision": "bf16-mixed"}),
        ("tf32", "cuda", {"accelerator": "cuda", "benchmark": True, "precision": "32-true"}),
        ("bf16", "cuda", {"accelerator": "cuda", "benchmark": True, "precision": "bf16-mixed"}),
    ],
)
def test_lightning_gets_its_precision_string_for_the_device(
    precision: str, device: str, trainer: dict[str, Any]
) -> None:
    cfg = make_config(precision) if device == "cpu" else cuda_config(precision)
    ex = autotune.export(cfg, "lightning")
    assert (ex.device, ex.precision) == (device, precision)
    assert trainer_section(ex) == trainer


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_lightning_fp16_is_the_plugin_with_the_tuned_scaler_on_its_device(device: str) -> None:
    # precision="16-mixed" would become bf16 on a CPU and drop the scaler: the plugin keeps both.
    cfg = make_config("fp16", init_scale=1024.0, growth_interval=500)
    ex = autotune.export(cfg, "lightning", device=device)
    section = trainer_section(ex)
    assert "precision" not in section
    assert section["plugins"] == [
        {
            "class_path": PLUGIN,
            "init_args": {
                "precision": "16-mixed",
                "device": device,
                "scaler": {
                    "class_path": "torch.amp.GradScaler",
                    "init_args": {"device": device, "init_scale": 1024.0, "growth_interval": 500},
                },
            },
        }
    ]


@pytest.mark.parametrize(
    ("precision", "device", "expected"),
    [
        ("fp32", "cpu", {"bf16": False, "fp16": False, "use_cpu": True}),
        ("bf16", "cpu", {"bf16": True, "fp16": False, "use_cpu": True}),
        ("fp32", "cuda", {"bf16": False, "fp16": False, "tf32": False}),
        ("tf32", "cuda", {"bf16": False, "fp16": False, "tf32": True}),
        ("fp16", "cuda", {"bf16": False, "fp16": True, "tf32": False}),
        ("bf16", "cuda", {"bf16": True, "fp16": False, "tf32": False}),
    ],
)
def test_hf_gets_training_arguments_fields_for_the_device(
    precision: str, device: str, expected: dict[str, bool]
) -> None:
    cfg = make_config(precision, batch_size=256, learning_rate=0.4)
    ex = autotune.export(cfg, "hf", device=device)
    assert ex.kwargs == {**expected, "per_device_train_batch_size": 256, "learning_rate": 0.4}
    assert json.loads(ex.render("json")) == ex.kwargs


@pytest.mark.parametrize(
    ("precision", "device", "mixed"),
    [
        ("fp32", "cpu", "no"),
        ("bf16", "cpu", "bf16"),
        ("tf32", "cuda", "no"),
        ("fp16", "cuda", "fp16"),
    ],
)
def test_accelerate_gets_mixed_precision_and_a_launch_config_file(
    precision: str, device: str, mixed: str
) -> None:
    ex = autotune.export(make_config(precision), "accelerate", device=device)
    assert json.loads(ex.render("json")) == {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "NO",
        "mixed_precision": mixed,
        "use_cpu": device == "cpu",
        "num_machines": 1,
        "num_processes": 1,
        "machine_rank": 0,
        "debug": False,
    }


@pytest.mark.parametrize(
    ("precision", "target", "needle"),
    [
        (
            "fp16",
            "hf",
            "precision 'fp16' on cpu: Hugging Face's Trainer trains fp16 on a CPU in fp32",
        ),
        ("fp16", "accelerate", "precision 'fp16' on cpu: accelerate trains fp16 on a CPU in fp32"),
        ("tf32", "lightning", "precision 'tf32' cannot run on cpu: TF32 is a CUDA matmul mode"),
        ("tf32", "hf", "precision 'tf32' cannot run on cpu"),
        ("tf32", "accelerate", "precision 'tf32' cannot run on cpu"),
    ],
)
def test_a_mode_the_library_would_silently_change_is_refused(
    precision: str, target: str, needle: str
) -> None:
    with pytest.raises(DeviceError, match=needle):
        autotune.export(make_config(precision), target)  # a CPU-tuned config


def test_the_device_is_the_configs_unless_asked() -> None:
    assert autotune.export(make_config("bf16"), "hf").device == "cpu"
    assert autotune.export(cuda_config("bf16"), "hf").device == "cuda"
    assert autotune.export(make_config("fp16"), "hf", device="cuda:1").device == "cuda"
    with pytest.raises(DeviceError, match="device='tpu'; use --device cpu or --device cuda"):
        autotune.export(make_config("bf16"), "hf", device="tpu")


def test_elsewhere_says_optimizer_rule_and_backend_flags() -> None:
    cfg = make_config("tf32", batch_size=64, learning_rate=0.1, optimizer="SGD")
    ex = autotune.export(cfg, "accelerate", device="cuda")
    rest = ex.elsewhere
    assert (rest.batch_size, rest.learning_rate, rest.optimizer) == (64, 0.1, "SGD")
    assert (rest.lr_scaling, rest.float32_matmul_precision, rest.cudnn_tf32) == (
        "linear",
        "high",
        True,
    )
    assert rest.cudnn_benchmark is True
    assert rest.learning_rate_for(256) == pytest.approx(0.4)
    adam = make_config("bf16", batch_size=64, learning_rate=0.1, optimizer="AdamW")
    adam.evidence.lr_scaling = "sqrt"
    assert autotune.export(adam, "hf").elsewhere.learning_rate_for(256) == pytest.approx(0.2)
    notes = " ".join(ex.notes)
    assert "tuned for the SGD optimizer at batch_size=64" in notes
    assert "linear rule" in notes
    assert 'torch.set_float32_matmul_precision("high")' in notes
    assert "torch.backends.cudnn.benchmark = True" in notes


def test_set_backend_flags_sets_what_the_probes_measured() -> None:
    saved = snapshot_backend_flags()
    try:
        torch.set_float32_matmul_precision("high")
        torch.backends.cudnn.benchmark = False
        autotune.export(make_config("bf16"), "lightning").elsewhere.set_backend_flags()
        assert torch.get_float32_matmul_precision() == "highest"
        assert torch.backends.cudnn.allow_tf32 is False
        assert torch.backends.cudnn.rnn.fp32_precision == "ieee"
        assert torch.backends.cudnn.benchmark is True
    finally:
        restore_backend_flags(saved)


def test_hf_says_which_optimizer_the_lr_is_for_and_what_the_scaler_loses() -> None:
    cfg = make_config("fp16", init_scale=1024.0, optimizer="SGD")
    notes = " ".join(autotune.export(cfg, "hf", device="cuda").notes)
    assert "trains with AdamW" in notes and "tuned for SGD" in notes
    assert "optimizers=(optimizer, None)" in notes
    assert "init_scale 65536, not the tuned 1024" in notes
    adamw = " ".join(autotune.export(make_config("bf16", optimizer="AdamW"), "hf").notes)
    assert "trains with AdamW" not in adamw
    # At torch's defaults there is nothing to say about the scaler.
    assert "init_scale" not in " ".join(
        autotune.export(make_config("fp16"), "hf", device="cuda").notes
    )


def test_accelerate_says_its_files_cannot_carry_the_tuned_scaler() -> None:
    cfg = make_config("fp16", init_scale=1024.0, growth_interval=500)
    ex = autotune.export(cfg, "accelerate", device="cuda")
    assert "mixed_precision" in json.loads(ex.render("json"))
    assert any("GradScalerKwargs(init_scale=1024, growth_interval=500)" in n for n in ex.notes)


def test_channels_last_and_a_fallback_config_are_noted() -> None:
    cfg = make_config("bf16", channels_last=True)
    assert any("channels_last" in n for n in autotune.export(cfg, "hf").notes)
    assert autotune.export(cfg, "hf").elsewhere.channels_last is True
    data = make_config("fp32").model_dump()
    data["evidence"].update(validated=False, validation_note="no candidate passed validation")
    fallback = type(cfg).model_validate(data)
    assert any("fp32 fallback" in n for n in autotune.export(fallback, "accelerate").notes)


def test_compile_goes_where_a_library_takes_it_and_fp32_modules_are_a_note_everywhere() -> None:
    cfg = cuda_config(
        "fp16", compile=True, compile_mode="max-autotune-no-cudagraphs", fp32_modules=["amplify"]
    )
    hf = autotune.export(cfg, "hf")
    assert json.loads(hf.render("json"))["torch_compile"] is True
    assert "--torch_compile_mode max-autotune-no-cudagraphs" in hf.render("args")
    acc = autotune.export(cfg, "accelerate")
    dynamo = json.loads(acc.render("json"))["dynamo_config"]
    assert dynamo == {"dynamo_backend": "INDUCTOR", "dynamo_mode": "max-autotune-no-cudagraphs"}
    assert "--dynamo_backend inductor" in acc.render("args")
    lightning = autotune.export(cfg, "lightning")
    # Lightning's Trainer has no compile setting: it is a note, with the call to make.
    assert "compile" not in json.dumps(trainer_section(lightning))
    assert any("model.compile(mode='max-autotune-no-cudagraphs')" in n for n in lightning.notes)
    assert not any("takes no compile setting" in n for n in hf.notes + acc.notes)
    # No library has a per-module precision: every export says so, with the call that does it.
    for ex in (hf, acc, lightning):
        assert any("keep_in_fp32(model, ['amplify'])" in n for n in ex.notes), ex.target
        assert ex.elsewhere.fp32_modules == ("amplify",)
        assert ex.elsewhere.compile_mode == "max-autotune-no-cudagraphs"


def test_accelerate_builds_its_dynamo_plugin_for_a_compiled_config() -> None:
    pytest.importorskip("accelerate")
    ex = autotune.export(cuda_config("bf16", compile=True), "accelerate")
    plugin = ex.kwargs["dynamo_plugin"]
    assert type(plugin).__name__ == "TorchDynamoPlugin" and plugin.mode == "default"


@pytest.mark.parametrize(
    ("target", "device", "expected"),
    [
        (
            "lightning",
            "cpu",
            "--trainer.accelerator cpu --trainer.benchmark true --trainer.precision bf16-mixed",
        ),
        (
            "hf",
            "cpu",
            "--bf16 true --fp16 false --use_cpu true --per_device_train_batch_size 256 "
            "--learning_rate 0.4",
        ),
        (
            "hf",
            "cuda",
            "--bf16 true --fp16 false --tf32 false --per_device_train_batch_size 256 "
            "--learning_rate 0.4",
        ),
        ("accelerate", "cpu", "--mixed_precision bf16 --num_processes 1 --num_machines 1 --cpu"),
    ],
)
def test_args_are_the_libraries_command_line_flags(target: str, device: str, expected: str) -> None:
    cfg = make_config("bf16", batch_size=256, learning_rate=0.4)
    assert autotune.export(cfg, target, device=device).render("args") == expected


def test_tf32_args_differ_from_fp32s() -> None:
    def args(precision: str) -> str:
        return autotune.export(make_config(precision), "hf", device="cuda").render("args")

    assert "--tf32 true" in args("tf32") and "--tf32 false" in args("fp32")


@pytest.mark.parametrize("target", ["lightning", "hf", "accelerate"])
def test_json_and_yaml_hold_the_same_file(target: str) -> None:
    ex = autotune.export(make_config("fp16", init_scale=512.0), target, device="cuda")
    assert yaml.safe_load(ex.render("yaml")) == json.loads(ex.render("json"))


def test_unknown_target_and_format_name_the_choices() -> None:
    cfg = make_config()
    with pytest.raises(SpecError, match="unknown export target 'keras'; use one of lightning, hf"):
        autotune.export(cfg, "keras")
    with pytest.raises(SpecError, match="unknown export format 'toml'; use one of json, yaml"):
        autotune.export(cfg, "hf").render("toml")


def test_kwargs_without_the_library_say_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "accelerate", None)  # as if it were not installed
    monkeypatch.setitem(sys.modules, "accelerate.utils", None)
    ex = autotune.export(make_config("fp16"), "accelerate", device="cuda")
    assert json.loads(ex.render("json"))["mixed_precision"] == "fp16"  # rendering needs nothing
    with pytest.raises(
        ImportError, match=r"pip install accelerate \(or 'autotune\[integrations\]'\)"
    ):
        ex.kwargs  # noqa: B018


# ---- the command ------------------------------------------------------------------------


def run_cli(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr if result.stderr_bytes else ""


def test_cli_prints_only_the_file_on_stdout(tmp_path: Path) -> None:
    path = write_config(
        tmp_path / "best.json", make_config("bf16", channels_last=True, optimizer="SGD")
    )
    code, out, err = run_cli("export", str(path), "--to", "hf")
    assert code == 0, out + err
    assert json.loads(out) == autotune.export(make_config("bf16"), "hf").kwargs
    assert "note: " in err and "channels_last" in err and "tuned for SGD" in err
    code, out, _ = run_cli("export", str(path), "--to", "accelerate", "--format", "args")
    assert (code, out.strip()) == (
        0,
        "--mixed_precision bf16 --num_processes 1 --num_machines 1 --cpu",
    )
    code, out, _ = run_cli("export", str(path), "--to", "lightning", "--format", "yaml")
    assert code == 0 and yaml.safe_load(out)["trainer"]["precision"] == "bf16-mixed"
    code, out, _ = run_cli("export", str(path), "--to", "hf", "--device", "cuda")
    assert code == 0 and json.loads(out)["tf32"] is False


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["missing.json", "--to", "hf"], "does not exist"),
        (["{cfg}", "--to", "keras"], "unknown export target 'keras'"),
        (["{cfg}", "--to", "hf", "--format", "toml"], "unknown format 'toml'"),
        (["{fp16}", "--to", "hf"], "precision 'fp16' on cpu"),
        (["{cfg}", "--to", "hf", "--device", "tpu"], "device='tpu'"),
    ],
)
def test_cli_bad_input_is_one_error_line(tmp_path: Path, args: list[str], needle: str) -> None:
    path = write_config(tmp_path / "best.json", make_config())
    fp16 = write_config(tmp_path / "fp16.json", make_config("fp16"))
    args = [
        a.replace("{cfg}", str(path))
        .replace("{fp16}", str(fp16))
        .replace("missing", str(tmp_path / "missing"))
        for a in args
    ]
    code, out, err = run_cli("export", *args)
    assert code == 2
    assert out == ""
    assert err.startswith("error: ") and needle in err and "Traceback" not in err
