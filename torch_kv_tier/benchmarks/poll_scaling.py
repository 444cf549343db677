"""Poll cost per completed transfer of the tier's transport, from 10 to 10,000 in flight.

For each depth N the transport is kept at N single-block writes in flight (``write_blocks``):
a loop calls ``poll()`` and replaces every completed transfer with a new one, until at least
``max(2N, 2000)`` transfers have completed. The figure is the time spent inside ``poll`` divided
by the transfers it reported: it stays flat when a poll costs in proportion to what it completes,
and grows with N when every poll rescans every outstanding transfer while few complete. Submit
cost is reported apart. The depths take turns: each round runs every depth once, the order
reversed every other round, and each run's blocks are read back and compared right after it.

Over UCX shared memory (the loopback default) a write usually completes inside ``transfer()``,
so "in flight" means submitted and not yet reported; ``--ucx-tls tcp`` keeps them on the wire.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from typing import Any

import numpy as np

from torch_kv_tier.benchmarks.core import Skip, TransferFailed, check, clear, fill
from torch_kv_tier.benchmarks.remote import Target, open_session
from torch_kv_tier.benchmarks.system_nixl_raw import local_arena

_REPEATS = 3
_PEER = "bench-remote"


class _Steady:
    """One steady-state run at a given depth: what it cost and how much it moved."""

    def __init__(self, transport: Any, depth: int, slots: int, base: int, total: int) -> None:
        self.submit_s = 0.0
        self.polls: list[float] = []
        self.completed = 0
        submitted = 0
        deadline = time.monotonic() + 120.0
        t0 = time.perf_counter()
        while self.completed < total:
            want = min(depth - (submitted - self.completed), total - submitted)
            t = time.perf_counter()
            for _ in range(want):
                j = submitted % slots
                if transport.write_blocks(_PEER, [j], [base + j]) is None:
                    raise TransferFailed("write_blocks refused a transfer")
                submitted += 1
            t1 = time.perf_counter()
            result = transport.poll()
            self.polls.append(time.perf_counter() - t1)
            self.submit_s += t1 - t
            if result.failed:
                raise TransferFailed(f"{len(result.failed)} transfers failed")
            self.completed += len(result.done)
            if time.monotonic() > deadline:
                raise TransferFailed(f"{submitted - self.completed} transfers stuck for 120 s")
        self.elapsed = time.perf_counter() - t0


def measure_poll_scaling(
    target: Target, depths: list[int], env: dict[str, Any]
) -> list[dict[str, Any]]:
    """One ``poll_scaling`` row per depth: measured, ``error`` (the transport failed) or
    ``skipped`` (the remote host refused the session)."""
    from torch_kv_tier.transport import NixlTransport

    slots = min(max(depths), target.remote_slots, target.local_slots // 2)
    mine = replace(target, device="cpu", local_slots=2 * slots, remote_slots=slots)
    arena = local_arena(mine, pinned=False)

    def row(depth: int, **fields: Any) -> dict[str, Any]:
        base = {
            "kind": "poll_scaling",
            "system": "torch_kv_tier",
            "path": "transport",
            "op": "write",
            "device": "cpu",
            "pattern": "single-block",
            "block_len": target.block_len,
            "batch": 1,
            "inflight": depth,
            "inflight_requested": depth,
            "gbps": None,
            "p50_us": None,
            "p99_us": None,
            "verified": False,
            "skipped": None,
            "error": None,
            "env": env,
        }
        return {**base, **fields}

    if target.address is None:
        return [row(depth, error=f"no remote host: {target.problem}") for depth in depths]
    transport = NixlTransport("bench-poll", arena)
    session: Any = None
    try:
        try:
            session = open_session(
                mine, transport.get_agent_metadata(), transport.base_addr, 2 * slots, "DRAM"
            )
        except Skip as exc:
            return [row(depth, skipped=str(exc)) for depth in depths]
        transport.add_remote_peer(
            _PEER, session.agent_metadata, session.base_addr, session.num_blocks, target.block_len
        )
        base, slots = session.lease.start, min(slots, len(session.lease))
        measured = _rounds(transport, arena, depths, slots, base, 9000)
    finally:
        transport.close()
        if session is not None:
            session.close()
    return [row(depth, **fields) for depth, fields in zip(depths, measured, strict=True)]


class _Depth:
    """One depth's runs: the slots they write (``used``), their pattern's seed, the timed runs,
    the blocks read back wrong over them, and the transport's failure if one ended them."""

    def __init__(self, depth: int, slots: int, seed: int) -> None:
        self.depth, self.seed = depth, seed
        self.total = max(2 * depth, 2000)
        self.used = np.arange(min(self.total, slots))  # every slot a run writes (``j % slots``)
        self.runs: list[_Steady] = []
        self.bad = 0
        self.error: str | None = None


