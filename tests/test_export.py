"""Exports without the libraries: what each mode becomes, on which device, which optimizer the lr
travels with, where Lightning's lr and batch size go, and what is refused.

The libraries' own tests (the README's examples training for real, the files read by their own
loaders) are in test_integrations.py; these need none of them installed.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from _configs import make_config, write_config
from typer.testing import CliRunner

import autotune
from autotune.cli import app
from autotune.errors import (
    ConfigError,
    DeviceError,
    ExportError,
    ExportWarning,
    SpecError,
    WorkloadError,
)
from autotune.execution.facts import workload_facts
from autotune.measure.precision import restore_backend_flags, snapshot_backend_flags
from autotune.workloads import load_workload

# Lightning's MixedPrecision plugin and the export's check, as LightningCLI names them.
PLUGIN = "lightning.pytorch.plugins.precision.MixedPrecision"
CHECK = "autotune.exports.lightning_check.TunedSettingsCheck"
# What a search records for tiny_mlp's optimizer (torch.optim.SGD, momentum 0.9, wd 5e-4).
SGD = {
    "momentum": 0.9,
    "dampening": 0,
    "weight_decay": 0.0005,
    "nesterov": False,
    "maximize": False,
}
ADAMW = {
    "betas": [0.9, 0.95],
    "eps": 1e-06,
    "weight_decay": 0.1,
    "amsgrad": False,
    "maximize": False,
}
# The Trainer's training recipe the search used: a constant lr, gradients not clipped.
HF_RECIPE = {"lr_scheduler_type": "constant", "max_grad_norm": 0.0}
HF_SGD = {
    "optim": "sgd",
    "weight_decay": 0.0005,
    "optim_args": "momentum=0.9,dampening=0,nesterov=False",
}


def tuned(precision: str = "bf16", **fields: Any) -> autotune.TunedConfig:
    """A config a search of this version writes: its optimizer and the optimizer's settings."""
    return make_config(precision, **{"optimizer": "SGD", "optimizer_kwargs": SGD, **fields})


def cuda_config(precision: str, **fields: Any) -> autotune.TunedConfig:
    """A config tuned on a CUDA device (its environment records a compute capability)."""
    cfg = tuned(precision, **fields)
    env = cfg.environment.model_copy(update={"device": "NVIDIA H200", "capability": [9, 0]})
    return cfg.model_copy(update={"environment": env})


