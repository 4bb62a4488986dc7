"""The adapters against the real Lightning and transformers: a spec names a project's own
classes, and a probe trains them as their library would, with the optimizer, schedule, loss,
batches and base settings the objects themselves say. Tiny models, a few CPU steps."""

from __future__ import annotations

import re
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from autotune.errors import SpecError, WorkloadError
from autotune.measure.step import StepEngine
from autotune.schema.spec import Candidate, parse_spec
from autotune.workloads import load_workload, loop_workload, reference_for

ROOT = Path(__file__).resolve().parent.parent
LIT = {
    "module": "examples.lightning.model:LitClassifier",
    "datamodule": "examples.lightning.data:CIFARData",
}
HF = {
    "model": "examples.huggingface.model:build_model",
    "dataset": "examples.huggingface.data:train_set",
}


@pytest.fixture(autouse=True)
def _project_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    # The examples are importable from the repository root, where autotune runs in them.
    monkeypatch.syspath_prepend(str(ROOT))
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")


def ref(kind: str, **fields: Any) -> str:
    """The workload reference a spec with ``{kind: fields}`` holds."""
    return parse_spec({"name": "x", "workload": {kind: fields}}).workload


def train(wl: Any, steps: int, *, batch_size: int = 16, lr: float = 0.1, seed: int = 0) -> dict:
    """``steps`` probe steps; what a user would look at afterwards."""
    cand = Candidate(precision="fp32", batch_size=batch_size, learning_rate=lr)
    with StepEngine(wl, cand, torch.device("cpu"), seed=seed) as engine:
        engine.build()
        first = engine.next_batch()
        engine.run_steps(steps)
        return {
            "model": engine.model,
            "optimizer": engine.optimizer,
            "losses": engine.read_losses(),
            "first": first,
        }


# ---- the spec's forms ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "fields"),
    [
        ("lightning", {**LIT, "module_args": {"channels": 8}, "datamodule_args": {"samples": 512}}),
        ("huggingface", {**HF, "collator": "transformers:default_data_collator"}),
        ("loop", {"model": "m:Net", "data": "m:loader", "optimizer": "m:opt", "base_lr": 0.1}),
    ],
)
def test_each_form_is_one_reference_whatever_the_yaml_order(kind: str, fields: dict) -> None:
    spec = parse_spec({"name": "x", "workload": {kind: fields}})
    shuffled = parse_spec({"name": "x", "workload": {kind: dict(reversed(fields.items()))}})
    assert spec.workload == shuffled.workload
    assert spec.space_fingerprint() == shuffled.space_fingerprint()
    assert spec.workload.startswith(f'{{"{kind}": ')
    # It survives a round trip through the spec's own dump (the service and overrides do it).
    assert spec.with_overrides({"budget": "2m"}).workload == spec.workload
    # The string form is untouched.
    assert parse_spec({"name": "x", "workload": "mypkg.train:workload"}).workload == (
        "mypkg.train:workload"
    )


@pytest.mark.parametrize(
    ("workload", "needle"),
    [
        (
            {"lightning": {"module": "m:Lit"}},
            "workload: lightning.datamodule: required field is missing",
        ),
        (
            {"lightning": {**LIT, "module": "mypkg/model.py"}},
            "lightning.module: must name a class or function as package.module:Name, got "
            "module='mypkg/model.py'",
        ),
        ({"huggingface": {**HF, "colator": "m:c"}}, "huggingface.colator: unknown field; "),
        (
            {"keras": {"model": "m:M"}},
            "one of lightning, huggingface, loop with its classes, got keras",
        ),
    ],
)
def test_a_bad_workload_mapping_is_one_line_naming_the_field(workload: dict, needle: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec({"name": "x", "workload": workload})
    message = str(err.value)
    assert needle in message
    assert len(message.splitlines()) == 2  # the header, then one line for the field


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        (
            {**LIT, "module": "nopkg_xyz.model:Lit"},
            "lightning.module 'nopkg_xyz.model:Lit': cannot import module 'nopkg_xyz.model'",
        ),
        (
            {**LIT, "module": "examples.lightning.model:LitClasifier"},
            "module 'examples.lightning.model' has no attribute 'LitClasifier'; it has LitClassifier",
        ),
        (
            {**LIT, "module": "_lightning_objects:Broken", "module_args": {"width": 3}},
            "lightning.module: Broken(width=3) raised ValueError: no weights for width=3",
        ),
        ({**LIT, "module": "os.path:join"}, "module 'os.path' is part of Python itself"),
    ],
)
def test_a_class_that_cannot_be_reached_or_built_is_one_line(fields: dict, needle: str) -> None:
    with pytest.raises(WorkloadError) as err:
        load_workload(ref("lightning", **fields))
    assert needle in str(err.value) and "\n" not in str(err.value)


