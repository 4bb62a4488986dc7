"""The ``workload`` field of a study spec: a reference, or the user's own classes named directly.

A spec names its workload in one of four forms::

    workload: mypkg.train:workload            # a function returning autotune.Workload

    workload:
      lightning:
        module: mypkg.model:LitClassifier     # a LightningModule class or factory
        datamodule: mypkg.data:CIFARData      # a LightningDataModule class or factory
        module_args: {channels: 32}           # optional init args for each
        datamodule_args: {root: data/}

    workload:
      huggingface:
        model: mypkg.hf:build_model           # a PreTrainedModel class, config or factory
        dataset: mypkg.hf:train_set           # a map-style dataset (or factory) of dicts
        collator: mypkg.hf:collate            # optional; the Trainer's default otherwise

    workload:
      loop:
        model: mypkg.train:Classifier         # an nn.Module class or factory
        data: mypkg.train:make_loader         # (batch_size) -> DataLoader
        optimizer: mypkg.train:make_optimizer # (params, lr) -> optimizer, or its class
        loss: torch.nn.functional:cross_entropy   # optional: (outputs, targets) -> loss

Whatever the form, the validated field is one string, the workload's *reference*: the worker
loads it, the study stores it, the config records it and the space fingerprint hashes it. A
mapping becomes its canonical JSON text (keys sorted, defaults left out), so the same classes
give the same reference, and so the same study, however the YAML was written.

Only this module's models are imported here: no torch, no user code. The worker turns a
reference into a :class:`~autotune.workloads.Workload` (:func:`autotune.workloads.load_workload`).
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from autotune.errors import short_repr

__all__ = [
    "ADAPTERS",
    "HuggingFaceSource",
    "LightningSource",
    "LoopSource",
    "Source",
    "canonical_reference",
    "is_object_reference",
    "named_objects",
    "object_references",
    "parse_source",
    "workload_label",
    "workload_reference",
]

# An object a spec names: ``package.module:Name``, or a file autotune.tune() pickled it to.
_OBJECT = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")
_PICKLED = re.compile(r"^pickle:\S.*\.pkl$")
_EXAMPLE = (
    "{lightning: {module: mypkg.model:LitClassifier, datamodule: mypkg.data:CIFARData}}, "
    "{huggingface: {model: mypkg.hf:build_model, dataset: mypkg.hf:train_set}} or "
    "{loop: {model: ..., data: ..., optimizer: ...}}"
)


def is_object_reference(text: str) -> bool:
    """Whether ``text`` names an object: ``package.module:Name`` or ``pickle:PATH.pkl``.

    Example:
        >>> is_object_reference("mypkg.model:LitClassifier"), is_object_reference("mypkg/model.py")
        (True, False)
    """
    return bool(_OBJECT.match(text) or _PICKLED.match(text))


def _object(value: Any, info: Any) -> Any:
    if isinstance(value, str) and is_object_reference(value.strip()):
        return value.strip()
    field = info.field_name
    raise ValueError(
        f"must name a class or function as package.module:Name, got "
        f"{field}={short_repr(value)}; e.g. {field}: mypkg.model:Name (a class or function "
        "defined in your package)"
    )


class _Source(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # What the user's objects say (an lr hparam, a batch_size init arg, TrainingArguments) is
    # the base; these override it where the objects say nothing or say something else.
    base_lr: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    base_batch_size: int | None = Field(default=None, gt=0)


class LightningSource(_Source):
    """A LightningModule and a LightningDataModule, each a class (built with its args) or a
    factory."""

    module: str
    datamodule: str
    module_args: dict[str, Any] = Field(default_factory=dict)
    datamodule_args: dict[str, Any] = Field(default_factory=dict)

    @field_validator("module", "datamodule", mode="before")
    @classmethod
    def _refs(cls, value: Any, info: Any) -> Any:
        return _object(value, info)


class HuggingFaceSource(_Source):
    """A transformers model (class, config or factory), a map-style dataset of dicts, and
    optionally a collator, a tokenizer and TrainingArguments (an instance or a factory)."""

    model: str
    dataset: str
    collator: str | None = None
    tokenizer: str | None = None
    training_args: str | None = None
    # Init args of the model's config (for a class) or of the factory.
    model_args: dict[str, Any] = Field(default_factory=dict)

    @field_validator("model", "dataset", "collator", "tokenizer", "training_args", mode="before")
    @classmethod
    def _refs(cls, value: Any, info: Any) -> Any:
        return None if value is None else _object(value, info)


class LoopSource(_Source):
    """A plain loop: a model factory, a DataLoader factory taking a batch size, an optimizer
    factory taking ``(params, lr)`` and a loss function taking ``(outputs, targets)``."""

    model: str
    data: str
    optimizer: str
    loss: str | None = None
    model_args: dict[str, Any] = Field(default_factory=dict)

    @field_validator("model", "data", "optimizer", "loss", mode="before")
    @classmethod
    def _refs(cls, value: Any, info: Any) -> Any:
        return None if value is None else _object(value, info)


Source = LightningSource | HuggingFaceSource | LoopSource
ADAPTERS: dict[str, type[Source]] = {
    "lightning": LightningSource,
    "huggingface": HuggingFaceSource,
    "loop": LoopSource,
}
Adapter = Literal["lightning", "huggingface", "loop"]


def _errors(exc: ValidationError, kind: str) -> str:
    """A source's validation errors as one line: ``lightning.module: ...; ...``."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in (kind, *err.get("loc", ())))
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        if err.get("type") == "missing":
            msg = "required field is missing"
        elif err.get("type") == "extra_forbidden":
            fields = sorted(ADAPTERS[kind].model_fields, key=lambda k: k.startswith("base_"))
            msg = f"unknown field; {kind} takes {', '.join(fields)}"
        parts.append(f"{loc}: {msg}")
    return "; ".join(parts)


