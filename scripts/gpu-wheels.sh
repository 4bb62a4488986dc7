#!/usr/bin/env bash
# Download, here, the wheels the GPU machine lacks (scripts/gpu-wheels.txt), as cp312 manylinux
# wheels into the ignored folder .whl/, each pinned to the version installed for $PYTHON (the
# environment the suite passes with). scripts/gpu-check.sh installs them there without a network.
#
#   PYTHON=.venv/bin/python bash scripts/gpu-wheels.sh
#
# tests/test_gpu_check.py checks that these wheels and the machine's own packages
# (scripts/gpu-machine-packages.txt) cover every runtime dependency of autotune.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
# name==version for each listed distribution, from $PYTHON's installed metadata.
mapfile -t PINS < <("$PY" - <<'PYEOF'
import sys
from importlib.metadata import PackageNotFoundError, version

missing = []
for line in open("scripts/gpu-wheels.txt"):
    name = line.split("#")[0].strip()
    if not name:
        continue
    try:
        print(f"{name}=={version(name)}")
    except PackageNotFoundError:
        missing.append(name)
if missing:
    sys.exit(f"gpu-wheels: not installed for {sys.executable}: {', '.join(missing)}; "
             "install autotune there first (pip install -e .) or set PYTHON")
PYEOF
)
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
           --platform manylinux1_x86_64 --platform manylinux_2_34_x86_64)
# One version of each: two wheels of one name stop the whole install there.
mkdir -p .whl
rm -f .whl/*.whl
# --no-deps: the list names every wheel; the test above checks that nothing is missing.
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${PLATFORMS[@]}" -d .whl "${PINS[@]}"
echo "gpu-wheels: $(ls .whl/*.whl | wc -l) wheels, $(du -sh .whl | cut -f1) in .whl/; name .whl in the" \
    "carry of every call to the GPU machine (bash scripts/gpu-check.sh --plan says the calls)"
