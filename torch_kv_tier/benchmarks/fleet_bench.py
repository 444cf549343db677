"""``torch-kv-tier fleet-bench``: what a tier and a host pay as the fleet grows (issue 20).

A simulated fleet, in one process, through the real code and the real protocol frames: a
host's ``SharedService`` over its ``SharedCache``, followers' ``IndexFollower`` s feeding a
tier's ``BlockIndex``, frames encoded and decoded with ``remote.protocol`` and pushed over real
ZeroMQ sockets (a ROUTER and one DEALER per follower, TCP loopback). NIXL moves no bytes here:
nothing measured depends on it. Keys are 32 random bytes (vLLM's block hashes). Followers hold
the compact copy (``slot_maps.CompactSlots``), the one a tier uses past 2**20 slots followed;
``dict_follower_bytes_per_key`` is the dict copy below that, for comparison. Figures:

- ``follower_bytes_per_key``: the memory a tier holds per key of a host it follows
  (``tracemalloc``: the index's entries and its per-slot digests, and whatever else the join
  left), after a join of a full host: the slope between joins of ``--keys`` / 2 and ``--keys``
  keys (what each key adds); ``follower_bytes_fixed``: what a followed host costs whatever its
  keys (the intercept); ``follower_bytes_over_keys``: the whole, over ``--keys``;
- ``join_s_per_million``: a follower's join (the host's paged snapshot, encoded, decoded and
  applied), per million keys;
- ``fanout_us_per_key_per_follower``: the host's CPU (its thread's CPU time) to push
  ``Events`` for newly stored keys to F followers, per key and follower, for each F in
  ``--followers``; ``fanout_marginal_us`` is the slope over F (what one more follower costs);
  ``apply_us_per_key``: a follower's CPU to decode and apply them (per round, the median over
  its F);
- ``lookup_ns`` p50/p99: ``BlockIndex.holder`` of one key, which ``TierManager.contains``
  asks (vLLM's tier ``lookup`` asks one key at a time, on the scheduler thread), with
  ``--keys`` keys held; ``prefix_lookup_ns``: ``BlockIndex.lookup`` of a prefix of 64 keys;
- ``call_us``: median µs of the index calls a 16-key shared store (``none_stored``,
  ``publish``) and load (``locate``) make, and of one-key ``contains``, for a dict copy and a
  compact one (the median over the measured rounds of each round's median);
- ``moved_over_1_n``: the fraction of keys whose home changes when one of N hosts is added or
  removed, over 1/N, for each N in ``--hosts`` (``keys.Placement``).

Each measurement is a function of ``fleet_figures``; this module runs them and reports. A cold
round (imports, a cold allocator and caches) runs first and is reported apart (``cold``); each
figure is the median over the ``--rounds`` measured rounds after it, with their min..max; what a
round compares (the fan-out's follower counts, the dict and compact calls) runs in reverse order
every other round.
The targets are issue 20's, judged on the median, but movement on its worst fleet size (it
must hold at every N); the table says met or missed. Exit status 0 (a missed target is a
figure, not an error); 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
from collections.abc import Sequence
from typing import Any

from torch_kv_tier.benchmarks import fleet_figures
from torch_kv_tier.benchmarks.options import (
    add_output_option,
    add_preset_options,
    list_of,
    positive,
    usable_cpus,
)

# figure -> (bound, the statistic judged, what it means): the median over rounds, but movement
# must hold at every fleet size, so its worst N is judged
TARGETS = {
    "follower_bytes_per_key": (16.0, "median", "<= 16 B per key a follower holds"),
    "join_s_per_million": (1.0, "median", "join <= 1 s per million keys"),
    "fanout_marginal_us": (0.1, "median", "host fan-out <= 0.1 us per key per follower"),
    "moved_over_1_n": (1.2, "max", "a host added or removed moves <= 1.2 x 1/N of the keys"),
}
DEFAULTS: dict[str, Any] = {
    "keys": 200_000,
    "followers": [1, 4, 16, 64],
    "hosts": [4, 16, 100],
    "rounds": 5,
    "batches": 16,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``fleet-bench`` options to ``parser``."""
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    add_preset_options(
        parser,
        [
            ("--keys", positive, "keys one host holds", ""),
            ("--followers", list_of(positive), "followers per host", ""),
            ("--hosts", list_of(positive), "host counts for movement", ""),
            ("--rounds", positive, "measured rounds per figure, after a cold one", ""),
            ("--batches", positive, "Events batches of 8192 keys per fan-out round", ""),
        ],
        DEFAULTS,
    )
    add_output_option(parser, "--json", "the results")


