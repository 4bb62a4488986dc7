"""How the strategies of ``search_sim.py`` compare: each figure averaged over the landscapes,
the strategies ranked, and the comparison's lines."""

from __future__ import annotations

import statistics
from typing import Any

# The figures the strategies are compared by, averaged over the landscapes.
COMPARED = (
    "median_share_of_optimum",
    "p10_share_of_optimum",
    "missed_win_rate",
    "false_claim_rate",
    "unsafe_rate",
    "fallback_rate",
)


def averages(
    entries: dict[str, Any], names: list[str], shares: list[float], checks: list[dict]
) -> dict[str, dict[str, Any]]:
    """Per share, each compared figure's mean over the landscapes, and how many of ``checks``
    (the goals, per landscape and share) are met there."""
    out = {}
    for share in shares:
        figures: dict[str, Any] = {
            k: statistics.fmean(entries[n][str(share)][k] for n in names) for k in COMPARED
        }
        these = [c for c in checks if abs(c["share"] - share) < 1e-9]
        figures["goals_met"] = sum(c["met"] for c in these)
        figures["goals"] = len(these)
        figures["landscapes"] = len(names)
        out[str(share)] = figures
    return out


def ranked(strategies: dict[str, Any], share: float) -> list[str]:
    """The strategies at ``share``, best first: by the mean median share of the optimum, then
    the mean p10, then the fewer missed wins and false claims."""
    key = str(share)

    def score(name: str) -> tuple[float, ...]:
        a = strategies[name]["averages"][key]
        return (
            round(a["median_share_of_optimum"], 6),
            round(a["p10_share_of_optimum"], 6),
            -a["missed_win_rate"],
            -a["false_claim_rate"],
        )

    return sorted(strategies, key=score, reverse=True)


def comparison(strategies: dict[str, Any], shares: list[float]) -> str:
    """Per share, one line per strategy (its averages, the difference to the first strategy
    listed) and which won."""
    first = next(iter(strategies))
    width = max(len(n) for n in strategies)
    lines = []
    for share in shares:
        key = str(share)
        base = strategies[first]["averages"][key]
        for name, st in strategies.items():
            a = st["averages"][key]
            line = (
                f"  {share:>4.0%}  {name:<{width}}  median {a['median_share_of_optimum']:6.1%}  "
                f"p10 {a['p10_share_of_optimum']:6.1%}  missed {a['missed_win_rate']:5.1%}  "
                f"false {a['false_claim_rate']:5.1%}  unsafe {a['unsafe_rate']:5.1%}  "
                f"fallback {a['fallback_rate']:4.0%}  goals {a['goals_met']}/{a['goals']}"
            )
            if name != first:
                dm = a["median_share_of_optimum"] - base["median_share_of_optimum"]
                dp = a["p10_share_of_optimum"] - base["p10_share_of_optimum"]
                line += f"  (vs {first}: median {dm * 100:+.1f} pts, p10 {dp * 100:+.1f} pts)"
            lines.append(line)
        order = ranked(strategies, share)
        best = strategies[order[0]]["averages"][key]
        if len(order) > 1:
            runner_up = strategies[order[1]]["averages"][key]
            dm = best["median_share_of_optimum"] - runner_up["median_share_of_optimum"]
            dp = best["p10_share_of_optimum"] - runner_up["p10_share_of_optimum"]
            if abs(dm) < 5e-4 and abs(dp) < 5e-4:
                lines.append(
                    f"  {share:>4.0%}  best: none: {order[0]} and {order[1]} tie on the median "
                    "and the p10 (to 0.1 pts)"
                )
            else:
                lines.append(
                    f"  {share:>4.0%}  best: {order[0]} (median {dm * 100:+.1f} pts, p10 "
                    f"{dp * 100:+.1f} pts over {order[1]}, the next)"
                )
    return "\n".join(lines)
