"""``torch-kv-tier shared-bench``: the shared pool's figures (issue 12), JSON and a table.

Throughput: tiers in separate processes (``shared_worker``; processes, not threads, because the
tier's per-call work holds the GIL: threads would measure the GIL, not the pool) store or load
distinct keys at once. Points: 1, 2, 4 tiers on one host and one tier over 1, 2, 4 hosts, at each
block size. At every point each process holds three systems open over the same hosts:
``shared`` (the tier joined to the hosts' shared pools), ``private`` (the same tier on private
leases, ``connect(private=True, slots=...)``, as large as what it cycles through on the shared
pools: ``private_lease``) and ``nixl_raw`` (a bare NIXL initiator on a
private lease of the first host, ``system_nixl_raw``). The private systems lease from hosts of
their own, started like the shared ones: a shared pool draws free slots in runs of up to 4096
and keeps them, so on one host the private leases would be refused once the shared tiers ran.
Rounds alternate the systems' order (A B C, C B A, ...); in each round every process runs one
timed burst of one system at once (``sweep.PointRunner``), every process the same calls
(``workers.Workers.open_point``), and the aggregate GB/s is all bytes over the span from the
first start to the last end. Ratios (shared/nixl_raw,
private/nixl_raw, shared/private) are paired within a round and reported as median, IQR and
min..max; after the rounds every system's bytes are verified. A tier repeat whose bytes the
tier's own counters did not move (a store that sent nothing) ends its point as an error.

Then, in this process: the cross-tier hit (bytes identical), ``lookup`` and shared ``load``
latency, staleness, and a SIGKILLed host (``shared_checks``). Exit status: 0 when every figure was
measured and every byte verified, 1 otherwise, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from torch_kv_tier.benchmarks import shared_checks
from torch_kv_tier.benchmarks.options import (
    add_output_option,
    add_preset_options,
    duration,
    list_of,
    positive,
    size,
    usable_cpus,
)
from torch_kv_tier.benchmarks.remote import host_group
from torch_kv_tier.benchmarks.shared_worker import SYSTEMS
from torch_kv_tier.benchmarks.workers import Workers
from torch_kv_tier.cli_numbers import integer
from torch_kv_tier.shared_host import default_grant_batch

logger = logging.getLogger(__name__)

QUICK: dict[str, Any] = {
    "block_sizes": [64 << 10],
    "tiers": [1, 2],
    "hosts": [1, 2],
    "rounds": 2,
    "min_time": 0.03,
    "working_set_mib": 4,
    "hit_blocks": 1000,
    "lookup_calls": 1000,
    "staleness_samples": 30,
    "heartbeat_s": 3.0,
}
FULL: dict[str, Any] = {
    "block_sizes": [64 << 10, 256 << 10],
    "tiers": [1, 2, 4],
    "hosts": [1, 2, 4],
    "rounds": 11,
    "min_time": 0.15,
    "working_set_mib": 8,
    "hit_blocks": 1000,
    "lookup_calls": 20000,
    "staleness_samples": 300,
    "heartbeat_s": 10.0,
}
BATCH, INFLIGHT = 16, 4
MAX_RESERVE_BYTES = 64 << 20  # the most a shared tier's reserve of granted slots holds here
RATIOS = (("shared", "nixl_raw"), ("private", "nixl_raw"), ("shared", "private"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``shared-bench`` options to ``parser``."""
    parser.description = __doc__
    parser.add_argument("--quick", action="store_true", help="fewer points and rounds (~1 min)")
    add_preset_options(
        parser,
        [
            ("--block-sizes", list_of(size), "bytes per block", "B"),
            ("--tiers", list_of(positive), "tier processes per host", ""),
            ("--hosts", list_of(positive), "hosts under one tier", ""),
            ("--rounds", positive, "interleaved rounds per point", ""),
            ("--min-time", duration, "least time per timed burst", "s"),
            ("--working-set-mib", positive, "bytes cycled per process", "MiB"),
            ("--hit-blocks", positive, "blocks of the cross-tier hit", ""),
            ("--lookup-calls", positive, "timed lookup calls", ""),
            ("--staleness-samples", positive, "stores timed to visibility", ""),
            (
                "--heartbeat-s",
                duration,
                "the host-kill tier's heartbeat timeout: the longest a read of a dead host waits",
                "s",
            ),
        ],
        FULL,
        QUICK,
    )
    parser.add_argument(
        "--seed",
        type=integer,
        default=1234,
        help="seed of plans and byte patterns (default %(default)s)",
    )
    add_output_option(parser, "--json", "every figure")


