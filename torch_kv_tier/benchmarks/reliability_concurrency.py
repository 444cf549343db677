"""Concurrency: threads hammer one tier with store/load/discard/lookup on shared keys.

Every stored block carries its key, a version unique to the store call that wrote it and a
CRC over both and the payload. Threads log each call with the monotonic times it started and
returned; a collector thread drains ``take_events()`` every millisecond and stamps each batch
with the window it happened in. After the run, ``History.check`` holds the log to the tier's
documented semantics (README "Usage"):

* a loaded block is intact (CRC), carries the key it was loaded under, and a version that some
  store of that key wrote (**integrity**), and that store began before the load returned
  (**causality**);
* it is not stale: no evidence shows the key absent after that store finished and before the
  load began (**freshness**). With dedupe, the content under a key is that of the store that
  *published* it; a later store of a present key sends nothing, so only absence (a discard, an
  eviction, a failed "missing" load, a lookup that stopped at it, a store that had to send it)
  retires a version;
* what a call saw agrees with the event log: a key that loaded or passed ``lookup`` was
  published before the call returned and not removed before it began (**visibility**); a key
  reported missing was not provably present throughout the call (**no loss**); a store that
  succeeded made its key present at some moment of the call unless a discard overlapped it
  (**durability**);
* per key, events alternate ``stored`` and a removal, and the final index is exactly what the
  event log says (**event log**).

Every check is sound under any interleaving: it flags only what no legal linearisation allows.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import random
import threading
import time
import zlib
from collections import Counter, defaultdict
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from torch_kv_tier.benchmarks.reliability_common import (
    TCP_ENV,
    Outcome,
    ucx_over_tcp,
)
from torch_kv_tier.keys import Key
from torch_kv_tier.manager import TierManager, TransferResult
from torch_kv_tier.remote import ServerProcess
from torch_kv_tier.results import TierEvent

HEADER = 16  # bytes: key id (u32), CRC (u32), version (u64)
MAX_KEYS_PER_CALL = 3
CALL_TIMEOUT_S = 30.0
INF = float("inf")
REMOVALS = ("evicted", "discarded", "lost")

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


# -- the log ------------------------------------------------------------------------------------

Kind = Literal["store", "load", "discard", "lookup"]


@dataclass
class Call:
    """One call as a worker saw it: ``t0`` before the call, ``t1`` when it returned, ``done``
    when its future resolved (``t1`` for synchronous calls)."""

    kind: Kind
    keys: list[int]  # key ids
    t0: float
    t1: float = INF
    done: float = INF
    versions: list[int] = field(default_factory=list)  # store: version written per key
    ok: dict[int, bool] = field(default_factory=dict)  # store/load: key id -> succeeded
    reasons: dict[int, str] = field(default_factory=dict)  # store/load: key id -> failure
    nbytes: int = 0
    loaded: dict[int, tuple[int, int, bool]] = field(default_factory=dict)  # load: read_block
    prefix: int = -1  # lookup: how many leading keys were stored


@dataclass(frozen=True)
class EventBatch:
    """Events returned by one ``take_events`` call; each happened within ``[start, end]``."""

    start: float
    end: float
    events: list[TierEvent]


class Workload:
    """The shared key space: key ids map to keys of every kind (str, bytes, int)."""

    def __init__(self, num_keys: int) -> None:
        self.keys: list[Key] = [_key(i) for i in range(num_keys)]
        self.ids: dict[Key, int] = {k: i for i, k in enumerate(self.keys)}
        self._versions = itertools.count(1)

    def version(self) -> int:
        """A fresh version number (thread-safe: ``next`` on ``count`` holds the GIL)."""
        return next(self._versions)


def _key(i: int) -> Key:
    return (f"key-{i}", f"key-{i}".encode(), 10_000 + i)[i % 3]


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


# -- checking -----------------------------------------------------------------------------------


class _Timeline:
    """One key's publications, each with the window of its ``stored`` event and that of the
    removal that ended it (``INF`` while it lasts). Both sequences are time-ordered, so
    ``present_during``/``present_throughout`` are two bisections."""

    def __init__(self) -> None:
        self.stored_start: list[float] = []
        self.stored_end: list[float] = []
        self.removed_start: list[float] = []
        self.removed_end: list[float] = []

    def present_during(self, t0: float, t1: float) -> bool:
        """Could the key have been present at some moment of ``[t0, t1]``?"""
        hi = bisect.bisect_left(self.stored_start, t1)  # published before t1
        lo = bisect.bisect_right(self.removed_end, t0)  # not removed before t0
        return lo < hi

    def present_throughout(self, t0: float, t1: float) -> bool:
        """Was the key certainly present during all of ``[t0, t1]``?"""
        hi = bisect.bisect_left(self.stored_end, t0)  # certainly published before t0
        lo = bisect.bisect_right(self.removed_start, t1)  # certainly removed after t1
        return lo < hi


class History:
    """The merged log of one run and the checks over it (see the module docstring)."""

    def __init__(
        self, workload: Workload, calls: Sequence[Call], batches: Sequence[EventBatch]
    ) -> None:
        self.workload = workload
        self.calls = list(calls)
        self.batches = list(batches)
        self.problems: list[str] = []
        self.counts: Counter[str] = Counter()
        self.timelines: dict[int, _Timeline] = defaultdict(_Timeline)
        self.final_present: set[int] = set()
        # version -> (key id, store call)
        self.versions = {
            v: (k, c) for c in self.calls if c.kind == "store" for k, v in zip(c.keys, c.versions)
        }
        self.absent: dict[int, list[tuple[float, float]]] = defaultdict(list)  # evidence windows
        self.discards: dict[int, list[tuple[float, float]]] = defaultdict(list)

    def check(self) -> list[str]:
        """Run every check; returns the problems found (empty when the run was correct)."""
        self._replay_events()
        self._gather_absence()
        for call in self.calls:
            if call.kind == "load":
                self._check_load(call)
            elif call.kind == "lookup":
                self._check_lookup(call)
            elif call.kind == "store":
                self._check_store(call)
        return self.problems

    def _problem(self, text: str) -> None:
        self.counts["problems"] += 1
        if len(self.problems) < 20:
            self.problems.append(text)

    def _replay_events(self) -> None:
        present: set[int] = set()
        for batch in self.batches:
            for event in batch.events:
                key_id = self.workload.ids[event.key]
                line = self.timelines[key_id]
                self.counts[f"event {event.kind}"] += 1
                if event.kind == "stored":
                    if key_id in present:
                        self._problem(f"key {key_id}: 'stored' twice without a removal")
                    present.add(key_id)
                    line.stored_start.append(batch.start)
                    line.stored_end.append(batch.end)
                    line.removed_start.append(INF)
                    line.removed_end.append(INF)
                else:
                    if key_id not in present:
                        self._problem(f"key {key_id}: '{event.kind}' of a key not stored")
                        continue
                    present.discard(key_id)
                    line.removed_start[-1] = batch.start
                    line.removed_end[-1] = batch.end
                    self.absent[key_id].append((batch.start, batch.end))
        self.final_present = present

    def _gather_absence(self) -> None:
        """Windows in which a key was certainly absent at some moment, from what calls saw."""
        for call in self.calls:
            if call.kind == "discard":
                for key_id in call.keys:
                    self.absent[key_id].append((call.t0, call.t1))
                    self.discards[key_id].append((call.t0, call.t1))
            elif call.kind == "lookup" and call.prefix < len(call.keys):
                self.absent[call.keys[call.prefix]].append((call.t0, call.t1))
            elif call.kind == "load":
                for key_id, reason in call.reasons.items():
                    if reason == "missing":
                        self.absent[key_id].append((call.t0, call.t1))
            elif call.kind == "store" and len(call.keys) == 1 and call.nbytes:
                # a one-key store that sent its block: the key was neither stored nor storing
                self.absent[call.keys[0]].append((call.t0, call.t1))
        for windows in self.absent.values():
            windows.sort()

    def _check_load(self, call: Call) -> None:
        for key_id in call.keys:
            if not call.ok.get(key_id, False):
                reason = call.reasons.get(key_id, "no result")
                if reason != "missing":
                    self._problem(f"load of key {key_id} failed: {reason!r}")
                elif self.timelines[key_id].present_throughout(call.t0, call.t1):
                    self._problem(f"load of key {key_id} said missing while it was stored")
                self.counts["loads missing"] += 1
                continue
            self.counts["blocks loaded"] += 1
            self._check_block(call, key_id)

    def _check_block(self, call: Call, key_id: int) -> None:
        got_key, version, crc_ok = call.loaded[key_id]
        if not crc_ok:
            self._problem(f"key {key_id}: loaded block fails its CRC (torn or overwritten)")
            return
        if got_key != key_id:
            self._problem(f"key {key_id}: loaded the block of key {got_key}")
            return
        owner = self.versions.get(version)
        if owner is None or owner[0] != key_id:
            self._problem(f"key {key_id}: loaded version {version}, never stored under it")
            return
        store = owner[1]
        if store.t0 >= call.t1:
            self._problem(f"key {key_id}: loaded version {version} before its store began")
        if not self.timelines[key_id].present_during(call.t0, call.t1):
            self._problem(f"key {key_id}: loaded while the event log says it was absent")
        if self._absent_between(key_id, store.done, call.t0):
            self._problem(
                f"key {key_id}: loaded stale version {version}: the key was absent after its "
                "store finished and before the load began"
            )

    def _check_lookup(self, call: Call) -> None:
        line_of = self.timelines
        for key_id in call.keys[: call.prefix]:
            if not line_of[key_id].present_during(call.t0, call.t1):
                self._problem(f"lookup counted key {key_id} while the event log says absent")
        if call.prefix < len(call.keys):
            key_id = call.keys[call.prefix]
            if line_of[key_id].present_throughout(call.t0, call.t1):
                self._problem(f"lookup stopped at key {key_id} while it was stored")

    def _check_store(self, call: Call) -> None:
        for key_id in call.keys:
            reason = call.reasons.get(key_id)
            if reason is not None and reason != "capacity":
                self._problem(f"store of key {key_id} failed: {reason!r}")
            if reason is not None:
                self.counts["stores over capacity"] += 1
                continue
            discarded = any(d0 < call.done and d1 > call.t0 for d0, d1 in self.discards[key_id])
            if not discarded and not self.timelines[key_id].present_during(call.t0, call.done):
                self._problem(
                    f"store of key {key_id} succeeded but the key was never present during the "
                    "call (no discard overlapped it)"
                )

    def _absent_between(self, key_id: int, after: float, before: float) -> bool:
        """Some absence evidence lies entirely within ``(after, before)``."""
        windows = self.absent[key_id]
        for start, end in itertools.islice(
            windows, bisect.bisect_right(windows, (after, INF)), None
        ):
            if start >= before:
                return False
            if end < before:
                return True
        return False


def check_final_state(
    tier: TierManager, workload: Workload, history: History, problems: list[str]
) -> None:
    """The index after the run is exactly what the event log left present."""
    index = {i for i, k in enumerate(workload.keys) if tier.contains(k)}
    if index != history.final_present:
        problems.append(
            f"index and event log disagree on {len(index ^ history.final_present)} keys"
        )
    late = tier.take_events()
    if late:
        problems.append(f"{len(late)} events after every call had returned: {late[:3]}")
    stats = tier.stats()
    if stats.keys != len(index):
        problems.append(f"stats().keys is {stats.keys}, the index holds {len(index)}")
    if stats.inflight or stats.queued or tier.transport.inflight_count():  # type: ignore[attr-defined]
        problems.append("transfers left in flight after every call returned")


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