def quiet_export(cfg: autotune.TunedConfig, target: str, **options: Any) -> autotune.Export:
    """An export whose warnings this test does not look at (Lightning's unplaced lr, say)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExportWarning)
        return autotune.export(cfg, target, **options)


def trainer_section(ex: autotune.Export) -> dict[str, Any]:
    return json.loads(ex.render("json"))["trainer"]


# ---- the mode, per library and device --------------------------------------------------------


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
    cfg = tuned(precision) if device == "cpu" else cuda_config(precision)
    ex = quiet_export(cfg, "lightning")
    assert (ex.device, ex.precision) == (device, precision)
    section = trainer_section(ex)
    assert section.pop("callbacks")[0]["class_path"] == CHECK
    assert section == trainer


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_lightning_fp16_is_the_plugin_with_the_tuned_scaler_on_its_device(device: str) -> None:
    # precision="16-mixed" would become bf16 on a CPU and drop the scaler: the plugin keeps both.
    cfg = tuned("fp16", init_scale=1024.0, growth_interval=500)
    section = trainer_section(quiet_export(cfg, "lightning", device=device))
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
    cfg = tuned(precision, batch_size=256, learning_rate=0.4)
    ex = autotune.export(cfg, "hf", device=device)
    assert ex.kwargs == {
        **expected,
        "per_device_train_batch_size": 256,
        "learning_rate": 0.4,
        **HF_RECIPE,
        **HF_SGD,
    }
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
    ex = autotune.export(tuned(precision), "accelerate", device=device)
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
        autotune.export(tuned(precision), target)  # a CPU-tuned config


def test_the_device_is_the_configs_unless_asked() -> None:
    assert autotune.export(tuned("bf16"), "hf").device == "cpu"
    assert autotune.export(cuda_config("bf16"), "hf").device == "cuda"
    assert autotune.export(tuned("fp16"), "hf", device="cuda:1").device == "cuda"
    with pytest.raises(DeviceError, match="device='tpu'; use --device cpu or --device cuda"):
        autotune.export(tuned("bf16"), "hf", device="tpu")


# ---- the optimizer the lr was tuned for ------------------------------------------------------


def test_a_search_records_the_optimizer_and_an_export_builds_the_same_one() -> None:
    workload = load_workload("autotune.workloads:tiny_mlp")
    facts = workload_facts(workload)
    assert (facts["optimizer"], facts["optimizer_kwargs"]) == ("SGD", SGD)
    cfg = tuned("bf16", learning_rate=0.3, optimizer_kwargs=facts["optimizer_kwargs"])
    params = [torch.nn.Parameter(torch.zeros(2))]
    built = autotune.export(cfg, "accelerate").elsewhere.build_optimizer(params)
    original = workload.build_optimizer([torch.nn.Parameter(torch.zeros(2))], 0.3)
    assert type(built) is type(original)
    assert {k: v for k, v in built.param_groups[0].items() if k != "params"} == {
        k: v for k, v in original.param_groups[0].items() if k != "params"
    }
    rescaled = autotune.export(cfg, "accelerate").elsewhere.build_optimizer(params, lr=0.6)
    assert rescaled.param_groups[0]["lr"] == 0.6


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"optimizer": None, "optimizer_kwargs": None}, "does not record the optimizer"),
        ({"optimizer_kwargs": None}, r"records the optimizer \(SGD\) but not its settings"),
        ({"optimizer": "Lion"}, "optimizer='Lion' is not a torch.optim class"),
    ],
)
def test_build_optimizer_refuses_what_the_config_cannot_say(
    fields: dict[str, Any], needle: str
) -> None:
    rest = autotune.export(tuned("bf16", **fields), "accelerate").elsewhere
    with pytest.raises(ExportError, match=needle):
        rest.build_optimizer([torch.nn.Parameter(torch.zeros(1))])


@pytest.mark.parametrize(
    ("optimizer", "settings", "fields"),
    [
        ("SGD", SGD, HF_SGD),
        (
            "AdamW",
            ADAMW,
            {
                "optim": "adamw_torch",
                "adam_beta1": 0.9,
                "adam_beta2": 0.95,
                "adam_epsilon": 1e-06,
                "weight_decay": 0.1,
            },
        ),
        # Adam without weight decay takes AdamW's steps without weight decay.
        (
            "Adam",
            {"betas": [0.9, 0.999], "eps": 1e-30, "weight_decay": 0, "amsgrad": False},
            {
                "optim": "adamw_torch",
                "adam_beta1": 0.9,
                "adam_beta2": 0.999,
                "adam_epsilon": 1e-30,
                "weight_decay": 0.0,
            },
        ),
        (
            "RMSprop",
            {"alpha": 0.9, "eps": 1e-08, "weight_decay": 0, "momentum": 0.5, "centered": True},
            {
                "optim": "rmsprop",
                "weight_decay": 0.0,
                "optim_args": "alpha=0.9,eps=1e-08,momentum=0.5,centered=True",
            },
        ),
    ],
)
def test_hf_trains_the_optimizer_the_lr_was_tuned_for_at_a_constant_rate(
    optimizer: str, settings: dict[str, Any], fields: dict[str, Any]
) -> None:
    cfg = make_config("bf16", learning_rate=0.2, optimizer=optimizer, optimizer_kwargs=settings)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # everything carried: nothing to warn about
        ex = autotune.export(cfg, "hf")
    assert {k: v for k, v in ex.kwargs.items() if k not in fields} == {
        "bf16": True,
        "fp16": False,
        "use_cpu": True,
        "per_device_train_batch_size": 128,
        "learning_rate": 0.2,
        **HF_RECIPE,
    }
    assert {k: ex.kwargs[k] for k in fields} == fields


@pytest.mark.parametrize(
    ("optimizer", "settings", "needle"),
    [
        (None, None, "does not record the optimizer .* Trainer would train AdamW at it"),
        ("NAdam", {"momentum_decay": 0.004}, "its optim names no NAdam"),
        # Adam with weight decay is neither of the Trainer's Adams.
        ("Adam", {"weight_decay": 0.01}, "its optim names no Adam"),
        ("AdamW", {**ADAMW, "amsgrad": True}, "its 'adamw_torch' takes no amsgrad=True"),
    ],
)
def test_hf_refuses_an_optimizer_its_trainer_cannot_build(
    optimizer: str | None, settings: dict[str, Any] | None, needle: str
) -> None:
    cfg = make_config("bf16", optimizer=optimizer, optimizer_kwargs=settings)
    with pytest.raises(ExportError, match=needle) as caught:
        autotune.export(cfg, "hf")
    if optimizer is not None:  # the way out: the Trainer's own optimizer argument
        assert f"optimizer_cls_and_kwargs=(torch.optim.{optimizer}" in str(caught.value)


def test_hf_warns_when_the_config_does_not_record_the_optimizers_settings() -> None:
    # A config from before optimizer_kwargs: the class is carried, its momentum cannot be.
    with pytest.warns(ExportWarning, match="records the optimizer \\(SGD\\) but not its settings"):
        ex = autotune.export(make_config("bf16", optimizer="SGD"), "hf")
    assert ex.kwargs["optim"] == "sgd" and "optim_args" not in ex.kwargs


def test_hf_notes_the_weight_decay_it_spares_and_the_scaler_it_loses() -> None:
    notes = " ".join(autotune.export(tuned("fp16", init_scale=1024.0), "hf", device="cuda").notes)
    assert "was tuned for SGD(momentum=0.9, dampening=0, weight_decay=0.0005" in notes
    assert "weight_decay=0.0005 to weights only, not to biases and LayerNorm" in notes
    assert "init_scale 65536, not the tuned 1024" in notes
    # At torch's defaults there is nothing to say about the scaler.
    assert "init_scale" not in " ".join(autotune.export(tuned("fp16"), "hf", device="cuda").notes)


def test_elsewhere_says_optimizer_rule_and_backend_flags() -> None:
    cfg = tuned("tf32", batch_size=64, learning_rate=0.1)
    ex = autotune.export(cfg, "accelerate", device="cuda")
    rest = ex.elsewhere
    assert (rest.batch_size, rest.learning_rate, rest.optimizer) == (64, 0.1, "SGD")
    assert rest.optimizer_kwargs == SGD
    assert (rest.lr_scaling, rest.float32_matmul_precision, rest.cudnn_tf32) == (
        "linear",
        "high",
        True,
    )
    assert rest.cudnn_benchmark is True
    assert rest.learning_rate_for(256) == pytest.approx(0.4)
    adam = make_config(
        "bf16", batch_size=64, learning_rate=0.1, optimizer="AdamW", optimizer_kwargs=ADAMW
    )
    adam.evidence.lr_scaling = "sqrt"
    assert autotune.export(adam, "hf").elsewhere.learning_rate_for(256) == pytest.approx(0.2)
    notes = " ".join(ex.notes)
    assert "Export.elsewhere.build_optimizer(model.parameters()) builds" in notes
    assert "linear rule" in notes
    assert 'torch.set_float32_matmul_precision("high")' in notes
    assert "torch.backends.cudnn.benchmark = True" in notes


def test_set_backend_flags_sets_what_the_probes_measured() -> None:
    saved = snapshot_backend_flags()
    try:
        torch.set_float32_matmul_precision("high")
        torch.backends.cudnn.benchmark = False
        autotune.export(tuned("bf16"), "accelerate").elsewhere.set_backend_flags()
        assert torch.get_float32_matmul_precision() == "highest"
        assert torch.backends.cudnn.allow_tf32 is False
        assert torch.backends.cudnn.rnn.fp32_precision == "ieee"
        assert torch.backends.cudnn.benchmark is True
    finally:
        restore_backend_flags(saved)


@pytest.mark.parametrize(
    ("settings", "needle"),
    [
        ({"momentum": {"x": 1}}, "momentum={'x': 1} is not a number, true/false"),
        ({"1st": 0.9}, "argument name '1st' is not a Python identifier"),
        ({"betas": [0.9] * 9}, "betas=.* is not a number, true/false, a short string"),
    ],
)
def test_a_config_s_optimizer_settings_are_checked_when_it_loads(
    tmp_path: Path, settings: dict[str, Any], needle: str
) -> None:
    data = tuned().model_dump(mode="json")
    data["optimizer_kwargs"] = settings
    with pytest.raises(ConfigError, match=f"optimizer_kwargs: {needle}"):
        autotune.load_config(write_config(tmp_path / "best.json", data))


# ---- the schedule the lr was tuned under ----------------------------------------------------------


def test_a_search_records_the_schedule_the_workload_trains_under() -> None:
    workload = load_workload("autotune.workloads:tiny_mlp")
    assert workload_facts(workload)["lr_schedule"] == "constant"  # a built-in: a constant lr
    workload.lr_schedule = "warm-up then decay"
    with pytest.raises(WorkloadError, match="lr_schedule='warm-up then decay' is not a schedule"):
        workload_facts(workload)  # in the worker, before the search, not when it writes best.json


@pytest.mark.parametrize(
    ("recorded", "scheduler_type"),
    [
        (None, "constant"),  # a config written before autotune recorded the schedule
        ("constant", "constant"),
        ("linear", "linear"),  # transformers' default, with the warm-up the user's args say
        ("cosine_with_restarts", "cosine_with_restarts"),
    ],
)
def test_hf_trains_under_the_schedule_the_lr_was_tuned_under(
    tmp_path: Path, recorded: str | None, scheduler_type: str
) -> None:
    data = tuned("bf16", lr_schedule=recorded).model_dump(mode="json")
    if recorded is None:
        del data["lr_schedule"]  # as an older best.json holds it: no such key
    cfg = autotune.load_config(write_config(tmp_path / "best.json", data))
    ex = autotune.export(cfg, "hf")
    assert ex.kwargs["lr_scheduler_type"] == scheduler_type
    assert f"--lr_scheduler_type {scheduler_type} " in ex.render("args")
    assert ex.elsewhere.lr_schedule == scheduler_type
    for target in ("hf", "lightning", "accelerate"):
        notes = " ".join(quiet_export(cfg, target).notes)
        assert ("at a constant rate" in notes) == (scheduler_type == "constant"), target
        assert (f"the {scheduler_type} schedule" in notes) == (scheduler_type != "constant")


def test_hf_refuses_a_schedule_its_trainer_cannot_name() -> None:
    # A LightningModule's scheduler class: lr_scheduler_type has no name for it.
    cfg = tuned("bf16", lr_schedule="CosineAnnealingLR")
    with pytest.raises(
        ExportError, match="tuned under the CosineAnnealingLR lr schedule, which "
    ) as e:
        autotune.export(cfg, "hf")
    assert "pass Trainer(..., optimizers=(optimizer, scheduler))" in str(e.value)
    # Lightning's own configure_optimizers builds it; accelerate's script is told to step it.
    assert any(
        "configure_optimizers returns that scheduler" in n
        for n in quiet_export(cfg, "lightning").notes
    )
    steps = "the lr was tuned under the CosineAnnealingLR schedule (Export.elsewhere.lr_schedule)"
    assert any(n.startswith(steps) for n in autotune.export(cfg, "accelerate").notes)


@pytest.mark.parametrize("schedule", ["linear decay", "x" * 65, ""])
def test_a_config_s_schedule_is_a_name_when_it_loads(tmp_path: Path, schedule: str) -> None:
    data = tuned().model_dump(mode="json")
    data["lr_schedule"] = schedule
    with pytest.raises(ConfigError, match="lr_schedule: .* is not a schedule's name"):
        autotune.load_config(write_config(tmp_path / "best.json", data))


# ---- Lightning: the lr and the batch size where the module and the DataModule take them ----------


class LitModel:
    """Stands for a LightningModule: the export reads only its __init__ signature."""

    def __init__(self, hidden: int = 32, learning_rate: float = 1e-3) -> None: ...


class LrModel:
    def __init__(self, lr: float = 1e-3, batch_size: int = 32) -> None: ...


class BareModel:
    def __init__(self, hidden: int = 32) -> None: ...


class LitData:
    def __init__(self, root: str = ".", batch_size: int = 32) -> None: ...


@pytest.mark.parametrize(
    ("model", "datamodule", "model_kwargs", "datamodule_kwargs"),
    [
        (LitModel, LitData, {"learning_rate": 0.05}, {"batch_size": 8}),
        (LrModel, LitData, {"lr": 0.05}, {"batch_size": 8}),
        # No DataModule: a module that builds its own loaders takes the batch size.
        (LrModel, None, {"lr": 0.05, "batch_size": 8}, {}),
    ],
)
def test_lightning_places_lr_and_batch_size_in_the_init_arguments(
    model: type, datamodule: type | None, model_kwargs: dict, datamodule_kwargs: dict
) -> None:
    cfg = tuned("bf16", batch_size=8, learning_rate=0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # all placed: nothing to warn about
        ex = autotune.export(cfg, "lightning", model=model, datamodule=datamodule)
    assert (ex.model_kwargs, ex.datamodule_kwargs) == (model_kwargs, datamodule_kwargs)
    file = json.loads(ex.render("json"))
    assert file.get("model") == model_kwargs and file.get("data", {}) == datamodule_kwargs
    assert "optimizer" not in file  # the module's configure_optimizers takes the lr itself
    (name, value) = next((k, v) for k, v in model_kwargs.items() if "lr" in k or "rate" in k)
    assert f"--model.{name} {value}" in ex.render("args")


@pytest.mark.parametrize(
    ("model", "datamodule", "warned"),
    [
        (
            None,
            None,
            [
                "learning_rate=0.05 was placed nowhere: no LightningModule class was given",
                "batch_size=8 was placed nowhere: no LightningDataModule class was given",
            ],
        ),
        (
            BareModel,
            LitData,
            ["learning_rate=0.05 was placed nowhere: BareModel.__init__ takes neither lr nor"],
        ),
        (
            LitModel,
            BareModel,
            [
                "batch_size=8 was placed nowhere: neither BareModel.__init__ nor "
                "LitModel.__init__ takes batch_size"
            ],
        ),
    ],
)
def test_lightning_says_plainly_what_it_could_not_place(
    model: type | None, datamodule: type | None, warned: list[str]
) -> None:
    cfg = tuned("bf16", batch_size=8, learning_rate=0.05)
    with pytest.warns(ExportWarning) as record:
        ex = autotune.export(cfg, "lightning", model=model, datamodule=datamodule)
    messages = [str(w.message) for w in record if w.category is ExportWarning]
    assert len(messages) == len(warned)
    for message, start in zip(messages, warned, strict=True):
        assert message.startswith(start), message
    file = json.loads(ex.render("json"))
    if any(w.startswith("learning_rate") for w in warned):
        # The LightningCLI file still carries the lr, with the optimizer it was tuned for.
        assert file["optimizer"] == {
            "class_path": "torch.optim.SGD",
            "init_args": {"lr": 0.05, **SGD},
        }
        assert "as an optimizer: section" in messages[0]


def test_lightning_takes_classes_by_name_and_refuses_instances(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "userpkg.py").write_text(
        "class Data:\n    def __init__(self, batch_size: int = 4) -> None: ...\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = tuned("bf16", batch_size=8)
    ex = quiet_export(cfg, "lightning", datamodule="userpkg:Data")
    assert ex.datamodule_kwargs == {"batch_size": 8}
    with pytest.raises(SpecError, match="model= takes the class \\(LitModel\\), not an instance"):
        autotune.export(cfg, "lightning", model=LitModel())
    with pytest.raises(SpecError, match="datamodule='userpkg:Nope' does not import"):
        autotune.export(cfg, "lightning", datamodule="userpkg:Nope")
    with pytest.raises(SpecError, match="model= and datamodule= are for the lightning export"):
        autotune.export(cfg, "hf", model=LitModel)


def test_lightning_s_check_callback_carries_what_it_checks() -> None:
    ex = quiet_export(tuned("bf16", batch_size=8, learning_rate=0.05), "lightning")
    assert trainer_section(ex)["callbacks"] == [
        {
            "class_path": CHECK,
            "init_args": {
                "optimizer": "SGD",
                "learning_rate": 0.05,
                "batch_size": 8,
                "lr_scaling": "linear",
            },
        }
    ]


# ---- the rest every export says ----------------------------------------------------------------


def test_accelerate_says_its_files_cannot_carry_the_tuned_scaler() -> None:
    cfg = tuned("fp16", init_scale=1024.0, growth_interval=500)
    ex = autotune.export(cfg, "accelerate", device="cuda")
    assert "mixed_precision" in json.loads(ex.render("json"))
    assert any("GradScalerKwargs(init_scale=1024, growth_interval=500)" in n for n in ex.notes)


def test_channels_last_and_a_fallback_config_are_noted() -> None:
    cfg = tuned("bf16", channels_last=True)
    assert any("channels_last" in n for n in autotune.export(cfg, "hf").notes)
    assert autotune.export(cfg, "hf").elsewhere.channels_last is True
    data = tuned("fp32").model_dump()
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
    lightning = quiet_export(cfg, "lightning")
    # Lightning's Trainer has no compile setting: it is a note, with the call to make.
    assert "compile" not in json.dumps(trainer_section(lightning))
    assert any(
        "torch.compile(model.forward, mode='max-autotune-no-cudagraphs')" in n
        for n in lightning.notes
    )
    assert not any("takes no compile setting" in n for n in hf.notes + acc.notes)
    # Every compiled export says how to keep the compiled backward outside autocast.
    for ex in (hf, acc, lightning):
        assert any("backward_pass_autocast = 'off'" in n for n in ex.notes), ex.target
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
            "--trainer.accelerator cpu --trainer.benchmark true --trainer.precision bf16-mixed "
            "--trainer.callbacks",
        ),
        (
            "hf",
            "cpu",
            "--bf16 true --fp16 false --use_cpu true --per_device_train_batch_size 256 "
            "--learning_rate 0.4 --lr_scheduler_type constant --max_grad_norm 0.0 --optim sgd "
            "--weight_decay 0.0005 --optim_args momentum=0.9,dampening=0,nesterov=False",
        ),
        (
            "hf",
            "cuda",
            "--bf16 true --fp16 false --tf32 false --per_device_train_batch_size 256 "
            "--learning_rate 0.4 --lr_scheduler_type constant",
        ),
        ("accelerate", "cpu", "--mixed_precision bf16 --num_processes 1 --num_machines 1 --cpu"),
    ],
)
def test_args_are_the_libraries_command_line_flags(target: str, device: str, expected: str) -> None:
    cfg = tuned("bf16", batch_size=256, learning_rate=0.4)
    assert quiet_export(cfg, target, device=device).render("args").startswith(expected)


def test_tf32_args_differ_from_fp32s() -> None:
    def args(precision: str) -> str:
        return autotune.export(tuned(precision), "hf", device="cuda").render("args")

    assert "--tf32 true" in args("tf32") and "--tf32 false" in args("fp32")


@pytest.mark.parametrize("target", ["lightning", "hf", "accelerate"])
def test_json_and_yaml_hold_the_same_file(target: str) -> None:
    ex = quiet_export(tuned("fp16", init_scale=512.0), target, device="cuda")
    assert yaml.safe_load(ex.render("yaml")) == json.loads(ex.render("json"))


def test_unknown_target_and_format_name_the_choices() -> None:
    cfg = tuned()
    with pytest.raises(SpecError, match="unknown export target 'keras'; use one of lightning, hf"):
        autotune.export(cfg, "keras")
    with pytest.raises(SpecError, match="unknown export format 'toml'; use one of json, yaml"):
        autotune.export(cfg, "hf").render("toml")


def test_kwargs_without_the_library_say_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "accelerate", None)  # as if it were not installed
    monkeypatch.setitem(sys.modules, "accelerate.utils", None)
    ex = autotune.export(tuned("fp16"), "accelerate", device="cuda")
    assert json.loads(ex.render("json"))["mixed_precision"] == "fp16"  # rendering needs nothing
    with pytest.raises(
        ImportError, match=r"pip install accelerate \(or 'autotune\[integrations\]'\)"
    ):
        ex.kwargs  # noqa: B018


def test_the_lightning_check_module_imports_without_lightning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A docs build or a doctest run imports every module; only the class needs Lightning.
    import importlib

    monkeypatch.setitem(sys.modules, "lightning", None)
    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)
    monkeypatch.delitem(sys.modules, "autotune.exports.lightning_check", raising=False)
    module = importlib.import_module("autotune.exports.lightning_check")
    with pytest.raises(ImportError):
        module.TunedSettingsCheck  # noqa: B018


# ---- the command ------------------------------------------------------------------------


def run_cli(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr if result.stderr_bytes else ""


def test_cli_prints_only_the_file_on_stdout(tmp_path: Path) -> None:
    path = write_config(tmp_path / "best.json", tuned("bf16", channels_last=True))
    code, out, err = run_cli("export", str(path), "--to", "hf")
    assert code == 0, out + err
    assert json.loads(out) == autotune.export(tuned("bf16"), "hf").kwargs
    assert "note: " in err and "channels_last" in err and "tuned for SGD(momentum=0.9" in err
    code, out, _ = run_cli("export", str(path), "--to", "accelerate", "--format", "args")
    assert (code, out.strip()) == (
        0,
        "--mixed_precision bf16 --num_processes 1 --num_machines 1 --cpu",
    )
    code, out, _ = run_cli("export", str(path), "--to", "lightning", "--format", "yaml")
    assert code == 0 and yaml.safe_load(out)["trainer"]["precision"] == "bf16-mixed"
    code, out, _ = run_cli("export", str(path), "--to", "hf", "--device", "cuda")
    assert code == 0 and json.loads(out)["tf32"] is False


def test_cli_puts_lr_and_batch_size_in_the_lightning_file_or_warns_in_one_line(
    tmp_path: Path,
) -> None:
    path = write_config(tmp_path / "best.json", tuned("bf16", batch_size=8))
    # Given the classes, LightningCLI's file carries the lr and the batch size where they go.
    here = f"{__name__}:LitModel", f"{__name__}:LitData"
    code, out, err = run_cli(
        "export", str(path), "--to", "lightning", "--format", "yaml", "--model", here[0],
        "--data", here[1],
    )  # fmt: skip
    assert code == 0, err
    assert yaml.safe_load(out)["model"]["learning_rate"] == 0.1
    assert yaml.safe_load(out)["data"]["batch_size"] == 8
    # Without them: a warning line naming each value, never a source location.
    code, out, err = run_cli("export", str(path), "--to", "lightning", "--format", "yaml")
    assert code == 0 and "ExportWarning" not in err
    assert "warning: batch_size=8 was placed nowhere" in err
    code, out, err = run_cli("export", str(path), "--to", "hf", "--model", here[0])
    assert code == 2 and "--model and --data are for --to lightning" in err


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["missing.json", "--to", "hf"], "does not exist"),
        (["{cfg}", "--to", "keras"], "unknown export target 'keras'"),
        (["{cfg}", "--to", "hf", "--format", "toml"], "unknown format 'toml'"),
        (["{fp16}", "--to", "hf"], "precision 'fp16' on cpu"),
        (["{cfg}", "--to", "hf", "--device", "tpu"], "device='tpu'"),
        (["{old}", "--to", "hf"], "does not record the optimizer"),
    ],
)
def test_cli_bad_input_is_one_error_line(tmp_path: Path, args: list[str], needle: str) -> None:
    """Tuned on another machine (as every one of these was on a GPU machine), a refused export
    is still its error line alone: the machine's warning waits for an export that is made."""

    def elsewhere(cfg: autotune.TunedConfig) -> autotune.TunedConfig:
        env = cfg.environment.model_copy(update={"device": "another machine's CPU"})
        return cfg.model_copy(update={"environment": env})

    paths = {
        "{cfg}": write_config(tmp_path / "best.json", elsewhere(tuned())),
        "{fp16}": write_config(tmp_path / "fp16.json", elsewhere(tuned("fp16"))),
        # No optimizer recorded.
        "{old}": write_config(tmp_path / "old.json", elsewhere(make_config())),
    }
    args = [str(paths.get(a, a)).replace("missing", str(tmp_path / "missing")) for a in args]
    code, out, err = run_cli("export", *args)
    assert code == 2
    assert out == ""
    assert err.startswith("error: ") and needle in err and "Traceback" not in err
    assert "warning" not in err
    if "{cfg}" in args:  # the same config exported: the warning is shown then
        code, out, err = run_cli("export", str(paths["{cfg}"]), "--to", "hf")
        assert code == 0 and out.startswith("{")
        assert err.startswith("warning: config ") and "tuned on another machine" in err