def _config(args: argparse.Namespace) -> dict[str, Any]:
    base = QUICK if args.quick else FULL
    cfg = {k: (v if (v := getattr(args, k, None)) is not None else base[k]) for k in base}
    if cfg["min_time"] <= 0 or cfg["heartbeat_s"] <= 0:
        raise ValueError("--min-time and --heartbeat-s must be > 0")
    if cfg["hit_blocks"] < shared_checks.LOAD_BATCH:
        raise ValueError(
            f"--hit-blocks must be >= {shared_checks.LOAD_BATCH} (the keys of one timed load), "
            f"got {cfg['hit_blocks']}"
        )
    return cfg


def _spread(values: list[float]) -> dict[str, float]:
    q1, med, q3 = np.percentile(values, [25, 50, 75])
    return {"median": float(med), "q1": float(q1), "q3": float(q3),
            "min": min(values), "max": max(values)}  # fmt: skip


def _point(
    workers: Workers,
    cfg: dict[str, Any],
    seed: int,
    hosts: tuple[list[str], list[str]],
    tiers: int,
    op: str,
) -> dict[str, Any]:
    """One point: ``tiers`` processes over ``hosts`` (shared, private), the systems interleaved
    by round. A failure the workers report ends the point as an ``error`` (the rounds complete
    so far are kept); the workers close its systems either way."""
    block_len = cfg["block_len"]
    gbps: dict[str, list[float]] = {name: [] for name in SYSTEMS}
    error = None
    try:
        workers.open_point(
            tiers,
            {"cmd": "open", "block_len": block_len, "addresses": hosts[0],
             "private_addresses": hosts[1], "systems": SYSTEMS,
             "working_set": cfg["working_set_mib"] << 20, "batch": BATCH, "inflight": INFLIGHT,
             "op": op, "min_time": cfg["min_time"], "warmup": cfg["min_time"] / 2, "seed": seed,
             "private_lease": cfg["private_lease"]},
        )  # fmt: skip
        for r in range(cfg["rounds"]):
            for name in SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]:
                answers = workers.ask(tiers, {"cmd": "burst", "system": name})
                span = max(a["end"] for a in answers) - min(a["start"] for a in answers)
                gbps[name].append(sum(a["bytes"] for a in answers) / span / 1e9)
    except RuntimeError as exc:
        error = str(exc)
    verified = []
    for i in range(tiers):  # one at a time: others' stores would evict the keys read back
        try:
            if error is None:
                workers.ask(i + 1, {"cmd": "last"}, first=i)
        except RuntimeError as exc:
            error = f"last repeat: {exc}"
        try:
            verified += workers.ask(i + 1, {"cmd": "finish"}, first=i)
        except RuntimeError as exc:
            error = error or f"verification: {exc}"
    if error is not None:
        logger.error("%d K, %d tiers, %d hosts, %s: %s", block_len >> 10, tiers, len(hosts[0]),
                     op, error)  # fmt: skip
    rounds = min(len(v) for v in gbps.values())
    complete = {name: v[:rounds] for name, v in gbps.items()}
    return {
        "kind": "throughput",
        "op": "store" if op == "write" else "load",
        "block_len": block_len,
        "tiers": tiers,
        "hosts": len(hosts[0]),
        "gbps": {name: _spread(v) if rounds else None for name, v in complete.items()},
        "gbps_rounds": complete,
        "ratios": {
            f"{a}/{b}": _spread([x / y for x, y in zip(complete[a], complete[b], strict=True)])
            if rounds
            else None
            for a, b in RATIOS
        },
        "verified": error is None and all(all(v["verified"].values()) for v in verified),
        "error": error,
    }