# ---- Lightning ---------------------------------------------------------------------------------


def test_lightning_takes_its_base_from_the_objects_and_trains_as_lightning_would() -> None:
    wl = load_workload(ref("lightning", **LIT, module_args={"channels": 8}))
    # lr=0.05 is LitClassifier's hparam default; batch_size=32 the data module's.
    assert (wl.base_lr, wl.base_batch_size, wl.lr_scaling) == (0.05, 32, "linear")
    assert "SGD from configure_optimizers, then CosineAnnealingLR (interval=step)" in wl.description
    # The schedule the config records, so an export trains under it too.
    assert wl.lr_schedule == "CosineAnnealingLR"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        run = train(wl, 3, batch_size=16, lr=0.2)
    # self.log in training_step: no warning; nothing was attached that logs.
    assert not [w for w in seen if "lightning" in str(w.filename)], [str(w.message) for w in seen]
    opt = run["optimizer"]
    # The module's own optimizer, built at the candidate's lr through its hparam.
    assert type(opt).__name__ == "SGD" and opt.defaults["momentum"] == 0.9
    assert opt.param_groups[0]["initial_lr"] == pytest.approx(0.2)
    assert run["model"].hparams.lr == pytest.approx(0.2)
    # Its cosine schedule stepped after each optimizer step, as interval=step says.
    trainer = run["model"].trainer
    assert trainer.global_step == 3
    assert trainer.lr_scheduler_configs[0]["scheduler"].last_epoch == 3
    assert run["first"][0].shape == (16, 3, 16, 16)
    assert len(run["losses"]) == 3 and all(v == v for v in run["losses"])


def test_lightning_module_that_keeps_no_lr_has_its_groups_and_schedule_moved() -> None:
    wl = load_workload(
        ref("lightning", module="_lightning_objects:NoLr", datamodule="_lightning_objects:Points")
    )
    # Its lr is the one configure_optimizers writes; the batch size the data module's.
    assert (wl.base_lr, wl.base_batch_size, wl.lr_schedule) == (0.1, 16, "StepLR")
    run = train(wl, 5, batch_size=16, lr=0.4)
    opt, trainer = run["optimizer"], run["model"].trainer
    sched = trainer.lr_scheduler_configs[0]["scheduler"]
    assert sched.base_lrs == [pytest.approx(0.4)]
    # 64 points are 4 batches of 16: the 5th step began epoch 1, and the epoch's StepLR halved it.
    assert (trainer.current_epoch, sched.last_epoch) == (1, 1)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.2)


