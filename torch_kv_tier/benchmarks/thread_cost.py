"""``torch-kv-tier thread-cost``: where shared and private tiers spend CPU, per thread, per GB.

``shared-bench`` gives throughput ratios; when tier processes and hosts saturate the machine's
cores, a ratio is the inverse ratio of CPU spent per byte, and this says who spends it. It
starts a shared host and a private one sized as ``shared-bench`` sizes them, and ``--tiers``
``shared_worker`` processes that each open both systems (``shared``: the tier joined to the
shared pool; ``private``: the same tier on a private lease). Then, per round, for each system
in turn (alternating the order), every process runs timed bursts of it back to back for
``--seconds``. Over that window (from the end of a first burst to the end of the last) every
thread of the tier processes and of that system's host is read from
``/proc/PID/task/TID/stat`` and ``status``: CPU time and voluntary and involuntary context
switches. Figures are per GB moved by all processes, per thread kind:

- ``tier``: the tier's own thread (the caller of ``store``/``load``);
- ``session``: its shared sessions' I/O threads; ``poller``: its transfer poller; ``zmq``:
  ZeroMQ's I/O threads; ``tier other``: any other thread (NIXL's, the redialer);
- ``host``: the loop thread of the host the system moves bytes to (the shared host in a
  ``shared`` window, the private one in a ``private`` window); ``host other``: its other
  threads (ZeroMQ's, NIXL's progress thread, metrics).

Median over ``--rounds`` with min..max; GB/s is the bytes of the window over its span. Then,
one worker at a time as ``shared-bench`` does (others' stores would evict what it reads back),
each runs a last repeat of each system and reads it back. Linux only (``/proc``). Exit status 0,
1 when a worker or host failed or bytes read back differ, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from torch_kv_tier.benchmarks.options import (
    add_output_option,
    add_preset_options,
    duration,
    list_of,
    positive,
    size,
    with_default,
)
from torch_kv_tier.benchmarks.remote import host_group
from torch_kv_tier.benchmarks.shared_bench import (
    BATCH,
    INFLIGHT,
    _environment,
    private_lease,
    shared_pool,
)
from torch_kv_tier.benchmarks.workers import Workers

SYSTEMS = ("shared", "private")
KINDS = ("tier", "session", "poller", "zmq", "tier other", "host", "host other")
FIELDS = ("cpu_ms", "voluntary", "involuntary")
DEFAULTS: dict[str, Any] = {
    "op": "write",
    "block_sizes": [64 << 10],
    "tiers": 4,
    "seconds": 6.0,
    "rounds": 3,
    "working_set_mib": 8,
}
_CLOCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

Sample = dict[tuple[str, int], tuple[float, int, int]]  # (kind, tid) -> cpu s, vol, invol
Proc = tuple[int, dict[int, str], bool]  # pid, its Python threads' names, whether a host


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``thread-cost`` options to ``parser``."""
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "--op",
        choices=("write", "read"),
        help=with_default("write: stores, read: loads", DEFAULTS["op"]),
    )
    add_preset_options(
        parser,
        [
            ("--block-sizes", list_of(size), "bytes per block", "B"),
            ("--tiers", positive, "tier processes", ""),
            ("--seconds", duration, "window per system and round", "s"),
            ("--rounds", positive, "rounds", ""),
            ("--working-set-mib", positive, "bytes cycled per process", "MiB"),
        ],
        DEFAULTS,
    )
    add_output_option(parser, "--json", "every figure")


def _kind(pid: int, tid: int, comm: str, names: dict[int, str], host: bool) -> str:
    if host:
        return "host" if tid == pid else "host other"
    name = names.get(tid, "")
    if tid == pid:
        return "tier"
    if name.startswith("tkvt-session"):
        return "session"
    if name == "tkvt-poller":
        return "poller"
    return "zmq" if comm.startswith("ZMQ") else "tier other"


def _sample(procs: Iterable[Proc]) -> Sample:
    """Every thread's CPU seconds and context switches: ``(pid, Python thread names, host)``."""
    out: Sample = {}
    for pid, names, host in procs:
        for entry in os.listdir(f"/proc/{pid}/task"):
            tid = int(entry)
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    stat = f.read()
                with open(f"/proc/{pid}/task/{tid}/status") as f:
                    status = dict(line.split(":", 1) for line in f if ":" in line)
            except OSError:  # the thread ended meanwhile
                continue
            comm = stat[stat.index("(") + 1 : stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2 :].split()
            cpu = (int(fields[11]) + int(fields[12])) / _CLOCK  # utime + stime
            vol = int(status["voluntary_ctxt_switches"])
            invol = int(status["nonvoluntary_ctxt_switches"])
            out[(_kind(pid, tid, comm, names, host), tid)] = (cpu, vol, invol)
    return out


def _per_kind(before: Sample, after: Sample, gb: float) -> dict[str, dict[str, float]]:
    """CPU ms and context switches per GB, summed per thread kind (threads alive at both)."""
    sums = {kind: [0.0, 0, 0] for kind in KINDS}
    for key, (cpu, vol, invol) in after.items():
        if key in before:
            b = before[key]
            s = sums[key[0]]
            s[0] += cpu - b[0]
            s[1] += vol - b[1]
            s[2] += invol - b[2]
    return {
        kind: {"cpu_ms": s[0] * 1e3 / gb, "voluntary": s[1] / gb, "involuntary": s[2] / gb}
        for kind, s in sums.items()
    }


