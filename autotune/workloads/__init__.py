"""Workloads: the interface, the built-ins, the reference loader, and the adapters that make a
Workload from what a project already has (a LightningModule and its DataModule, a transformers
model and dataset, or the pieces of a plain loop).

The adapters import Lightning or transformers only when called."""

from autotune.workloads._base import Batch, Workload, cross_entropy_loss, synthetic_batches
from autotune.workloads._builtin import (
    BUILTINS,
    class_images,
    resnet18,
    tiny_convnet,
    tiny_gpt,
    tiny_mlp,
)
from autotune.workloads._factory import (
    BUILTIN_MODULES,
    builtin_factories,
    factory_problem,
    is_stdlib,
)
from autotune.workloads._huggingface import huggingface_workload
from autotune.workloads._lightning import lightning_workload
from autotune.workloads._loader import (
    check_factory,
    is_reference,
    load_workload,
    normalize_reference,
)
from autotune.workloads._loop import loop_workload
from autotune.workloads._objects import reference_for

__all__ = [
    "BUILTINS",
    "BUILTIN_MODULES",
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
