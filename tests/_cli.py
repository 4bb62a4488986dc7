"""Running the `autotune` command as a user does: a fresh interpreter, the tiny study."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_tiny_search(
    tmp_path: Path, out_dir: Path, env: dict[str, str]
) -> subprocess.CompletedProcess:
    """`autotune search studies/tiny.yaml` with a 25 s budget and its own storage, on this
    CPU's recorded landscape (the command's output is the same; a real worker is other
    tests' business)."""
    argv = [
        sys.executable,
        "-m",
        "autotune",
        "search",
        str(ROOT / "studies" / "tiny.yaml"),
        "--budget",
        "25s",
        "--simulate",
        "cpu-tiny_convnet",
        "--storage",
        f"sqlite:///{tmp_path / 's.db'}",
        "--out",
        str(out_dir),
    ]
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
