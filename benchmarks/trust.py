"""Does a claimed speedup survive a full training run? Searches, then full runs, side by side.

For each study and seed:

1. ``autotune search`` (in a worker, its own storage) emits a config with a claimed speedup
   and its interval, or falls back to fp32;
2. a full-length ``autotune train --compare fp32`` with that config — the tuned run and the
   fp32 baseline interleaved block by block (paired), on the same samples — measures the real
   speedup and the final losses; after a fallback (the config *is* fp32, so that run would
   measure nothing), the full run trains instead the fastest candidate the search measured to
   the end at other settings, the one it passed over (off parity at the probe's horizon, or
   refused in validation): a win the fallback missed runs >= 1.10x faster there, keeping parity;
3. with ``--unpaired``, the same two runs one after the other as well: what a measurement
   without pairing would have said.

It prints per run and in total: the claimed speedup (interval), the full run's speedup,
``|claimed/measured - 1|``, whether parity held in the full run (final loss within the
tolerance of fp32's, plus the seed band: how far fp32's own final loss moves when fp32 is
trained once more with another seed — on tiny fp32's final loss moves 2-17%, more than the
tolerance, so a verdict without it is mostly the seed's), the fallback rate, false claims
(claimed >= 1.05x, measured <= 1.0x), whether repeated searches agree on the winner, and the
fallbacks that missed a real win.
``--neighbour`` runs a bursty CPU-bound process beside everything (on for a few seconds, off for
a few), the noise a shared machine has.

Goals: median |claimed/measured - 1| <= 10%; no false claims; the full run keeps parity; the fp32
fallback only where no candidate beats fp32 by 5%; repeated searches agree.

    python benchmarks/trust.py [--studies tiny,tiny-gpt | all] [--seeds 1,2,3] [--epochs 2]
        [--budget-scale 1.0] [--device auto] [--neighbour] [--unpaired] [--json out.json]
        [--markdown out.md] [--peers all|hf-bf16,pl-scale,...]

``--peers`` also trains, in full beside fp32 and paired as the search's config is, what users
pick instead (``_trust_peers.py``: the AMP recipe, bf16 at the workload's batch, Lightning's
batch scaling with the lr kept and with the lr rule, the search's fastest probe with parity
ignored), and counts the runs where the search's full-run figure is at least the best peer
that kept parity, less 2%.

``--budget-scale`` multiplies each study's search budget (tiny 60 s, tiny-gpt 120 s).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from optuna.trial import FrozenTrial, TrialState

from autotune.infra.devices import resolve_device
from autotune.schema.spec import Candidate, load_spec
from autotune.search import run_search
from autotune.study.trials import candidate, record
from autotune.train import TrainSettings, baseline_candidate, compare, train
from autotune.workloads import load_workload

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the _trust_peers helper beside it

import _trust_peers  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# The studies it knows (``--studies all``: every one), by the spec each searches with: the
# built-in workloads, a user's own workload function (the mypkg MLP) and the Lightning and
# Hugging Face examples (the integrations extra).
SPECS = {
    "tiny": "studies/tiny.yaml",
    "tiny-gpt": "studies/tiny-gpt.yaml",
    "resnet18": "studies/resnet18.yaml",
    "mypkg": "studies/mypkg.yaml",
    "lightning": "examples/lightning/tune.yaml",
    "hf": "examples/huggingface/tune.yaml",
}
# Per study: the budget a user would give a first search of it on a CPU.
BUDGETS = {"tiny": 60.0, "tiny-gpt": 120.0, "resnet18": 180.0, "lightning": 90.0, "hf": 90.0}
# Where each study's workload imports from: the examples as ``examples.<name>`` from the
# repository's root, the user's package ``mypkg`` from its folder (as docs/own-model.md runs it;
# not for the others: examples/lightning there would hide the lightning library).
PATHS = {"mypkg": ROOT / "examples"}
# A fallback missed a real win when the candidate it passed over runs this much faster in full.
REAL_WIN = 1.10


@contextlib.contextmanager
def _importable(study: str) -> Iterator[None]:
    """The study's workload importable here and in the probe worker its search starts."""
    folder = str(PATHS.get(study, ROOT))
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (folder, before) if p)
    sys.path.insert(0, folder)
    try:
        yield
    finally:
        sys.path.remove(folder)
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before


