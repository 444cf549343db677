"""Concurrency: threads hammer one tier with store/load/discard/lookup on shared keys.

Every stored block carries its key, a version unique to the store call that wrote it and a
CRC over both and the payload. Threads log each call with the monotonic times it started and
returned; a collector thread drains ``take_events()`` every millisecond and stamps each batch
with the window it happened in. After the run, ``reliability_history.History.check`` holds the
log to the tier's documented semantics (integrity, causality, freshness, visibility, no loss,
durability, the event log: that module's docstring).
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
import zlib
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import Future

import numpy as np
import torch

from torch_kv_tier.benchmarks.reliability_common import (
    TCP_ENV,
    Outcome,
    ucx_over_tcp,
)
from torch_kv_tier.benchmarks.reliability_history import (
    Call,
    EventBatch,
    History,
    Kind,
    Workload,
    check_final_state,
)
from torch_kv_tier.manager import TierManager, TransferResult
from torch_kv_tier.remote import ServerProcess

HEADER = 16  # bytes: key id (u32), CRC (u32), version (u64)
MAX_KEYS_PER_CALL = 3
CALL_TIMEOUT_S = 30.0

# -- blocks -------------------------------------------------------------------------------------


def make_block(key_id: int, version: int, block_len: int) -> np.ndarray:
    """A block: header (key id, CRC, version) then a payload derived from the version."""
    payload = np.random.default_rng(version).integers(0, 256, block_len - HEADER, dtype=np.uint8)
    block = np.empty(block_len, dtype=np.uint8)
    block[HEADER:] = payload
    _header(block)[:] = (key_id, 0, version & 0xFFFFFFFF, version >> 32)
    _header(block)[1] = _crc(block)
    return block


def read_block(block: np.ndarray) -> tuple[int, int, bool]:
    """(key id, version, CRC matches) of a block written by ``make_block``."""
    head = _header(block)
    key_id, crc, lo, hi = (int(x) for x in head)
    return key_id, lo | (hi << 32), crc == _crc(block)


def _header(block: np.ndarray) -> np.ndarray:
    return block[:HEADER].view(np.uint32)


def _crc(block: np.ndarray) -> int:
    """CRC over everything but the CRC field itself."""
    return zlib.crc32(block[8:].data, zlib.crc32(block[:4].data)) & 0xFFFFFFFF


# -- running ------------------------------------------------------------------------------------


def run_workers(
    tier: TierManager,
    workload: Workload,
    threads: int,
    calls: int,
    *,
    first_block: int = 0,
    seed: int = 0,
) -> tuple[list[Call], list[EventBatch], list[str]]:
    """``threads`` workers make ``calls`` random calls each; returns the merged call log, the
    event batches and the workers' errors (a call that raised or timed out stops its worker).

    Worker ``w`` owns arena blocks from ``first_block + 2 * MAX_KEYS_PER_CALL * w`` on (its
    sources, then its destinations)."""
    logs: list[list[Call]] = [[] for _ in range(threads)]
    errors: list[str] = []
    batches: list[EventBatch] = []
    stop = threading.Event()
    collector = threading.Thread(
        target=_collect, args=(tier, batches, stop, time.monotonic()), daemon=True
    )
    collector.start()
    workers = [
        threading.Thread(
            target=_work,
            args=(
                tier,
                workload,
                logs[w],
                errors,
                calls,
                first_block + 2 * MAX_KEYS_PER_CALL * w,
                seed + w,
            ),
            name=f"worker-{w}",
            daemon=True,
        )
        for w in range(threads)
    ]
    for worker in workers:
        worker.start()
    deadline = time.monotonic() + CALL_TIMEOUT_S + calls * 0.5
    for worker in workers:
        worker.join(timeout=max(0.0, deadline - time.monotonic()))
    stop.set()
    collector.join(timeout=5)
    hung = [w.name for w in workers if w.is_alive()]
    if hung:
        raise TimeoutError(
            f"workers still running after {CALL_TIMEOUT_S + calls * 0.5:.0f} s: {hung}"
        )
    return [c for log in logs for c in log], batches, errors


def _collect(
    tier: TierManager, batches: list[EventBatch], stop: threading.Event, last: float
) -> None:
    """Drain the event log every millisecond, stamping each batch with its time window: its
    events happened after the previous drain began (``last`` for the first) and before this
    drain returned. The last drain runs after ``stop`` is set."""
    while True:
        stopping = stop.is_set()
        before = time.monotonic()
        events = tier.take_events()
        after = time.monotonic()
        if events:
            batches.append(EventBatch(last, after, events))
        last = before
        if stopping:
            return
        time.sleep(0.001)


def _work(
    tier: TierManager,
    workload: Workload,
    log: list[Call],
    errors: list[str],
    calls: int,
    base: int,
    seed: int,
) -> None:
    try:
        _calls(tier, workload, log, calls, base, seed)
    except Exception as exc:  # recorded; the missing calls show in the figures
        errors.append(f"{threading.current_thread().name} after {len(log)} calls: {exc!r}")


def _calls(
    tier: TierManager, workload: Workload, log: list[Call], calls: int, base: int, seed: int
) -> None:
    rng = random.Random(seed)
    tensor = tier.arena.tensor
    block_len = tier.arena.block_len
    src = list(range(base, base + MAX_KEYS_PER_CALL))
    dst = list(range(base + MAX_KEYS_PER_CALL, base + 2 * MAX_KEYS_PER_CALL))
    n = len(workload.keys)
    for _ in range(calls):
        ids = rng.sample(range(n), rng.randint(1, MAX_KEYS_PER_CALL))
        keys = [workload.keys[i] for i in ids]
        kind: Kind = rng.choices(("store", "load", "discard", "lookup"), (35, 35, 10, 20))[0]
        call = Call(kind, ids, 0.0)
        if kind == "store":
            call.versions = [workload.version() for _ in ids]
            for slot, key_id, version in zip(src, ids, call.versions):
                tensor[slot] = torch.from_numpy(make_block(key_id, version, block_len))
            call.t0 = time.monotonic()
            future = tier.store(keys, src[: len(ids)])
        elif kind == "load":
            tensor[dst[0] : dst[-1] + 1].zero_()
            call.t0 = time.monotonic()
            future = tier.load(keys, dst[: len(ids)])
        elif kind == "discard":
            call.t0 = time.monotonic()
            tier.discard(keys)
            call.t1 = call.done = time.monotonic()
            log.append(call)
            continue
        else:
            call.t0 = time.monotonic()
            call.prefix = tier.lookup(keys)
            call.t1 = call.done = time.monotonic()
            log.append(call)
            continue
        call.t1 = time.monotonic()
        log.append(call)
        _settle(call, future, workload, tensor, dst)  # a hang raises: the worker stops


def _settle(
    call: Call,
    future: Future[TransferResult],
    workload: Workload,
    tensor: torch.Tensor,
    dst: Sequence[int],
) -> None:
    """Wait for a store/load and log its outcome; a loaded key's block is read at once."""
    result = future.result(timeout=CALL_TIMEOUT_S)
    call.done = time.monotonic()
    call.nbytes = result.nbytes
    for i, key_id in enumerate(call.keys):
        reason = result.failed.get(workload.keys[key_id])
        call.ok[key_id] = reason is None
        if reason is not None:
            call.reasons[key_id] = reason
        elif call.kind == "load":
            call.loaded[key_id] = read_block(tensor[dst[i]].numpy())


