"""``torch-kv-tier share-cost``: the CPU a shared pool's control plane spends per key.

A shared store costs, beyond the transfer a private one makes, control-plane work per key: the
host decodes and applies the commit, evicts for the grant that brought the slot and announces
both changes in its index events; every tier that follows the host decodes those events and
applies them to its copy of the index, its own keys included. On a machine whose cores the
tiers and the host share (this 2-core VM running ``shared-bench`` with 4 tiers), that work comes
out of the same cores as the transfers, so it bounds shared/private throughput.

This measures that work on one thread, in this process, with the real code (``SharedService``
over a ``SharedCache``, ``protocol`` frames, ``BlockIndex.apply_host_changes``), in steady
state: ``--tiers`` sessions of one namespace each take a grant of ``--keys-per-commit`` slots
(the pool full, so each slot evicts a key) and commit as many fresh 16-byte keys; then the host
takes its events, encoded once. The events are then replayed, in order, into a follower's copy
of the index (a dict, and the compact table of ``slot_maps``), round by round, the two copies in
alternating order. Figures are thread CPU time per
key (``us_per_key``: per key stored for ``commit`` and ``grant``; per key announced, stored or
evicted, for ``events`` and the followers), median over ``--rounds`` with IQR and min..max:
robust to other processes on the machine, unlike throughput.

From them, per GB stored with blocks of ``--block-sizes`` bytes: the host's CPU, one follower's
and the whole sharing cost when every one of the ``N`` tiers follows the host, in ms of one
core per GB (``ms_per_gb``). Exit status 0; 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from torch_kv_tier.benchmarks.options import (
    add_output_option,
    add_preset_options,
    list_of,
    positive,
    size,
)
from torch_kv_tier.benchmarks.shared_bench import _environment, _spread
from torch_kv_tier.index import BlockIndex
from torch_kv_tier.remote import protocol as p
from torch_kv_tier.remote.leases import Session, SlotPool
from torch_kv_tier.remote.shared_service import SharedService

DEFAULTS: dict[str, Any] = {
    "tiers": [1, 4],
    "block_sizes": [64 << 10, 256 << 10],
    "keys_per_commit": 256,
    "pool_slots": 16384,
    "rounds": 7,
    "steps": 100,
}
HOST_CELLS = ("commit", "grant", "events")
FOLLOWERS = ("dict", "compact")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``share-cost`` options to ``parser``."""
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    add_preset_options(
        parser,
        [
            ("--tiers", list_of(positive), "sessions storing", ""),
            ("--block-sizes", list_of(size), "for ms per GB", "B"),
            ("--keys-per-commit", positive, "keys per grant and commit", ""),
            ("--pool-slots", positive, "the host's pool, in slots", ""),
            ("--rounds", positive, "rounds per figure", ""),
            ("--steps", positive, "commits per session and round", ""),
        ],
        DEFAULTS,
    )
    add_output_option(parser, "--json", "every figure")


