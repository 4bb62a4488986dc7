"""Every numeric field has a physical range, refused past it at parse time in one line naming
the field and the range (docs/specs.md holds the same table); keys given twice are refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from autotune.errors import SpecError
from autotune.schema.bounds import BOUNDS, Bound
from autotune.schema.spec import Candidate, load_spec, parse_spec

ROOT = Path(__file__).resolve().parents[1]
BASE = {"name": "b", "workload": "tiny_mlp"}
INTEGERS = {"batch_size", "batch_sizes[]", "warmup_steps", "steps", "check_every", "top_k"}
INTEGERS |= {"fp16_steps", "growth_interval"}
DURATIONS = {"probe.min_time", "probe.time_limit"}


def _outside(path: str, bound: Bound) -> list[Any]:
    """One value below the range and one above it."""
    leaf = path.split(".")[-2 if path.endswith((".min", ".max")) else -1]
    if leaf in INTEGERS:
        return [int(bound.low) - 1, int(bound.high) + 1]
    return [bound.low - max(bound.low / 2, 0.01), bound.high * 2]


def _spec_with(path: str, value: Any) -> dict[str, Any]:
    data: dict[str, Any] = dict(BASE)
    *parents, leaf = path.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
    if leaf.endswith("[]"):
        node[leaf.removesuffix("[]")] = [value]
    elif leaf in ("min", "max"):  # the other end within the range, the pair in order
        node.update(min=value, max=value)
    else:
        node[leaf] = value
    return data


CASES = [(p, v) for p, b in BOUNDS.items() for v in _outside(p, b)]


@pytest.mark.parametrize(("path", "value"), CASES, ids=[f"{p}={v:g}" for p, v in CASES])
def test_a_value_outside_its_range_is_refused_naming_the_field_and_the_range(
    path: str, value: float
) -> None:
    bound = BOUNDS[path]
    if path.startswith("candidate."):
        fields = {"precision": "fp16", "batch_size": 32, "learning_rate": 0.1}
        with pytest.raises(ValidationError) as info:
            Candidate(**{**fields, path.split(".")[1]: value})
        said = str(info.value)
    else:
        with pytest.raises(SpecError) as info:
            parse_spec(_spec_with(path, value))
        said = str(info.value)
        where = path.rsplit(".", 1)[0] if path.endswith((".min", ".max")) else path
        assert f"  {where.removesuffix('[]')}" in said, said
        if path in DURATIONS and value < bound.low:  # a duration's own check: it is positive
            assert "must be positive" in said, said
            return
    assert f"must be from {bound.shown()} ({bound.why})" in said, said
    # The ends themselves are accepted.
    for inside in (bound.low, bound.high):
        if path.startswith("candidate."):
            Candidate(**{**fields, path.split(".")[1]: inside})
        elif path != "probe.time_limit" or inside > 0:  # a duration is positive
            parse_spec(
                _spec_with(
                    path, int(inside) if float(inside).is_integer() and inside >= 1 else inside
                )
            )


def test_the_docs_show_every_bound() -> None:
    text = (ROOT / "docs" / "specs.md").read_text()
    for path, bound in BOUNDS.items():
        assert f"| `{path}` | {bound.shown()} | {bound.why} |" in text, path


def test_a_key_given_twice_is_refused_not_silently_the_last(tmp_path: Path) -> None:
    spec = tmp_path / "twice.yaml"
    spec.write_text("name: b\nworkload: tiny_mlp\nbudget: 30s\nbudget: 30h\n")
    with pytest.raises(SpecError, match=r"the key 'budget' is given twice in one mapping \(line 4"):
        load_spec(spec)
    # Merged keys (<<) may still be overridden, as YAML means them.
    spec.write_text(
        "name: b\nworkload: tiny_mlp\nbase: &p {steps: 4}\nprobe:\n  <<: *p\n  steps: 6\n"
    )
    with pytest.raises(SpecError, match="base: unknown field"):
        load_spec(spec)
    spec.write_text("name: b\nworkload: tiny_mlp\nprobe: {<<: {steps: 4}, steps: 6}\n")
    assert load_spec(spec).probe.steps == 6
    # JSON (a request body, a config) the same.
    from autotune.infra.inputs import load_text

    with pytest.raises(SpecError, match="the key 'budget' is given twice in one mapping"):
        load_text('{"name": "b", "budget": "30s", "budget": "30h"}', "json", "a request")
