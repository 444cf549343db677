"""``torch-kv-tier chaos``: hosts and tiers killed, frozen, restarted and cut off at random for
``--seconds``, while reader tiers check every block they load (issue 18, "Chaos").

Processes: ``--hosts`` ``torch-kv-tier serve`` children (a pool larger than the key space, so
nothing is evicted: a probe key stays until its host dies), ``--writers`` + ``--readers``
long-lived tier processes (``chaos_worker``; stopped and resumed, never killed: their fds,
threads and RSS are measured), and one short-lived writer that gets SIGKILLed and replaced.
Every tier joins the shared pool of every host (and dials again a host it lost).
With ``--disk DIR`` every host keeps a disk tier (``serve --disk``) behind a pool of a quarter
of the key space: keys leave DRAM for the disk and are promoted back, and a host killed in the
middle of its disk writes restarts on its directory and recovers what verifies. With ``--tcp``
every process runs UCX over TCP (over shared memory a transfer usually completes inside
``transfer()``; over TCP it stays in flight while its writer or its host freezes or dies).

Faults, one every 0.2 to 1 s, chosen at random: SIGKILL a host and restart it on the same port;
SIGSTOP a host or a long-lived tier for 0.5 to 3 s; SIGKILL the short-lived tier; reset the
control connections of a host (``ss -K`` on its port, either side); and a staleness probe: a
tier of this process stores a fresh key on one host and every long-lived tier must see it, or
drop that host, within ``chaos_worker.STALE_BOUND_S``. The workers feed bad keys themselves.
A host that exits by itself (``chaos_hosts``) is recorded (exit code, signal, time, the end of its
stderr: the JSON's ``host_exits``) and restarted on its port, the long-lived tiers told first as
for a kill.

What must hold (the exit status is 1 otherwise): 0 wrong blocks; 0 hung futures (each bounded
by ``chaos_worker.FUTURE_BOUND_S``); 0 stale probes; fds, threads and RSS of every long-lived
tier flat (end vs. start of its loop); every worker finished and reported; no host exited by
itself but for the UCX abort the README documents over TCP (``chaos_hosts.is_known_ucx_abort``),
which is counted, not failed: it loses the host's keys, never a load's bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import multiprocessing as mp
import os
import queue
import random
import signal
import subprocess
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import psutil

from torch_kv_tier.benchmarks import chaos_worker as cw
from torch_kv_tier.benchmarks.chaos_hosts import HostExit, Hosts
from torch_kv_tier.benchmarks.options import duration, output_file, pause
from torch_kv_tier.benchmarks.reliability_common import Outcome, ucx_over_tcp
from torch_kv_tier.benchmarks.reliability_faults import FDS_PER_DEAD_PEER, FDS_PER_DEAD_PEER_TCP
from torch_kv_tier.cli_numbers import integer

logger = logging.getLogger(__name__)

START_S = 180.0  # every worker ready (spawned interpreters import torch and NIXL)
GRACE_S = 90.0  # after --seconds: the last calls (a frozen worker finishes late), counts back
RSS_GROWTH = 0.25  # the most a long-lived tier's RSS may grow over its loop
THREADS_GROWTH = 4  # the most threads it may gain (a re-dialed session's I/O thread)


def _resources(procs: dict[str, Any], names: list[str], out: Outcome) -> dict[str, dict[str, int]]:
    """RSS, threads and fds of each live process in ``names``; a dead one is a problem."""
    taken = {}
    for name in names:
        try:
            proc = psutil.Process(procs[name].pid)
            taken[name] = {
                "rss": proc.memory_info().rss,
                "threads": proc.num_threads(),
                "fds": proc.num_fds(),
            }
        except psutil.NoSuchProcess:
            out.problem(f"{name} is gone (exit code {procs[name].exitcode})")
    return taken


class Chaos:
    """One run: the processes, the fault loop and the report (module docstring)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.ctx = mp.get_context("spawn")
        self.results = self.ctx.Queue()
        self.out = Outcome("chaos", {k: v for k, v in vars(args).items() if k not in ("run",)})
        self.faults: dict[str, int] = {}
        self.stopped: list[tuple[float, int]] = []  # (SIGCONT time, pid)
        self.probes = 0
        self.commands: dict[str, Any] = {}
        self.procs: dict[str, Any] = {}
        self.counts: dict[str, cw.WorkerCounts] = {}
        self.start_res: dict[str, dict[str, int]] = {}
        self.end_res: dict[str, dict[str, int]] = {}
        self.ephemeral = 0
        self.exits: list[HostExit] = []  # hosts that exited by themselves (``chaos_hosts``)

    def spawn(self, role: str, name: str, addresses: list[str], seconds: float) -> None:
        commands = self.ctx.Queue()
        args = (role, name, addresses, self.args.keys, seconds, self.args.pause, commands)
        proc = self.ctx.Process(target=cw.worker, args=(*args, self.results), daemon=True)
        proc.start()
        self.commands[name], self.procs[name] = commands, proc

    def receive(self, timeout_s: float) -> tuple[str, str, Any] | None:
        try:
            what, name, payload = self.results.get(timeout=timeout_s)
        except queue.Empty:
            return None
        if what == "error":
            self.out.problem(f"{name} failed:\n{payload}")
        elif what == "done":
            self.counts[name] = payload
        return what, name, payload

    def fault(self, hosts: Hosts, long_lived: list[str], probe_tiers: list[Any]) -> None:
        kind = self.rng.choice(
            ["kill-host", "stop-host", "stop-tier", "kill-tier", "reset", "probe", "probe"]
        )
        i = self.rng.randrange(len(hosts.servers))
        if kind == "kill-host":
            self.restart(hosts, i, long_lived)
        elif kind == "stop-host" or kind == "stop-tier":
            pid = hosts.servers[i].proc.pid if kind == "stop-host" else None
            if pid is None:
                pid = self.procs[self.rng.choice(long_lived)].pid
            if any(p == pid for _, p in self.stopped):
                return
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:  # a worker that died: its error message says why
                return
            self.stopped.append((time.monotonic() + self.rng.uniform(0.5, 3.0), pid))
        elif kind == "kill-tier":
            victim = f"ephemeral-{self.ephemeral}"
            self.procs[victim].kill()
            self.procs[victim].join(timeout=10)
            self.ephemeral += 1
            self.spawn("writer", f"ephemeral-{self.ephemeral}", hosts.addresses, 3600)
        elif kind == "reset":
            side = self.rng.choice(["src", "dst"])
            port = hosts.servers[i].address.rsplit(":", 1)[1]
            subprocess.run(["ss", "-K", side, f"127.0.0.1:{port}"], capture_output=True, timeout=10)
        elif all(pid != hosts.servers[i].proc.pid for _, pid in self.stopped):
            self.probe(hosts.addresses[i], probe_tiers[i], long_lived)
        self.faults[kind] = self.faults.get(kind, 0) + 1

    def restart(self, hosts: Hosts, i: int, long_lived: list[str]) -> None:
        """Restart host ``i`` (killed, or exited by itself), telling every long-lived tier
        first: a worker's verdict on a probe of the host reads it (``chaos_worker``)."""
        for name in long_lived:
            self.commands[name].put(("restart", hosts.addresses[i]))
        hosts.restart(i)

    def probe(self, address: str, tier: Any, long_lived: list[str]) -> None:
        """Store a fresh key on ``address`` alone; tell every long-lived tier to expect it."""
        if not tier.peers():
            with contextlib.suppress(Exception):  # host down or frozen: next probe
                tier.connect(address, timeout_s=2.0)
            return
        self.probes += 1
        key = f"probe-{self.probes}"
        tier.arena.tensor[0] = 0
        try:
            result = tier.store([key], [0]).result(timeout=cw.FUTURE_BOUND_S)
        except TimeoutError:
            self.out.problem(f"a probe store to {address} did not settle")
            return
        if result.ok and tier.peers():
            for name in long_lived:
                self.commands[name].put(("probe", address, key))

    def resume_due(self, now: float) -> None:
        due = [(t, pid) for t, pid in self.stopped if t <= now]
        for item in due:
            with contextlib.suppress(ProcessLookupError):
                os.kill(item[1], signal.SIGCONT)
            self.stopped.remove(item)

    def run(self) -> Outcome:
        from torch_kv_tier.manager import TierManager

        a = self.args
        started = time.monotonic()
        hosts = Hosts(a.hosts, a.disk, a.keys, tcp=a.tcp, started=started)
        long_lived = [f"writer-{i}" for i in range(a.writers)]
        long_lived += [f"reader-{i}" for i in range(a.readers)]
        probe_tiers = [
            TierManager.create(1, cw.BLOCK_LEN, name=f"probe-{i}") for i in range(a.hosts)
        ]
        try:
            for tier, address in zip(probe_tiers, hosts.addresses):
                tier.connect(address)
            for name in long_lived:  # they run until told to stop (at most twice --seconds)
                self.spawn(name.split("-")[0], name, hosts.addresses, 2 * a.seconds + START_S)
            self.spawn("writer", "ephemeral-0", hosts.addresses, 3600)
            ready: set[str] = set()
            deadline = time.monotonic() + START_S
            while len(ready) < len(long_lived) + 1 and time.monotonic() < deadline:
                got = self.receive(1.0)
                if got is not None and got[0] == "ready":
                    ready.add(got[1])
            if len(ready) < len(long_lived) + 1:
                self.out.problem(f"workers not ready within {START_S:.0f} s: {sorted(ready)}")
                return self.out
            time.sleep(2.0)  # warm-up before the resources are taken
            self.start_res = _resources(self.procs, long_lived, self.out)
            end = time.monotonic() + a.seconds - 4.0
            while time.monotonic() < end:
                self.resume_due(time.monotonic())
                while self.receive(0.0) is not None:  # errors of workers that died
                    pass
                for i in hosts.exited():  # by itself (a UCX abort over TCP, say)
                    self.restart(hosts, i, long_lived)
                self.fault(hosts, long_lived, probe_tiers)
                time.sleep(self.rng.uniform(0.2, 1.0))
            self.resume_due(float("inf"))
            time.sleep(1.0)
            self.end_res = _resources(self.procs, long_lived, self.out)
            for name in long_lived:
                self.commands[name].put(None)
            deadline = time.monotonic() + GRACE_S
            while set(long_lived) - set(self.counts) and time.monotonic() < deadline:
                self.receive(1.0)
            for name in sorted(set(long_lived) - set(self.counts)):
                self.out.problem(f"{name} did not report within {GRACE_S:.0f} s of the end")
        finally:
            self.resume_due(float("inf"))
            for proc in self.procs.values():
                if proc.is_alive():
                    proc.kill()
                proc.join(timeout=10)
            for tier in probe_tiers:
                tier.close()
            hosts.close()
        self.exits = hosts.exits
        self.report(long_lived, hosts.restarts)
        self.out.seconds = time.monotonic() - started
        return self.out

    def report(self, long_lived: list[str], restarts: int) -> None:
        total = {
            f.name: 0
            for f in fields(cw.WorkerCounts)
            if f.name not in ("failures", "raised_samples")
        }
        for counts in self.counts.values():
            for name in total:
                total[name] += getattr(counts, name)
        out = self.out
        out.equals("wrong blocks", total["wrong"], 0)
        out.at_least("blocks verified", total["verified"], 1)
        out.info("futures settled", total["settled"])
        out.equals("futures hung", total["hung"], 0)
        out.equals("calls that raised unexpectedly", total["raised"], 0)
        for name, counts in sorted(self.counts.items()):
            for sample in counts.raised_samples[:1]:
                out.problem(f"{name}: a call raised:\n{sample}")
        out.equals("stale probes (a listed host's key never seen)", total["probes_stale"], 0)
        out.info("probes seen", total["probes_seen"])
        out.info("probes answered by dropping the host", total["probes_dropped"])
        out.info("probes answered by the host's restart", total["probes_restarted"])
        out.info("bad keys refused at the call", total["bad_raised"])
        out.info("bad keys whose future settled", total["bad_settled"])
        out.info("connects (first and re-dials)", total["connects"])
        for kind, n in sorted(self.faults.items()):
            out.info(f"faults: {kind}", n)
        out.info("host restarts", restarts)
        known = sum(e.known for e in self.exits)
        out.info("host exits: the UCX abort documented over TCP", known)
        out.equals("host exits: any other", len(self.exits) - known, 0)
        for e in self.exits:
            if not e.known:
                out.problem(
                    f"host {e.host} exited by itself {e.at_s} s into the run: exit code "
                    f"{e.returncode} ({e.signal or 'no signal'}); its stderr ended:\n{e.stderr}"
                )
        for name in long_lived:
            start, end = self.start_res.get(name), self.end_res.get(name)
            if start is None or end is None:
                continue
            growth = (end["rss"] - start["rss"]) / start["rss"]
            out.at_most(f"{name} RSS growth", round(100 * growth, 1), 100 * RSS_GROWTH, "%")
            out.at_most(f"{name} threads growth", end["threads"] - start["threads"], THREADS_GROWTH)
            # NIXL keeps the sockets of every remote agent a tier removed: one per host restart
            # (a control-connection reset or a freeze that drops a host loads its parked agent
            # again: nixl_peers; this harness never resets UCX's own connections)
            worker = self.counts.get(name)
            if worker is not None:
                out.info(f"{name} hosts dropped", worker.peers_dropped)
            per_restart = FDS_PER_DEAD_PEER_TCP if self.args.tcp else FDS_PER_DEAD_PEER
            fd_bound = per_restart * restarts + 16
            out.at_most(f"{name} fds growth", end["fds"] - start["fds"], fd_bound)
        reasons: dict[str, int] = {}
        for counts in self.counts.values():
            for reason, n in counts.failures.items():
                reasons[reason] = reasons.get(reason, 0) + n
        for reason, n in sorted(reasons.items()):
            out.info(f"keys failed: {reason}", n)


