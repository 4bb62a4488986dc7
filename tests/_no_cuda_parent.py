"""Run the autotune command, or the service, in a process where opening CUDA is forbidden.

    python tests/_no_cuda_parent.py [--fake-gpu] cli search studies/tiny.yaml --device cuda ...
    python tests/_no_cuda_parent.py [--fake-gpu] service STORAGE_URL SPEC.yaml

Every torch call that opens a CUDA context (the lazy initialisation they all go through, and
the public ones by name) raises ``FORBIDDEN`` in this process; the probe worker it starts is a
fresh interpreter and may use the GPU. ``--fake-gpu`` makes this process see one CUDA device on
a machine without one, so the CPU can show which code would have touched it.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

FORBIDDEN = "CUDA was initialised in the calling process"
_OPENS_CONTEXT = (
    "_lazy_init",
    "init",
    "current_device",
    "set_device",
    "synchronize",
    "mem_get_info",
    "get_device_capability",
    "get_device_name",
    "get_device_properties",
)


def _forbid(*args: object, **kwargs: object) -> None:
    raise RuntimeError(FORBIDDEN)


def forbid_cuda(fake_gpu: bool) -> None:
    """Make every context-opening CUDA call in this process raise; optionally fake one GPU."""
    if fake_gpu:
        torch.cuda.is_available = lambda: True
        torch.cuda.device_count = lambda: 1
    for name in _OPENS_CONTEXT:
        setattr(torch.cuda, name, _forbid)
    # Bound by name in the memory module too.
    torch.cuda.memory._lazy_init = _forbid
    torch.cuda.memory.mem_get_info = _forbid


def run_service(storage: str, spec_file: Path) -> None:
    """Start the service on cuda:0, queue one study, print how it ended as JSON."""
    from autotune.service import TuningService

    service = TuningService(storage, ["cuda:0"], out_dir=spec_file.parent / "out")
    service.start()
    try:
        name = service.submit(spec_file.read_bytes()).name
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            status = service.study(name)
            if status.state in ("done", "failed", "cancelled"):
                break
            time.sleep(0.2)
        devices = [d.model_dump(mode="json") for d in service.devices()]
        print(json.dumps({"state": status.state, "detail": status.detail, "devices": devices}))
    finally:
        service.stop()


def main() -> None:
    args = sys.argv[1:]
    fake = args[:1] == ["--fake-gpu"]
    args = args[1:] if fake else args
    forbid_cuda(fake)
    if args[0] == "service":
        run_service(args[1], Path(args[2]))
        return
    from autotune.cli import main as cli

    sys.argv = ["autotune", *args[1:]]
    cli()


if __name__ == "__main__":
    main()