def test_lightning_batches_follow_the_probes_seed() -> None:
    wl = load_workload(
        ref("lightning", module="_lightning_objects:NoLr", datamodule="_lightning_objects:Points")
    )

    def first(seed: int, batch_size: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        return next(wl.make_batches(batch_size, torch.device("cpu"), gen))[0]

    assert torch.equal(first(0, 16), first(0, 16))
    assert not torch.equal(first(0, 16), first(1, 16))
    assert first(0, 32).shape[0] == 32  # the data module's batch_size was set to the candidate's


@pytest.mark.parametrize(
    ("module", "datamodule", "needle"),
    [
        ("NoLr", "FixedBatch", "FixedBatch keeps no batch_size: autotune tries batch sizes"),
        ("TwoOptimizers", "Points", "configure_optimizers() returned 2 optimizers"),
        ("Manual", "Points", "uses manual optimization"),
    ],
)
def test_lightning_refuses_what_it_cannot_tune_with_the_fix(
    module: str, datamodule: str, needle: str
) -> None:
    with pytest.raises(WorkloadError, match=re.escape(needle)):
        wl = load_workload(
            ref(
                "lightning",
                module=f"_lightning_objects:{module}",
                datamodule=f"_lightning_objects:{datamodule}",
            )
        )
        train(wl, 1)


def test_lightning_stand_in_trainer_names_what_it_cannot_answer() -> None:
    wl = load_workload(
        ref(
            "lightning",
            module="_lightning_objects:ReadsStrategy",
            datamodule="_lightning_objects:Points",
        )
    )
    with pytest.raises(AttributeError, match=r"self\.trainer\.strategy is not available"):
        train(wl, 1)


# ---- Hugging Face ------------------------------------------------------------------------------


def test_huggingface_trains_with_what_the_trainer_would_build() -> None:
    training_args = "examples.huggingface.model:training_args"
    wl = load_workload(ref("huggingface", **HF, training_args=training_args))
    # TrainingArguments(learning_rate=1e-3, per_device_train_batch_size=32); AdamW: sqrt rule;
    # their lr_scheduler_type, transformers' default linear decay.
    assert (wl.base_lr, wl.base_batch_size, wl.lr_scaling) == (1e-3, 32, "sqrt")
    assert wl.lr_schedule == "linear"
    run = train(wl, 2, batch_size=16, lr=2e-3)
    opt = run["optimizer"]
    assert type(opt).__name__ == "AdamW"
    decayed, plain = opt.param_groups
    names = {id(p): n for n, p in run["model"].named_parameters()}
    assert all("bias" in names[id(p)] or "LayerNorm" in names[id(p)] for p in plain["params"])
    assert plain["weight_decay"] == 0.0
    # A linear decay over the run the arguments describe at this batch: 3 epochs of 4096/16.
    assert opt.param_groups[0]["lr"] == pytest.approx(2e-3 * (1 - 2 / (3 * 4096 // 16)))
    assert set(run["first"]) == {"input_ids", "labels"} and run["first"]["input_ids"].shape[0] == 16


def _config(**more: Any) -> Any:
    import transformers

    return transformers.BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=32, num_labels=2, **more,
    )  # fmt: skip


def _rows(n: int = 64, **extra: Any) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    return [
        {
            "input_ids": torch.randint(0, 64, (8,), generator=gen),
            "labels": torch.tensor(i % 2),
            **extra,
        }
        for i in range(n)
    ]


@pytest.mark.parametrize("form", ["class", "config", "factory of a config", "half-precision model"])
def test_huggingface_builds_the_model_from_a_class_config_or_factory(form: str) -> None:
    import transformers

    from autotune.workloads import huggingface_workload

    model, args = {
        "class": (transformers.BertForSequenceClassification, {"hidden_size": 16, "num_hidden_layers": 1,
                  "num_attention_heads": 2, "intermediate_size": 32, "vocab_size": 64}),
        "config": (_config(architectures=["BertForSequenceClassification"]), {}),
        "factory of a config": (lambda: _config(architectures=["BertForSequenceClassification"]), {}),
        "half-precision model": (transformers.BertForSequenceClassification(_config()).to(torch.bfloat16), {}),
    }[form]  # fmt: skip
    # Columns the model's forward does not take are dropped, as the Trainer drops them.
    wl = huggingface_workload(model, _rows(text="a sentence"), model_args=args)
    run = train(wl, 1, batch_size=8, lr=1e-3)
    assert isinstance(run["model"], transformers.BertForSequenceClassification)
    assert {p.dtype for p in run["model"].parameters()} == {torch.float32}
    assert ("upcast from bfloat16" in wl.description) == (form == "half-precision model")
    assert set(run["first"]) == {"input_ids", "labels"}


@pytest.mark.parametrize(
    ("form", "schedule"),
    [
        ("lightning, no scheduler", "constant"),
        ("huggingface, lr_scheduler_type", "cosine_with_restarts"),
    ],
)
def test_the_schedule_a_workload_trains_under_reaches_its_facts(
    form: str, schedule: str, tmp_path: Path
) -> None:
    from autotune.execution.facts import workload_facts
    from autotune.workloads import huggingface_workload

    if form.startswith("lightning"):
        points = "_lightning_objects:Points"
        wl = load_workload(
            ref("lightning", module="_lightning_objects:NoSchedule", datamodule=points)
        )
    else:
        import transformers

        args = transformers.TrainingArguments(
            output_dir=str(tmp_path), lr_scheduler_type=schedule, report_to=[]
        )
        model = _config(architectures=["BertForSequenceClassification"])
        wl = huggingface_workload(model, _rows(), training_args=args)
    assert workload_facts(wl)["lr_schedule"] == schedule


def test_huggingface_refuses_a_config_without_a_class_and_a_model_without_labels() -> None:
    from autotune.workloads import huggingface_workload

    with pytest.raises(WorkloadError, match=r"names no model class \(architectures=\[\]\)"):
        huggingface_workload(_config(), _rows())
    import transformers

    wl = huggingface_workload(transformers.BertForSequenceClassification(_config()), [
        {"input_ids": r["input_ids"]} for r in _rows()
    ])  # fmt: skip
    with pytest.raises(WorkloadError, match="returned no loss.*give each example its labels"):
        train(wl, 1, batch_size=8)


# ---- a plain loop ------------------------------------------------------------------------------


def _loader_factory(seen: list) -> Any:
    data = torch.utils.data.TensorDataset(torch.randn(128, 8), torch.randint(0, 2, (128,)))

    def make_loader(batch_size: int = 32, generator: torch.Generator | None = None) -> Any:
        seen.append(generator)
        return torch.utils.data.DataLoader(
            data, batch_size=batch_size, shuffle=True, generator=generator
        )

    return make_loader


def test_loop_takes_its_base_from_the_factories_defaults() -> None:
    seen: list = []

    def make_optimizer(params: Any, lr: float = 3e-3) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=lr)

    wl = loop_workload(lambda: torch.nn.Linear(8, 2), _loader_factory(seen), make_optimizer)
    assert (wl.base_lr, wl.base_batch_size, wl.lr_scaling) == (3e-3, 32, "sqrt")
    assert wl.lr_schedule == "constant"  # the factory builds an optimizer, no schedule
    run = train(wl, 2, batch_size=16, lr=6e-3)
    assert run["optimizer"].param_groups[0]["lr"] == pytest.approx(6e-3)
    assert run["first"][0].shape == (16, 8)
    assert isinstance(seen[-1], torch.Generator)  # the probe's seeded generator


def test_loop_without_defaults_asks_for_the_base() -> None:
    with pytest.raises(WorkloadError, match=r"says no default lr.*set workload\.loop\.base_lr"):
        loop_workload(lambda: torch.nn.Linear(8, 2), _loader_factory([]), lambda params, lr: None)
    wl = loop_workload(
        torch.nn.Linear, _loader_factory([]), torch.optim.SGD, model_args={"in_features": 8, "out_features": 2},
        base_lr=0.1,
    )  # fmt: skip
    assert (wl.base_lr, wl.base_batch_size, wl.lr_scaling) == (0.1, 32, "linear")


# ---- autotune.tune(): what is refused before anything runs -------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({}, "tune() takes one workload"),
        ({"module": "m:Lit"}, "lightning needs datamodule= too"),
        (
            {"module": "m:Lit", "datamodule": "m:D", "dataset": "m:d"},
            "got module, datamodule, dataset",
        ),
        ({"model": "m:M", "dataset": "m:d", "loss": "m:l"}, "loss= do not go with huggingface"),
    ],
)
def test_tune_needs_exactly_one_workload(kwargs: dict, needle: str) -> None:
    import autotune

    with pytest.raises(SpecError) as err:
        autotune.tune(**kwargs, budget="10s")
    assert needle in str(err.value)