def run(args: argparse.Namespace) -> int:
    opts = {k: (getattr(args, k, None) or v) for k, v in DEFAULTS.items()}
    problem = _refused(opts)
    if problem:
        print(f"fleet-bench: need {problem}", file=sys.stderr)
        return 2
    rounds = range(opts["rounds"] + 1)  # round 0 is the cold one
    figures: dict[str, Any] = {}
    half, whole = opts["keys"] // 2, opts["keys"]
    held = [
        (fleet_figures.follower_bytes(half), fleet_figures.follower_bytes(whole)) for _ in rounds
    ]
    slopes = [(b - a) / (whole - half) for a, b in held]
    figures["follower_bytes_per_key"] = _rounds(slopes)
    figures["follower_bytes_fixed"] = _rounds([b - k * whole for (_, b), k in zip(held, slopes)])
    figures["follower_bytes_over_keys"] = _rounds([b / whole for _, b in held])
    dict_held = [fleet_figures.follower_bytes(whole, compact=False) / whole for _ in rounds]
    figures["dict_follower_bytes_per_key"] = _rounds(dict_held)
    figures["join_s_per_million"] = _rounds(
        [fleet_figures.join_s(opts["keys"]) * 1e6 / opts["keys"] for _ in rounds]
    )
    per_f: dict[int, list[float]] = {f: [] for f in opts["followers"]}
    applies: list[float] = []  # per round, the median over its follower counts
    for r in rounds:  # interleaved: every F in each round, the order reversed every other
        round_applies = []
        for f in opts["followers"] if r % 2 == 0 else opts["followers"][::-1]:
            host_us, apply_us = fleet_figures.fanout_us(f, opts["batches"])
            per_f[f].append(host_us)
            round_applies.append(apply_us)
        applies.append(statistics.median(round_applies))
    figures["fanout_us_per_key_per_follower"] = {f: _rounds(v) for f, v in per_f.items()}
    figures["fanout_marginal_us"] = _rounds(_slopes(per_f))
    figures["apply_us_per_key"] = _rounds(applies)
    lookups, prefixes = fleet_figures.lookup_ns(opts["keys"])
    figures["lookup_ns"] = {"p50": _pct(lookups, 50), "p99": _pct(lookups, 99)}
    figures["prefix_lookup_ns"] = {"p50": _pct(prefixes, 50), "p99": _pct(prefixes, 99)}
    forms = (("dict", False), ("compact", True))
    per_form: dict[str, list[dict[str, float]]] = {form: [] for form, _ in forms}
    for r in rounds:  # interleaved as the fan-out is
        for form, compact in forms if r % 2 == 0 else forms[::-1]:
            per_form[form].append(fleet_figures.call_us(opts["keys"], compact))
    figures["call_us"] = {  # the cold round's calls left out
        form: {name: statistics.median(c[name] for c in calls[1:]) for name in calls[0]}
        for form, calls in per_form.items()
    }
    movement = {n: fleet_figures.moved_over_1_n(n, opts["keys"]) for n in opts["hosts"]}
    figures["moved_over_1_n_by_hosts"] = movement
    figures["moved_over_1_n"] = _summary([max(v) for v in movement.values()])
    result = {
        "machine": {"cpus": usable_cpus(), "python": platform.python_version()},
        "options": opts,
        "figures": figures,
        "targets": {
            name: {
                "bound": bound,
                "statistic": stat,
                "value": figures[name][stat],
                "median": figures[name]["median"],
                "met": figures[name][stat] <= bound,
                "what": what,
            }
            for name, (bound, stat, what) in TARGETS.items()
        },
    }
    print(_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def _refused(opts: dict[str, Any]) -> str:
    """What ``opts`` lacks for every figure to be measured, or ``""``."""
    if opts["keys"] <= fleet_figures.PREFIX_KEYS:
        return f"--keys > {fleet_figures.PREFIX_KEYS} (the prefix lookup times stored prefixes)"
    if min(opts["followers"]) < 1 or min(opts["hosts"]) < 2:
        return "--followers >= 1 and --hosts >= 2"
    if any(len(set(counts)) < len(counts) for counts in (opts["followers"], opts["hosts"])):
        return "each follower count and host count once"
    return ""


# -- report -------------------------------------------------------------------------------------


def _summary(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _rounds(values: Sequence[float]) -> dict[str, float]:
    """The summary of a figure's rounds, the first of which is the cold round: the median and
    min..max of the measured ones, and ``cold`` apart."""
    return {**_summary(values[1:]), "cold": values[0]}


def _pct(values: list[float], q: float) -> float:
    """The ``q``-th percentile by nearest rank: the smallest value at least ``q`` % of the
    samples are at or below (p99 of 100 samples is the 99th smallest, not the largest)."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered), math.ceil(len(ordered) * q / 100)) - 1)]


def _slopes(per_f: dict[int, list[float]]) -> list[float]:
    """Per round: the host's extra CPU per key for each follower past the first (least
    squares over F of total cost per key, F x per-key-per-follower)."""
    fs = sorted(per_f)
    if len(fs) < 2:
        return [per_f[fs[0]][r] for r in range(len(per_f[fs[0]]))]
    out = []
    for r in range(len(per_f[fs[0]])):
        ys = [f * per_f[f][r] for f in fs]
        mean_f, mean_y = statistics.fmean(fs), statistics.fmean(ys)
        num = sum((f - mean_f) * (y - mean_y) for f, y in zip(fs, ys))
        out.append(num / sum((f - mean_f) ** 2 for f in fs))
    return out


def _table(result: dict[str, Any]) -> str:
    fig = result["figures"]
    rng = lambda s, fmt: (  # noqa: E731
        f"{s['median']:{fmt}} ({s['min']:{fmt}}..{s['max']:{fmt}}; cold {s['cold']:{fmt}})"
    )
    lines = [
        f"fleet-bench: {result['options']['keys']} keys per host, "
        f"{result['options']['rounds']} rounds after a cold one, {result['machine']['cpus']} CPUs",
        f"follower memory per key      {rng(fig['follower_bytes_per_key'], '.2f')} B, plus "
        f"{fig['follower_bytes_fixed']['median'] / 1024:.1f} KiB per host "
        f"({fig['follower_bytes_over_keys']['median']:.2f} B per key in all)",
        f"  (a dict copy, below 2**20 slots followed: "
        f"{fig['dict_follower_bytes_per_key']['median']:.1f} B per key)",
        f"join per million keys        {rng(fig['join_s_per_million'], '.2f')} s",
    ]
    for f, s in fig["fanout_us_per_key_per_follower"].items():
        lines.append(f"host fan-out, {f:3d} followers  {rng(s, '.4f')} us per key per follower")
    lines += [
        f"host fan-out, marginal       {rng(fig['fanout_marginal_us'], '.4f')} us per key "
        "per follower",
        f"follower apply               {rng(fig['apply_us_per_key'], '.3f')} us per key",
        f"lookup of one key            p50 {fig['lookup_ns']['p50']:.0f} ns, "
        f"p99 {fig['lookup_ns']['p99']:.0f} ns",
        f"lookup of a 64-key prefix    p50 {fig['prefix_lookup_ns']['p50'] / 1e3:.1f} us, "
        f"p99 {fig['prefix_lookup_ns']['p99'] / 1e3:.1f} us",
        "index calls, median us       "
        + "   ".join(
            f"{form}: " + ", ".join(f"{name} {us:.1f}" for name, us in calls.items())
            for form, calls in fig["call_us"].items()
        ),
    ]
    for n, (add, remove) in fig["moved_over_1_n_by_hosts"].items():
        lines.append(
            f"keys moved, {n:3d} hosts       add one {add:.3f}, remove one {remove:.3f} x 1/N"
        )
    lines.append("targets:")
    for t in result["targets"].values():
        worst = " (the worst fleet size)" if t["statistic"] == "max" else ""
        lines.append(f"  {'met   ' if t['met'] else 'MISSED'} {t['what']}: {t['value']:.4g}{worst}")
    return "\n".join(lines)