def _window(
    workers: Workers, n: int, system: str, seconds: float, procs: list[Proc]
) -> dict[str, Any]:
    """Bursts of ``system`` in every worker for ``seconds``; the figures of its middle."""
    workers.ask(n, {"cmd": "burst", "system": system})  # the window starts after one burst
    before, start, moved = _sample(procs), time.perf_counter(), 0
    deadline = start + seconds
    while time.perf_counter() < deadline:
        moved += sum(a["bytes"] for a in workers.ask(n, {"cmd": "burst", "system": system}))
    after, span = _sample(procs), time.perf_counter() - start
    gb = moved / 1e9
    return {"gbps": gb / span, "per_gb": _per_kind(before, after, gb)}


def measure(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (block size, system): per-round GB/s and per-kind figures per GB."""
    rows: list[dict[str, Any]] = []
    n = cfg["tiers"]
    for block_len in cfg["block_sizes"]:
        shared, max_grant = shared_pool(block_len, cfg["working_set_mib"], n)
        with host_group(None, block_len, [shared, 2 * shared], ["--max-grant", str(max_grant)]
                        ) as hosts:  # fmt: skip
            pids = [h.pid for h in hosts if h.pid is not None]
            if len(pids) != len(hosts):
                raise RuntimeError(f"hosts did not start: {[h.problem for h in hosts]}")
            workers = Workers(n)
            try:
                workers.open_point(n, {
                    "cmd": "open", "block_len": block_len, "addresses": [hosts[0].address],
                    "private_addresses": [hosts[1].address], "systems": list(SYSTEMS),
                    "working_set": cfg["working_set_mib"] << 20, "batch": BATCH,
                    "inflight": INFLIGHT, "op": cfg["op"], "min_time": 0.15, "warmup": 0.075,
                    "seed": 1, "private_lease": private_lease(shared, n, 1),
                })  # fmt: skip
                names = [a["threads"] for a in workers.ask(n, {"cmd": "threads"})]
                tiers = [(p.pid, {int(k): v for k, v in t.items()}, False)
                         for p, t in zip(workers.procs, names, strict=True)]  # fmt: skip
                procs = {s: [*tiers, (pid, {}, True)] for s, pid in zip(SYSTEMS, pids, strict=True)}
                windows: dict[str, list[dict[str, Any]]] = {s: [] for s in SYSTEMS}
                for r in range(cfg["rounds"]):
                    for system in SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]:
                        windows[system].append(
                            _window(workers, n, system, cfg["seconds"], procs[system])
                        )
                for i in range(n):  # one at a time: others' stores would evict what it reads back
                    workers.ask(i + 1, {"cmd": "last"}, first=i)
                    [done] = workers.ask(i + 1, {"cmd": "finish"}, first=i)
                    if not all(done["verified"].values()):
                        raise RuntimeError(
                            f"worker {i}: bytes read back differ: {done['verified']}"
                        )
            finally:
                workers.close()
        for system, ws in windows.items():
            rows.append({"block_len": block_len, "system": system, "windows": ws})
    return rows


def _median(values: list[float]) -> str:
    return f"{np.median(values):.0f} ({min(values):.0f}..{max(values):.0f})"


def _figures(windows: list[dict[str, Any]], kind: str, field: str) -> list[float]:
    """One figure of one thread kind (``all``: every kind summed) per window."""
    per = [w["per_gb"] for w in windows]
    if kind == "all":
        return [sum(p[k][field] for k in KINDS) for p in per]
    return [p[kind][field] for p in per]


def table(rows: list[dict[str, Any]]) -> str:
    """Per (block, system): GB/s, then CPU ms and context switches per GB for each kind."""
    lines = [
        "| block | system | GB/s | kind | CPU ms/GB | voluntary/GB | involuntary/GB |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        ws = row["windows"]
        head = f"| {row['block_len'] >> 10}K | {row['system']} | "
        head += f"{np.median([w['gbps'] for w in ws]):.2f}"
        for kind in (*KINDS, "all"):
            cpu, vol, invol = (_figures(ws, kind, f) for f in FIELDS)
            if kind != "all" and max(cpu) < 1 and max(vol) < 1:
                continue  # a kind this system does not have (a private tier's session thread)
            lines.append(f"{head} | {kind} | {_median(cpu)} | {_median(vol)} | {_median(invol)} |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Measure, print the table, write ``--json``; return the exit status."""
    cfg = {k: (v if (v := getattr(args, k, None)) is not None else DEFAULTS[k]) for k in DEFAULTS}
    if cfg["seconds"] <= 0 or not os.path.isdir("/proc/self/task"):
        print("torch-kv-tier thread-cost: --seconds must be > 0, and /proc is needed (Linux)",
              file=sys.stderr)  # fmt: skip
        return 2
    env = _environment()
    try:
        rows = measure(cfg)
    except RuntimeError as exc:
        print(f"torch-kv-tier thread-cost: {exc}", file=sys.stderr)
        return 1
    env["loadavg_end"] = os.getloadavg()
    print(table(rows))
    load = "/".join(f"{x:.2f}" for x in env["loadavg_start"])
    print(f"\n{cfg['tiers']} tier processes, {cfg['op']}s, {cfg['rounds']} rounds of "
          f"{cfg['seconds']:.0f} s per system; median (min..max) per GB moved; load average "
          f"{load} at start on {env['cpus']} CPUs")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "config": cfg, "rows": rows}, f, indent=1)
        print(f"results: {args.json}")
    return 0
