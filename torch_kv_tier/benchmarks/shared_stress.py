"""``torch-kv-tier shared-stress``: torn-read stress of one shared pool, with faults (issues 12
and 17).

One ``torch-kv-tier serve`` with a small pool (``--slots``, default 256, for ``--keys`` 2048 keys)
is shared by ``--writers`` writer and ``--readers`` reader processes, each with its own
``TierManager`` (its own NIXL agent), for ``--seconds``. A key's block is a pure function of the
key (``reliability_concurrency.make_block``: key id, CRC-32, a payload seeded by the key), so any
reader can check any block it loads. Writers store random batches of 1..``--max-batch`` keys
(keys stored by anyone are skipped by the tier; the pool keeps evicting them, so they keep
coming back). Readers load random batches of keys their tier believes stored (``contains``),
after random pauses, so that reads overlap evictions and rewrites of the same slots, and compare
every loaded block with the key's block: anything else is a WRONG block.

Nothing pins a shared load's slots: the tier verifies each block it read against the digest
published with its key and reports a block that differs as "missing" (``verify_failed``). A
reader zeroes its destination rows before each load, so a "missing" key whose row was written
all the same is a read that landed and was *rejected* (``rejected``); ``rejected_wrong`` counts
those rows that were indeed not their key's block (what verification kept from the caller). As
a key's bytes are a function of the key, every rejected row should be wrong: a rejected row that
equals its key's block is a false rejection, reported as a problem.

Faults (``shared_stress_faults``, on unless ``--no-faults``): writers frozen with SIGSTOP and
resumed with SIGCONT (``--writer-freezes``; every other one longer than the host's
``--lease-timeout``, so the host ends the session and the tier, once resumed, re-dials), and the
host frozen (``--host-freezes``; every other one longer than the tiers' ``--heartbeat-timeout``,
so every tier drops the host and re-dials it). A freeze counts once every thread of the process
is stopped. A worker whose tier has no peer waits (bounded) for the re-dial (``peer_waits``).

What is legitimate around a fault, and why: a key may fail with "peer lost" (the tier dropped the
host while the call was in flight: the host froze past the heartbeat timeout, or the host ended
a frozen writer's session; a load of a dropped host settles when the transport reports the
read), "transfer failed" (the transport reported an error on the dropped or resuming
connection) or "no peers" (a store made in the instant between the worker's peer check and the
drop). None of these returns bytes, so none can be a wrong block; but each must be explained: a
call that failed so must overlap a freeze of the host, or (a writer) of its own process,
extended by ``max(--lease-timeout, --heartbeat-timeout) + SLACK_S`` after the resume (the time a
lost session takes to be noticed). Reads otherwise fail only with "missing", writes only with
"capacity".

Processes: children start with the ``spawn`` context, report ``ready`` once connected, start
together, and send their counts back on a queue. Every wait has a timeout, every future is
awaited with ``result(timeout)`` (``shared_stress_worker.RESULT_TIMEOUT_S``); a child that
crashes, reports an error (a hang or an exception out of the tier) or does not finish is a
failure, and every child still alive at the end is killed; every frozen process is resumed.

Exit status: 0 when no block was wrong, some were verified, every process finished, every
planned freeze was done, and no key failed for another reason than the ones above; 1 otherwise;
2 for bad arguments. ``--self-check`` corrupts two loaded blocks in the first reader (one bit
flipped, one replaced by another key's valid block) and passes only when exactly those two are
counted wrong: the checker can fail.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import platform
import queue
import random
import sys
import time
from dataclasses import asdict
from typing import Any

from torch_kv_tier.benchmarks.options import (
    duration,
    heartbeat_timeout,
    output_file,
    positive,
    size,
    usable_cpus,
)
from torch_kv_tier.benchmarks.reliability_common import server_stats, ucx_over_tcp
from torch_kv_tier.benchmarks.shared_stress_faults import FREEZE_EXTRA_S, Freezer, plan_freezes
from torch_kv_tier.benchmarks.shared_stress_report import (
    check_faults,
    check_held,
    check_totals,
    render,
    totals_of,
)
from torch_kv_tier.benchmarks.shared_stress_worker import (
    STARTUP_TIMEOUT_S,
    Params,
    worker,
)
from torch_kv_tier.cli_numbers import integer

FINISH_GRACE_S = 90.0  # after --seconds: the last calls, close(), the counts sent back
SLACK_S = 5.0  # after a freeze (plus the longer timeout): a lost session has been noticed
END_MARGIN_S = 3.0  # the last freeze ends at least this long before the run does


def shared_stress(
    *,
    writers: int = 4,
    readers: int = 4,
    slots: int = 256,
    max_grant: int = 16,
    lease_timeout_s: float = 3.0,
    writer_freezes: int = 0,
    host_freezes: int = 0,
    tcp: bool = False,
    params: Params,
) -> dict[str, Any]:
    """Run the stress (module docstring); returns the report: ``ok``, ``problems``, ``totals``,
    ``faults`` (what was frozen), ``processes`` (each child's ``Counts``), ``server`` (the
    host's stats at the end).

    ``tcp``: UCX over TCP for the server and every child (transfers stay in flight longer than
    over shared memory, so more reads overlap evictions and freezes)."""
    from torch_kv_tier.remote import ServerProcess

    ctx = mp.get_context("spawn")
    start, results = ctx.Event(), ctx.Queue()
    roles = [("writer", i) for i in range(writers)] + [("reader", i) for i in range(readers)]
    problems: list[str] = []
    host: dict[str, Any] = {}
    host_log: list[str] = []
    counts: dict[tuple[str, int], dict[str, Any]] = {}
    extra = ["--max-grant", str(max_grant), "--lease-timeout", str(lease_timeout_s)]
    rng = random.Random(f"{params.seed}-faults")
    hb = params.heartbeat_timeout_s
    latest = params.seconds - max(lease_timeout_s, hb) - FREEZE_EXTRA_S - END_MARGIN_S
    window = (0.1 * params.seconds, latest)
    writer_plan = plan_freezes(
        rng, [f"writer-{i}" for i in range(writers)], writer_freezes, lease_timeout_s, window
    )
    host_plan = plan_freezes(rng, ["host"], host_freezes, hb, window)
    if writer_freezes + host_freezes and latest <= window[0]:
        problems.append(f"--seconds {params.seconds:g} leaves no time for a freeze")
    pids: dict[str, int] = {}  # filled once the children started
    freezers = {"writers": Freezer("writers", writer_plan, pids)}
    freezers["host"] = Freezer("host", host_plan, pids)
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
                pids.update({f"{r}-{i}": p.pid for (r, i), p in procs.items() if p.pid})
                pids["host"] = server.proc.pid
                started = time.monotonic()
                start.set()
                for freezer in freezers.values():
                    freezer.start(started, latest)
                _gather(results, procs, "done", params.seconds + FINISH_GRACE_S, counts, problems)
                elapsed = time.monotonic() - started
            else:
                elapsed = 0.0
            for freezer in freezers.values():
                freezer.stop()
            for proc in procs.values():
                proc.join(timeout=10)
            host = server_stats(server.address, params.block_len)
            host_log = [line for line in server.stderr.splitlines() if "held" in line]
        finally:
            for freezer in freezers.values():  # resume whatever is frozen, whatever happened
                freezer.stop()
            for key, proc in procs.items():
                if proc.is_alive():
                    problems.append(f"{key[0]}-{key[1]} still running at the end: killed")
                    proc.kill()
                    proc.join(timeout=10)
        if server.proc.poll() is not None:
            problems.append(f"the server exited with code {server.proc.returncode}")
    check_faults(list(freezers.values()), counts, max(lease_timeout_s, hb) + SLACK_S, problems)
    faults = {
        "writers": freezers["writers"].summary(lease_timeout_s),
        "host": freezers["host"].summary(hb),
    }
    totals = totals_of(list(counts.values()))
    check_totals(totals, params, writer_freezes + host_freezes > 0, problems)
    if len(counts) == len(procs):
        check_held(host, totals, problems)
    return {
        "ok": not problems,
        "problems": problems,
        "seconds": elapsed,
        "totals": totals,
        "faults": faults,
        "processes": [counts[key] for key in sorted(counts)],
        "server": host,
        "server_log_held": host_log,
        "params": {
            "writers": writers,
            "readers": readers,
            "slots": slots,
            "max_grant": max_grant,
            "lease_timeout_s": lease_timeout_s,
            "writer_freezes": writer_freezes,
            "host_freezes": host_freezes,
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``shared-stress`` subcommand's options."""
    parser.add_argument("--writers", type=integer, default=4, help="writer processes (default 4)")
    parser.add_argument("--readers", type=integer, default=4, help="reader processes (default 4)")
    parser.add_argument(
        "--seconds", type=duration, default=60.0, help="run time, s (default %(default)s)"
    )
    parser.add_argument("--slots", type=integer, default=256, help="host pool slots (default 256)")
    parser.add_argument("--keys", type=integer, default=2048, help="key space (default 2048)")
    parser.add_argument(
        "--block-len", type=size, default=4096, help="bytes per block (default 4096; e.g. 64K)"
    )
    parser.add_argument(
        "--max-batch",
        type=integer,
        default=64,
        help="most keys per call (batches are 1..N; default %(default)s)",
    )
    parser.add_argument(
        "--max-grant", type=positive, default=16, help="host's --max-grant (default %(default)s)"
    )
    parser.add_argument(
        "--lease-timeout", type=duration, default=3.0, help="host's --lease-timeout, s (default 3)"
    )
    parser.add_argument(
        "--heartbeat-timeout",
        type=heartbeat_timeout,
        default=3.0,
        help="the tiers' heartbeat timeout, s (default 3): a host silent this long is dropped",
    )
    parser.add_argument(
        "--writer-freezes",
        type=integer,
        help="writers SIGSTOPped and resumed during the run, every other one past "
        "--lease-timeout (default: one per 6 s of run)",
    )
    parser.add_argument(
        "--host-freezes",
        type=integer,
        help="host SIGSTOPs during the run, every other one past --heartbeat-timeout "
        "(default: one per 15 s of run)",
    )
    parser.add_argument(
        "--no-faults", action="store_true", help="freeze nothing (--*-freezes default to 0)"
    )
    parser.add_argument(
        "--seed", type=integer, default=0, help="workload and fault seed (default %(default)s)"
    )
    parser.add_argument(
        "--tcp", action="store_true", help="UCX over TCP (UCX_TLS=tcp) instead of UCX's choice"
    )
    parser.add_argument(
        "--self-check",
        action="store_true",
        help="corrupt two loaded blocks on purpose: passes only if exactly they count wrong",
    )
    parser.add_argument(
        "--compact-index",
        action="store_true",
        help="tiers hold the host's index compact (16 B per key; default: a dict at this size)",
    )
    parser.add_argument(
        "--json", type=output_file, help="write the report as JSON to this file (default: none)"
    )


def run(args: argparse.Namespace) -> int:
    """Run the stress, print the table, write ``--json``; see the module docstring."""
    sizes = (args.writers, args.readers, args.slots, args.keys, args.block_len, args.max_batch)
    times = (args.seconds, args.lease_timeout, args.heartbeat_timeout)
    freezes = [n for n in (args.writer_freezes, args.host_freezes) if n is not None]
    if min(sizes) <= 0 or args.block_len < 64 or min(times) <= 0 or min(freezes, default=0) < 0:
        print(
            "torch-kv-tier shared-stress: counts, sizes and times must be > 0 "
            "(--block-len at least 64, freezes at least 0)",
            file=sys.stderr,
        )
        return 2
    auto = 0 if args.no_faults else 1
    writer_freezes = args.writer_freezes
    if writer_freezes is None:
        writer_freezes = auto * int(args.seconds // 6)
    host_freezes = args.host_freezes
    if host_freezes is None:
        host_freezes = auto * int(args.seconds // 15)
    params = Params(
        keys=args.keys,
        block_len=args.block_len,
        max_batch=min(args.max_batch, args.keys),
        seconds=args.seconds,
        seed=args.seed,
        self_check=args.self_check,
        heartbeat_timeout_s=args.heartbeat_timeout,
        compact_index=True if args.compact_index else None,
    )
    report = shared_stress(
        writers=args.writers,
        readers=args.readers,
        slots=args.slots,
        max_grant=args.max_grant,
        lease_timeout_s=args.lease_timeout,
        writer_freezes=writer_freezes,
        host_freezes=host_freezes,
        tcp=args.tcp,
        params=params,
    )
    print(render(report))
    if args.json is not None:
        report["machine"] = {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": usable_cpus(),
            "load_average": os.getloadavg(),
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"report written to {args.json}")
    return 0 if report["ok"] else 1
