"""The documentation holds to the code: the site builds strict and offline, the module map names
every module, the README stays a five-minute read, and the training loops the pages show run.

The pages' other code runs where its subject is tested: the export examples in
test_integrations.py, the GPU check's table in test_gpu_check.py, the systemd unit's page in
test_docker.py, and the training loops verbatim on a GPU in test_session.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _configs import make_config, write_config
from _docs import DOCS, ROOT, code_block, page
from torch import nn

import autotune
from autotune.measure.precision import restore_backend_flags, snapshot_backend_flags

README_LINES = 150
# A tag that would fetch something when the page is opened: a script, a stylesheet or a font,
# an image, a frame. Links a reader clicks (<a href>) are not fetched.
REMOTE_ASSET = re.compile(
    r"<(?:script|link|img|iframe|source|embed)\b[^>]*\b(?:src|href)=[\"'](?:https?:)?//", re.I
)
REMOTE_CSS = re.compile(r"(?:url\(\s*[\"']?|@import\s+[\"']?)(?:https?:)?//", re.I)


# ---- the site ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site as `make docs` builds it, with --strict, into a folder of its own."""
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def test_every_page_and_api_page_is_built(site: Path) -> None:
    pages = {p.relative_to(DOCS).with_suffix(".html") for p in DOCS.rglob("*.md")}
    assert pages and all((site / p).is_file() for p in pages), sorted(
        str(p) for p in pages if not (site / p).is_file()
    )
    # The API pages are generated from the docstrings: the names are there, with their sections.
    api = {
        "api/config.html": ["load_config", "TunedConfig", "EnvironmentMismatchWarning"],
        "api/session.html": ["AmpSession", "prepare_batch"],
        "api/export.html": ["Export", "set_backend_flags"],
        "api/spec.html": ["StudySpec", "load_spec", "Candidate", "ProbeSettings"],
        "api/library.html": ["run_search", "simulate", "diagnose", "ServiceClient"],
    }
    for name, words in api.items():
        html = (site / name).read_text()
        assert all(w in html for w in words), (name, [w for w in words if w not in html])


def test_docstring_examples_render_as_code_not_as_quotes(site: Path) -> None:
    # An "Example:" section read as plain Markdown turns ">>>" into nested quotes.
    for html in (site / "api").glob("*.html"):
        text = html.read_text()
        assert "<blockquote>" not in text, html.name
    assert "&gt;&gt;&gt;" in (site / "api" / "library.html").read_text()


def test_the_site_loads_nothing_from_the_network(site: Path) -> None:
    found = [
        f"{p.relative_to(site)}: {m.group(0)}"
        for p in site.rglob("*")
        if p.suffix in {".html", ".css", ".js"}
        for m in (REMOTE_ASSET if p.suffix == ".html" else REMOTE_CSS).finditer(p.read_text())
    ]
    assert not found, found


# ---- the module map ---------------------------------------------------------------------------


def modules() -> set[str]:
    """Every module under autotune/, as the map names it: a package by its folder."""
    out = set()
    for path in (ROOT / "autotune").rglob("*.py"):
        rel = path.relative_to(ROOT)
        out.add(f"{rel.parent.as_posix()}/" if path.name == "__init__.py" else rel.as_posix())
    return out


def mapped() -> tuple[set[str], set[str]]:
    """What the module map in docs/architecture.md names: autotune's modules, other folders."""
    text = page("docs/architecture.md").split("\n## Module map\n", 1)[1]
    names = re.findall(r"^\| `([^`]+)` \|", text, re.M)
    return {n for n in names if n.startswith("autotune/")}, {
        n for n in names if not n.startswith("autotune/")
    }


def test_the_module_map_names_every_module_and_nothing_else() -> None:
    listed, _ = mapped()
    real = modules()
    assert not real - listed, (
        f"add to the module map in docs/architecture.md: {sorted(real - listed)}"
    )
    assert not listed - real, f"no such module, remove from the map: {sorted(listed - real)}"


def test_the_folders_beside_the_package_exist() -> None:
    _, folders = mapped()
    assert folders and all((ROOT / f).exists() for f in folders), folders


# ---- the README -------------------------------------------------------------------------------


def test_the_readme_is_a_five_minute_read_that_links_into_the_docs() -> None:
    text = page("README.md")
    assert len(text.splitlines()) <= README_LINES, "move detail into docs/, link it from here"
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", text)]
    local = [t for t in targets if "://" not in t]
    assert "docs/index.md" in local
    assert all((ROOT / t).exists() for t in local), [t for t in local if not (ROOT / t).exists()]


# ---- the training loops the pages show, on a CPU ---------------------------------------------

LOOPS = {
    "README": ("README.md", "with autotune.session(cfg, "),
    "short form": ("docs/training.md", "with autotune.session(cfg, "),
    "tuned loop": ("docs/training.md", "amp = autotune.session(cfg, "),
}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@pytest.mark.parametrize("loop", list(LOOPS))
@pytest.mark.parametrize("precision", list(DTYPES))
def test_the_training_loops_train_in_the_tuned_mode_on_a_cpu(
    loop: str, precision: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, needle = LOOPS[loop]
    block = code_block(path, needle)
    assert '"cuda"' in block
    # The pages train on CUDA; here the same code runs on the CPU (verbatim on a GPU:
    # test_session.py).
    block = block.replace('"cuda"', '"cpu"')
    monkeypatch.chdir(tmp_path)
    (tmp_path / "studies" / "resnet18").mkdir(parents=True)
    write_config(
        tmp_path / "studies" / "resnet18" / "best.json",
        make_config(precision, batch_size=16, init_scale=1024.0, growth_interval=500),
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    before_weights = [p.detach().clone() for p in model.parameters()]
    seen: list[torch.dtype] = []
    model[0].register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    data = torch.utils.data.TensorDataset(torch.randn(64, 16), torch.randint(0, 4, (64,)))
    flags = snapshot_backend_flags()
    ns: dict[str, Any] = {
        "autotune": autotune,
        "torch": torch,
        "DataLoader": torch.utils.data.DataLoader,
        "model": model,
        "dataset": data,
        "loss_fn": nn.functional.cross_entropy,
    }
    try:
        exec(compile(block, f"{path} ({loop})", "exec"), ns)
    finally:
        restore_backend_flags(flags)
    assert seen == [DTYPES[precision]] * 4  # 64 samples in batches of the tuned 16
    assert ns["amp"].closed
    assert snapshot_backend_flags() == flags
    if precision == "fp16":
        assert ns["amp"].scaler.get_scale() == 1024.0  # the tuned init_scale, not torch's
    # The steps updated the weights.
    assert any(
        not torch.equal(a, b) for a, b in zip(before_weights, model.parameters(), strict=True)
    )
