"""``torch-kv-tier shared-stress``: torn-read stress of one shared pool (issue 12).

One ``torch-kv-tier serve`` with a small pool (``--slots``, default 256, for ``--keys`` 2048 keys)
is shared by ``--writers`` writer and ``--readers`` reader processes, each with its own
``TierManager`` (its own NIXL agent), for ``--seconds``. A key's block is a pure function of the
key (``reliability_concurrency.make_block``: key id, CRC-32, a payload seeded by the key), so any
reader can check any block it loads. Writers store random batches of 1..``--max-batch`` keys
(keys stored by anyone are skipped by the tier; the pool keeps evicting them, so they keep
coming back). Readers load random batches of keys their tier believes stored (``contains``),
after random pauses, so that reads overlap evictions and rewrites of the same slots, and compare
every loaded block with the key's block: anything else is a WRONG block. A key the host evicted
before the pin is a legitimate "missing"; so is a read that outlived its pin (``--pin-ttl``):
such a read did land, and the blocks it brought are checked too (``late_wrong``: how many of
them a rewrite of their slot had indeed corrupted, i.e. what the pin deadline protected from).

Processes: children start with the ``spawn`` context, report ``ready`` once connected, start
together, and send their counts back on a queue. Every wait has a timeout; a child that crashes,
reports an error or hangs is a failure, and every child still alive at the end is killed.

Exit status: 0 when no block was wrong, some were verified, every process finished and no key
failed for another reason than "missing" (reads) or "capacity" (writes); 1 otherwise; 2 for bad
arguments. ``--self-check`` corrupts two loaded blocks in the first reader
(one bit flipped, one replaced by another key's valid block) and passes only when exactly those
two are counted wrong: the checker can fail.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import platform
import queue
import sys
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

from torch_kv_tier.benchmarks.reliability_common import ucx_over_tcp
from torch_kv_tier.benchmarks.reliability_faults import server_stats
from torch_kv_tier.benchmarks.shared_stress_worker import (
    STARTUP_TIMEOUT_S,
    SUMMED,
    Params,
    worker,
)

FINISH_GRACE_S = 60.0  # after --seconds: the last calls, close(), the counts sent back


def shared_stress(
    *,
    writers: int = 4,
    readers: int = 4,
    slots: int = 256,
    max_grant: int = 16,
    pin_ttl_s: float = 10.0,
    tcp: bool = False,
    params: Params,
) -> dict[str, Any]:
    """Run the stress (module docstring); returns the report: ``ok``, ``problems``, ``totals``,
    ``processes`` (each child's ``Counts``), ``server`` (the host's stats at the end).

    ``tcp``: UCX over TCP for the server and every child (transfers stay in flight longer than
    over shared memory, so more reads overlap evictions)."""
    from torch_kv_tier.remote import ServerProcess

    ctx = mp.get_context("spawn")
    start, results = ctx.Event(), ctx.Queue()
    roles = [("writer", i) for i in range(writers)] + [("reader", i) for i in range(readers)]
    problems: list[str] = []
    counts: dict[tuple[str, int], dict[str, Any]] = {}
    extra = ["--max-grant", str(max_grant), "--pin-ttl", str(pin_ttl_s)]
    with (
        ucx_over_tcp() if tcp else contextlib.nullcontext(),
        ServerProcess.start(slots, params.block_len, extra_args=extra) as server,
    ):
        procs = {
            (role, i): ctx.Process(
                target=worker,
                args=(role, i, server.address, params, start, results),
                name=f"{role}-{i}",
                daemon=True,
            )
            for role, i in roles
        }
        try:
            for proc in procs.values():
                proc.start()
            ready = _gather(results, procs, "ready", STARTUP_TIMEOUT_S, counts, problems)
            if len(ready) == len(procs):
                started = time.monotonic()
                start.set()
                _gather(results, procs, "done", params.seconds + FINISH_GRACE_S, counts, problems)
                elapsed = time.monotonic() - started
            else:
                elapsed = 0.0
            for proc in procs.values():
                proc.join(timeout=10)
            host = server_stats(server.address, params.block_len)
        finally:
            for key, proc in procs.items():
                if proc.is_alive():
                    problems.append(f"{key[0]}-{key[1]} still running at the end: killed")
                    proc.kill()
                    proc.join(timeout=10)
        if server.proc.poll() is not None:
            problems.append(f"the server exited with code {server.proc.returncode}")
    totals = _totals(list(counts.values()))
    if totals["wrong"] != totals["injected"]:
        problems.append(f"{totals['wrong'] - totals['injected']} WRONG blocks loaded")
    if params.self_check and totals["injected"] == 0:
        problems.append("self-check: no block was corrupted (no reader loaded anything)")
    if totals["other"]:
        problems.append(f"calls failed for other reasons than missing/capacity: {totals['other']}")
    if totals["verified"] == 0:
        problems.append("no loaded block was verified")
    return {
        "ok": not problems,
        "problems": problems,
        "seconds": elapsed,
        "totals": totals,
        "processes": [counts[key] for key in sorted(counts)],
        "server": host,
        "params": {
            "writers": writers,
            "readers": readers,
            "slots": slots,
            "max_grant": max_grant,
            "pin_ttl_s": pin_ttl_s,
            "tcp": tcp,
            **asdict(params),
        },
    }


def _gather(
    results: Any,
    procs: dict[tuple[str, int], Any],
    kind: str,
    timeout_s: float,
    counts: dict[tuple[str, int], dict[str, Any]],
    problems: list[str],
) -> set[tuple[str, int]]:
    """Collect one ``kind`` message per child until ``timeout_s``; a child that reports an
    error, or exits or times out without reporting, becomes a problem. Returns who reported."""
    seen: set[tuple[str, int]] = set()
    failed: set[tuple[str, int]] = set()
    deadline = time.monotonic() + timeout_s
    while len(seen | failed) < len(procs) and time.monotonic() < deadline:
        try:
            what, role, index, payload = results.get(timeout=0.5)
        except queue.Empty:
            for key, proc in procs.items():
                if key not in seen | failed and proc.exitcode is not None:
                    failed.add(key)
                    problems.append(f"{key[0]}-{key[1]} exited with code {proc.exitcode}")
            continue
        if what == "error":
            failed.add((role, index))
            problems.append(f"{role}-{index} failed:\n{payload}")
        else:
            seen.add((role, index))
            if what == "done":
                counts[(role, index)] = payload
    for key in sorted(set(procs) - seen - failed):
        problems.append(f"{key[0]}-{key[1]} did not report {kind!r} within {timeout_s:.0f} s")
    return seen


def _totals(counts: list[dict[str, Any]]) -> dict[str, Any]:
    totals: dict[str, Any] = {name: sum(c[name] for c in counts) for name in SUMMED}
    other: Counter[str] = Counter()
    for c in counts:
        other.update(c["other"])
    totals["other"] = dict(other)
    return totals


def render(report: dict[str, Any]) -> str:
    """The report as a fixed-width table (one row per process, then the totals)."""
    cols = [name for name in SUMMED if name != "injected"]
    rows: list[tuple[str, ...]] = [("process", *cols, "other")]
    for c in report["processes"]:
        rows.append((f"{c['role']}-{c['index']}", *(f"{c[n]:,}" for n in cols), str(c["other"])))
    t = report["totals"]
    rows.append(("total", *(f"{t[n]:,}" for n in cols), str(t["other"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    p, host = report["params"], report["server"]
    lines.append(
        f"{p['writers']} writers + {p['readers']} readers for {report['seconds']:.1f} s: "
        f"{p['keys']:,} keys of {p['block_len']:,} B over {p['slots']:,} slots "
        f"(max grant {p['max_grant']}, pin TTL {p['pin_ttl_s']:g} s"
        f"{', UCX over TCP' if p['tcp'] else ''}); host evictions "
        f"{host.get('shared_evictions', '?'):,}, stored at the end "
        f"{host.get('shared_stored_blocks', '?')}"
    )
    if t["injected"]:
        lines.append(f"self-check: {t['injected']} blocks corrupted on purpose, {t['wrong']} wrong")
    for c in report["processes"]:
        lines += [f"{c['role']}-{c['index']}: {s}" for s in c["wrong_samples"]]
    lines += report["problems"]
    lines.append("ok" if report["ok"] else "FAILED")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``shared-stress`` subcommand's options."""
    parser.add_argument("--writers", type=int, default=4, help="writer processes (default 4)")
    parser.add_argument("--readers", type=int, default=4, help="reader processes (default 4)")
    parser.add_argument("--seconds", type=float, default=60.0, help="run time (default 60)")
    parser.add_argument("--slots", type=int, default=256, help="host pool slots (default 256)")
    parser.add_argument("--keys", type=int, default=2048, help="key space (default 2048)")
    parser.add_argument("--block-len", type=int, default=4096, help="bytes per block")
    parser.add_argument(
        "--max-batch", type=int, default=64, help="most keys per call (batches are 1..N)"
    )
    parser.add_argument("--max-grant", type=int, default=16, help="host's --max-grant")
    parser.add_argument("--pin-ttl", type=float, default=10.0, help="host's --pin-ttl, s")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument(
        "--tcp", action="store_true", help="UCX over TCP (UCX_TLS=tcp) instead of UCX's choice"
    )
    parser.add_argument(
        "--self-check",
        action="store_true",
        help="corrupt two loaded blocks on purpose: passes only if exactly they count wrong",
    )
    parser.add_argument("--json", type=Path, help="write the report as JSON to this file")


def run(args: argparse.Namespace) -> int:
    """Run the stress, print the table, write ``--json``; see the module docstring."""
    sizes = (args.writers, args.readers, args.slots, args.keys, args.block_len, args.max_batch)
    if min(sizes) <= 0 or args.block_len < 64 or min(args.seconds, args.pin_ttl) <= 0:
        print(
            "torch-kv-tier shared-stress: counts, sizes and times must be > 0 "
            "(--block-len at least 64)",
            file=sys.stderr,
        )
        return 2
    params = Params(
        keys=args.keys,
        block_len=args.block_len,
        max_batch=min(args.max_batch, args.keys),
        seconds=args.seconds,
        seed=args.seed,
        self_check=args.self_check,
    )
    report = shared_stress(
        writers=args.writers,
        readers=args.readers,
        slots=args.slots,
        max_grant=args.max_grant,
        pin_ttl_s=args.pin_ttl,
        tcp=args.tcp,
        params=params,
    )
    print(render(report))
    if args.json is not None:
        report["machine"] = {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "load_average": os.getloadavg(),
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"report written to {args.json}")
    return 0 if report["ok"] else 1