def render(out: Outcome, exits: list[HostExit]) -> str:
    """The figures as a table, the hosts' exits of their own, the problems, ``ok``/``FAILED``."""
    rows = [("figure", "value", "limit", "")] + [
        (f.name, f.text(), f.limit or "-", "" if f.ok else "FAILED") for f in out.figures
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines += [
        f"host {e.host} exited at {e.at_s} s: exit code {e.returncode} ({e.signal or '-'}), "
        + ("the known UCX abort" if e.known else "unexpected")
        for e in exits
    ]
    return "\n".join([*lines, *out.problems, "ok" if out.ok else "FAILED"])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``chaos`` subcommand's options."""
    parser.add_argument(
        "--seconds", type=duration, default=600.0, help="run time, s (default %(default)s)"
    )
    parser.add_argument("--hosts", type=integer, default=2, help="host processes (default 2)")
    parser.add_argument(
        "--writers", type=integer, default=2, help="long-lived writer tiers (default %(default)s)"
    )
    parser.add_argument(
        "--readers", type=integer, default=2, help="long-lived reader tiers (default %(default)s)"
    )
    parser.add_argument("--keys", type=integer, default=512, help="key space (default 512)")
    parser.add_argument(
        "--pause",
        type=pause,
        default=0.005,
        help="pause between a tier's calls, s (default %(default)s)",
    )
    parser.add_argument(
        "--seed", type=integer, default=0, help="fault schedule seed (default %(default)s)"
    )
    parser.add_argument(
        "--json", type=output_file, help="write the figures as JSON to this file (default: none)"
    )
    parser.add_argument(
        "--tcp",
        action="store_true",
        help="UCX over TCP (UCX_TLS=tcp) for every process instead of UCX's choice (shared "
        "memory here): transfers stay in flight while processes freeze, die and reconnect",
    )
    parser.add_argument(
        "--disk",
        type=Path,
        help="give every host a disk tier under this directory (a pool of a quarter of the "
        "key space in front of it; a host restarted after SIGKILL recovers its disk; default: "
        "none, DRAM pools alone)",
    )


def run(args: argparse.Namespace) -> int:
    """Run the chaos, print the table, write ``--json``; exit 0 only when every limit held."""
    if min(args.hosts, args.writers, args.readers) <= 0 or args.seconds < 10 or args.keys < 64:
        print("torch-kv-tier chaos: counts > 0, --seconds >= 10, --keys >= 64", file=sys.stderr)
        return 2
    with ucx_over_tcp() if args.tcp else contextlib.nullcontext():
        chaos = Chaos(args)
        out = chaos.run()
    print(render(out, chaos.exits))
    if args.json is not None:
        report = {**asdict(out), "ok": out.ok, "host_exits": [asdict(e) for e in chaos.exits]}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")
    return 0 if out.ok else 1
