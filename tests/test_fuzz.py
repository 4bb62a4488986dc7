"""A fuzz pass (property-based, with hypothesis) over everything that reads input from outside:
the spec loader, the config loader and the service's request bodies.

The property is the house rule: any input gives a clean result or one clear error (SpecError,
ConfigError, a 4xx with a ``detail``), never another exception, a 500 or a hang. The example
counts are modest so the suite stays fast; each test is bounded by its own timeout.
"""

from __future__ import annotations

import json
import math
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import yaml
from _configs import make_config
from fastapi.testclient import TestClient

# A machine with only the runtime dependencies (the GPU check) collects this file too.
pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from autotune.errors import ConfigError, SpecError  # noqa: E402
from autotune.infra.inputs import load_text  # noqa: E402
from autotune.schema.config import TunedConfig, load_config  # noqa: E402
from autotune.schema.spec import StudySpec, parse_spec  # noqa: E402
from autotune.service import TuningService, create_app  # noqa: E402

TOKEN = "fuzz-token-0123456789abcdef"
FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

SPEC_FIELDS = sorted(StudySpec.model_fields)
CONFIG_FIELDS = sorted(TunedConfig.model_fields)

# Scalars as YAML and JSON can carry them, the awkward ones included: huge integers, NaN,
# infinities, empty and non-ASCII text, text that looks like a duration or a number.
scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(10**120), max_value=10**120)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
    | st.sampled_from(["30m", "1h30m", "-5m", "0", "1e308", "cuda:99", "auto", "fp16", "yes"])
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(SPEC_FIELDS) | st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)

# Text built from the pieces that trouble YAML and JSON parsers: brackets, anchors, aliases,
# merge keys, tags, long digit runs, quotes, indentation.
PIECES = [
    "[", "]", "{", "}", ": ", "- ", "\n", "  ", ",", "&a ", "*a", "<<: *a", "!!python/object:os.system ",
    "!!int ", "!!float ", "!!binary ", "!!set ", "? ", "'", '"', "\\u0000", "9" * 60, "0x" + "f" * 40,
    "2024-13-45", "name: x\n", "workload: tiny_mlp\n", "seed: ", "budget: ", "1:2:3", "~", "ø", "\t",
]  # fmt: skip
hostile_text = st.lists(st.sampled_from(PIECES), max_size=80).map("".join) | st.text(max_size=200)


def spec_data() -> st.SearchStrategy[dict[str, Any]]:
    """Mostly-plausible specs with any field replaced by anything."""
    base = {"name": "fuzz", "workload": "tiny_mlp", "device": "cpu", "budget": "30s"}
    return st.dictionaries(st.sampled_from(SPEC_FIELDS), values, max_size=6).map(
        lambda extra: {**base, **extra}
    )


def as_text(data: Any, fmt: str) -> str:
    if fmt == "json":
        return json.dumps(data, default=str)
    return yaml.safe_dump(data, allow_unicode=True)


def _spec_result(text: str, fmt: str) -> StudySpec | None:
    try:
        return parse_spec(load_text(text, fmt, "study spec"))  # type: ignore[arg-type]
    except SpecError as exc:
        assert str(exc).strip() and len(str(exc)) < 5000
        return None


# ---- the spec loader ---------------------------------------------------------------------


@pytest.mark.timeout(120)
@FUZZ
@given(data=spec_data(), fmt=st.sampled_from(["yaml", "json"]))
def test_spec_loader_fuzz_structured(data: dict[str, Any], fmt: str) -> None:
    spec = _spec_result(as_text(data, fmt), fmt)
    if spec is not None:
        assert spec.budget >= 4 and 0 <= spec.seed < 2**32


@pytest.mark.timeout(120)
@FUZZ
@given(text=hostile_text, fmt=st.sampled_from(["yaml", "json"]))
def test_spec_loader_fuzz_text(text: str, fmt: str) -> None:
    _spec_result(text, fmt)


