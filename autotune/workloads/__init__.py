"""Workloads: the interface, the built-ins, the reference loader, and the adapters that make a
Workload from what a project already has (a LightningModule and its DataModule, a transformers
model and dataset, or the pieces of a plain loop)."""

from typing import TYPE_CHECKING

from autotune.infra.lazy import lazy
from autotune.workloads._base import Batch, Workload, cross_entropy_loss, synthetic_batches
from autotune.workloads._factory import (
    BUILTIN_MODULES,
    BUILTIN_NAMES,
    builtin_factories,
    factory_problem,
    is_stdlib,
)
from autotune.workloads._loader import (
    check_factory,
    is_reference,
    load_workload,
    normalize_reference,
)
from autotune.workloads._objects import reference_for

if TYPE_CHECKING:
    from autotune.workloads._builtin import (
        BUILTINS,
        class_images,
        resnet18,
        tiny_convnet,
        tiny_gpt,
        tiny_mlp,
    )
    from autotune.workloads._from_huggingface import huggingface_workload
    from autotune.workloads._from_lightning import lightning_workload
    from autotune.workloads._from_loop import loop_workload

__all__ = [
    "BUILTINS",
    "BUILTIN_MODULES",
    "BUILTIN_NAMES",
    "Batch",
    "Workload",
    "builtin_factories",
    "check_factory",
    "class_images",
    "cross_entropy_loss",
    "factory_problem",
    "huggingface_workload",
    "is_reference",
    "is_stdlib",
    "lightning_workload",
    "load_workload",
    "loop_workload",
    "normalize_reference",
    "reference_for",
    "resnet18",
    "synthetic_batches",
    "tiny_convnet",
    "tiny_gpt",
    "tiny_mlp",
]

# Where each name that needs torch lives: loaded on first use.
_LAZY = {
    "BUILTINS": "autotune.workloads._builtin",
    "class_images": "autotune.workloads._builtin",
    "resnet18": "autotune.workloads._builtin",
    "tiny_convnet": "autotune.workloads._builtin",
    "tiny_gpt": "autotune.workloads._builtin",
    "tiny_mlp": "autotune.workloads._builtin",
    "huggingface_workload": "autotune.workloads._from_huggingface",
    "lightning_workload": "autotune.workloads._from_lightning",
    "loop_workload": "autotune.workloads._from_loop",
}


__getattr__ = lazy(__name__, _LAZY)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
