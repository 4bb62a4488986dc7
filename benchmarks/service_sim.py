"""The tuning service at scale, simulated: a box of 8 GPUs, 50 studies from 10 users.

The service's real queue, scheduler and search (:func:`autotune.sim.run_box`) run over simulated
GPUs (a shipped landscape, ``h100-resnet18`` by default) on one event clock, so a day of the box
takes minutes of real time. The scenario, fixed by ``--seed``:

- 50 studies from 10 users (``u0``..``u9``) arrive as a Poisson stream over ``--hours`` (a
  quarter of an hour by default: a morning rush, more work than 8 GPUs take at once), each with a budget
  drawn from 5, 10, 20 and 30 minutes;
- every tenth study is urgent (priority 10: it pre-empts a running study at its next trial when
  no GPU is free); 3 studies are cancelled by their owners: one while it waits, two 2 minutes
  after they were submitted (running by then, or still queued);
- the worker on ``cuda:3`` dies during its 40th probe (a crash the study must survive).

It prints: the simulated span, each GPU's utilisation (its share of the span held by a study,
and spent running probes; the rest of a held GPU's time is the tuner's own work between
probes: asking, telling, storing), the queue wait by user (median and longest, submission to first start), the studies by
final state, pre-emptions (studies that ran more than once) and any trial a study lost (a trial
its search started that the storage does not hold finished): the service's promise is none.

    python benchmarks/service_sim.py                   # the scenario above
    python benchmarks/service_sim.py --studies 12 --gpus 2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from autotune.sim import Arrival, run_box  # noqa: E402

BUDGETS = (300.0, 600.0, 1200.0, 1800.0)


def scenario(studies: int, users: int, hours: float, seed: int) -> list[Arrival]:
    """The arrivals: Poisson over ``hours``, budgets from BUDGETS, every tenth urgent, three
    cancels (the 5th study a second after it arrives, the 17th and 33rd 2 minutes after)."""
    rng = random.Random(seed)
    rate = studies / (hours * 3600)
    at, out = 0.0, []
    for i in range(studies):
        budget = rng.choice(BUDGETS)
        cancel = None
        if i in (4,):
            cancel = 1.0  # straight after submitting: still queued on a busy box
        elif i in (16, 32):
            cancel = 120.0
        out.append(
            Arrival(
                at=round(at, 1),
                user=f"u{rng.randrange(users)}",
                name=f"study-{i:02d}",
                budget=budget,
                priority=10 if i % 10 == 9 else 0,
                cancel_after=cancel,
            )
        )
        at += rng.expovariate(rate)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--studies", type=int, default=50)
    ap.add_argument("--users", type=int, default=10)
    ap.add_argument("--hours", type=float, default=0.25, help="arrivals spread over this long")
    ap.add_argument("--landscape", default="h100-resnet18")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="also write the report here")
    args = ap.parse_args(argv)

    from loguru import logger

    logger.remove()
    logger.add(sys.stderr, level="ERROR")
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)

    arrivals = scenario(args.studies, args.users, args.hours, args.seed)
    crash = {3: frozenset({40})} if args.gpus > 3 else {0: frozenset({40})}
    t0 = time.perf_counter()
    report = run_box(arrivals, args.landscape, devices=args.gpus, seed=args.seed, crashes=crash)
    wall = time.perf_counter() - t0

    print(
        f"{args.studies} studies from {args.users} users on {args.gpus} simulated GPUs "
        f"({args.landscape}), arrivals over {args.hours:g} h, seed {args.seed}"
    )
    print(f"simulated span: {report.seconds / 3600:.2f} h, in {wall:.0f} s of real time")
    for what, use in (("held by a study", report.held), ("probing", report.utilisation)):
        print(
            f"GPU time {what}: "
            + ", ".join(f"{d} {u:.0%}" for d, u in use.items())
            + f"; mean {sum(use.values()) / len(use):.0%}"
        )
    print("queue wait by user (submission to first start): median / longest")
    for user, (med, top) in report.waits_by_user().items():
        print(f"  {user:4s} {med / 60:6.1f} min / {top / 60:6.1f} min")
    states: dict[str, int] = {}
    for s in report.studies:
        states[s.state] = states.get(s.state, 0) + 1
    print("studies: " + ", ".join(f"{n} {k}" for k, n in sorted(states.items())))
    resumed = [s.name for s in report.studies if s.runs > 1]
    print(f"ran more than once (pre-empted, then resumed): {len(resumed)} {resumed}")
    print(f"worker crashes (injected) survived: {report.crashes}")
    trials = sum(s.trials for s in report.studies)
    lost = report.lost()
    print(f"trials stored: {trials}; lost: {len(lost)}" + (f" {lost[:5]}" if lost else ""))
    if args.json:
        args.json.write_text(json.dumps({**report.to_json(), "wall_seconds": wall}, indent=1))
    return 1 if lost else 0


if __name__ == "__main__":
    raise SystemExit(main())