def test_a_notebook_class_without_cloudpickle_is_refused_before_the_search(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import autotune

    monkeypatch.setitem(sys.modules, "cloudpickle", None)  # as if not installed
    notebook = type("LitModel", (torch.nn.Module,), {"__module__": "__main__"})
    monkeypatch.setattr(sys.modules["__main__"], "LitModel", notebook, raising=False)
    with pytest.raises(WorkloadError) as err:
        autotune.tune(
            module=notebook, datamodule="_lightning_objects:Points", out=tmp_path, budget="10s"
        )
    assert str(err.value).startswith(
        "lightning.module: LitModel is defined in the notebook or script (__main__), which the "
        "probe worker, a separate process, cannot import; move it into a module of your package"
    )
    assert not (tmp_path / "best.json").exists()


def test_objects_reach_the_worker_by_name_or_pickled(tmp_path: Path) -> None:
    from examples.huggingface.data import train_set

    assert (
        reference_for(torch.nn.Linear, "loop.model", tmp_path) == "torch.nn.modules.linear:Linear"
    )
    data = train_set(8)
    pickled = reference_for(data, "huggingface.dataset", tmp_path / "objects")
    assert pickled == f"pickle:{tmp_path / 'objects' / 'huggingface.dataset.pkl'}"
    wl = load_workload(ref("huggingface", model=HF["model"], dataset=pickled))
    assert wl.description.startswith("BertForSequenceClassification on 8 examples")


def test_a_workload_function_sent_by_value_loads_in_the_worker(tmp_path: Path) -> None:
    import functools

    from autotune.workloads import tiny_mlp

    # A partial has no import path: it travels pickled, as a notebook's workload function does.
    pickled = reference_for(functools.partial(tiny_mlp), "workload", tmp_path)
    assert pickled.startswith("pickle:") and pickled.endswith("workload.pkl")
    assert load_workload(pickled).name == "tiny_mlp"