def parse_source(value: Any) -> tuple[Adapter, Source]:
    """Validate a ``{adapter: {...}}`` mapping (or its JSON text) into its source model.

    Args:
        value: ``{"lightning": {...}}``, ``{"huggingface": {...}}`` or ``{"loop": {...}}``.

    Returns:
        ``(adapter name, source)``.

    Raises:
        ValueError: one line naming the field, the value and what would work.

    Example:
        >>> kind, src = parse_source({"lightning": {"module": "m:Lit", "datamodule": "m:Data"}})
        >>> kind, src.module
        ('lightning', 'm:Lit')
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise ValueError(
                f"{short_repr(value)} starts like a mapping but is not valid JSON; "
                f"write package.module:function or {_EXAMPLE}"
            ) from None
    if not isinstance(value, dict) or len(value) != 1 or next(iter(value)) not in ADAPTERS:
        keys = ", ".join(map(str, value)) if isinstance(value, dict) else type(value).__name__
        raise ValueError(
            f"must be package.module:function, a built-in name, or one of "
            f"{', '.join(ADAPTERS)} with its classes, got {keys}; e.g. {_EXAMPLE}"
        )
    kind, body = next(iter(value.items()))
    if not isinstance(body, dict):
        raise ValueError(
            f"{kind} must be a mapping of fields, got {kind}={short_repr(body)}; e.g. {_EXAMPLE}"
        )
    try:
        return kind, ADAPTERS[kind].model_validate(body)
    except ValidationError as exc:
        raise ValueError(_errors(exc, kind)) from None


def canonical_reference(kind: str, source: Source) -> str:
    """The reference a source is stored and fingerprinted as: its JSON, keys sorted, fields at
    their defaults left out.

    Example:
        >>> canonical_reference(*parse_source({"loop": {"model": "m:Net", "data": "m:loader",
        ...                                             "optimizer": "m:opt"}}))
        '{"loop": {"data": "m:loader", "model": "m:Net", "optimizer": "m:opt"}}'
    """
    body = source.model_dump(mode="json", exclude_defaults=True)
    try:
        return json.dumps({kind: body}, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError):
        raise ValueError(
            f"{kind}: init args must be plain values (numbers, strings, booleans, lists, "
            f"mappings), got {short_repr(body)}"
        ) from None


def workload_reference(value: Any) -> Any:
    """The spec's ``workload`` as a reference string: a plain reference stays as written
    (stripped); a mapping, or JSON text of one, becomes its canonical reference.

    Raises:
        ValueError: a mapping that is not one of the adapter forms, or has bad fields.

    Example:
        >>> workload_reference(" tiny_mlp ")
        'tiny_mlp'
        >>> workload_reference({"huggingface": {"model": "m:build", "dataset": "m:data"}})
        '{"huggingface": {"dataset": "m:data", "model": "m:build"}}'
    """
    if isinstance(value, str) and not value.strip().startswith("{"):
        return value.strip()
    if isinstance(value, (str, dict)):
        return canonical_reference(*parse_source(value))
    return value  # the field's own type check names it


def named_objects(reference: str) -> list[tuple[str, str]]:
    """The objects an adapter reference names, each with the field that names it, so a checker
    can say which one it refuses.

    Raises:
        ValueError: the reference is not an adapter form with valid fields (see
            :func:`parse_source`).

    Example:
        >>> named_objects('{"lightning": {"datamodule": "m:Data", "module": "m:Lit"}}')
        [('lightning.module', 'm:Lit'), ('lightning.datamodule', 'm:Data')]
    """
    kind, source = parse_source(reference)
    return [
        (f"{kind}.{k}", getattr(source, k))
        for k in type(source).model_fields
        if k in _REF_FIELDS and getattr(source, k)
    ]


def object_references(reference: str) -> list[str]:
    """The objects a reference names: itself for ``package.module:function``, each named class
    or function for an adapter reference (so a checker can look at every one).

    Example:
        >>> object_references('{"lightning": {"datamodule": "m:Data", "module": "m:Lit"}}')
        ['m:Lit', 'm:Data']
        >>> object_references("mypkg.train:workload")
        ['mypkg.train:workload']
    """
    if not reference.lstrip().startswith("{"):
        return [reference]
    return [ref for _, ref in named_objects(reference)]


# The fields of a source that name objects (the rest are args and numbers).
_REF_FIELDS = (
    "module",
    "datamodule",
    "model",
    "dataset",
    "collator",
    "tokenizer",
    "training_args",
    "data",
    "optimizer",
    "loss",
)


def workload_label(reference: str) -> str:
    """A reference as a title shows it: an adapter reference as its kind and the objects it
    names (args left out), a plain reference as it is.

    Example:
        >>> workload_label('{"lightning": {"datamodule": "m:Data", "module": "m:Lit", '
        ...                '"module_args": {"channels": 32}}}')
        'lightning m:Lit + m:Data'
        >>> workload_label("autotune.workloads:tiny_mlp")
        'autotune.workloads:tiny_mlp'
    """
    if not reference.lstrip().startswith("{"):
        return reference
    try:
        kind, _ = parse_source(reference)
    except ValueError:
        return reference
    return f"{kind} {' + '.join(object_references(reference))}"
