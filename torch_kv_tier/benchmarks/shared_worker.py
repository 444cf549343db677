"""One tier process of ``torch-kv-tier shared-bench``: opens systems, runs timed bursts on command.

``python -m torch_kv_tier.benchmarks.shared_worker INDEX`` reads one JSON command per line on
stdin and answers each with one JSON line (``{"ok": true, ...}`` or ``{"ok": false, "error":
...}``) on the stdout it was started with; anything else that writes to stdout (NIXL, UCX) is
sent to stderr. Commands:

- ``open``: open ``systems`` (``nixl_raw``, ``shared``, ``private``) for one block length, the
  shared tier over ``addresses``, the others over ``private_addresses`` (hosts of their own: see
  ``shared_bench``), and prepare ``op`` on each (plan, fill, staging, warm-up:
  ``sweep.PointRunner``);
- ``burst`` ``system``: one timed repeat; answers ``start``/``end`` (``time.perf_counter``, i.e.
  CLOCK_MONOTONIC, comparable across the processes of one machine) and ``bytes``;
- ``last``: the last repeat of every system (writes refill their source, reads zero their
  destination first);
- ``finish``: byte verification of what the last repeats moved, then close; answers
  ``verified`` per system. ``shared_bench`` sends ``last`` and ``finish`` to one process at a
  time: tiers sharing a pool evict each other's keys, so no other process may store between a
  process's last stores and their read-back;
- ``threads``: ``{"threads": {native id: name}}`` of this process's Python threads (for
  ``thread_cost``, which reads their CPU time from ``/proc``);
- ``exit``.

Every repeat of a tier system (``burst`` and ``last``) is checked against the tier's own counters
(``Tier.moved``): when they moved other bytes than the repeat claims, the command fails, so a
store that sent nothing is never counted as bytes moved.

Keys come from one source per process that never restarts (``Worker.keys``, from
``(INDEX + 1) << 40``): the hosts outlive a point, and a host keeps a key's first bytes, so no key
is stored twice into a host across points, repeats and systems, and tiers sharing a pool never
store each other's keys.

Threading: one thread (the tiers run their own poller threads). Failure model: an exception is
answered as an error and the systems stay as they are until ``finish`` or ``exit``; end of stdin
(the parent died) closes everything and exits.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import replace
from typing import IO, Any

from torch_kv_tier.benchmarks.core import System
from torch_kv_tier.benchmarks.remote import Target
from torch_kv_tier.benchmarks.sweep import Keys, Point, PointRunner, PointState, Settings
from torch_kv_tier.benchmarks.system_nixl_raw import NixlRaw
from torch_kv_tier.benchmarks.system_tier import Tier

SYSTEMS = ("nixl_raw", "shared", "private")
_KEY_SPACE = 1 << 40  # keys of worker i start at (i + 1) << 40


def _open(name: str, target: Target) -> System:
    hosts = 1 + len(target.more_addresses)
    if name == "nixl_raw":
        return NixlRaw(target)  # one private lease on the first host
    if name in ("shared", "private"):
        return Tier(target, hosts=hosts, shared=name == "shared")
    raise ValueError(f"unknown system {name!r}; choose from {SYSTEMS}")


class Worker:
    """The systems open for the current point and their prepared states."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.keys = Keys((index + 1) * _KEY_SPACE)  # shared by every point's runner
        self.systems: dict[str, System] = {}
        self.states: dict[str, PointState] = {}

    def open(self, msg: dict[str, Any]) -> dict[str, Any]:
        self.close()
        block_len = int(msg["block_len"])
        ws_blocks = max(msg["batch"] * msg["inflight"], msg["working_set"] // block_len)
        shared = Target(
            address=msg["addresses"][0],
            token=None,
            device="cpu",
            block_len=block_len,
            local_slots=2 * ws_blocks,
            remote_slots=ws_blocks,
            embedded=True,
            more_addresses=tuple(msg["addresses"][1:]),
            slack_slots=msg["batch"] * msg["inflight"],
        )
        private = replace(
            shared,
            address=msg["private_addresses"][0],
            more_addresses=tuple(msg["private_addresses"][1:]),
        )
        runner = PointRunner(
            Settings(
                min_time=msg["min_time"],
                warmup=msg["warmup"],
                working_set=msg["working_set"],
                seed=msg["seed"] + 7919 * self.index,
            ),
            self.keys,
        )
        point = Point(msg["op"], "contiguous", block_len, msg["batch"], msg["inflight"])
        # the private tier leases as much as the shared one cycles through (its working set plus
        # slack: fresh keys evict the oldest); nixl_raw leases its working set
        leased = replace(
            private, slack_slots=max(private.slack_slots, msg["private_lease"] - ws_blocks)
        )
        targets = {"shared": shared, "private": leased, "nixl_raw": private}
        for name in msg["systems"]:
            self.systems[name] = _open(name, targets[name])
            self.states[name] = runner.prepare(self.systems[name], point)
        self.runner = runner
        return {"calls": {name: state.calls for name, state in self.states.items()}}

    def calls(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Make each system's timed repeats ``msg["calls"][system]`` calls
        (``Workers.open_point``)."""
        for name, state in self.states.items():
            state.run_at_least(int(msg["calls"][name]))
        return {}

    def burst(self, msg: dict[str, Any]) -> dict[str, Any]:
        return self._burst(msg["system"], last=False)

    def last(self, msg: dict[str, Any]) -> dict[str, Any]:
        for name in self.states:
            self._burst(name, last=True)
        return {}

    def _burst(self, name: str, *, last: bool) -> dict[str, Any]:
        """One timed repeat of system ``name``: its ``start``, ``end`` and the ``bytes`` it
        claims (every block of every call). Raises ``RuntimeError`` when ``name`` is a tier whose
        own counters moved other bytes meanwhile (a store of a key already stored sends
        nothing): such a repeat is no figure."""
        state = self.states[name]
        system, op = state.system, state.point.op
        tier = system if isinstance(system, Tier) else None
        before = tier.moved(op) if tier is not None else 0
        start = time.perf_counter()
        self.runner.burst(state, last=last)
        end = time.perf_counter()
        claimed = state.calls * state.point.batch * state.point.block_len
        if tier is not None and (moved := tier.moved(op) - before) != claimed:
            raise RuntimeError(
                f"{name} {'store' if op == 'write' else 'load'} repeat claims {claimed} B, the "
                f"tier's counters moved {moved} B (a key stored before sends nothing)"
            )
        return {"start": start, "end": end, "bytes": claimed}

    def finish(self, msg: dict[str, Any]) -> dict[str, Any]:
        verified = {}
        try:
            for name, state in self.states.items():
                m = self.runner.finish(state)
                verified[name] = m.mismatched_blocks == 0 and m.verified_blocks > 0
        finally:
            self.close()
        return {"verified": verified}

    def close(self) -> None:
        for system in self.systems.values():
            system.close()
        self.systems.clear()
        self.states.clear()


def serve(index: int, commands: IO[str], answers: IO[str]) -> None:
    """Answer ``commands`` until ``exit`` or end of file."""
    worker = Worker(index)
    handlers = {
        "open": worker.open,
        "calls": worker.calls,
        "burst": worker.burst,
        "last": worker.last,
        "finish": worker.finish,
        "threads": lambda msg: {"threads": {t.native_id: t.name for t in threading.enumerate()}},
    }
    try:
        for line in commands:
            msg = json.loads(line)
            if msg["cmd"] == "exit":
                break
            try:
                answer = {"ok": True, **handlers[msg["cmd"]](msg)}
            except Exception as exc:
                answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            answers.write(json.dumps(answer) + "\n")
            answers.flush()
    finally:
        worker.close()


def main() -> int:
    from torch_kv_tier.benchmarks.options import quiet_nixl

    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # native libraries printing to stdout must not corrupt the answers
    sys.stdout = sys.stderr
    quiet_nixl()
    serve(int(sys.argv[1]), sys.stdin, answers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