def _burn(on: float, off: float) -> None:
    """A neighbour: busy for ``on`` seconds, idle for ``off``, forever."""
    while True:
        end = time.monotonic() + on
        x = 0
        while time.monotonic() < end:
            x += 1
        time.sleep(off)


def one_run(study: str, seed: int, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    spec = load_spec(ROOT / SPECS[study]).with_overrides(
        {
            "name": f"trust-{study}-{seed}",
            "seed": seed,
            "device": args.device,
            "budget": BUDGETS.get(study, 60.0) * args.budget_scale,
            "storage": f"sqlite:///{tmp / f'{study}-{seed}.db'}",
            "probe.seed": seed,
            # The full run's length, so the search judges parity for the run it is checked by.
            "run": {"samples": args.epochs * TrainSettings().samples_per_epoch},
        }
    )
    t0 = time.monotonic()
    result = run_search(spec, out_dir=tmp / f"{study}-{seed}")
    search_seconds = time.monotonic() - t0
    cfg = result.config
    assert cfg is not None, "the search wrote no config"
    ev = cfg.evidence
    workload = load_workload(cfg.workload)
    settings = TrainSettings(epochs=args.epochs, seed=seed)
    row: dict[str, Any] = {
        "study": study,
        "seed": seed,
        "search_seconds": round(search_seconds, 1),
        "budget": spec.budget,
        "winner": f"{cfg.precision} bs={cfg.batch_size} lr={cfg.learning_rate:.3g}",
        "mode": cfg.precision,
        "batch_size": cfg.batch_size,
        "validated": ev.validated,
        "claimed": ev.speedup,
        "claimed_low": ev.speedup_low,
        "claimed_high": ev.speedup_high,
        "parity_tolerance": spec.parity_tolerance,
    }
    if not ev.validated:
        # Nothing claimed, nothing to check the claim against; parity is the reference's own.
        row.update(dict.fromkeys(("measured", "measured_low", "measured_high", "error")))
        row.update(dict.fromkeys(("tuned_loss", "fp32_loss", "loss_ratio", "accuracy_delta")))
        row.update(parity_held=None, false_claim=False, measured_in_claimed_interval=None)
        reference = (cfg.precision, cfg.batch_size)
        row.update(
            _passed_over(
                result.store.study, reference, workload, settings, args, spec.parity_tolerance
            )
        )
        return _with_peers(row, cfg, result.store.trials(), workload, settings, args)
    full = compare(workload, cfg, args.device, settings, against="fp32")
    band = _seed_band(workload, settings, args, full.baseline)
    row.update(
        seed_band=band,
        measured=full.speedup,
        measured_low=full.speedup_low,
        measured_high=full.speedup_high,
        tuned_loss=full.tuned.final_loss,
        fp32_loss=full.baseline.final_loss if full.baseline else None,
        loss_ratio=full.loss_ratio,
        accuracy_delta=full.accuracy_delta,
    )
    if args.unpaired:
        seq = compare(workload, cfg, args.device, settings, against="fp32", paired=False)
        row["unpaired"] = seq.speedup
    m, c = row["measured"], row["claimed"]
    row["error"] = abs(c / m - 1) if m and c else None
    row["parity_held"] = _held(row["loss_ratio"], spec.parity_tolerance, band)
    row["false_claim"] = bool(c and m and c >= 1.05 and m <= 1.0)
    lo, hi = row["claimed_low"], row["claimed_high"]
    row["measured_in_claimed_interval"] = (
        None if lo is None or hi is None or m is None else lo <= m <= hi
    )
    if args.unpaired and lo is not None and hi is not None and row["unpaired"]:
        row["unpaired_in_claimed_interval"] = lo <= row["unpaired"] <= hi
    return _with_peers(row, cfg, result.store.trials(), workload, settings, args)


def _with_peers(  # noqa: PLR0913 - one run's parts, from one_run alone
    row: dict[str, Any],
    cfg: Any,
    trials: list[FrozenTrial],
    workload: Any,
    settings: TrainSettings,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """With ``--peers``: each peer's pick trained in full beside fp32, as the search's config
    is, its parity judged the same way (the same seed band); and the search's own full-run
    figure beside the best peer that kept parity (the search's: its measured speedup where it
    kept parity, 0 where it did not, 1.0 where it fell back to fp32)."""
    if not args.peers:
        return row
    tolerance = row["parity_tolerance"]
    band = row.get("seed_band", row.get("passed_over_seed_band"))
    peers: dict[str, Any] = {}
    cpu = resolve_device(args.device).type == "cpu"
    names = _trust_peers.parse(args.peers, cpu=cpu)
    for name, cand in _trust_peers.picks(names, workload, cfg, trials, args.device).items():
        full = compare(workload, cand, args.device, settings, against="fp32")
        if band is None:
            band = _seed_band(workload, settings, args, full.baseline)
        peers[name] = {
            "pick": _trust_peers.describe(cand),
            "measured": full.speedup,
            "measured_low": full.speedup_low,
            "measured_high": full.speedup_high,
            "loss_ratio": full.loss_ratio,
            "accuracy_delta": full.accuracy_delta,
            "held": _held(full.loss_ratio, tolerance, band),
        }
    mine = (row["measured"] or 0.0) if row["validated"] and row["parity_held"] else 0.0
    row["search_full"] = mine if row["validated"] else 1.0
    safe = [p["measured"] for p in peers.values() if p["held"] and p["measured"]]
    row["peers"] = peers
    row["best_safe_peer"] = max(safe, default=None)
    return row


def _seed_band(
    workload: Any, settings: TrainSettings, args: argparse.Namespace, fp32: Any
) -> float | None:
    """How far fp32's final loss moves with the seed alone: the fp32 baseline trained once more
    with another seed, against the full run's fp32 arm (None where either has no loss)."""
    if fp32 is None or not fp32.final_loss:
        return None
    other_seed = settings.model_copy(update={"seed": settings.seed + 1000})
    other = train(workload, baseline_candidate(workload, "fp32"), args.device, other_seed)
    if other.final_loss is None:
        return None
    return abs(other.final_loss / fp32.final_loss - 1)


def _held(ratio: float | None, tolerance: float, band: float | None) -> bool:
    """Parity in a full run: the final loss within the tolerance of fp32's, plus the seed band."""
    return ratio is not None and ratio <= 1 + tolerance + (band or 0.0)


def _passed_over(
    study: Any,
    reference: tuple[str, int],
    workload: Any,
    settings: TrainSettings,
    args: argparse.Namespace,
    tolerance: float,
) -> dict[str, Any]:
    """After a fallback: the search's fastest fully measured candidate other than the fp32
    reference's own settings, whether the search kept it (validation refused it) or judged it
    off parity at the probe's short horizon, trained in full against fp32. A missed win: >=
    REAL_WIN faster in the full run, and its final loss within the tolerance."""
    best = max(
        _measured(study.trials, reference), key=lambda t: record(t).throughput or 0.0, default=None
    )
    if best is None:
        return {"passed_over": None, "missed_win": False}
    cand: Candidate = candidate(best)
    full = compare(workload, cand, args.device, settings, against="fp32")
    ratio = full.loss_ratio
    band = _seed_band(workload, settings, args, full.baseline)
    held = _held(ratio, tolerance, band)
    return {
        "passed_over": f"{cand.precision} bs={cand.batch_size} lr={cand.learning_rate:.3g}",
        "passed_over_measured": full.speedup,
        "passed_over_low": full.speedup_low,
        "passed_over_high": full.speedup_high,
        "passed_over_loss_ratio": ratio,
        "passed_over_seed_band": band,
        "passed_over_held": held,
        "missed_win": bool(full.speedup and full.speedup >= REAL_WIN and held),
    }


def _measured(trials: list[FrozenTrial], reference: tuple[str, int]) -> list[FrozenTrial]:
    """Search trials measured to the end (feasible or not) at other settings than the fp32
    reference's (precision, batch size)."""
    return [
        t
        for t in trials
        if t.state == TrialState.COMPLETE
        and record(t).throughput
        and not record(t).tuned_config
        and (t.params.get("precision"), t.params.get("batch_size")) != reference
    ]


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    errors = [r["error"] for r in rows if r["error"] is not None and r["validated"]]
    by_study: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_study.setdefault(r["study"], []).append(r)
    agreement = {}
    for study, runs in by_study.items():
        winners = [(r["mode"], r["batch_size"]) for r in runs]
        top = max(set(winners), key=winners.count)
        agreement[study] = {
            "winner": f"{top[0]} bs={top[1]}",
            "agree": winners.count(top) / len(runs),
        }
    out = {
        "runs": len(rows),
        "median_error": statistics.median(errors) if errors else None,
        "false_claims": sum(r["false_claim"] for r in rows),
        "fallback_rate": sum(not r["validated"] for r in rows) / len(rows) if rows else None,
        "validated": sum(bool(r["validated"]) for r in rows),
        "parity_held": sum(bool(r["parity_held"]) for r in rows),
        # The candidate a fallback passed over ran >= REAL_WIN faster in full, keeping parity.
        "fallbacks_where_a_candidate_beat_fp32": sum(bool(r.get("missed_win")) for r in rows),
        "agreement": agreement,
        "measured_in_claimed_interval": sum(
            bool(r.get("measured_in_claimed_interval")) for r in rows
        ),
        "unpaired_in_claimed_interval": sum(
            bool(r.get("unpaired_in_claimed_interval")) for r in rows
        ),
    }
    with_peers = [r for r in rows if "peers" in r]
    if with_peers:
        out["peers"] = _peer_totals(with_peers)
    return out


# The search's full-run speedup may trail the best peer that kept parity by at most this share.
BEHIND_BEST_PEER = 0.02


def _peer_totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per peer: the median full-run speedup and the runs that kept parity; and the runs where
    the search's full-run figure is at least the best safe peer's, less 2%."""
    names = sorted({n for r in rows for n in r["peers"]})
    per = {}
    for n in names:
        runs = [r["peers"][n] for r in rows if n in r["peers"]]
        speeds = [p["measured"] for p in runs if p["measured"]]
        per[n] = {
            "median_measured": statistics.median(speeds) if speeds else None,
            "held": sum(bool(p["held"]) for p in runs),
            "runs": len(runs),
        }
    level = [
        r
        for r in rows
        if r["best_safe_peer"] is None
        or r["search_full"] >= (1 - BEHIND_BEST_PEER) * r["best_safe_peer"]
    ]
    return {"per_peer": per, "search_at_best_safe_peer": len(level), "runs": len(rows)}


def _fmt(v: float | None, lo: float | None = None, hi: float | None = None) -> str:
    if v is None:
        return "—"
    text = f"{v:.2f}x"
    if lo is not None and hi is not None:
        text += f" ({lo:.2f}–{hi:.2f})"
    return text


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{v:.1%}"


def _parity(r: dict[str, Any]) -> str:
    if r["parity_held"] is None:
        return "— (the reference)"
    band = r.get("seed_band")
    return f"{'held' if r['parity_held'] else 'broken'} ({r['loss_ratio'] or 0:.3f}" + (
        f"; seed band {band:.1%})" if band is not None else ")"
    )


def _row_note(r: dict[str, Any]) -> str:
    if r["validated"]:
        return "validated" + (", FALSE CLAIM" if r["false_claim"] else "")
    if not r.get("passed_over"):
        return "fp32 fallback (nothing measured to pass over)"
    ratio = r["passed_over_loss_ratio"]
    return (
        f"fp32 fallback; passed over {r['passed_over']}: "
        f"{_fmt(r['passed_over_measured'], r.get('passed_over_low'), r.get('passed_over_high'))} in "
        f"full, loss ratio {'—' if ratio is None else f'{ratio:.3f}'}"
        + (
            f" (seed band {band:.1%})"
            if (band := r.get("passed_over_seed_band")) is not None
            else ""
        )
        + (", MISSED WIN" if r["missed_win"] else "")
    )


def markdown(rows: list[dict[str, Any]], total: dict[str, Any], note: str) -> str:
    lines = [
        f"{note}",
        "",
        "| study | seed | winner | claimed | full run | error | parity (loss ratio) | note |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['study']} | {r['seed']} | {r['winner']} | "
            f"{_fmt(r['claimed'], r['claimed_low'], r['claimed_high'])} | "
            f"{_fmt(r['measured'], r.get('measured_low'), r.get('measured_high'))} | "
            f"{_pct(r['error'])} | "
            f"{_parity(r)} | {_row_note(r)} |"
        )
    med = total["median_error"]
    lines += [
        "",
        f"median |claimed/measured - 1| (validated runs): {'—' if med is None else f'{med:.1%}'}"
        " (goal <= 10%)",
        f"false claims: {total['false_claims']} of {total['runs']} (goal 0)",
        f"full runs that kept parity: {total['parity_held']} of {total['validated']} validated",
        f"fp32 fallbacks: {total['fallback_rate']:.0%}; that missed a real win (the candidate "
        f"passed over >= {REAL_WIN:.2f}x in full, keeping parity): "
        f"{total['fallbacks_where_a_candidate_beat_fp32']}",
        "agreement between seeds: "
        + ", ".join(
            f"{s}: {a['winner']} in {a['agree']:.0%}" for s, a in total["agreement"].items()
        ),
        f"full-run speedup inside the claimed interval: {total['measured_in_claimed_interval']} of "
        f"{total['runs']}",
    ]
    if "peers" in total:
        lines += ["", *_peer_lines(rows, total["peers"])]
    if any("unpaired" in r for r in rows):
        lines.append(
            f"unpaired (sequential) speedup inside the claimed interval: "
            f"{total['unpaired_in_claimed_interval']} of {total['runs']}"
        )
    return "\n".join(lines)


def _peer_lines(rows: list[dict[str, Any]], peers: dict[str, Any]) -> list[str]:
    """The peers' table: per run, the search's full-run figure beside each peer's pick, its
    full-run speedup and whether it kept parity; then the totals."""
    names = list(peers["per_peer"])
    lines = [
        "| study | seed | search (full run) | " + " | ".join(names) + " |",
        "| --- | --- | --- | " + " | ".join("---" for _ in names) + " |",
    ]
    for r in (r for r in rows if "peers" in r):
        cells = []
        for n in names:
            p = r["peers"].get(n)
            cells.append(
                "—"
                if p is None
                else f"{p['pick']}: {_fmt(p['measured'])}, {'held' if p['held'] else 'broken'}"
            )
        lines.append(
            f"| {r['study']} | {r['seed']} | {_fmt(r['search_full'])} | " + " | ".join(cells) + " |"
        )
    lines.append("")
    for n, p in peers["per_peer"].items():
        lines.append(
            f"{n} ({_trust_peers.PEERS[n]}): median {_fmt(p['median_measured'])} in full, parity "
            f"kept in {p['held']} of {p['runs']}"
        )
    lines.append(
        f"the search at least the best peer that kept parity, less {BEHIND_BEST_PEER:.0%}: "
        f"{peers['search_at_best_safe_peer']} of {peers['runs']}"
    )
    return lines


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--studies", default="tiny,tiny-gpt", help=f"of {', '.join(SPECS)}, or all")
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--budget-scale", type=float, default=1.0)
    parser.add_argument("--neighbour", action="store_true", help="a bursty CPU-bound neighbour")
    parser.add_argument("--unpaired", action="store_true", help="also time the runs one by one")
    parser.add_argument(
        "--peers",
        default="",
        help="also train what users pick instead, each in full beside fp32: "
        f"{', '.join(_trust_peers.PEERS)}, or all",
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args(argv)
    studies = list(SPECS) if args.studies == "all" else args.studies.split(",")
    unknown = [name for name in studies if name not in SPECS]
    if unknown:
        parser.error(f"unknown study {', '.join(unknown)}; known: {', '.join(SPECS)}, or all")
    args.studies = ",".join(studies)
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse(argv)
    neighbour = None
    if args.neighbour:
        neighbour = multiprocessing.get_context("spawn").Process(
            target=_burn, args=(3.0, 3.0), daemon=True
        )
        neighbour.start()
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for study in args.studies.split(","):
                for seed in (int(s) for s in args.seeds.split(",")):
                    with _importable(study):
                        row = one_run(study, seed, args, Path(tmp))
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    finally:
        if neighbour is not None:
            neighbour.terminate()
    total = summarize(rows)
    note = (
        f"trust: {len(rows)} searches + full runs ({args.epochs} epochs), device {args.device}"
        + (", with a bursty CPU-bound neighbour" if args.neighbour else "")
    )
    text = markdown(rows, total, note)
    print(text)
    out = {"rows": rows, "total": total}
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    if args.markdown:
        args.markdown.write_text(text + "\n")
    return out


if __name__ == "__main__":
    main()
