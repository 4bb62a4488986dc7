"""The tuning service under load, and the worker's fixed cost per trial.

Prints two sets of figures with their goals:

1. status under load: a local ``autotune serve`` (loopback, its own temporary storage) runs a
   study while ``--clients`` concurrent clients poll it (``GET /studies/<name>`` and
   ``GET /studies``, alternately, each waiting ``--interval`` between polls) for ``--seconds``:
   requests/s, p50 and p99 latency, errors. ``--interval 0`` polls back to back: a stress test
   whose latency is queueing behind the offered load, not the service's own speed.
   Goals: p99 under 100 ms with 50 clients, zero errors.
2. per-trial overhead: a persistent :class:`~autotune.execution.probe_worker.ProbeWorker` runs
   ``--probes`` one-step probes of ``tiny_mlp``; overhead = the wall time of ``ProbeWorker.run``
   minus the probe's own ``wall_seconds`` (request and reply over the pipes, JSON, validation),
   averaged after a first untimed probe. Goal: under 1 s on CPU. Beside it, from the polled study:
   each trial's wall time minus its probe's (sampling, the device gate, storage writes, the round
   trip), as the service really runs trials.
3. ``--submits N`` instead: health under a burst of submits. N clients each POST a study spec at
   once (each parses a spec and writes the database in the service's thread pool) while one
   client times ``GET /health`` back to back until the last submit is answered: the /health
   latency's max and p95, and how the submits fared. Goal: /health max under 1 s with 200
   submits (it answers from memory, on the event loop).

Usage:
    python benchmarks/service_load.py                       # 50 clients every 0.5 s, 10 s
    python benchmarks/service_load.py --interval 0          # back to back: the throughput
    python benchmarks/service_load.py --clients 20 --seconds 5 --json load.json
    python benchmarks/service_load.py --submits 200         # /health during 200 submits

Time: about 10 s to start the service and its worker, then ``--seconds``, then ``--probes``
short probes (defaults: about 30 s in all). Loopback only; clients are capped at 200 and the
duration at 120 s. The clients share the machine with the service: on a small box their own
CPU use is part of the latency measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

P99_GOAL = 0.100
HEALTH_GOAL = 1.0
OVERHEAD_GOAL = 1.0
ROOT = Path(__file__).resolve().parent.parent
_MAX_CLIENTS = 200
_MAX_SECONDS = 120.0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=50, help="concurrent pollers (default 50)")
    p.add_argument("--seconds", type=float, default=10.0, help="polling time (default 10)")
    p.add_argument(
        "--interval",
        type=float,
        default=0.5,
        help="seconds each client waits between its polls (default 0.5; 0 = back to back)",
    )
    p.add_argument("--probes", type=int, default=20, help="probes for the overhead (default 20)")
    p.add_argument(
        "--submits",
        type=int,
        default=0,
        help="instead: time /health while this many submits arrive at once (e.g. 200)",
    )
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write here")
    args = p.parse_args(argv)
    if not 0 <= args.submits <= 1000:
        p.error(f"--submits must be 0..1000, got --submits {args.submits}")
    if not 1 <= args.clients <= _MAX_CLIENTS:
        p.error(f"--clients must be 1..{_MAX_CLIENTS}, got --clients {args.clients}")
    if not 0 < args.seconds <= _MAX_SECONDS:
        p.error(f"--seconds must be in (0, {_MAX_SECONDS:g}], got --seconds {args.seconds:g}")
    return args


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_service(tmp: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp / "service.log", "w")  # noqa: SIM115 - lives as long as the service
    env = {k: v for k, v in os.environ.items() if k != "AUTOTUNE_TOKEN"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "autotune", "serve", "--port", str(port), "--devices", "cpu"]
        + ["--storage", f"sqlite:///{tmp / 's.db'}", "--out", str(tmp / "out")],
        cwd=ROOT,
        env={**env, "AUTOTUNE_WORKER_LOG_LEVEL": "ERROR"},
        stdout=log,
        stderr=log,
    )
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"the service exited: {(tmp / 'service.log').read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.3)
    proc.kill()
    sys.exit("the service did not answer /health within 90 s")


async def _get(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: str) -> int:
    """One keep-alive HTTP/1.1 GET on an open connection; returns the status code.

    A load generator should spend as little CPU as it can on the box it measures (wrk-style):
    a general-purpose client costs more per request than the service does.
    """
    writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    length = next(
        int(line.split(":", 1)[1]) for line in lines if line.lower().startswith("content-length:")
    )
    await reader.readexactly(length)
    return int(lines[0].split()[1])


async def _post(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: str, body: bytes
) -> int:
    """One HTTP/1.1 POST of a JSON body on an open connection; returns the status code."""
    writer.write(
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    length = next(
        int(line.split(":", 1)[1]) for line in lines if line.lower().startswith("content-length:")
    )
    await reader.readexactly(length)
    return int(lines[0].split()[1])


def _burst_spec(i: int) -> bytes:
    """A valid study (so each submit parses, checks and writes the queue) that stays queued
    behind the first: sleepy probes, one device."""
    spec = {
        "name": f"burst-{i:04d}",
        "workload": "autotune.testing.workloads:sleepy",
        "budget": "30s",
        "space": {"precisions": ["fp32"], "batch_sizes": [16]},
        "probe": {"warmup_steps": 1, "steps": 6, "check_every": 6, "time_limit": "8s"},
    }
    return json.dumps(spec).encode()


async def _burst(url: str, submits: int) -> dict[str, Any]:
    """``submits`` POSTs at once, each on its own connection, while /health is timed."""
    port = int(url.rsplit(":", 1)[1])
    statuses: list[int | str] = []
    health: list[float] = []
    done = asyncio.Event()
    connections = [await asyncio.open_connection("127.0.0.1", port) for _ in range(submits)]
    go = asyncio.Event()

    async def submit(i: int) -> None:
        reader, writer = connections[i]
        await go.wait()
        try:
            statuses.append(await _post(reader, writer, "/studies", _burst_spec(i)))
        except (OSError, asyncio.IncompleteReadError, ValueError, StopIteration) as exc:
            statuses.append(type(exc).__name__)
        finally:
            writer.close()

    async def watch() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        await go.wait()
        try:
            while not done.is_set():
                t0 = time.perf_counter()
                status = await _get(reader, writer, "/health")
                health.append(time.perf_counter() - t0)
                if status != 200:
                    statuses.append(f"health HTTP {status}")
        finally:
            writer.close()

    watcher = asyncio.create_task(watch())
    tasks = [asyncio.create_task(submit(i)) for i in range(submits)]
    await asyncio.sleep(0.2)  # every connection open and waiting: then all at once
    t0 = time.perf_counter()
    go.set()
    await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    done.set()
    await watcher
    ordered = sorted(health)
    return {
        "submits": submits,
        "seconds": wall,
        "created": sum(s == 201 for s in statuses),
        "other": sorted({str(s) for s in statuses if s != 201}),
        "health_requests": len(health),
        "health_max": ordered[-1],
        "health_p95": ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))],
        "health_p50": ordered[len(ordered) // 2],
    }


def _submits(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="autotune-burst-") as tmp_name:
        proc, url = _start_service(Path(tmp_name))
        try:
            figures = asyncio.run(_burst(url, args.submits))
        finally:
            proc.terminate()
            proc.wait(60)
    return figures


async def _poll(
    url: str, name: str, clients: int, seconds: float, interval: float
) -> dict[str, Any]:
    port = int(url.rsplit(":", 1)[1])
    latencies: list[float] = []
    errors: list[str] = []
    end = time.perf_counter() + seconds

    async def client(i: int) -> None:
        paths = (f"/studies/{name}", "/studies")
        k = i
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        # Spread the clients' first requests over one interval, as independent pollers are.
        await asyncio.sleep(interval * i / clients)
        try:
            while time.perf_counter() < end:
                t0 = time.perf_counter()
                try:
                    status = await _get(reader, writer, paths[k % 2])
                    if status != 200:
                        errors.append(f"HTTP {status}")
                except (OSError, asyncio.IncompleteReadError, ValueError, StopIteration) as exc:
                    errors.append(type(exc).__name__)
                    writer.close()
                    reader, writer = await asyncio.open_connection("127.0.0.1", port)
                latencies.append(time.perf_counter() - t0)
                k += 1
                if interval:
                    await asyncio.sleep(interval)
        finally:
            writer.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(clients)))
    wall = time.perf_counter() - t0
    latencies.sort()
    pick = lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))]  # noqa: E731
    return {
        "clients": clients,
        "interval": interval,
        "seconds": wall,
        "requests": len(latencies),
        "requests_per_second": len(latencies) / wall,
        "p50": pick(0.50),
        "p99": pick(0.99),
        "errors": len(errors),
        "error_kinds": sorted(set(errors)),
    }


def _load(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="autotune-load-") as tmp_name:
        tmp = Path(tmp_name)
        proc, url = _start_service(tmp)
        try:
            # A study long enough to be running throughout the polling.
            spec = {
                "name": "load",
                "workload": "autotune.testing.workloads:sleepy",
                "budget": f"{args.seconds + 60:g}s",
                "space": {"precisions": ["fp32"], "batch_size": {"min": 16, "max": 64}},
                "probe": {"warmup_steps": 1, "steps": 12, "check_every": 6, "time_limit": "8s"},
            }
            httpx.post(f"{url}/studies", json=spec, timeout=10).raise_for_status()
            while httpx.get(f"{url}/studies/load", timeout=10).json()["state"] != "running":
                time.sleep(0.2)
            figures = asyncio.run(_poll(url, "load", args.clients, args.seconds, args.interval))
            state = httpx.get(f"{url}/studies/load", timeout=10).json()
            figures["study_state_after"] = state["state"]
            figures["study_trials_after"] = state["progress"]["trials"]
            httpx.post(f"{url}/studies/load/cancel", timeout=10)
        finally:
            proc.terminate()
            proc.wait(60)
        figures["trial_overhead"] = _trial_overhead(f"sqlite:///{tmp / 's.db'}")
    return figures


def _trial_overhead(storage: str) -> dict[str, Any]:
    """Per trial in the service: the trial's wall time minus its probe's, i.e. sampling, the
    device gate, storage writes and the worker round trip (measured under the polling load)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    trials = optuna.load_study(study_name="load", storage=storage).get_trials(
        states=(optuna.trial.TrialState.COMPLETE,)
    )
    extra = [
        (t.datetime_complete - t.datetime_start).total_seconds() - t.user_attrs["probe_seconds"]
        for t in trials
        if t.datetime_complete
        and "probe_seconds" in t.user_attrs
        and "duplicate_of" not in t.user_attrs
    ]
    if not extra:
        return {"trials": 0}
    return {"trials": len(extra), "mean": statistics.mean(extra), "max": max(extra)}


