"""The report of ``torch-kv-tier shared-stress`` (``shared_stress``): the totals over the
processes, the checks of the invariants on them, and the text table. No I/O: ``check_*``
append what is broken to ``problems`` (``check_faults`` also replaces each process's failed-call
spans with how many were unexplained).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from torch_kv_tier.benchmarks.shared_stress_faults import Freezer, unexplained_calls
from torch_kv_tier.benchmarks.shared_stress_worker import SUMMED, Params


def check_faults(
    freezers: list[Freezer],
    counts: dict[tuple[str, int], dict[str, Any]],
    slack_s: float,
    problems: list[str],
) -> None:
    """Every planned freeze done; every call failed with a fault's reason explained by a freeze
    of the host or of its own process (module docstring). Drops the calls' spans from
    ``counts`` (each keeps how many were unexplained)."""
    done = [f for freezer in freezers for f in freezer.done]
    for freezer in freezers:
        problems.extend(freezer.problems)
        if freezer.skipped:
            problems.append(f"{freezer.skipped} planned freezes could not start in time")
    host = [f for f in done if f.target == "host"]
    for (role, index), c in counts.items():
        own = [f for f in done if f.target == f"{role}-{index}"]
        bad = unexplained_calls(c.pop("fault_calls"), host + own, slack_s)
        c["unexplained"] = len(bad)
        for t0, t1, why in bad[:3]:
            problems.append(
                f"{role}-{index}: a call failed with {why!r} and overlapped no freeze of the "
                f"host or of itself ({t1 - t0:.2f} s long)"
            )


def check_totals(totals: dict[str, Any], params: Params, faults: bool, problems: list[str]) -> None:
    """The invariants on the totals (``shared_stress``'s docstring); each broken one is a
    problem."""
    if totals["wrong"] != totals["injected"]:
        problems.append(f"{totals['wrong'] - totals['injected']} WRONG blocks loaded")
    if params.self_check and totals["injected"] == 0:
        problems.append("self-check: no block was corrupted (no reader loaded anything)")
    if totals["other"]:
        problems.append(f"keys failed for other reasons than the legitimate: {totals['other']}")
    if totals["fault_failed"] and not faults:
        problems.append(
            f"keys failed with a fault's reason in a run without faults: {totals['failures']}"
        )
    if totals["rejected_wrong"] != totals["rejected"]:
        problems.append(
            f"{totals['rejected'] - totals['rejected_wrong']} blocks were rejected by "
            "verification although they held their key's bytes (false rejections)"
        )
    if totals["verified"] == 0:
        problems.append("no loaded block was verified")


def check_held(host: dict[str, Any], totals: dict[str, Any], problems: list[str]) -> None:
    """Fencing must not leak: once every tier closed, the host may still hold only the ended
    sessions whose writes a tier's transport never reported (``unreleased_sessions``); every
    other ended session was released by its tier (``totals["held_leaked"]``)."""
    leaked = max(0, host.get("held_sessions", 0) - totals["unreleased_sessions"])
    totals["held_leaked"] = leaked
    if leaked:
        problems.append(
            f"HELD LEAK: after every tier closed the host still holds {host['held_sessions']} "
            f"ended sessions ({host.get('held_blocks')} slots) while the tiers report "
            f"{totals['unreleased_sessions']} unreleased: their slots never go back to the pool"
        )


def totals_of(counts: list[dict[str, Any]]) -> dict[str, Any]:
    """The processes' counts added up (the longest waits: the maximum)."""
    totals: dict[str, Any] = {name: sum(c[name] for c in counts) for name in SUMMED}
    for name in ("failures", "other"):
        merged: Counter[str] = Counter()
        for c in counts:
            merged.update(c[name])
        totals[name] = dict(merged)
    for name in ("peer_wait_max_s", "max_call_s"):
        totals[name] = max((c[name] for c in counts), default=0.0)
    totals["unexplained"] = sum(c.get("unexplained", 0) for c in counts)
    totals["unreleased_sessions"] = sum(c["unreleased_sessions"] for c in counts)
    totals["held_leaked"] = 0  # check_held
    return totals


def render(report: dict[str, Any]) -> str:
    """The report as a fixed-width table (one row per process, then the totals), the faults
    done and the problems."""
    cols = [name for name in SUMMED if name != "injected"]
    rows: list[tuple[str, ...]] = [("process", *cols, "failures", "other")]
    for c in [*report["processes"], {"role": "total", **report["totals"]}]:
        name = f"{c['role']}-{c['index']}" if "index" in c else "total"
        cells = (f"{c[n]:,}" for n in cols)
        rows.append((name, *cells, str(c["failures"] or "-"), str(c["other"] or "-")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    p, host, t, f = report["params"], report["server"], report["totals"], report["faults"]
    lines.append(
        f"{p['writers']} writers + {p['readers']} readers for {report['seconds']:.1f} s: "
        f"{p['keys']:,} keys of {p['block_len']:,} B over {p['slots']:,} slots "
        f"(max grant {p['max_grant']}{', UCX over TCP' if p['tcp'] else ''}); host evictions "
        f"{host.get('shared_evictions', '?'):,}, stored at the end "
        f"{host.get('shared_stored_blocks', '?')}; held at the end: {host.get('held_blocks', '?')} "
        f"slots of {host.get('held_sessions', '?')} ended sessions ({t['held_leaked']} of them "
        f"not explained by a tier's unreleased session)"
    )
    for name, what in (("writers", "host --lease-timeout"), ("host", "tiers' heartbeat timeout")):
        s = f[name]
        lines.append(
            f"{name} freezes: {s['done']} of {s['planned']} planned ({s['long']} longer than the "
            f"{what} {s['timeout_s']:g} s; longest {s['longest_s']:.2f} s)"
        )
    lines.append(
        f"peer waits: {t['peer_waits']:,} (longest {t['peer_wait_max_s']:.2f} s); slowest "
        f"future {t['max_call_s']:.2f} s; calls failed by a fault and overlapping no freeze: "
        f"{t['unexplained']}"
    )
    if t["injected"]:
        lines.append(f"self-check: {t['injected']} blocks corrupted on purpose, {t['wrong']} wrong")
    for c in report["processes"]:
        lines += [f"{c['role']}-{c['index']}: {s}" for s in c["wrong_samples"]]
    lines += report["problems"]
    lines.append("ok" if report["ok"] else "FAILED")
    return "\n".join(lines)
