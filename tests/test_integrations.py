"""The exports against the real Lightning, transformers and accelerate (the `integrations` extra).

The export examples in docs/exports.md run verbatim on a config of each mode, and every route
trains a tiny model while a hook inside the training step reads back what it really runs: the
optimizer and its lr (from its param groups), the batch size (the batch's first dimension), the
autocast dtype and a layer's output dtype, and the GradScaler's scale. Each is the tuned one, or
the export refused with a message naming the mode and the device. The files and flags
`autotune export` prints are read by each library's own loader, and LightningCLI and the
Trainer train from them. Tiny models built from config objects, synthetic data, a few CPU
steps, no download; each library is imported inside the tests that need it (Lightning costs
seconds to import).
"""

from __future__ import annotations

import functools
import shlex
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from _configs import make_config, write_config
from _docs import code_block
from torch import nn

import autotune
from autotune.errors import DeviceError, ExportError, ExportWarning
from autotune.measure.precision import restore_backend_flags, snapshot_backend_flags
from autotune.schema.config import current_environment

DTYPES = {
    "fp32": torch.float32,
    "tf32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}
AUTOCAST = {"fp32": None, "tf32": None, "fp16": torch.float16, "bf16": torch.bfloat16}
# Only fp16 carries a scaler; its tuned values differ from torch's 65536 and 2000 on purpose.
INIT_SCALE, GROWTH_INTERVAL = 1024.0, 500
# The tuned values differ from every library's and script's default, so a dropped one shows.
BATCH_SIZE, LEARNING_RATE = 8, 0.05
SGD = {"momentum": 0.9, "dampening": 0, "weight_decay": 0.0, "nesterov": False, "maximize": False}


@pytest.fixture(autouse=True)
def _offline_and_no_trace(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    # No test may reach the Hugging Face hub; everything a library writes lands in tmp_path.
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.chdir(tmp_path)
    saved = snapshot_backend_flags()
    yield
    restore_backend_flags(saved)  # set_backend_flags() is for the rest of a training process
    state = sys.modules.get("accelerate.state")
    if state is not None:
        # accelerate keeps one process-wide state; a training script sets it once, tests often.
        state.AcceleratorState._reset_state(True)


EXAMPLES = "docs/exports.md"


def docs_example(target: str) -> str:
    """The Python example for one export target in the docs, as written there."""
    return code_block(EXAMPLES, f'autotune.export(cfg, "{target}"')


def config(precision: str, device: str = "cpu", **fields: Any) -> autotune.TunedConfig:
    """A config of this mode tuned on ``device`` for SGD with momentum, as a search writes it."""
    cfg = make_config(
        precision,
        batch_size=BATCH_SIZE,
        learning_rate=LEARNING_RATE,
        init_scale=INIT_SCALE,
        growth_interval=GROWTH_INTERVAL,
        **{"optimizer": "SGD", "optimizer_kwargs": SGD, **fields},
    )
    if device == "cuda":
        cfg = cfg.model_copy(update={"environment": current_environment(torch.device("cuda"))})
    return cfg


def tuned_config(precision: str, device: str) -> Path:
    """The config where the docs' examples load it from."""
    path = Path("studies/resnet18/best.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_config(path, config(precision, device))


def run_example(target: str, namespace: dict[str, Any]) -> dict[str, Any]:
    exec(compile(docs_example(target), f"{EXAMPLES} ({target} example)", "exec"), namespace)
    return namespace


# ---- what a training step really runs --------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """One training step, as a hook on a layer inside the forward pass saw it."""

    optimizer: str
    lr: float
    momentum: float | None
    batch: int
    autocast: torch.dtype | None
    output: torch.dtype


def record_steps(layer: nn.Module, optimizer_of: Callable[[], Any]) -> list[Step]:
    """Each forward of ``layer`` (one per step here) recorded as a :class:`Step`."""
    seen: list[Step] = []

    def hook(module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        device = args[0].device.type
        opt = optimizer_of()
        opt = getattr(opt, "optimizer", opt)  # accelerate's and the Trainer's wrappers
        group = opt.param_groups[0]
        enabled = torch.is_autocast_enabled(device)
        seen.append(
            Step(
                optimizer=type(opt).__name__,
                lr=float(group["lr"]),
                momentum=group.get("momentum"),
                batch=args[0].shape[0],
                autocast=torch.get_autocast_dtype(device) if enabled else None,
                output=out.dtype,
            )
        )

    layer.register_forward_hook(hook)
    return seen


def assert_trained_as_tuned(steps: list[Step], precision: str, batch: int = BATCH_SIZE) -> None:
    assert steps, "no training step ran"
    expected = Step("SGD", LEARNING_RATE, 0.9, batch, AUTOCAST[precision], DTYPES[precision])
    assert set(steps) == {expected}, steps


def classification_data(samples: int = 32) -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(
        torch.randn(samples, 16, generator=gen), torch.randint(0, 4, (samples,), generator=gen)
    )


def small_net() -> nn.Sequential:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


# ---- the three libraries' parts of a docs example ----------------------------------------------


@functools.cache
def lightning_classes() -> tuple[type, type, type]:
    """A user's LightningModule, its DataModule, and a module on another optimizer."""
    lightning = pytest.importorskip("lightning")

    class LitModel(lightning.LightningModule):
        """Its optimizer takes the lr from its init; the script's default lr is 0.1."""

        def __init__(self, learning_rate: float = 0.1) -> None:
            super().__init__()
            self.learning_rate = learning_rate
            self.net = small_net()
            self.steps = record_steps(self.net[0], lambda: self.trainer.optimizers[0])

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.cross_entropy(self.net(x).float(), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=self.learning_rate, momentum=0.9)

    class LitData(lightning.LightningDataModule):
        """Its loader takes the batch size from its init; the script's default is 32."""

        def __init__(self, batch_size: int = 32) -> None:
            super().__init__()
            self.batch_size = batch_size

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            return torch.utils.data.DataLoader(classification_data(), batch_size=self.batch_size)

    class AdamModel(LitModel):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=self.learning_rate)

    return LitModel, LitData, AdamModel


def lightning_namespace() -> dict[str, Any]:
    model, data, _ = lightning_classes()
    return {"LitModel": model, "LitData": data}


class TokenData(torch.utils.data.Dataset):
    """Random token sequences: a causal LM learns them as well as anything."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 64, (8,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def hf_namespace() -> dict[str, Any]:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=64, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    ns: dict[str, Any] = {"model": model, "dataset": TokenData()}
    ns["steps"] = record_steps(model.transformer.h[0].mlp.c_fc, lambda: ns["trainer"].optimizer)
    return ns


def accelerate_namespace() -> dict[str, Any]:
    pytest.importorskip("accelerate")
    model = small_net()
    ns: dict[str, Any] = {
        "model": model,
        "dataset": classification_data(),
        "loss_fn": nn.functional.cross_entropy,
    }
    ns["steps"] = record_steps(model[0], lambda: ns["optimizer"])
    return ns


NAMESPACES = {
    "lightning": lightning_namespace,
    "hf": hf_namespace,
    "accelerate": accelerate_namespace,
}


def trained(target: str, ns: dict[str, Any]) -> tuple[list[Step], float | None]:
    """The steps the example trained, and the GradScaler's scale (fp16)."""
    if target == "lightning":
        scaler = getattr(ns["trainer"].precision_plugin, "scaler", None)
        return ns["model"].steps, None if scaler is None else scaler.get_scale()
    accelerator = ns["accelerator"] if target == "accelerate" else ns["trainer"].accelerator
    scaler = accelerator.scaler
    return ns["steps"], None if scaler is None else scaler.get_scale()


# ---- on the CPU: every mode trains as tuned, or is refused ---------------------------------------

CPU_CASES = [(t, p) for t in NAMESPACES for p in ("fp32", "tf32", "fp16", "bf16")]
# What the libraries would do instead, so the export refuses (see autotune.export).
REFUSED_ON_CPU = {("hf", "fp16"), ("accelerate", "fp16"), *((t, "tf32") for t in NAMESPACES)}


@pytest.mark.parametrize(("target", "precision"), CPU_CASES)
def test_the_docs_example_trains_in_the_tuned_mode_on_a_cpu(target: str, precision: str) -> None:
    namespace = NAMESPACES[target]()
    tuned_config(precision, "cpu")
    if (target, precision) in REFUSED_ON_CPU:
        with pytest.raises(
            DeviceError, match=rf"precision '{precision}'.* on cpu|cannot run on cpu"
        ):
            run_example(target, namespace)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("error", ExportWarning)  # every tuned value found its place
        ns = run_example(target, namespace)
    steps, scale = trained(target, ns)
    # The optimizer the lr was tuned for, at that lr on every step (no decaying schedule), on
    # the tuned batch, under autocast in the tuned dtype.
    assert_trained_as_tuned(steps, precision)
    if precision == "fp16":
        # The tuned scaler, not torch's 65536: a few steps of a tiny model never overflow.
        assert scale == INIT_SCALE
    else:
        assert scale is None


# ---- on a GPU: the same examples, CUDA-tuned configs ----------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("target", ["lightning", "hf", "accelerate"])
@pytest.mark.parametrize("precision", ["fp32", "tf32", "fp16", "bf16"])
def test_the_docs_example_trains_in_the_tuned_mode_on_a_gpu(target: str, precision: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device; none is visible")
    namespace = NAMESPACES[target]()
    tuned_config(precision, "cuda")
    ns = run_example(target, namespace)
    steps, scale = trained(target, ns)
    assert_trained_as_tuned(steps, precision)
    if precision == "fp16":
        # Hugging Face's TrainingArguments take no scaler: torch's default, as the export notes.
        assert scale == (2.0**16 if target == "hf" else INIT_SCALE)
    # The backend flags as tuned, and every TF32 getter answering (pytorch#179445).
    tf32 = precision == "tf32"
    assert torch.get_float32_matmul_precision() == ("high" if tf32 else "highest")
    assert torch.backends.cuda.matmul.allow_tf32 is tf32
    assert torch.backends.cudnn.allow_tf32 is tf32
    assert torch.backends.cudnn.benchmark is True


# ---- Lightning: the check that a run trains what was tuned ---------------------------------------


def fit(model: Any, data: Any, ex: autotune.Export) -> None:
    import lightning

    trainer = lightning.Trainer(
        **ex.kwargs,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, data)


@pytest.mark.parametrize(
    ("mistake", "warned"),
    [
        ("module at its default lr", "LitModel trains at lr=0.1, not the tuned learning_rate=0.05"),
        ("loader at its default batch", "the first training batch holds 32 samples, not the tuned"),
    ],
)
def test_lightning_warns_when_a_run_leaves_a_tuned_value_behind(mistake: str, warned: str) -> None:
    model_cls, data_cls, _ = lightning_classes()
    ex = autotune.export(config("bf16"), "lightning", model=model_cls, datamodule=data_cls)
    model = model_cls() if "lr" in mistake else model_cls(**ex.model_kwargs)
    data = data_cls() if "batch" in mistake else data_cls(**ex.datamodule_kwargs)
    with pytest.warns(ExportWarning, match=warned):
        fit(model, data, ex)


def test_lightning_refuses_to_train_the_lr_with_another_optimizer() -> None:
    _, data_cls, adam_cls = lightning_classes()
    ex = autotune.export(config("bf16"), "lightning", model=adam_cls, datamodule=data_cls)
    model = adam_cls(**ex.model_kwargs)
    with pytest.raises(ExportError, match="tuned for SGD, but AdamModel.configure_optimizers"):
        fit(model, data_cls(**ex.datamodule_kwargs), ex)
    assert model.steps == []  # refused before the first step


# ---- the files and flags, read by each library's own loader -------------------------------------


def exported(precision: str, target: str, fmt: str, device: str = "cpu", **options: Any) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExportWarning)  # what a test looks at, it asserts
        return autotune.export(config(precision), target, device=device, **options).render(fmt)


def cli_args(text: str, fmt: str) -> list[str]:
    """LightningCLI's arguments for an exported file or flags."""
    if fmt == "args":
        return shlex.split(text)
    Path(f"trainer.{fmt}").write_text(text)
    return ["--config", str(Path(f"trainer.{fmt}").resolve())]


@pytest.mark.parametrize("fmt", ["yaml", "json", "args"])
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_lightning_cli_takes_the_config_file_and_flags(
    precision: str, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("jsonargparse", reason="LightningCLI needs jsonargparse[signatures]")
    from lightning.pytorch.cli import LightningCLI

    monkeypatch.setattr(sys, "argv", ["train.py"])  # LightningCLI also looks at the real ones
    model, data, _ = lightning_classes()
    text = exported(precision, "lightning", fmt, model=model, datamodule=data)
    cli = LightningCLI(model, data, args=cli_args(text, fmt), run=False, save_config_callback=None)
    plugin = cli.trainer.precision_plugin
    assert plugin.precision == ("16-mixed" if precision == "fp16" else "bf16-mixed")
    if precision == "fp16":
        assert plugin.scaler.get_scale() == INIT_SCALE
        assert plugin.scaler.get_growth_interval() == 500
    assert torch.backends.cudnn.benchmark is True
    assert (cli.model.learning_rate, cli.datamodule.batch_size) == (LEARNING_RATE, BATCH_SIZE)
    assert [type(c).__name__ for c in cli.trainer.callbacks].count("TunedSettingsCheck") == 1


@pytest.mark.parametrize("classes", [True, False], ids=["classes given", "no classes"])
def test_lightning_cli_trains_from_the_exported_file(
    classes: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("jsonargparse", reason="LightningCLI needs jsonargparse[signatures]")
    from lightning.pytorch.cli import LightningCLI

    monkeypatch.setattr(sys, "argv", ["train.py"])
    model, data, _ = lightning_classes()
    options = {"model": model, "datamodule": data} if classes else {}
    text = exported("bf16", "lightning", "yaml", **options)
    args = [
        "fit",
        *cli_args(text, "yaml"),
        "--trainer.max_steps=2",
        "--trainer.logger=false",
        "--trainer.enable_checkpointing=false",
        "--trainer.enable_progress_bar=false",
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli = LightningCLI(model, data, args=args, save_config_callback=None)
    told = [str(w.message) for w in caught if w.category is ExportWarning]
    if classes:
        # The lr in the module's init, the batch size in the DataModule's: nothing to say.
        assert_trained_as_tuned(cli.model.steps, "bf16")
        assert told == []
    else:
        # The file's optimizer: section carries the lr with its optimizer; the batch size had
        # no place, which the export said, and the run says again as it starts.
        assert_trained_as_tuned(cli.model.steps, "bf16", batch=32)
        assert told == [
            "the first training batch holds 32 samples, not the tuned batch_size=8: pass "
            "Export.datamodule_kwargs to your DataModule, or Export.elsewhere.batch_size to "
            "your DataLoader"
        ]


@pytest.mark.parametrize("fmt", ["yaml", "json", "args"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_hf_argument_parser_takes_the_file_and_flags(precision: str, fmt: str) -> None:
    transformers = pytest.importorskip("transformers")
    parser = transformers.HfArgumentParser(transformers.TrainingArguments)
    text = exported(precision, "hf", fmt)
    if fmt == "args":
        (args,) = parser.parse_args_into_dataclasses(shlex.split(text) + ["--output_dir", "out"])
    else:
        Path(f"args.{fmt}").write_text(text)
        parse = parser.parse_json_file if fmt == "json" else parser.parse_yaml_file
        (args,) = parse(f"args.{fmt}")
    assert (args.bf16, args.fp16, args.use_cpu) == (precision == "bf16", False, True)
    assert (args.per_device_train_batch_size, args.learning_rate) == (BATCH_SIZE, LEARNING_RATE)
    assert (args.lr_scheduler_type.value, args.max_grad_norm) == ("constant", 0.0)
    # The optimizer the Trainer builds from these arguments is the tuned one.
    cls, kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(args)
    assert (cls, kwargs) == (
        torch.optim.SGD,
        {"lr": LEARNING_RATE, "momentum": 0.9, "dampening": 0.0, "nesterov": False},
    )


def test_hf_trainer_trains_from_the_exported_file() -> None:
    transformers = pytest.importorskip("transformers")
    Path("args.json").write_text(exported("bf16", "hf", "json"))
    (args,) = transformers.HfArgumentParser(transformers.TrainingArguments).parse_json_file(
        "args.json"
    )
    ns = hf_namespace()
    ns["trainer"] = transformers.Trainer(model=ns["model"], args=args, train_dataset=ns["dataset"])
    ns["trainer"].train()
    assert_trained_as_tuned(ns["steps"], "bf16")


def test_hf_trainer_trains_under_the_schedule_the_config_was_tuned_under() -> None:
    # A Hugging Face workload tuned under its TrainingArguments' linear decay, no warm-up.
    transformers = pytest.importorskip("transformers")
    ex = autotune.export(config("bf16", lr_schedule="linear"), "hf")
    args = transformers.TrainingArguments(output_dir="out", max_steps=4, report_to=[], **ex.kwargs)
    ns = hf_namespace()
    ns["trainer"] = transformers.Trainer(model=ns["model"], args=args, train_dataset=ns["dataset"])
    ns["trainer"].train()
    # Inside each step, the lr the decay gives it (0.05 at step 0, 0 after step 4), not 0.05.
    assert [s.lr for s in ns["steps"]] == pytest.approx(
        [LEARNING_RATE * (1 - i / 4) for i in range(4)]
    )
    assert {(s.optimizer, s.batch, s.autocast) for s in ns["steps"]} == {
        ("SGD", BATCH_SIZE, torch.bfloat16)
    }


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_accelerate_launch_takes_the_config_file_and_flags(precision: str, device: str) -> None:
    if (precision, device) == ("fp16", "cpu"):
        pytest.skip("refused: accelerate trains fp16 on a CPU in fp32")
    pytest.importorskip("accelerate")
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import launch_command_parser

    for fmt in ("yaml", "json"):
        Path(f"accelerate.{fmt}").write_text(exported(precision, "accelerate", fmt, device))
        loaded = load_config_from_file(f"accelerate.{fmt}")
        assert (loaded.mixed_precision, loaded.use_cpu) == (precision, device == "cpu")
        assert (loaded.distributed_type.value, loaded.num_processes) == ("NO", 1)
    args = shlex.split(exported(precision, "accelerate", "args", device))
    launch = launch_command_parser().parse_args([*args, "train.py"])
    assert (launch.mixed_precision, launch.cpu, launch.num_processes) == (
        precision,
        device == "cpu",
        1,
    )
