"""Shared test set-up: tests marked ``gpu`` run only where CUDA is visible."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is visible")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
