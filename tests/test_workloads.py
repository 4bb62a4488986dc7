"""Workloads: the built-ins train, and bad references fail with the reference in the message."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from autotune.errors import WorkloadError
from autotune.workloads import BUILTINS, Workload, load_workload, normalize_reference

USER_MODULE = "autotune_test_user_workloads"
BROKEN_MODULE = "autotune_test_broken_import"


@pytest.fixture
def user_modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Two importable modules a user might write: one with mistakes, one that fails to import."""
    (tmp_path / f"{USER_MODULE}.py").write_text(
        textwrap.dedent(
            """
            from autotune.workloads import tiny_mlp

            NUMBER = 3
            READY = tiny_mlp()

            def raises():
                raise RuntimeError("dataset not found")

            def returns_none():
                return None

            def good():
                return tiny_mlp()
            """
        )
    )
    (tmp_path / f"{BROKEN_MODULE}.py").write_text("raise ImportError('needs extra package foo')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in (USER_MODULE, BROKEN_MODULE):
        sys.modules.pop(name, None)


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_builtin_names_load_with_a_full_reference(name: str) -> None:
    wl = load_workload(name)
    assert isinstance(wl, Workload)
    assert wl.name == name
    assert wl.reference == f"autotune.workloads:{name}"
    assert load_workload(wl.reference).name == name


@pytest.mark.parametrize("name", ["tiny_mlp", "tiny_convnet", "tiny_gpt", "resnet18"])
def test_builtin_batches_and_loss_have_the_promised_shape(name: str) -> None:
    # A large batch keeps the pool of synthetic batches (a fixed number of samples) short.
    wl = BUILTINS[name]()
    batches = wl.make_batches(64, torch.device("cpu"), torch.Generator().manual_seed(0))
    first = next(batches)
    assert all(t.shape[0] == 64 for t in first)
    loss = wl.loss(wl.build_model(), first)
    assert loss.dim() == 0 and torch.isfinite(loss)


def test_synthetic_batches_are_the_same_for_the_same_seed() -> None:
    wl = load_workload("tiny_mlp")

    def first(seed: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        return next(wl.make_batches(64, torch.device("cpu"), gen))[0]

    assert torch.equal(first(3), first(3))
    assert not torch.equal(first(3), first(4))


@pytest.mark.parametrize(
    ("ref", "expected"),
    [("tiny_mlp", "autotune.workloads:tiny_mlp"), (" pkg.mod:fn ", "pkg.mod:fn")],
)
def test_normalize_reference(ref: str, expected: str) -> None:
    assert normalize_reference(ref) == expected


@pytest.mark.parametrize(
    ("ref", "expected"),
    [
        ("garbage", "must look like package.module:function"),
        ("", "must look like package.module:function"),
        ("pkg.mod:", "must look like package.module:function"),
        ("pkg.mod:fn:extra", "must look like package.module:function"),
        ("pkg/mod.py:fn", "must look like package.module:function"),
        ("no_such_package_xyz.mod:fn", "cannot import module 'no_such_package_xyz.mod'"),
        ("autotune.workloads:no_such_thing", "has no attribute 'no_such_thing'"),
        ("autotune.testing.workloads:OOM_LIMIT", "'OOM_LIMIT' is a int, expected a function"),
        ("os:getcwd", "getcwd() returned str, expected autotune.Workload"),
        ("os.path:join", "calling join() raised TypeError"),
    ],
    ids=[
        "no-colon",
        "empty",
        "no-attribute",
        "two-colons",
        "a-path",
        "missing-module",
        "missing-attribute",
        "not-callable",
        "wrong-return-type",
        "needs-arguments",
    ],
)
def test_bad_reference_is_a_workload_error_naming_it(ref: str, expected: str) -> None:
    with pytest.raises(WorkloadError) as info:
        load_workload(ref)
    message = str(info.value)
    assert repr(ref) in message
    assert expected in message


@pytest.mark.parametrize(
    ("attr", "expected"),
    [
        ("raises", "calling raises() raised RuntimeError: dataset not found"),
        ("returns_none", "returns_none() returned NoneType, expected autotune.Workload"),
        ("NUMBER", "'NUMBER' is a int"),
    ],
)
def test_user_module_mistakes_are_named(user_modules: None, attr: str, expected: str) -> None:
    ref = f"{USER_MODULE}:{attr}"
    with pytest.raises(WorkloadError) as info:
        load_workload(ref)
    assert repr(ref) in str(info.value)
    assert expected in str(info.value)


def test_module_that_fails_to_import_is_named(user_modules: None) -> None:
    ref = f"{BROKEN_MODULE}:anything"
    with pytest.raises(WorkloadError) as info:
        load_workload(ref)
    assert repr(ref) in str(info.value)
    assert "raised ImportError: needs extra package foo" in str(info.value)


def test_missing_attribute_lists_what_the_module_has(user_modules: None) -> None:
    with pytest.raises(WorkloadError, match="has no attribute 'godo'; it has .*good"):
        load_workload(f"{USER_MODULE}:godo")


@pytest.mark.parametrize("attr", ["good", "READY"])
def test_user_function_or_workload_object_loads(user_modules: None, attr: str) -> None:
    wl = load_workload(f"{USER_MODULE}:{attr}")
    assert wl.name == "tiny_mlp"
    assert wl.reference == f"{USER_MODULE}:{attr}"