def throughput(cfg: dict[str, Any], seed: int) -> Iterator[dict[str, Any]]:
    """Every throughput point (1 tier on 1 host is measured once and serves both series)."""
    shapes = [(t, 1) for t in cfg["tiers"]] + [(1, h) for h in cfg["hosts"] if h > 1]
    if 1 not in cfg["tiers"] and 1 in cfg["hosts"]:
        shapes.insert(0, (1, 1))
    max_tiers, max_hosts = max(t for t, _ in shapes), max(h for _, h in shapes)
    workers: Workers | None = None  # started once the first hosts are up (fewer at once)
    try:
        for block_len in cfg["block_sizes"]:
            shared, max_grant = shared_pool(block_len, cfg["working_set_mib"], max_tiers)
            # A private host holds the private tiers' leases (as much as the shared tiers cycle
            # through: ``private_lease``) and a nixl_raw lease of the working set per process,
            # twice (the last point's may still be on their way back).
            pools = [shared] * max_hosts + [2 * shared] * max_hosts
            with host_group(None, block_len, pools, ["--max-grant", str(max_grant)]) as hosts:
                missing = [h.problem for h in hosts if h.address is None]
                if missing:
                    raise RuntimeError(f"hosts did not start: {missing}")
                addresses = [str(h.address) for h in hosts]
                workers = workers or Workers(max_tiers)
                for tiers, n_hosts in shapes:
                    for op in ("write", "read"):
                        logger.info("%d K: %d tiers, %d hosts, %s", block_len >> 10, tiers,
                                    n_hosts, op)  # fmt: skip
                        pair = (addresses[:n_hosts], addresses[max_hosts : max_hosts + n_hosts])
                        lease = private_lease(shared, tiers, n_hosts)
                        yield _point(workers, {**cfg, "block_len": block_len,
                                               "private_lease": lease}, seed, pair, tiers,
                                     op)  # fmt: skip
    finally:
        if workers is not None:
            workers.close()


