"""The exports against the real Lightning, transformers and accelerate (the `integrations` extra).

The README's export examples run verbatim on a config of each mode: they train in the tuned mode
(the dtype a layer's output has, the GradScaler's scale) or are refused with a message naming the
mode and the device. The files and flags `autotune export` prints are read by each library's own
loader. Tiny models built from config objects, synthetic data, a few CPU steps, no download; each
library is imported inside the tests that need it (Lightning costs seconds to import).
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _configs import make_config, write_config
from torch import nn

import autotune
from autotune.config import current_environment
from autotune.errors import DeviceError
from autotune.precision import restore_backend_flags, snapshot_backend_flags

ROOT = Path(__file__).resolve().parent.parent
DTYPES = {
    "fp32": torch.float32,
    "tf32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}
# Only fp16 carries a scaler; its tuned values differ from torch's 65536 and 2000 on purpose.
INIT_SCALE, GROWTH_INTERVAL = 1024.0, 500


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


def readme_example(target: str) -> str:
    """The README's Python example for one export target, as written there."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    found = [b for b in blocks if f'autotune.export(cfg, "{target}")' in b]
    assert len(found) == 1, f"README must hold one {target} export example, found {len(found)}"
    return found[0]


def tuned_config(precision: str, device: str) -> Path:
    """A config of this mode tuned on ``device``, where the README's examples load it from."""
    cfg = make_config(
        precision,
        batch_size=8,
        learning_rate=0.05,
        optimizer="SGD",
        init_scale=INIT_SCALE,
        growth_interval=GROWTH_INTERVAL,
    )
    if device == "cuda":
        cfg = cfg.model_copy(update={"environment": current_environment(torch.device("cuda"))})
    path = Path("studies/resnet18/best.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_config(path, cfg)


def run_example(target: str, namespace: dict[str, Any]) -> dict[str, Any]:
    exec(compile(readme_example(target), f"README.md ({target} example)", "exec"), namespace)
    return namespace


def recorded_dtypes(layer: nn.Module) -> list[torch.dtype]:
    seen: list[torch.dtype] = []
    layer.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    return seen


def classification_data(samples: int = 32) -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(
        torch.randn(samples, 16, generator=gen), torch.randint(0, 4, (samples,), generator=gen)
    )


def small_net() -> nn.Sequential:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


# ---- the three libraries' parts of a README example --------------------------------------------


def lightning_namespace() -> dict[str, Any]:
    lightning = pytest.importorskip("lightning")

    class LitModel(lightning.LightningModule):
        """A user's LightningModule: its optimizer takes the tuned lr."""

        def __init__(self, learning_rate: float = 0.1) -> None:
            super().__init__()
            self.learning_rate = learning_rate
            self.net = small_net()
            self.dtypes = recorded_dtypes(self.net[0])

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.cross_entropy(self.net(x).float(), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=self.learning_rate, momentum=0.9)

    return {"LitModel": LitModel, "dataset": classification_data()}


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
    return {
        "model": model,
        "dataset": TokenData(),
        "dtypes": recorded_dtypes(model.transformer.h[0].mlp.c_fc),
    }


def accelerate_namespace() -> dict[str, Any]:
    pytest.importorskip("accelerate")
    model = small_net()
    return {
        "model": model,
        "dataset": classification_data(),
        "loss_fn": nn.functional.cross_entropy,
        "dtypes": recorded_dtypes(model[0]),
    }


NAMESPACES = {
    "lightning": lightning_namespace,
    "hf": hf_namespace,
    "accelerate": accelerate_namespace,
}


def trained(target: str, ns: dict[str, Any]) -> tuple[list[torch.dtype], float | None]:
    """The dtypes the first layer produced in training, and the GradScaler's scale (fp16)."""
    if target == "lightning":
        scaler = getattr(ns["trainer"].precision_plugin, "scaler", None)
        return ns["model"].dtypes, None if scaler is None else scaler.get_scale()
    accelerator = ns["accelerator"] if target == "accelerate" else ns["trainer"].accelerator
    scaler = accelerator.scaler
    return ns["dtypes"], None if scaler is None else scaler.get_scale()


# ---- on the CPU: every mode trains as tuned, or is refused ---------------------------------------

CPU_CASES = [
    ("lightning", "fp32"),
    ("lightning", "tf32"),
    ("lightning", "fp16"),
    ("lightning", "bf16"),
    ("hf", "fp32"),
    ("hf", "tf32"),
    ("hf", "fp16"),
    ("hf", "bf16"),
    ("accelerate", "fp32"),
    ("accelerate", "tf32"),
    ("accelerate", "fp16"),
    ("accelerate", "bf16"),
]
# What the libraries would do instead, so the export refuses (see autotune.export).
REFUSED_ON_CPU = {("hf", "fp16"), ("accelerate", "fp16"), *((t, "tf32") for t in NAMESPACES)}


@pytest.mark.parametrize(("target", "precision"), CPU_CASES)
def test_the_readme_example_trains_in_the_tuned_mode_on_a_cpu(target: str, precision: str) -> None:
    namespace = NAMESPACES[target]()
    tuned_config(precision, "cpu")
    if (target, precision) in REFUSED_ON_CPU:
        with pytest.raises(
            DeviceError, match=rf"precision '{precision}'.* on cpu|cannot run on cpu"
        ):
            run_example(target, namespace)
        return
    ns = run_example(target, namespace)
    dtypes, scale = trained(target, ns)
    assert dtypes and set(dtypes) == {DTYPES[precision]}, dtypes
    if precision == "fp16":
        # The tuned scaler, not torch's 65536: a few steps of a tiny model never overflow.
        assert scale == INIT_SCALE
    else:
        assert scale is None


# ---- on a GPU: the same examples, CUDA-tuned configs ----------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("target", ["lightning", "hf", "accelerate"])
@pytest.mark.parametrize("precision", ["fp32", "tf32", "fp16", "bf16"])
def test_the_readme_example_trains_in_the_tuned_mode_on_a_gpu(target: str, precision: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device; none is visible")
    namespace = NAMESPACES[target]()
    tuned_config(precision, "cuda")
    ns = run_example(target, namespace)
    dtypes, scale = trained(target, ns)
    assert dtypes and set(dtypes) == {DTYPES[precision]}, dtypes
    if precision == "fp16":
        # Hugging Face's TrainingArguments take no scaler: torch's default, as the export notes.
        assert scale == (2.0**16 if target == "hf" else INIT_SCALE)
    # The backend flags as tuned, and every TF32 getter answering (pytorch#179445).
    tf32 = precision == "tf32"
    assert torch.get_float32_matmul_precision() == ("high" if tf32 else "highest")
    assert torch.backends.cuda.matmul.allow_tf32 is tf32
    assert torch.backends.cudnn.allow_tf32 is tf32
    assert torch.backends.cudnn.benchmark is True


# ---- the files and flags, read by each library's own loader -------------------------------------


def exported(precision: str, target: str, fmt: str, device: str = "cpu") -> str:
    cfg = make_config(
        precision, batch_size=8, learning_rate=0.05, init_scale=INIT_SCALE, growth_interval=500
    )
    return autotune.export(cfg, target, device=device).render(fmt)


@pytest.mark.parametrize("fmt", ["yaml", "json", "args"])
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_lightning_cli_takes_the_config_file_and_flags(
    precision: str, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("jsonargparse", reason="LightningCLI needs jsonargparse[signatures]")
    from lightning.pytorch.cli import LightningCLI

    monkeypatch.setattr(sys, "argv", ["train.py"])  # LightningCLI also looks at the real ones
    model = lightning_namespace()["LitModel"]
    text = exported(precision, "lightning", fmt)
    if fmt == "args":
        args = shlex.split(text)
    else:
        args = ["--config", str(Path(f"trainer.{fmt}").resolve())]
        Path(f"trainer.{fmt}").write_text(text)
    cli = LightningCLI(model, args=args, run=False, save_config_callback=None)
    plugin = cli.trainer.precision_plugin
    assert plugin.precision == ("16-mixed" if precision == "fp16" else "bf16-mixed")
    if precision == "fp16":
        assert plugin.scaler.get_scale() == INIT_SCALE
        assert plugin.scaler.get_growth_interval() == 500
    assert torch.backends.cudnn.benchmark is True


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
    assert (args.per_device_train_batch_size, args.learning_rate) == (8, 0.05)


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
