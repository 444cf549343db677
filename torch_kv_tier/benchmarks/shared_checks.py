"""The shared pool's non-throughput figures for ``torch-kv-tier shared-bench``.

- ``cross_tier_hit``: tier A stores N blocks, tier B (same namespace) loads them; bytes compared.
- ``lookup_latency``: ``tier.lookup``/``tier.contains`` on the scheduler path, p50/p99.
- ``load_latency``: one synchronous ``tier.load(...).result()`` of 16 stored keys from the
  shared pool (tier B, keys stored by A, every digest checked), p50/p99, one call at a time.
- ``staleness``: time from tier A's store future resolving to tier B's ``contains`` seeing the
  key (B polls, sleeping 20 us between polls so that its session thread gets the GIL).
- ``host_kill``: one of several hosts SIGKILLed under a load of every key: time until every
  future settled, counts of ok/"missing"/"peer lost", then the survivors serve again.

Each figure runs its own ``torch-kv-tier serve`` hosts on loopback and two tiers in this process
(two NIXL agents; the tiers' threads share this process's GIL, so the staleness measured is an
upper bound of what two processes would see). Every wait has a timeout; a future that does not
settle in time is counted as hung, never waited on forever.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future, wait
from typing import Any

import numpy as np
import torch

from torch_kv_tier.manager import TierManager
from torch_kv_tier.remote.launch import ServerProcess
from torch_kv_tier.results import MISSING, PEER_LOST, TransferResult

RESULT_TIMEOUT_S = 60.0
_POLL_SLEEP_S = 20e-6


def _us(samples: list[float]) -> dict[str, float]:
    """p50/p99/max of ``samples`` (seconds) in microseconds."""
    arr = np.asarray(samples) * 1e6
    return {
        "p50_us": float(np.percentile(arr, 50)),
        "p99_us": float(np.percentile(arr, 99)),
        "max_us": float(arr.max()),
        "samples": len(samples),
    }


@contextlib.contextmanager
def _pair(block_len: int, slots: int, pool: int) -> Iterator[tuple[TierManager, TierManager]]:
    """Tiers A and B with ``slots`` local blocks each, both joined to one fresh host."""
    with (
        ServerProcess.start(pool, block_len) as server,
        TierManager.create(slots, block_len, name="tier-a") as a,
        TierManager.create(slots, block_len, name="tier-b") as b,
    ):
        a.connect(server.address)
        b.connect(server.address)
        yield a, b


def _wait_visible(tier: TierManager, keys: list[int], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while tier.lookup(keys) < len(keys):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


LOAD_BATCH = 16  # keys per timed load of ``load_latency``


def cross_tier_and_lookup(block_len: int, blocks: int, calls: int) -> dict[str, Any]:
    """Cross-tier hit of ``blocks`` blocks, then ``calls`` lookups/contains on tier B, then
    ``calls // 10`` timed loads of ``LOAD_BATCH`` keys on tier B (``load_latency``)."""
    with _pair(block_len, blocks, 2 * blocks) as (a, b):
        a.arena.tensor.random_(0, 256)
        keys = list(range(1, blocks + 1))
        t0 = time.perf_counter()
        stored = a.store(keys, range(blocks)).result(timeout=RESULT_TIMEOUT_S)
        t_stored = time.perf_counter()
        visible = _wait_visible(b, keys, 10.0)
        t_visible = time.perf_counter()
        targets = torch.randperm(blocks).tolist()
        loaded = b.load(keys, targets).result(timeout=RESULT_TIMEOUT_S)
        t_loaded = time.perf_counter()
        identical = int((b.arena.tensor[targets] == a.arena.tensor[:blocks]).all(dim=1).sum())
        hit = {
            "block_len": block_len,
            "blocks": blocks,
            "stored_ok": stored.ok,
            "visible_to_b": visible,
            "loaded_ok": loaded.ok,
            "load_failed": dict(Counter(loaded.failed.values())),
            "identical_blocks": identical,
            "store_s": t_stored - t0,
            "visible_s": t_visible - t_stored,
            "load_s": t_loaded - t_visible,
        }
        prefix, absent = keys[:32], [-k for k in keys[:32]]
        lookup = {
            "lookup_hit_32": _us(_time_calls(lambda: b.lookup(prefix), calls)),
            "lookup_miss_32": _us(_time_calls(lambda: b.lookup(absent), calls)),
            "contains": _us(_time_calls(lambda: b.contains(keys[-1]), calls)),
        }
        return {
            "cross_tier_hit": hit,
            "lookup": lookup,
            "load_latency": _load_latency(b, keys, max(1, calls // 10)),
        }


def _load_latency(tier: TierManager, keys: list[int], calls: int) -> dict[str, Any]:
    """``calls`` synchronous loads of ``LOAD_BATCH`` stored keys (cycling through ``keys``)
    into local blocks ``0 .. LOAD_BATCH - 1``; p50/p99 in µs. A load that is not ok fails."""
    groups = [keys[i : i + LOAD_BATCH] for i in range(0, len(keys) - LOAD_BATCH + 1, LOAD_BATCH)]
    local = list(range(LOAD_BATCH))
    out = []
    for i in range(calls):
        t0 = time.perf_counter()
        result = tier.load(groups[i % len(groups)], local).result(timeout=RESULT_TIMEOUT_S)
        out.append(time.perf_counter() - t0)
        if not result.ok:
            raise RuntimeError(f"load latency: {Counter(result.failed.values())}")
    return {"keys_per_call": LOAD_BATCH, **_us(out)}


def _time_calls(fn: Callable[[], object], calls: int) -> list[float]:
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def staleness(block_len: int, samples: int) -> dict[str, Any]:
    """Store one key at a time in tier A; time until tier B's ``contains`` sees it."""
    with _pair(block_len, 8, 4 * samples + 64) as (a, b):
        lags, unseen = [], 0
        stamps: queue.SimpleQueue[float] = queue.SimpleQueue()  # when each future resolved
        for i in range(samples):
            key = 10_000_000 + i
            future = a.store([key], [i % 8])
            future.add_done_callback(lambda _f: stamps.put(time.perf_counter()))
            result = future.result(timeout=RESULT_TIMEOUT_S)
            done_at = stamps.get(timeout=RESULT_TIMEOUT_S)  # callbacks run after waiters wake
            if not result.ok:
                raise RuntimeError(f"staleness store failed: {result.failed}")
            deadline = time.monotonic() + 5.0
            while not b.contains(key) and time.monotonic() < deadline:
                time.sleep(_POLL_SLEEP_S)
            seen = time.perf_counter()
            if b.contains(key):
                lags.append(seen - done_at)
            else:
                unseen += 1
        return {"block_len": block_len, **_us(lags), "unseen_after_5s": unseen}


def host_kill(
    block_len: int, hosts: int, keys_per_host: int, batch: int, heartbeat_s: float
) -> dict[str, Any]:
    """SIGKILL one of ``hosts`` hosts, then load every key: nothing hangs, the rest serve.

    The sessions' ZeroMQ sockets do not report a dead peer: reads pinned on the killed host
    settle when its heartbeat timeout (``heartbeat_s``) declares it lost.
    """
    blocks = hosts * keys_per_host
    servers = [ServerProcess.start(4 * keys_per_host, block_len) for _ in range(hosts)]
    try:
        with TierManager.create(blocks, block_len, name="tier-kill") as tier:
            tier.arena.tensor.random_(0, 256)
            original = tier.arena.tensor.clone()
            peers = [tier.connect(s.address, heartbeat_timeout_s=heartbeat_s) for s in servers]
            keys = list(range(1, blocks + 1))
            stored = tier.store(keys, range(blocks)).result(timeout=RESULT_TIMEOUT_S)
            if not stored.ok:
                raise RuntimeError(f"host_kill store failed: {Counter(stored.failed.values())}")
            on_victim = tier.stats().peers[peers[0]].keys
            tier.arena.tensor.zero_()
            with _quiet("torch_kv_tier"):  # a warning per failed pin and a lost peer: expected
                servers[0].kill()
                t0 = time.perf_counter()
                futures = [
                    tier.load(keys[i : i + batch], range(i, min(i + batch, blocks)))
                    for i in range(0, blocks, batch)
                ]
                done, not_done = wait(futures, timeout=RESULT_TIMEOUT_S)
                settle_s = time.perf_counter() - t0
            counts = _outcomes(futures, done)
            ok_keys = [k for f in done for k in f.result().keys]
            idx = [int(k) - 1 for k in ok_keys]  # key k came from local block k - 1
            wrong = int((tier.arena.tensor[idx] != original[idx]).any(dim=1).sum()) if idx else 0
            again = tier.load(keys, range(blocks)).result(timeout=RESULT_TIMEOUT_S)
            after = dict(Counter(again.failed.values()))
            after["ok"] = blocks - len(again.failed)
            return {
                "block_len": block_len,
                "hosts": hosts,
                "keys": blocks,
                "keys_on_killed_host": on_victim,
                "settle_s": settle_s,
                "heartbeat_timeout_s": heartbeat_s,
                "hung_futures": len(not_done),
                "first_load": counts,
                "wrong_bytes_blocks": wrong,
                "reload": after,
                "peers_left": len(tier.peers()),
            }
    finally:
        for server in servers:
            server.kill()


@contextlib.contextmanager
def _quiet(name: str) -> Iterator[None]:
    log = logging.getLogger(name)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _outcomes(futures: list[Future[TransferResult]], done: set[Any]) -> dict[str, int]:
    counts: Counter[str] = Counter()
    for f in futures:
        if f not in done:
            continue
        result = f.result()
        counts["ok"] += len(result.keys)
        for reason in result.failed.values():
            counts[reason if reason in (MISSING, PEER_LOST) else "other"] += 1
    return {"ok": counts["ok"], MISSING: counts[MISSING], PEER_LOST: counts[PEER_LOST],
            "other": counts["other"]}  # fmt: skip
