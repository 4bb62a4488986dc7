"""A Workload from a transformers model and a dataset of dicts, as ``Trainer`` would train them."""

from __future__ import annotations

import copy
import inspect
import math
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from autotune.errors import WorkloadError
from autotune.workloads._base import Workload
from autotune.workloads._common import Built, endless, lr_rule, seed_loader
from autotune.workloads._objects import build, call

__all__ = ["huggingface_workload"]


def _made(what: str, given: Any) -> Any:
    """A class or function is a factory, called without arguments; anything else is the
    object itself."""
    if inspect.isclass(given) or inspect.isfunction(given):
        return build(what, given)
    return given


class _HuggingFace:
    def __init__(
        self, model: Any, dataset: Any, collator: Any, tokenizer: Any, args: Any, model_args: dict
    ) -> None:
        import transformers

        self.tf = transformers
        self.given, self.model_args = model, dict(model_args)
        made = _made("huggingface.training_args", args) if args is not None else None
        if made is None:
            # transformers' own defaults; nothing is written, the output folder is never used.
            made = transformers.TrainingArguments(output_dir="trainer_output", report_to=[])
        if not isinstance(made, transformers.TrainingArguments):
            raise WorkloadError(
                f"huggingface.training_args: got a {type(made).__name__}, not "
                "transformers.TrainingArguments (or a function returning them)"
            )
        self.args = made
        self.dataset = _made("huggingface.dataset", dataset)
        if not (hasattr(self.dataset, "__getitem__") and hasattr(self.dataset, "__len__")):
            raise WorkloadError(
                f"huggingface.dataset: a {type(self.dataset).__name__} is not a map-style dataset "
                "(with __len__ and __getitem__) of dicts; pass a list of dicts, a torch Dataset or "
                "a datasets.Dataset"
            )
        tok = _made("huggingface.tokenizer", tokenizer) if tokenizer is not None else None
        if collator is None:
            collator = (
                transformers.DataCollatorWithPadding(tok)
                if tok is not None
                else transformers.default_data_collator
            )
        self.collator = collator
        self.built = Built()
        self.runs: weakref.WeakKeyDictionary[nn.Module, _Run] = weakref.WeakKeyDictionary()
        self.upcast: str | None = None
        example = self.build_model()
        self.name = type(example).__name__
        self.columns = self._columns(example)
        cls, kwargs = self._optimizer_class(example)
        self.optimizer_class, self.optimizer_kwargs = cls, kwargs

    # ---- the model --------------------------------------------------------------------------

    def _from_config(self, config: Any) -> nn.Module:
        names = list(getattr(config, "architectures", None) or [])
        cls = getattr(self.tf, names[0], None) if names else None
        if cls is None:
            raise WorkloadError(
                f"huggingface.model: config {type(config).__name__} names no model class "
                f"(architectures={names}); set architectures=['GPT2LMHeadModel'] on it, or name "
                "the model class or a function returning the model"
            )
        return build(f"huggingface.model {cls.__name__}", cls, config=config)

    def build_model(self) -> nn.Module:
        given, what = self.given, "huggingface.model"
        if isinstance(given, nn.Module):
            model = copy.deepcopy(given)
        elif isinstance(given, self.tf.PretrainedConfig):
            model = self._from_config(given)
        elif inspect.isclass(given) and issubclass(given, self.tf.PreTrainedModel):
            config_class: Any = given.config_class  # type: ignore[attr-defined]
            config = build(f"{what} {given.__name__}.config_class", config_class, self.model_args)
            model = build(what, given, config=config)
        else:
            made = build(what, given, self.model_args)
            model = self._from_config(made) if isinstance(made, self.tf.PretrainedConfig) else made
        if not isinstance(model, nn.Module):
            raise WorkloadError(
                f"{what}: built a {type(model).__name__}, not a model; name a PreTrainedModel "
                "class, a config, or a function returning either"
            )
        dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
        if dtypes - {torch.float32}:
            self.upcast = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
            model = model.float()
        return self.built.add(model)

    def _columns(self, model: nn.Module) -> list[str] | None:
        """What the Trainer keeps of each example: the forward's arguments and the labels."""
        if not self.args.remove_unused_columns:
            return None
        labels = self.args.label_names or self.tf.utils.find_labels(type(model)) or ["labels"]
        return list(inspect.signature(model.forward).parameters) + ["label", "label_ids", *labels]

    # ---- the optimizer and its schedule -----------------------------------------------------

    def _optimizer_class(self, model: nn.Module) -> tuple[type, dict[str, Any]]:
        cls, kwargs = call(
            f"huggingface.training_args optim={self.args.optim}",
            self.tf.Trainer.get_optimizer_cls_and_kwargs,
            self.args,
            model,
        )
        odd = sorted({"params", "model", "optimizer_dict"} & set(kwargs))
        if odd or not inspect.isclass(cls):
            raise WorkloadError(
                f"huggingface.training_args: optim={self.args.optim} builds its own parameter "
                f"groups ({', '.join(odd) or 'a factory'}); autotune's adapter takes the "
                "optimizers the Trainer builds from the model's parameters, e.g. adamw_torch"
            )
        return cls, dict(kwargs)

    def build_optimizer(self, params: Iterable[Any], lr: float) -> torch.optim.Optimizer:
        params = list(params)
        kwargs = {**self.optimizer_kwargs, "lr": lr}
        model = self.built.owner(params)
        if model is None:  # someone else's parameters: the optimizer the lr belongs to
            return self.optimizer_class(params, **kwargs, weight_decay=self.args.weight_decay)
        # The Trainer's rule, called unbound: the method never reads self.
        decay = set(self.tf.Trainer.get_decay_parameter_names(None, model))
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = [
            {"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ]
        optimizer = self.optimizer_class([g for g in groups if g["params"]], **kwargs)
        run = self.runs[model] = _Run(optimizer)
        optimizer.register_step_post_hook(run.after_step)
        return optimizer

    def training_steps(self, batch_size: int) -> int:
        """The run's optimizer steps as the Trainer counts them, at this batch size."""
        args = self.args
        if args.max_steps > 0:
            return int(args.max_steps)
        n = len(self.dataset)
        batches = n // batch_size if args.dataloader_drop_last else math.ceil(n / batch_size)
        per_epoch = max(1, batches // max(1, args.gradient_accumulation_steps))
        return max(1, math.ceil(args.num_train_epochs * per_epoch))

    def _schedule(self, run: _Run, batch_size: int) -> None:
        steps = self.training_steps(batch_size)
        run.scheduler = call(
            f"huggingface.training_args lr_scheduler_type={self.args.lr_scheduler_type}",
            self.tf.get_scheduler,
            self.args.lr_scheduler_type,
            optimizer=run.optimizer,
            num_warmup_steps=self.args.get_warmup_steps(steps),
            num_training_steps=steps,
            scheduler_specific_kwargs=self.args.lr_scheduler_kwargs,
        )

    # ---- the loss and the batches -----------------------------------------------------------

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        run = self.runs.get(model)
        if run is not None and run.scheduler is None:
            # Built at the first step, when the batch says how long the Trainer's run would be.
            self._schedule(run, _rows(batch))
        smoothing = self.args.label_smoothing_factor
        if smoothing and "labels" in batch:
            from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
            from transformers.trainer_pt_utils import LabelSmoother

            labels = batch["labels"]
            outputs = model(**{k: v for k, v in batch.items() if k != "labels"})
            causal = type(model).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
            return LabelSmoother(epsilon=smoothing)(outputs, labels, shift_labels=causal)
        outputs = model(**batch)
        if isinstance(outputs, Mapping) and outputs.get("loss") is None:
            raise WorkloadError(
                f"huggingface.model {self.name} returned no loss, only {', '.join(outputs)}; "
                f"its inputs were {', '.join(batch)}: give each example its labels (for a "
                "causal LM, labels = input_ids)"
            )
        return outputs["loss"] if isinstance(outputs, Mapping) else outputs[0]

    def _collate(self, features: list[Any]) -> dict[str, Any]:
        if self.columns is not None:
            keep = set(self.columns)
            features = [
                {k: v for k, v in f.items() if k in keep} if isinstance(f, Mapping) else f
                for f in features
            ]
        return dict(self.collator(features))

    def make_batches(
        self, batch_size: int, device: torch.device, generator: torch.Generator
    ) -> Iterator[Any]:
        loader = torch.utils.data.DataLoader(
            self.dataset,
            batch_size=batch_size,
            shuffle=True,
            collate_fn=self._collate,
            drop_last=True,
            num_workers=self.args.dataloader_num_workers,
        )
        seed_loader(loader, generator)
        return endless(
            loader, batch_size, device, f"huggingface.dataset {type(self.dataset).__name__}"
        )


class _Run:
    """One probe's optimizer and the schedule the Trainer would step with it."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.scheduler: Any = None

    def after_step(self, *args: Any) -> None:
        if self.scheduler is not None:
            self.scheduler.step()


def _rows(batch: Mapping[str, Any]) -> int:
    first = next((v for v in batch.values() if isinstance(v, torch.Tensor) and v.dim()), None)
    return int(first.shape[0]) if first is not None else 1


def huggingface_workload(  # noqa: PLR0913 - public API: the objects a Trainer takes, keyword-only
    model: Any,
    dataset: Any,
    *,
    collator: Any = None,
    tokenizer: Any = None,
    training_args: Any = None,
    model_args: Mapping[str, Any] | None = None,
    base_lr: float | None = None,
    base_batch_size: int | None = None,
) -> Workload:
    """A Workload from a transformers model and a dataset of dicts (see the module's notes).

    Args:
        model: a ``PreTrainedModel`` class (built from its config class with ``model_args``), a
            config naming its class in ``architectures``, a function returning a model or a
            config (called with ``model_args``), or a model (copied for each probe).
        dataset: a map-style dataset of dicts (a list, a torch Dataset, a datasets.Dataset), or
            a function returning one.
        collator: turns a list of examples into a batch; the Trainer's default otherwise.
        tokenizer: makes the default collator pad (``DataCollatorWithPadding``).
        training_args: ``TrainingArguments`` (or a function returning them): the optimizer,
            schedule, base lr and batch size; transformers' defaults when None.
        model_args: init args of the config class (for a model class) or of the factory.
        base_lr: overrides ``learning_rate`` of the arguments.
        base_batch_size: overrides ``per_device_train_batch_size``.

    Returns:
        The Workload; its lr rule follows the optimizer (square root for AdamW).

    Raises:
        WorkloadError: one line naming what cannot be built or used, and why.

    Example:
        >>> wl = huggingface_workload(GPT2LMHeadModel, train_set, model_args={"n_layer": 2})  # doctest: +SKIP
        >>> wl.base_lr, wl.base_batch_size, wl.lr_scaling  # doctest: +SKIP
        (5e-05, 8, 'sqrt')
    """
    hf = _HuggingFace(model, dataset, collator, tokenizer, training_args, dict(model_args or {}))
    schedule = str(getattr(hf.args.lr_scheduler_type, "value", hf.args.lr_scheduler_type))
    note = f"; weights upcast from {hf.upcast} to float32" if hf.upcast else ""
    return Workload(
        name=hf.name,
        build_model=hf.build_model,
        make_batches=hf.make_batches,
        build_optimizer=hf.build_optimizer,
        base_lr=base_lr or float(hf.args.learning_rate),
        base_batch_size=base_batch_size or int(hf.args.per_device_train_batch_size),
        loss=hf.loss,
        lr_scaling=lr_rule(hf.optimizer_class),
        # Its warm-up and lr_scheduler_kwargs stay the arguments' own: an export that lays its
        # fields over them keeps them.
        lr_schedule=schedule,
        description=(
            f"{hf.name} on {len(hf.dataset)} examples (Hugging Face): "
            f"{hf.optimizer_class.__name__} with a {schedule} schedule, as Trainer builds them{note}"
        ),
    )