def shared_pool(block_len: int, working_set_mib: int, tiers: int) -> tuple[int, int]:
    """The slots of a shared host for ``tiers`` processes cycling ``working_set_mib`` each, and
    its ``--max-grant``.

    The grant cap is a tier's default reserve: its grant batch
    (``shared_host.default_grant_batch``), which a host at its default cap (a sixteenth of the
    pool) grants on any pool of gigabytes. At most MAX_RESERVE_BYTES, so that the pools fit this
    machine (256 slots at 256 KiB, where the default is 512), and at least twice the blocks in
    flight. A shared host holds every process's reserve (and those of sessions that ended with
    writes in flight, until released) beside what they store, and evicts beyond that: its pool
    is four times every working set, and at least twice every working set and reserve.
    """
    ws_blocks = max(BATCH * INFLIGHT, (working_set_mib << 20) // block_len)
    max_grant = min(
        default_grant_batch(block_len), max(2 * BATCH * INFLIGHT, MAX_RESERVE_BYTES // block_len)
    )
    need = ws_blocks + BATCH * INFLIGHT
    return max(4 * tiers * need, 2 * tiers * (need + max_grant)), max_grant


def private_lease(pool: int, tiers: int, hosts: int) -> int:
    """The slots each private tier leases: as many as it cycles through on the shared pools,
    so that both write into as much memory (a lease of the working set alone stays in the CPU's
    caches, a shared pool does not). On one host its share of the pool; over several hosts
    one pool per host (``system_tier`` leases 1.5 times an even share on each)."""
    return pool // tiers if hosts == 1 else 2 * pool * hosts // 3


def _environment() -> dict[str, Any]:
    return {
        "host": platform.node(),
        "cpus": usable_cpus(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "loadavg_start": os.getloadavg(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join(["torch-kv-tier", *sys.argv[1:]]),
    }


def _table(result: dict[str, Any]) -> str:
    lines = [
        "| op | block | tiers | hosts | nixl_raw GB/s | shared GB/s | private GB/s "
        "| shared/nixl_raw | shared/private (IQR; min..max) | verified |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in result["throughput"]:
        if p["error"] is not None:
            lines.append(
                f"| {p['op']} | {p['block_len'] >> 10}K | {p['tiers']} | {p['hosts']} "
                f"| error: {p['error'][:200]} |"
            )
            continue
        g, r = p["gbps"], p["ratios"]
        sp = r["shared/private"]
        lines.append(
            f"| {p['op']} | {p['block_len'] >> 10}K | {p['tiers']} | {p['hosts']} "
            f"| {g['nixl_raw']['median']:.2f} | {g['shared']['median']:.2f} "
            f"| {g['private']['median']:.2f} | {r['shared/nixl_raw']['median']:.2f} "
            f"| {sp['median']:.2f} ({sp['q1']:.2f}-{sp['q3']:.2f}; "
            f"{sp['min']:.2f}..{sp['max']:.2f}) | {p['verified']} |"
        )
    hit, lk, st = result["cross_tier_hit"], result["lookup"], result["staleness"]
    kill = result["host_kill"]
    lines += [
        "",
        f"cross-tier hit: {hit['identical_blocks']}/{hit['blocks']} blocks of "
        f"{hit['block_len'] >> 10}K stored by A loaded byte-identical by B "
        f"(visible to B {hit['visible_s'] * 1e3:.1f} ms after A's store; load "
        f"{hit['load_s'] * 1e3:.1f} ms)",
    ]
    for name, v in lk.items():
        lines.append(f"{name}: p50 {v['p50_us']:.1f} us, p99 {v['p99_us']:.1f} us")
    ll = result["load_latency"]
    lines.append(
        f"shared load of {ll['keys_per_call']} keys x {hit['block_len'] >> 10}K (one call at a "
        f"time, verified): p50 {ll['p50_us']:.0f} us, p99 {ll['p99_us']:.0f} us over "
        f"{ll['samples']} calls"
    )
    lines.append(
        f"staleness (A's store done -> B.contains): p50 {st['p50_us']:.0f} us, "
        f"p99 {st['p99_us']:.0f} us, max {st['max_us']:.0f} us over {st['samples']} stores; "
        f"unseen after 5 s: {st['unseen_after_5s']}"
    )
    first, reload = kill["first_load"], kill["reload"]
    lines.append(
        f"host SIGKILLed (1 of {kill['hosts']}, {kill['keys_on_killed_host']} of "
        f"{kill['keys']} keys on it): every future settled in {kill['settle_s'] * 1e3:.0f} ms "
        f"(hung {kill['hung_futures']}); ok {first['ok']}, missing {first['missing']}, "
        f"peer lost {first['peer lost']}, other {first['other']}; wrong bytes "
        f"{kill['wrong_bytes_blocks']}; reload: {reload}"
    )
    return "\n".join(lines)


def _failures(result: dict[str, Any]) -> list[str]:
    out = [f"{p['op']} {p['block_len']} B, {p['tiers']} tiers, {p['hosts']} hosts: "
           f"{p['error'] or 'bytes differ'}"
           for p in result["throughput"] if not p["verified"]]  # fmt: skip
    hit, kill = result["cross_tier_hit"], result["host_kill"]
    if hit["identical_blocks"] != hit["blocks"] or not hit["loaded_ok"]:
        out.append(f"cross-tier hit: {hit}")
    if kill["hung_futures"] or kill["wrong_bytes_blocks"]:
        out.append(f"host kill: {kill}")
    return out


def _setup_nixl() -> None:
    from torch_kv_tier.benchmarks.options import quiet_nixl

    os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")  # as ``bench`` sets it
    quiet_nixl()


def run(args: argparse.Namespace) -> int:
    """Measure every figure; print the table; write ``--json``; return the exit status."""
    try:
        cfg = _config(args)
    except ValueError as exc:
        print(f"torch-kv-tier shared-bench: {exc}", file=sys.stderr)
        return 2
    started = time.monotonic()
    result: dict[str, Any] = {"env": _environment(), "config": cfg}
    _setup_nixl()
    result["throughput"] = list(throughput(cfg, args.seed))
    block_len = min(cfg["block_sizes"])
    result.update(
        shared_checks.cross_tier_and_lookup(block_len, cfg["hit_blocks"], cfg["lookup_calls"])
    )
    result["staleness"] = shared_checks.staleness(block_len, cfg["staleness_samples"])
    result["host_kill"] = shared_checks.host_kill(block_len, 3, 100, BATCH, cfg["heartbeat_s"])
    result["env"]["loadavg_end"] = os.getloadavg()
    result["env"]["seconds"] = round(time.monotonic() - started, 1)
    print(_table(result))
    env = result["env"]
    print(
        f"\n{env['seconds']} s on {env['cpus']} CPUs ({env['host']}); load average "
        f"{'/'.join(f'{x:.2f}' for x in env['loadavg_start'])} at start, "
        f"{'/'.join(f'{x:.2f}' for x in env['loadavg_end'])} at end"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"results: {args.json}")
    failures = _failures(result)
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0