def _overhead(probes: int) -> dict[str, Any]:
    from loguru import logger

    from autotune.execution.probe_worker import ProbeWorker
    from autotune.schema.spec import Candidate, ProbeSettings

    logger.remove()
    cand = Candidate(precision="fp32", batch_size=32, learning_rate=0.05)
    settings = ProbeSettings(warmup_steps=0, steps=1, check_every=1, time_limit=30)
    t0 = time.perf_counter()
    worker = ProbeWorker("cpu")
    worker.start()
    startup = time.perf_counter() - t0
    try:
        # The first probe loads the workload into the worker: a once-per-worker cost.
        t0 = time.perf_counter()
        worker.run("tiny_mlp", cand, settings, timeout=60)
        first = time.perf_counter() - t0
        overheads, walls = [], []
        for _ in range(probes):
            t0 = time.perf_counter()
            result = worker.run("tiny_mlp", cand, settings, timeout=60)
            wall = time.perf_counter() - t0
            if result.outcome != "completed":
                sys.exit(
                    f"a probe did not complete, so the overhead means nothing: {result.summary()}"
                )
            overheads.append(wall - result.wall_seconds)
            walls.append(wall)
    finally:
        worker.close()
    return {
        "worker_startup_seconds": startup,
        "first_probe_seconds": first,
        "probes": probes,
        "overhead_mean": statistics.mean(overheads),
        "overhead_p50": statistics.median(overheads),
        "overhead_max": max(overheads),
        "run_wall_mean": statistics.mean(walls),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse(argv)
    if args.submits:
        print(f"{args.submits} submits at once while /health is timed back to back ...")
        burst = _submits(args)
        met = burst["health_max"] <= HEALTH_GOAL
        print(
            f"/health under {burst['submits']} submits  max {burst['health_max'] * 1e3:.0f} ms, "
            f"p95 {burst['health_p95'] * 1e3:.0f} ms, p50 {burst['health_p50'] * 1e3:.0f} ms "
            f"over {burst['health_requests']} requests   goal max <= {HEALTH_GOAL:g} s  "
            f"{'met' if met else 'MISSED'}"
        )
        print(
            f"  submits: {burst['created']} created in {burst['seconds']:.1f}s"
            + (f"; other answers: {', '.join(burst['other'])}" if burst["other"] else "")
        )
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"burst": burst}, indent=2) + "\n")
        return {"burst": burst}
    every = f"every {args.interval:g}s" if args.interval else "back to back"
    print(
        f"{args.clients} clients polling a running study {every} for {args.seconds:g}s on "
        "loopback ..."
    )
    load = _load(args)
    print(
        f"status under load  {load['requests_per_second']:.0f} requests/s "
        f"({load['requests']} in {load['seconds']:.1f}s), p50 {load['p50'] * 1e3:.1f} ms, "
        f"p99 {load['p99'] * 1e3:.1f} ms, {load['errors']} errors   "
        f"goal p99 < {P99_GOAL * 1e3:.0f} ms, 0 errors  "
        f"{'met' if load['p99'] < P99_GOAL and not load['errors'] else 'MISSED'}"
    )
    if load["errors"]:
        print(f"  errors: {', '.join(load['error_kinds'])}")
    print(f"  the study was {load['study_state_after']} after, trials {load['study_trials_after']}")
    t = load["trial_overhead"]
    if t["trials"]:
        print(
            f"  bookkeeping per trial in the service (trial wall - probe wall, under this load): "
            f"{t['mean']:.3f} s mean, {t['max']:.3f} s max over {t['trials']} trials"
        )
    over = _overhead(args.probes)
    print(
        f"per-trial overhead {over['overhead_mean']:.3f} s mean, {over['overhead_p50']:.3f} s "
        f"p50, {over['overhead_max']:.3f} s max over {over['probes']} one-step probes   "
        f"goal < {OVERHEAD_GOAL:g} s  {'met' if over['overhead_mean'] < OVERHEAD_GOAL else 'MISSED'}"
    )
    print(
        f"  once per worker: start {over['worker_startup_seconds']:.2f} s, first probe (loads "
        f"the workload) {over['first_probe_seconds']:.2f} s"
    )
    report = {"load": load, "overhead": over}
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"figures written to {args.json}")
    return report


if __name__ == "__main__":
    main()
