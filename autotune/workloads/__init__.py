"""Workloads: the interface, the built-ins and the reference loader."""

from autotune.workloads._base import Batch, Workload, cross_entropy_loss, synthetic_batches
from autotune.workloads._builtin import BUILTINS, resnet18, tiny_convnet, tiny_gpt, tiny_mlp
from autotune.workloads._factory import (
    BUILTIN_MODULES,
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

__all__ = [
    "BUILTINS",
    "BUILTIN_MODULES",
    "Batch",
    "Workload",
    "builtin_factories",
    "check_factory",
    "cross_entropy_loss",
    "factory_problem",
    "is_reference",
    "is_stdlib",
    "load_workload",
    "normalize_reference",
    "resnet18",
    "synthetic_batches",
    "tiny_convnet",
    "tiny_gpt",
    "tiny_mlp",
]