# ---- the config loader -------------------------------------------------------------------


@pytest.fixture(scope="module")
def folder() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as d:
        yield Path(d)


GOOD_CONFIG = make_config("fp16").model_dump(mode="json")
config_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(CONFIG_FIELDS) | st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)


@pytest.mark.timeout(120)
@FUZZ
@given(
    changes=st.dictionaries(st.sampled_from(CONFIG_FIELDS), config_values, max_size=4),
    drop=st.lists(st.sampled_from(CONFIG_FIELDS), max_size=2),
)
def test_config_loader_fuzz(folder: Path, changes: dict[str, Any], drop: list[str]) -> None:
    data = {k: v for k, v in {**GOOD_CONFIG, **changes}.items() if k not in drop}
    path = folder / "best.json"
    path.write_text(json.dumps(data, default=str))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            cfg = load_config(path, device="cpu")
        except ConfigError as exc:
            assert str(exc).strip() and len(str(exc)) < 5000
            return
    assert 0 < cfg.batch_size < 2**31 and 0 < cfg.learning_rate <= 100
    assert isinstance(cfg.channels_last, bool) and math.isfinite(cfg.learning_rate)


@pytest.mark.timeout(120)
@FUZZ
@given(text=hostile_text)
def test_config_loader_fuzz_text(folder: Path, text: str) -> None:
    path = folder / "text.json"
    path.write_text(text)
    with pytest.raises(ConfigError):
        load_config(path, device="cpu")


# ---- the service's request bodies -----------------------------------------------------------


@pytest.fixture(scope="module")
def client(folder: Path) -> Iterator[TestClient]:
    """The HTTP app over a service that is never started: requests are answered, nothing runs."""
    service = TuningService(
        f"sqlite:///{folder / 'service.db'}", ["cpu"], out_dir=folder / "out", token=TOKEN
    )
    with TestClient(create_app(service), raise_server_exceptions=False) as http:
        # The lifespan started the device thread; keep it from taking what the fuzz queues.
        service.scheduler.drain(grace=0)
        yield http


def _answered(r: Any) -> None:
    assert r.status_code < 500 or r.status_code == 503, r.text
    if r.status_code >= 400:
        detail = r.json()["detail"]
        assert isinstance(detail, str) and detail.strip()


@pytest.mark.timeout(180)
@FUZZ
@given(
    body=st.one_of(
        spec_data().map(lambda d: as_text(d, "yaml").encode()),
        spec_data().map(lambda d: as_text(d, "json").encode()),
        hostile_text.map(str.encode),
        st.binary(max_size=300),
    ),
    kind=st.sampled_from(["application/yaml", "application/json", "text/plain", ""]),
    priority=st.sampled_from(["0", "5", "-1001", "1e3", "99999999999999999999", "x"]),
)
def test_service_bodies_fuzz(client: TestClient, body: bytes, kind: str, priority: str) -> None:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    if kind:
        headers["content-type"] = kind
    r = client.post(f"/studies?priority={priority}", content=body, headers=headers)
    _answered(r)
    if r.status_code == 201:
        name = r.json()["name"]
        _answered(client.get(f"/studies/{name}"))
        _answered(client.post(f"/studies/{name}/cancel", headers=headers))


@pytest.mark.timeout(120)
@FUZZ
@given(
    header=st.tuples(
        st.sampled_from([b"Bearer ", b"bearer ", b"Basic ", b""]),
        st.binary(max_size=40) | st.text(max_size=20).map(str.encode),
    )
    .map(b"".join)
    .filter(lambda b: b"\n" not in b and b"\r" not in b and b"\0" not in b),
    name=st.text(max_size=30),
)
def test_service_headers_and_names_fuzz(client: TestClient, header: bytes, name: str) -> None:
    r = client.post("/studies", content=b"name: x\n", headers={"Authorization": header})
    _answered(r)
    assert r.status_code in (401, 422, 503)
    _answered(client.get("/studies/" + quote(name, safe="")))