def _rounds(
    transport: Any, arena: Any, depths: list[int], slots: int, base: int, seed: int
) -> list[dict[str, Any]]:
    """Each depth's figures, in ``depths``' order: a short warm-up of every depth (round -1,
    excluded), then ``_REPEATS`` rounds with one timed run of each, in reverse order every other
    round, so that a change of load over the measurement does not fall on the deepest runs
    alone. Every timed run writes its depth's own pattern, read back and compared right after
    it. A depth whose transport failed (``TransferFailed``) has only ``error`` and sits out the
    later rounds."""
    states = [_Depth(depth, slots, seed + n) for n, depth in enumerate(depths)]
    for r in range(-1, _REPEATS):
        for state in states if r % 2 == 0 else states[::-1]:
            if state.error is not None:
                continue
            try:
                fill(arena, state.used, state.seed)
                if r < 0:
                    _Steady(transport, state.depth, slots, base, min(state.total, 500))
                    continue
                state.runs.append(_Steady(transport, state.depth, slots, base, state.total))
                state.bad += _read_back(transport, arena, state.used, slots, base, state.seed)
            except TransferFailed as exc:
                state.error = str(exc)
    return [_figures(s, arena.shape[1]) if s.error is None else {"error": s.error} for s in states]


def _figures(state: _Depth, block_len: int) -> dict[str, Any]:
    """A depth's row fields: medians over its runs (``poll_us_per_round``: each run's, in
    round order, for ratios paired by round), ``verified`` when no block read back wrong."""
    runs, bad = state.runs, state.bad
    per_poll = [t * 1e6 for r in runs for t in r.polls]
    per_round = [sum(r.polls) / r.completed * 1e6 for r in runs]
    return {
        "poll_us_per_transfer": statistics.median(per_round),
        "poll_us_per_round": per_round,
        "submit_us_per_transfer": statistics.median(r.submit_s / r.completed * 1e6 for r in runs),
        "completed_per_poll": statistics.median(r.completed / len(r.polls) for r in runs),
        "polls": int(statistics.median(len(r.polls) for r in runs)),
        "transfers": state.total,
        "gbps": statistics.median(r.completed * block_len / r.elapsed / 1e9 for r in runs),
        "blocks_per_s": statistics.median(r.completed / r.elapsed for r in runs),
        "p50_us": float(np.percentile(per_poll, 50)),
        "p99_us": float(np.percentile(per_poll, 99)),
        "verified": bad == 0,
        "error": None if bad == 0 else f"{bad} of {len(state.used) * len(runs)} blocks differ",
        "repeats": _REPEATS,
    }


def _read_back(
    transport: Any, arena: Any, used: np.ndarray, slots: int, base: int, seed: int
) -> int:
    """Read the written remote blocks into the upper half of ``arena``; blocks that differ."""
    scratch = used + slots
    clear(arena, scratch)
    ids = [
        transport.read_blocks(_PEER, [int(s)], [base + int(u)])
        for s, u in zip(scratch, used, strict=True)
    ]
    if None in ids:
        raise TransferFailed("read_blocks refused a read-back")
    pending = len(ids)
    deadline = time.monotonic() + 60.0
    while pending:
        r = transport.poll()
        if r.failed:
            raise TransferFailed("read-back failed")
        pending -= len(r.done)
        if time.monotonic() > deadline:
            raise TransferFailed("read-back did not finish in 60 s")
    return check(arena, scratch, used, seed)
