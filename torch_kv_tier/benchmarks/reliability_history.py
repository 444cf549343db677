"""The log of a concurrency run (``reliability_concurrency``) and the checks over it.

Threads log each call with the monotonic times it started and returned; a collector stamps
each batch of ``take_events()`` with the window it happened in. ``History.check`` then holds
the log to the tier's documented semantics (README "Usage"):

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
import itertools
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from torch_kv_tier.keys import Key
from torch_kv_tier.manager import TierManager
from torch_kv_tier.results import TierEvent

INF = float("inf")

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
