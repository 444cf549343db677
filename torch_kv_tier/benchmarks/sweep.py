"""Measuring one point of the sweep on one system: warm-up, timed repeats, byte verification.

A point is (op, pattern, block_len, batch, inflight). For each point the system gets a plan of
disjoint calls (``core.make_plan``) covering a working set of about ``working_set`` bytes; the
sweep cycles through the plan keeping ``inflight`` calls outstanding.

1. The plan's local blocks are filled with a pattern unique to the point; for a read point they
   are first written to the remote side (untimed) and then zeroed locally.
2. A warm-up pass (excluded) runs at least one cycle and ``warmup`` seconds; it sizes the timed
   repeats to about ``min_time`` seconds each, in whole cycles of the plan.
3. ``repeats`` timed repeats. Before the last one, writes refill their source with a new pattern
   and reads zero their destination again, so the last repeat alone must have moved every byte.
4. Verification: reads compare the local blocks with the pattern; writes read the remote blocks
   back (through the system, or a bare NIXL reader for write-only systems) and compare. A point
   whose bytes do not match is an error, not a number.

Reported: median GB/s and blocks/s over the repeats; per-call latency (submit to observed
completion) p50/p99 pooled over the timed repeats.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections.abc import Hashable
from dataclasses import dataclass, field

import numpy as np

from torch_kv_tier.benchmarks.core import (
    Call,
    Op,
    Pattern,
    Plan,
    System,
    TransferFailed,
    check,
    clear,
    drain,
    make_plan,
)
from torch_kv_tier.benchmarks.core import fill as fill_pattern

STALL_S = 30.0  # a point with no completion for this long fails


@dataclass(frozen=True)
class Point:
    op: Op
    pattern: Pattern
    block_len: int
    batch: int
    inflight: int


@dataclass(frozen=True)
class Settings:
    """How long and how often each point runs (see the module docstring)."""

    repeats: int = 3
    min_time: float = 0.25
    warmup: float = 0.1
    working_set: int = 64 << 20
    mean_run: float = 4.0
    seed: int = 1234
    max_calls: int = 200_000


@dataclass
class Measurement:
    gbps: list[float]
    blocks_per_s: list[float]
    latencies: list[float]
    calls: int
    inflight: int
    verified_blocks: int
    mismatched_blocks: int
    us_per_call: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, object]:
        lat = np.asarray(self.latencies) * 1e6
        return {
            "gbps": statistics.median(self.gbps),
            "gbps_repeats": [round(g, 4) for g in self.gbps],
            "us_per_call_repeats": [round(u, 2) for u in self.us_per_call],
            "blocks_per_s": statistics.median(self.blocks_per_s),
            "p50_us": float(np.percentile(lat, 50)),
            "p99_us": float(np.percentile(lat, 99)),
            "calls": self.calls,
            "repeats": len(self.gbps),
            "inflight": self.inflight,
            "verified": self.mismatched_blocks == 0 and self.verified_blocks > 0,
            "verified_blocks": self.verified_blocks,
            "mismatched_blocks": self.mismatched_blocks,
        }


class Keys:
    """Logical keys for systems that place blocks themselves: each ``fresh`` range starts where
    the last one ended (at ``next``), so one source never hands out a key twice.

    Runners whose systems store into the same hosts share one source: a host keeps a key's
    first bytes, and storing the key again sends nothing.
    """

    def __init__(self, first: int = 1) -> None:
        self.next = first

    def fresh(self, n: int) -> range:
        start, self.next = self.next, self.next + n
        return range(start, start + n)


class PointRunner:
    """Runs points on systems; one per benchmark run (owns the pattern seeds, and the key space
    unless given ``keys``: a source it shares with other runners)."""

    def __init__(self, settings: Settings, keys: Keys | None = None) -> None:
        self.settings = settings
        self._keys = keys if keys is not None else Keys()
        self._serial = itertools.count(1)

    def plan_size(self, system: System, point: Point) -> int:
        """Calls in the plan: enough for the working set and the in-flight depth, if they fit."""
        fit = min(system.local.shape[0] // 2, system.remote_slots) // point.batch
        want = max(
            point.inflight, math.ceil(self.settings.working_set / (point.batch * point.block_len))
        )
        return min(fit, want)

    def measure(self, system: System, point: Point) -> Measurement:
        """Measure ``point`` on ``system``; raises ``TransferFailed`` or ``ValueError``."""
        state = self.prepare(system, point)
        for rep in range(self.settings.repeats):
            self.burst(state, last=rep == self.settings.repeats - 1)
        return self.finish(state)

    def prepare(self, system: System, point: Point) -> PointState:
        """Steps 1-2 (plan, fill, stage, warm up); then ``burst`` once per repeat, ``finish``.

        Splitting a point this way lets the caller interleave systems repeat by repeat.
        """
        s = self.settings
        size = self.plan_size(system, point)
        if size < 1:
            raise ValueError(
                f"one call of {point.batch} x {point.block_len} B does not fit the pools "
                "(raise --pool-mib)"
            )
        inflight = min(point.inflight, size)
        serial = next(self._serial)
        plan = make_plan(
            pattern=point.pattern,
            layout=system.remote_layout,
            batch=point.batch,
            num_calls=size,
            local_slots=system.local.shape[0],
            remote_slots=system.remote_slots,
            remote_base=system.remote_base,
            mean_run=s.mean_run,
            seed=s.seed + serial,
        )
        seed = (s.seed + serial) * 2
        slots = plan.local_slots
        fill_pattern(system.local, slots, seed)
        cycle = self._cycle(system, plan, point.op)
        if point.op == "read":
            drain(system, "write", cycle.calls, timeout=STALL_S)
            clear(system.local, slots)

        elapsed, lat = _run(system, point.op, cycle, size, inflight, s.warmup)
        per_call = elapsed / len(lat)
        cycles = max(1, math.ceil(s.min_time / max(per_call, 1e-7) / size))
        calls = min(cycles * size, max(size, s.max_calls // size * size))
        return PointState(system, point, plan, cycle, seed, calls, inflight)

    def burst(self, state: PointState, *, last: bool) -> None:
        """One timed repeat (step 3); ``last`` first refills (writes) or zeroes (reads)."""
        system, point, slots = state.system, state.point, state.plan.local_slots
        if last:
            if point.op == "write":
                state.seed += 1
                fill_pattern(system.local, slots, state.seed)
            else:
                clear(system.local, slots)
        elapsed, lat = _run(system, point.op, state.cycle, state.calls, state.inflight, 0.0)
        blocks = state.calls * point.batch
        state.gbps.append(blocks * point.block_len / elapsed / 1e9)
        state.bps.append(blocks / elapsed)
        state.us_per_call.append(elapsed / state.calls * 1e6)
        state.latencies.extend(lat)

    def finish(self, state: PointState) -> Measurement:
        """Step 4: verify the bytes the last repeat moved."""
        system, plan, seed = state.system, state.plan, state.seed
        slots = plan.local_slots
        if state.point.op == "read":
            bad = check(system.local, slots, slots, seed)
        else:
            scratch = np.concatenate(plan.scratch)
            clear(system.local, scratch)
            system.fetch(state.cycle.last, plan.scratch)
            bad = check(system.local, scratch, slots, seed)
        return Measurement(
            state.gbps,
            state.bps,
            state.latencies,
            state.calls,
            state.inflight,
            len(slots),
            bad,
            state.us_per_call,
        )

    def _cycle(self, system: System, plan: Plan, op: Op) -> _Cycle:
        keys = self._keys if system.remote_layout == "system" else None
        return _Cycle(plan.calls, keys, fresh_per_call=op == "write")


@dataclass
class PointState:
    """A prepared point on one system: its plan, key cycle and the repeats measured so far."""

    system: System
    point: Point
    plan: Plan
    cycle: _Cycle
    seed: int
    calls: int  # per timed repeat
    inflight: int
    gbps: list[float] = field(default_factory=list)
    bps: list[float] = field(default_factory=list)
    us_per_call: list[float] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)

    def run_at_least(self, calls: int) -> None:
        """Make a timed repeat ``calls`` calls, rounded up to whole cycles over the plan (as
        ``PointRunner.prepare`` counts them)."""
        size = len(self.plan.calls)
        self.calls = max(1, math.ceil(calls / size)) * size


class _Cycle:
    """The calls of a plan in submission order, with keys for systems that place blocks.

    Reads (and the staging write before them) reuse one key set per plan call; timed writes take
    fresh keys per call (storing a stored key sends nothing). ``last`` holds the calls of the most
    recent cycle as submitted, for read-back.
    """

    def __init__(self, calls: list[Call], keys: Keys | None, *, fresh_per_call: bool) -> None:
        if keys is not None:
            calls = [c.with_keys(keys.fresh(len(c))) for c in calls]
        self.calls = calls
        self.last = list(calls)
        self._fresh = keys if keys is not None and fresh_per_call else None

    def call(self, i: int) -> Call:
        j = i % len(self.calls)
        c = self.calls[j]
        if self._fresh is not None:
            c = c.with_keys(self._fresh.fresh(len(c)))
            self.last[j] = c
        return c


def _run(
    system: System, op: Op, cycle: _Cycle, calls: int, inflight: int, min_time: float
) -> tuple[float, list[float]]:
    """Run at least ``calls`` calls (more, in whole cycles, until ``min_time`` has passed).

    Returns (elapsed seconds, per-call latencies).
    """
    size = len(cycle.calls)
    pending: dict[Hashable, float] = {}
    latencies: list[float] = []
    submitted = done = 0
    t0 = last_done = time.perf_counter()
    target = calls
    while done < target:
        while submitted < target and len(pending) < inflight:
            call = cycle.call(submitted)
            t = time.perf_counter()
            pending[system.submit(op, call)] = t
            submitted += 1
        finished = system.reap(0.5)
        for token, t_done in finished:
            latencies.append(t_done - pending.pop(token))
        done += len(finished)
        now = time.perf_counter()
        if finished:
            last_done = now
        elif now - last_done > STALL_S:
            raise TransferFailed(f"{system.name}: no completion for {STALL_S:.0f} s")
        if done == target and now - t0 < min_time:
            target += size
    return time.perf_counter() - t0, latencies