def final_load(tier: TierManager, workload: Workload, first_block: int) -> Call:
    """Load every key the index holds now, in one call, as a last logged call."""
    present = [i for i, k in enumerate(workload.keys) if tier.contains(k)]
    dst = list(range(first_block, first_block + len(present)))
    call = Call("load", present, time.monotonic())
    future = tier.load([workload.keys[i] for i in present], dst)
    call.t1 = time.monotonic()
    _settle(call, future, workload, tier.arena.tensor, dst)
    return call


# -- the scenario -------------------------------------------------------------------------------


def concurrency(
    threads: int,
    calls: int,
    *,
    keys: int = 48,
    lease: int = 32,
    block_len: int = 4096,
    tcp: bool = True,
    seed: int = 0,
) -> Outcome:
    """``threads`` x ``calls`` mixed calls on ``keys`` shared keys, through a tier leasing
    ``lease`` slots (fewer than keys: stores evict), then every check of ``History``."""
    out = Outcome(
        "concurrency",
        {
            "threads": threads,
            "calls_per_thread": calls,
            "keys": keys,
            "lease": lease,
            "transport": "UCX tcp" if tcp else "UCX default",
        },
    )
    started = time.monotonic()
    workload = Workload(keys)
    worker_blocks = 2 * MAX_KEYS_PER_CALL * threads
    with (
        ucx_over_tcp() if tcp else contextlib.nullcontext(),
        ServerProcess.start(lease, block_len, env=TCP_ENV if tcp else {}) as server,
        TierManager.create(
            worker_blocks + keys, block_len, name="concurrency", events=True
        ) as tier,
    ):
        tier.connect(server.address, private=True)
        log, batches, errors = run_workers(tier, workload, threads, calls, seed=seed)
        last = final_load(tier, workload, worker_blocks)
        history = History(workload, [*log, last], batches)
        problems = errors + history.check()
        check_final_state(tier, workload, history, problems)
        stats = tier.stats()
    for text in problems:
        out.problem(text)
    counts = Counter(c.kind for c in log)
    out.equals("calls made", len(log), threads * calls)
    for kind in ("store", "load", "discard", "lookup"):
        out.info(f"{kind} calls", counts[kind])
    out.info("blocks loaded and verified", history.counts["blocks loaded"])
    out.info("loads of absent keys (missing)", history.counts["loads missing"])
    out.info("evictions", history.counts["event evicted"])
    out.info("discards applied", history.counts["event discarded"])
    out.equals("failed transfers", stats.transfers_failed, 0)
    out.equals("events dropped", stats.events_dropped, 0)
    out.equals("violations of the tier's semantics", history.counts["problems"], 0)
    out.seconds = time.monotonic() - started
    return out