def _timed(clock: dict[str, float], name: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, its thread CPU time added to ``clock[name]``."""
    t0 = time.thread_time()
    out = fn(*args)
    clock[name] = clock.get(name, 0.0) + time.thread_time() - t0
    return out


def _answer(service: SharedService, session: Session, frame: bytes) -> bytes | None:
    """What the server does with a shared session's frame: decode, answer, encode the reply."""
    reply = service.answer(session, p.decode_client(frame), 0.0)  # type: ignore[arg-type]
    return p.encode(reply) if reply is not None else None


Frames = list[list[bytes]]  # event frames, per round


def _host_rounds(
    tiers: int, per_commit: int, pool: int, rounds: int, steps: int
) -> tuple[dict[str, list[float]], float, Frames, Frames]:
    """The host's µs per key of each cell per round, keys announced per key stored, and the
    event frames of the warm-up and of the timed rounds."""
    service = SharedService(SlotPool(pool), quota=None, max_granted=per_commit)
    sessions = [
        Session(f"s{i}", f"p{i}", "bench", range(0), 0.0, 0.0, shared=True, namespace="m")
        for i in range(tiers)
    ]
    for session in sessions:
        service.join(session)
    seq, next_key = 1, 0
    per_key: dict[str, list[float]] = {cell: [] for cell in HOST_CELLS}
    frames: Frames = []
    stored_all = announced_all = 0
    warmup = max(1, -(-pool // (tiers * per_commit)))  # fill the pool: every later grant evicts
    for r in range(-warmup, rounds):
        clock: dict[str, float] = {}
        stored = announced = 0
        round_frames: list[bytes] = []
        for _ in range(steps if r >= 0 else 1):
            for s in sessions:
                ask = p.encode(p.GrantRequest(seq, s.session_id, per_commit))
                granted = _timed(clock, "grant", _answer, service, s, ask)
                slots = p.decode_server(granted).slots  # type: ignore[union-attr]
                keys = [(next_key + i).to_bytes(16, "little") for i in range(len(slots))]
                next_key += len(slots)
                commit = p.encode(p.Commit(seq + 1, s.session_id, keys, slots, [7] * len(keys)))
                _timed(clock, "commit", _answer, service, s, commit)
                seq += 2
                stored += len(keys)
            batch = _timed(clock, "events", service.events, sessions)
            for _, frame in batch:
                events = p.decode_server(frame)
                announced += len(events.stored) + len(events.evicted)  # type: ignore[union-attr]
                round_frames.append(frame)
        frames.append(round_frames)
        if r >= 0:
            stored_all, announced_all = stored_all + stored, announced_all + announced
            per_key["grant"].append(clock["grant"] / stored * 1e6)
            per_key["commit"].append(clock["commit"] / stored * 1e6)
            per_key["events"].append(clock["events"] / max(announced, 1) * 1e6)
    return per_key, announced_all / max(stored_all, 1), frames[:warmup], frames[warmup:]


def _follower_rounds(pool: int, warm: Frames, timed: Frames) -> dict[str, list[float]]:
    """Each follower's µs per key announced (a dict copy and a compact one): decode each frame
    and apply it, per round, the two in alternating order round by round."""
    indexes = {f: BlockIndex(compact=f == "compact") for f in FOLLOWERS}
    peers = {f: index.add_shared_peer("host", pool) for f, index in indexes.items()}

    def apply(follower: str, frame: bytes) -> int:
        e = p.decode_server(frame)
        assert isinstance(e, p.Events)
        indexes[follower].apply_host_changes(
            peers[follower], e.stored, e.slots, e.digests, e.evicted, False
        )
        return len(e.stored) + len(e.evicted)

    for frames in warm:
        for follower in FOLLOWERS:
            for frame in frames:
                apply(follower, frame)
    out: dict[str, list[float]] = {f: [] for f in FOLLOWERS}
    for r, frames in enumerate(timed):
        for follower in FOLLOWERS if r % 2 == 0 else FOLLOWERS[::-1]:
            t0 = time.thread_time()
            announced = sum(apply(follower, frame) for frame in frames)
            out[follower].append((time.thread_time() - t0) / max(announced, 1) * 1e6)
    return out


def measure(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per number of tiers: ``us_per_key`` of every host cell and follower (spread
    over rounds), ``announced_per_stored`` and ``ms_per_gb`` per block size."""
    rows = []
    pool, per_commit = cfg["pool_slots"], cfg["keys_per_commit"]
    for tiers in cfg["tiers"]:
        host, announced, warm, timed = _host_rounds(
            tiers, per_commit, pool, cfg["rounds"], cfg["steps"]
        )
        cells = {**host, **_follower_rounds(pool, warm, timed)}
        us = {name: _spread(values) for name, values in cells.items()}
        host_us = sum(us[c]["median"] for c in ("commit", "grant"))
        host_us += us["events"]["median"] * announced
        costs = {}
        for block_len in cfg["block_sizes"]:
            keys_per_ms = 1e9 / block_len / 1e3  # keys per GB, in thousands: µs -> ms
            follower = {f: us[f]["median"] * announced * keys_per_ms for f in FOLLOWERS}
            costs[str(block_len)] = {
                "host": host_us * keys_per_ms,
                **{f"follower_{f}": v for f, v in follower.items()},
                "all_tiers_dict": host_us * keys_per_ms + tiers * follower["dict"],
            }
        rows.append({
            "tiers": tiers, "us_per_key": us, "announced_per_stored": announced,
            "ms_per_gb": costs, "rounds_us_per_key": {k: [round(x, 4) for x in v]
                                                      for k, v in cells.items()},
        })  # fmt: skip
    return rows


def _label(n: int) -> str:
    return f"{n >> 20}M" if n >= 1 << 20 else f"{n >> 10}K"


def table(rows: list[dict[str, Any]]) -> str:
    """µs per key of each cell, then ms of CPU per GB stored, per number of tiers."""

    def cell(s: dict[str, float]) -> str:
        return f"{s['median']:.2f} ({s['q1']:.2f}-{s['q3']:.2f}; {s['min']:.2f}..{s['max']:.2f})"

    lines = [
        "| tiers | host commit µs/key | host grant µs/key | host events µs/key announced "
        "| follower (dict) µs/key announced | follower (compact) | announced per stored |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        u = r["us_per_key"]
        lines.append(
            f"| {r['tiers']} | {cell(u['commit'])} | {cell(u['grant'])} | {cell(u['events'])} "
            f"| {cell(u['dict'])} | {cell(u['compact'])} | {r['announced_per_stored']:.2f} |"
        )
    lines += ["", "| tiers | block | host ms/GB | one follower ms/GB (dict / compact) "
              "| host + every tier following (dict) ms/GB |", "|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        for block_len, c in r["ms_per_gb"].items():
            lines.append(
                f"| {r['tiers']} | {_label(int(block_len))} | {c['host']:.1f} "
                f"| {c['follower_dict']:.1f} / {c['follower_compact']:.1f} "
                f"| {c['all_tiers_dict']:.1f} |"
            )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Measure, print the tables, write ``--json``; return the exit status."""
    cfg = {k: (v if (v := getattr(args, k, None)) is not None else DEFAULTS[k]) for k in DEFAULTS}
    if cfg["keys_per_commit"] > min(p.MAX_KEYS_PER_MESSAGE, cfg["pool_slots"] // 2):
        print(f"torch-kv-tier share-cost: --keys-per-commit must be at most "
              f"{p.MAX_KEYS_PER_MESSAGE} and half of --pool-slots", file=sys.stderr)  # fmt: skip
        return 2
    env = _environment()
    rows = measure(cfg)
    env["loadavg_end"] = os.getloadavg()
    print(table(rows))
    print(
        f"\n{cfg['rounds']} rounds of {cfg['steps']} commits of {cfg['keys_per_commit']} keys per "
        f"tier; pool {cfg['pool_slots']} slots; thread CPU time; load average "
        f"{'/'.join(f'{x:.2f}' for x in env['loadavg_start'])} at start on {env['cpus']} CPUs"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "config": cfg, "rows": rows}, f, indent=1)
        print(f"results: {args.json}")
    return 0
