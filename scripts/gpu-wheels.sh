#!/usr/bin/env bash
# Download, here, the wheels a CUDA machine with Python 3.12, torch and torchvision lacks:
# autotune's other dependencies as cp312 manylinux wheels, into the ignored folder .whl/.
# `make gpu-check` on that machine installs them from there without any network.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
           --platform manylinux1_x86_64 --platform manylinux_2_34_x86_64)
# Pure-Python or binary, each named: --no-deps fetches none of their needs.
PACKAGES=(optuna alembic sqlalchemy greenlet colorlog mako pydantic pydantic-core
          annotated-types typing-inspection loguru fastapi starlette uvicorn h11 anyio sniffio
          httpx httpcore idna certifi typer shellingham rich markdown-it-py mdurl pygments
          pyyaml click nvidia-ml-py typing-extensions annotated-doc hypothesis sortedcontainers)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${PLATFORMS[@]}" -d .whl "${PACKAGES[@]}"
ls .whl | wc -l
