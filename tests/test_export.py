"""Exports: keys and values as Lightning, transformers and accelerate document them.

The libraries are not installed here, so their documented names are written down below, each
with where it comes from; where a library is installed, the last tests check against it too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from _configs import make_config, write_config
from typer.testing import CliRunner

from autotune.cli import app
from autotune.errors import SpecError
from autotune.export import export

# lightning/fabric/connector.py: _PRECISION_INPUT_STR (Trainer(precision=...), Lightning 2.x).
LIGHTNING_PRECISION = {
    "transformer-engine",
    "transformer-engine-float16",
    "16-true",
    "16-mixed",
    "bf16-true",
    "bf16-mixed",
    "32-true",
    "64-true",
}
# torch.set_float32_matmul_precision accepts these.
MATMUL_PRECISION = {"highest", "high", "medium"}
# transformers/training_args.py: TrainingArguments fields an export may use.
HF_FIELDS = {"bf16", "fp16", "tf32", "per_device_train_batch_size", "learning_rate"}
# accelerate Accelerator(mixed_precision=...): "Choose from 'no','fp16','bf16' or 'fp8'".
ACCELERATE_PRECISION = {"no", "fp16", "bf16", "fp8"}
# accelerate.utils.GradScalerKwargs fields, the same names as torch.amp.GradScaler's arguments.
GRAD_SCALER_KWARGS = {"init_scale", "growth_factor", "backoff_factor", "growth_interval", "enabled"}


@pytest.mark.parametrize(
    ("precision", "lightning", "matmul", "hf", "accelerate"),
    [
        ("fp32", "32-true", "highest", {"bf16": False, "fp16": False, "tf32": False}, "no"),
        ("tf32", "32-true", "high", {"bf16": False, "fp16": False, "tf32": True}, "no"),
        ("fp16", "16-mixed", "highest", {"bf16": False, "fp16": True, "tf32": False}, "fp16"),
        ("bf16", "bf16-mixed", "highest", {"bf16": True, "fp16": False, "tf32": False}, "bf16"),
    ],
)
def test_each_mode_maps_to_the_documented_values(
    precision: str, lightning: str, matmul: str, hf: dict[str, bool], accelerate: str
) -> None:
    cfg = make_config(precision, batch_size=256, learning_rate=0.4)

    lt = cfg.to_lightning()
    assert lt["precision"] == lightning and lt["precision"] in LIGHTNING_PRECISION
    assert lt["float32_matmul_precision"] == matmul and matmul in MATMUL_PRECISION
    assert (lt["batch_size"], lt["learning_rate"]) == (256, 0.4)

    args = cfg.to_hf()
    assert set(args) <= HF_FIELDS  # TrainingArguments(output_dir=..., **args) takes every key
    assert args == {**hf, "per_device_train_batch_size": 256, "learning_rate": 0.4}

    acc = cfg.to_accelerate()
    assert acc["mixed_precision"] == accelerate and accelerate in ACCELERATE_PRECISION
    assert acc["float32_matmul_precision"] == matmul
    assert (acc["batch_size"], acc["learning_rate"]) == (256, 0.4)

    has_scaler = precision == "fp16"
    assert ("grad_scaler_kwargs" in lt) == has_scaler
    assert ("grad_scaler_kwargs" in acc) == has_scaler


def test_tf32_says_how_to_turn_tf32_on() -> None:
    out = export(make_config("tf32"), "lightning")
    assert out.settings["precision"] == "32-true"
    assert any('torch.set_float32_matmul_precision("high")' in n for n in out.notes)


def test_a_tuned_grad_scaler_is_carried_where_the_library_can_take_it() -> None:
    cfg = make_config("fp16", init_scale=1024.0, growth_interval=500)
    for target in ("lightning", "accelerate"):
        out = export(cfg, target)
        kwargs = out.settings["grad_scaler_kwargs"]
        assert kwargs == {"init_scale": 1024.0, "growth_interval": 500}
        assert set(kwargs) <= GRAD_SCALER_KWARGS
    assert any(
        "MixedPrecision(" in n and "init_scale=1024" in n for n in export(cfg, "lightning").notes
    )
    assert any("GradScalerKwargs" in n for n in export(cfg, "accelerate").notes)
    # TrainingArguments has no such field: the export says what the Trainer will do instead.
    hf = export(cfg, "hf")
    assert "grad_scaler_kwargs" not in hf.settings
    assert any("init_scale 65536, not the tuned 1024" in n for n in hf.notes)
    # At torch's defaults there is nothing to say.
    plain = make_config("fp16")
    assert not any("init_scale" in n for n in export(plain, "hf").notes)


def test_channels_last_and_a_fallback_config_are_noted() -> None:
    cfg = make_config("bf16", channels_last=True)
    assert any("channels_last" in n for n in export(cfg, "hf").notes)
    data = make_config("fp32").model_dump()
    data["evidence"].update(validated=False, validation_note="no candidate passed validation")
    fallback = type(cfg).model_validate(data)
    assert any("fp32 fallback" in n for n in export(fallback, "accelerate").notes)


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        (
            "lightning",
            "--trainer.precision bf16-mixed --data.batch_size 256 --model.learning_rate 0.4",
        ),
        (
            "hf",
            "--bf16 true --fp16 false --tf32 false --per_device_train_batch_size 256 "
            "--learning_rate 0.4",
        ),
        ("accelerate", "--mixed_precision bf16"),
    ],
)
def test_args_are_the_libraries_command_line_flags(target: str, expected: str) -> None:
    cfg = make_config("bf16", batch_size=256, learning_rate=0.4)
    assert export(cfg, target).render("args") == expected


@pytest.mark.parametrize("target", ["lightning", "hf", "accelerate"])
def test_json_and_yaml_hold_the_same_settings(target: str) -> None:
    out = export(make_config("fp16", init_scale=512.0), target)
    assert json.loads(out.render("json")) == out.settings
    assert yaml.safe_load(out.render("yaml")) == out.settings


def test_unknown_target_and_format_name_the_choices() -> None:
    cfg = make_config()
    with pytest.raises(SpecError, match="unknown export target 'keras'; use one of lightning, hf"):
        export(cfg, "keras")
    with pytest.raises(SpecError, match="unknown export format 'toml'; use one of json, yaml"):
        export(cfg, "hf").render("toml")


def run_cli(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr if result.stderr_bytes else ""


def test_cli_prints_only_the_settings_on_stdout(tmp_path: Path) -> None:
    path = write_config(tmp_path / "best.json", make_config("bf16", channels_last=True))
    code, out, err = run_cli("export", str(path), "--to", "hf")
    assert code == 0, out + err
    assert json.loads(out) == make_config("bf16").to_hf()
    assert "note: " in err and "channels_last" in err
    code, out, _ = run_cli("export", str(path), "--to", "accelerate", "--format", "args")
    assert (code, out.strip()) == (0, "--mixed_precision bf16")
    code, out, _ = run_cli("export", str(path), "--to", "lightning", "--format", "yaml")
    assert code == 0 and yaml.safe_load(out)["precision"] == "bf16-mixed"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["missing.json", "--to", "hf"], "does not exist"),
        (["{cfg}", "--to", "keras"], "unknown export target 'keras'"),
        (["{cfg}", "--to", "hf", "--format", "toml"], "unknown format 'toml'"),
    ],
)
def test_cli_bad_input_is_one_error_line(tmp_path: Path, args: list[str], needle: str) -> None:
    path = write_config(tmp_path / "best.json", make_config())
    args = [
        a.replace("{cfg}", str(path)).replace("missing", str(tmp_path / "missing")) for a in args
    ]
    code, out, err = run_cli("export", *args)
    assert code == 2
    assert out == ""
    assert err.startswith("error: ") and needle in err and "Traceback" not in err


# ---- against the libraries themselves, where installed ---------------------------------


def test_lightning_accepts_the_precision_strings() -> None:
    connector = pytest.importorskip("lightning.fabric.connector")
    from typing import get_args

    documented = set(get_args(connector._PRECISION_INPUT_STR))
    for precision in ("fp32", "tf32", "fp16", "bf16"):
        assert make_config(precision).to_lightning()["precision"] in documented


def test_transformers_has_the_training_arguments_fields() -> None:
    transformers = pytest.importorskip("transformers")
    import dataclasses

    fields = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    assert set(make_config("bf16").to_hf()) <= fields


def test_accelerate_takes_the_mixed_precision_and_scaler_kwargs() -> None:
    utils = pytest.importorskip("accelerate.utils")
    cfg = make_config("fp16", init_scale=1024.0)
    assert cfg.to_accelerate()["mixed_precision"] in {p.value for p in utils.PrecisionType}
    utils.GradScalerKwargs(**cfg.to_accelerate()["grad_scaler_kwargs"])
