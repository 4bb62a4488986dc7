"""An adapter reference (``{"lightning": {...}}`` and its kin) turned into a Workload, in the
worker: each named object is reached (:mod:`~autotune.workloads._objects`), then the adapter
for its kind builds the Workload from them."""

from __future__ import annotations

from typing import Any

from autotune.errors import WorkloadError
from autotune.schema.workload_spec import object_references, parse_source
from autotune.workloads._base import Workload
from autotune.workloads._factory import is_stdlib
from autotune.workloads._objects import import_user_module, resolve

__all__ = ["adapter_workload", "check_adapter", "is_adapter_reference"]

# What each adapter needs installed, and how to get it.
_NEEDS = {
    "lightning": ("lightning", "pip install lightning"),
    "huggingface": ("transformers", "pip install transformers"),
}


def is_adapter_reference(reference: str) -> bool:
    """Whether a reference names the user's classes through an adapter (its JSON form)."""
    return reference.lstrip().startswith("{")


def _source(reference: str) -> tuple[str, Any]:
    try:
        return parse_source(reference)
    except ValueError as exc:
        raise WorkloadError(f"workload {reference[:200]!r}: {exc}") from None


def _build(kind: str, source: Any) -> Workload:
    def get(field: str) -> Any:
        ref = getattr(source, field)
        return None if ref is None else resolve(f"{kind}.{field}", ref)

    base = {"base_lr": source.base_lr, "base_batch_size": source.base_batch_size}
    if kind == "lightning":
        from autotune.workloads._from_lightning import lightning_workload

        return lightning_workload(
            get("module"),
            get("datamodule"),
            module_args=source.module_args,
            datamodule_args=source.datamodule_args,
            **base,
        )
    if kind == "huggingface":
        from autotune.workloads._from_huggingface import huggingface_workload

        return huggingface_workload(
            get("model"),
            get("dataset"),
            collator=get("collator"),
            tokenizer=get("tokenizer"),
            training_args=get("training_args"),
            model_args=source.model_args,
            **base,
        )
    from autotune.workloads._from_loop import loop_workload

    return loop_workload(
        get("model"),
        get("data"),
        get("optimizer"),
        get("loss"),
        model_args=source.model_args,
        **base,
    )


def adapter_workload(reference: str) -> Workload:
    """Build the Workload an adapter reference names.

    Raises:
        WorkloadError: one line naming the field and the object that cannot be reached, built
            or used; or the library the adapter needs, when it is not installed.
    """
    kind, source = _source(reference)
    try:
        workload = _build(kind, source)
    except ModuleNotFoundError as exc:
        package, fix = _NEEDS.get(kind, (exc.name, f"pip install {exc.name}"))
        if exc.name and exc.name.split(".")[0] == package:
            raise WorkloadError(
                f"workload {kind}: {package} is not installed here; {fix} "
                "(or pip install 'autotune[integrations]')"
            ) from None
        raise
    workload.reference = reference
    return workload


def check_adapter(reference: str) -> str:
    """Check each object an adapter reference names can be reached, calling nothing but the
    imports; the reference, validated.

    Raises:
        WorkloadError: naming the field and what is wrong.
    """
    _source(reference)
    for ref in object_references(reference):
        if ref.startswith("pickle:"):
            continue
        module_name, _, attr = ref.partition(":")
        if is_stdlib(module_name):
            raise WorkloadError(
                f"workload {ref!r}: module {module_name!r} is part of Python itself; name a class "
                "or function of your own package"
            )
        module = import_user_module(f"workload {ref!r}", module_name)
        if not hasattr(module, attr):
            raise WorkloadError(
                f"workload {ref!r}: module {module_name!r} has no attribute {attr!r}"
            )
    return reference
