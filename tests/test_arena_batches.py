"""The torch loop's arena batches against a scripted tier: when a host is overdue, and for how
long an offload waits for slots. No host runs: the tier's store futures resolve when a test says
(a frozen host's never do until then), so each test takes well under a second."""

from __future__ import annotations

import inspect
import itertools
import linecache
import sys
import threading
import time
import types
from collections import Counter
from concurrent.futures import Future

import pytest

from torch_kv_tier.arena import BlockArena
from torch_kv_tier.integrations.torch_loop import arena_batches, arena_slots, host_shares
from torch_kv_tier.integrations.torch_loop.arena_batches import ArenaBatches
from torch_kv_tier.integrations.torch_loop.host_shares import OVERDUE
from torch_kv_tier.keys import Key, home_peer
from torch_kv_tier.results import TransferResult
from torch_kv_tier.slots import SlotPool

WAIT_S = 60.0  # the deadline of an offload that must not wait for it


def stored(keys: list[Key]) -> TransferResult:
    return TransferResult(ok=True, keys=list(keys), failed={}, nbytes=0, seconds=0.0)


class ScriptedTier:
    """The calls ``ArenaBatches`` makes of a ``TierManager``: stores with a key on a
    ``frozen`` host (``None``: any) stay under way until the test resolves them (``stores``);
    loads find every key."""

    def __init__(self, slots: int, peers: list[str], frozen: set[str] | None = None) -> None:
        self.arena = BlockArena(slots, 64)
        self._peers = peers
        self._frozen = frozen
        self.stores: list[tuple[list[Key], Future[TransferResult]]] = []

    def peers(self) -> list[str]:
        return list(self._peers)

    def holders(self, keys: list[Key]) -> list[str | None]:
        return [home_peer(k, self._peers) for k in keys]

    def store(
        self, keys: list[Key], slots: list[int], placed: list[str] | None = None
    ) -> Future[TransferResult]:
        future: Future[TransferResult] = Future()
        under_way = next((f for ks, f in self.stores if not f.done() and ks == keys), None)
        if under_way is not None:  # keys in flight join their store, as TierManager's do
            under_way.add_done_callback(lambda _: future.set_result(stored(keys)))
            return future
        self.stores.append((list(keys), future))
        if placed is not None:
            placed.extend(dict.fromkeys(h for h in self.holders(keys) if h is not None))
        if self._frozen is not None and self._frozen.isdisjoint(self.holders(keys)):
            future.set_result(stored(keys))
        return future

    def load(self, keys: list[Key], slots: list[int]) -> Future[TransferResult]:
        future: Future[TransferResult] = Future()
        future.set_result(stored(keys))
        return future

    def end_stores(self) -> None:
        for keys, future in self.stores:
            if not future.done():
                future.set_result(stored(keys))


class NoCopies:
    def gather(self, pages: list[int], slots: list[int]) -> None:
        pass

    def scatter(self, slots: list[int], pages: list[int]) -> None:
        pass


def batches(tier: ScriptedTier, timeout: float) -> ArenaBatches:
    return ArenaBatches(tier, NoCopies(), timeout)  # type: ignore[arg-type]


def keys_on(host: str, peers: list[str], count: int) -> list[Key]:
    """``count`` keys whose home among ``peers`` is ``host``."""
    return [k for k in (f"key-{i}".encode() for i in range(200)) if home_peer(k, peers) == host][
        :count
    ]


def failures(parts: list[tuple[list[Key], Future[TransferResult]]]) -> dict[Key, str]:
    return {k: r for _, part in parts if part.done() for k, r in part.result().failed.items()}


@pytest.mark.parametrize(("peers", "held"), [(["a"], 2), (["a", "b"], 1)])
def test_an_offload_waiting_on_a_frozen_hosts_slots_ends_once_its_store_is_overdue(
    peers: list[str], held: int
) -> None:
    # Found by review: an offload that waited for the slots (one host) or the share (several)
    # that a frozen host's store held woke only at its own deadline, though that store turned
    # overdue at its timeout: the generation loop stalled up to a whole timeout more, here
    # WAIT_S, before the page failed. The wait now ends when the store turns overdue, and the
    # page fails for that reason (its deadline, WAIT_S away, cannot be the one).
    tier = ScriptedTier(2, peers)
    arena = batches(tier, timeout=0.3)  # a store is overdue 0.3 s into it
    *first, second = keys_on("a", peers, held + 1)  # 'a' holds the arena (one host) or its share
    arena.store_all({k: i for i, k in enumerate(first)}, time.monotonic() + 0.3)
    assert tier.arena.num_free == 2 - held  # 'a' froze: its store does not end
    parts: list[tuple[list[Key], Future[TransferResult]]] = []
    waiting = threading.Thread(
        target=lambda: parts.extend(arena.store_all({second: 5}, time.monotonic() + WAIT_S)),
        daemon=True,
    )
    waiting.start()
    try:
        waiting.join(timeout=10.0)
        assert not waiting.is_alive(), "the offload waited past the frozen host's timeout"
        assert failures(parts) == {second: OVERDUE}
    finally:
        tier.end_stores()  # 'a' resumes: a waiter still there wakes, every slot comes back
        waiting.join(timeout=10.0)
    assert tier.arena.num_free == 2


class Clock:
    """The ``time`` of the arena's modules: ``monotonic`` stands still until the test moves it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def on_the_clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    """A :class:`Clock` that the arena's modules read for ``time``."""
    clock = Clock()
    for module in (arena_slots, arena_batches, host_shares):
        monkeypatch.setattr(module, "time", clock)
    return clock


def test_pages_that_waited_out_the_deadline_fail_capacity_though_their_host_turned_overdue_since(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Found under load: the pages that waited for a frozen host's slot until the offload's
    # deadline sometimes failed "host overdue", not "capacity": the reason was taken from a
    # second look at the hosts, and the host's store, begun just after the deadline was set,
    # turned overdue before the offload's thread (a moment behind, on a busy box) took it.
    # The reason is now the look's that sized the batch to 0.
    clock = on_the_clock(monkeypatch)
    tier = ScriptedTier(1, ["a"], frozen={"a"})
    arena = batches(tier, timeout=1.0)
    monkeypatch.setattr(arena, "_changed", WaitsOnTheClock(arena._changed, clock))
    waits = arena._wait

    def late(deadline: float, seen: float) -> bool:  # its thread runs again a timeout later
        waited = waits(deadline, seen)
        if not waited:
            clock.now += 1.0
        return waited

    monkeypatch.setattr(arena, "_wait", late)
    parts = arena.store_all({b"first": 0, b"second": 1}, clock.now)  # the deadline: now
    assert failures(parts) == {b"second": "capacity"}
    tier.end_stores()
    assert tier.arena.num_free == 1


class WaitsOnTheClock:
    """The arena's condition on the test's clock: a wait moves the clock to its end, ``late``
    (s) past it (a busy machine woke the thread late), instead of waiting."""

    def __init__(self, changed: threading.Condition, clock: Clock, late: float = 0.0) -> None:
        self._changed, self._clock, self._late = changed, clock, late

    def wait(self, timeout: float) -> bool:
        self._clock.now += timeout + self._late
        return False

    def notify_all(self) -> None:
        self._changed.notify_all()


class CopiesThatTakeTime(NoCopies):
    """Page copies that take ``seconds`` of the test's clock."""

    def __init__(self, clock: Clock, seconds: float) -> None:
        self._clock, self._seconds = clock, seconds

    def gather(self, pages: list[int], slots: list[int]) -> None:
        self._clock.now += self._seconds


def test_pages_whose_wait_ran_out_fail_capacity_though_the_thread_woke_after_their_store(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Found under load: a page that waited for its host's share until the offload's deadline
    # failed "host overdue" when its thread woke late (a busy machine), after the host's store
    # begun just after the deadline was set (the copy before it) turned overdue; "capacity"
    # when it woke in time. A wait the deadline ended now ends the look: "capacity" always.
    clock = on_the_clock(monkeypatch)
    both = ["a", "b"]
    tier = ScriptedTier(2, both, frozen={"a"})
    arena = ArenaBatches(tier, CopiesThatTakeTime(clock, 0.01), 1.0)  # type: ignore[arg-type]
    monkeypatch.setattr(arena, "_changed", WaitsOnTheClock(arena._changed, clock, late=0.5))
    first, second = keys_on("a", both, 2)  # a's share: one slot of two
    parts = arena.store_all({first: 0, second: 1}, clock.now + 1.0)
    assert failures(parts) == {second: "capacity"}  # before: "host overdue"
    tier.end_stores()
    assert tier.arena.num_free == 2


class SlowHost(WaitsOnTheClock):
    """The arena's condition on the test's clock, for a host whose stores each end
    ``seconds`` after they began: a wait lasts until the oldest store under way ends (its
    callback runs as the waiter waits, the lock released) or until its timeout."""

    def __init__(
        self,
        changed: threading.Condition,
        clock: Clock,
        tier: ScriptedTier,
        seconds: float,
        late: float = 0.0,
    ) -> None:
        super().__init__(changed, clock, late)
        self._tier, self._seconds = tier, seconds
        self.begun: list[float] = []  # each store's start, in ``tier.stores``' order

    def wait(self, timeout: float) -> bool:
        ends = [
            b + self._seconds for b, (_, f) in zip(self.begun, self._tier.stores) if not f.done()
        ]
        if not ends or self._clock.now + timeout < ends[0]:
            return super().wait(timeout)
        self._clock.now = ends[0] + self._late  # (the waiter woken ``late`` after it ended)
        keys, store = next((k, f) for k, f in self._tier.stores if not f.done())
        self._changed.release()
        try:
            store.set_result(stored(keys))
        finally:
            self._changed.acquire()
        return True


def slow_host(
    monkeypatch: pytest.MonkeyPatch, **kw: float
) -> tuple[Clock, ScriptedTier, ArenaBatches]:
    """One host, one arena slot, a 1 s timeout, on the test's clock: the host's stores end
    as a :class:`SlowHost` (``kw``: its times) says."""
    clock = on_the_clock(monkeypatch)
    tier = ScriptedTier(1, ["a"], frozen={"a"})  # stores end as the slow host says
    arena = batches(tier, timeout=1.0)
    host = SlowHost(arena._changed, clock, tier, **kw)
    monkeypatch.setattr(arena, "_changed", host)
    scripted_store = tier.store

    def timed_store(
        keys: list[Key], slots: list[int], placed: list[str] | None = None
    ) -> Future[TransferResult]:
        host.begun.append(clock.now)
        return scripted_store(keys, slots, placed)

    tier.store = timed_store  # type: ignore[method-assign]
    return clock, tier, arena


def test_an_offload_through_a_slow_hosts_stores_waits_for_slots_its_timeout_in_all(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Found by review (dba37d3): an offload larger than the arena gave each batch a deadline
    # of its own, so a slow host (each store ending within the timeout) held the generation
    # loop for batches x timeout. The offload's one deadline bounds all its waits: here the
    # third page, whose slot comes back 1.2 s into a 1 s timeout, and the fourth fail.
    clock, tier, arena = slow_host(monkeypatch, seconds=0.6)
    keys = [f"slow-{i}".encode() for i in range(4)]
    deadline = clock.now + 1.0
    parts = arena.store_all({k: i for i, k in enumerate(keys)}, deadline)
    assert clock.now <= deadline  # before: 1.8 s on the test's clock
    assert failures(parts) == {keys[2]: "capacity", keys[3]: "capacity"}  # before: none
    tier.end_stores()
    assert tier.arena.num_free == 1


def test_a_page_whose_slot_came_back_in_time_is_stored_though_its_thread_woke_late(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Found by review: a page waiting for its host's share, which its store handed back
    # before the offload's deadline, failed "capacity" when its thread woke after the
    # deadline (a busy machine): the wait counted as one the deadline ended. A wait that
    # something ended (the condition notified) looks again, however late the thread woke.
    clock, tier, arena = slow_host(monkeypatch, seconds=0.9, late=0.2)
    parts = arena.store_all({b"first": 0, b"second": 1}, clock.now + 1.0)
    assert failures(parts) == {}  # before: {b"second": "capacity"}
    assert [keys for keys, _ in tier.stores] == [[b"first"], [b"second"]]
    tier.end_stores()
    assert tier.arena.num_free == 1


def test_a_store_started_as_its_offload_ran_out_of_time_leaves_the_host_usable() -> None:
    # Found by review: a store was overdue from its offload's deadline on, however late in
    # the offload it started (a slow copy into the arena, or the last batch of a long
    # offload): the only host, healthy, was "overdue" until that store ended, so the next
    # offload failed every page ("host overdue") and the next restore read nothing. A store is
    # overdue once it has been under way for the timeout.
    tier = ScriptedTier(4, ["a"])
    arena = batches(tier, timeout=WAIT_S)
    arena.store_all({b"late": 0}, time.monotonic())  # its deadline passed as it started
    assert not tier.stores[0][1].done()  # under way on a healthy host
    assert failures(arena.store_all({b"next": 1}, time.monotonic() + WAIT_S)) == {}
    assert arena.load_prefix([b"late-restore"], [2], time.monotonic() + WAIT_S) == 1
    tier.end_stores()
    assert tier.arena.num_free == 4


def test_a_read_begun_just_before_its_restores_deadline_leaves_its_host_usable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Found by review: a read still under way at its restore's deadline made its host
    # "overdue" however late in the restore it began, so a healthy host, a read begun just
    # before the deadline, failed the next offload's every page ("host overdue") until that
    # read ended. A read is overdue once under way for the timeout, as a store is.
    clock = on_the_clock(monkeypatch)
    tier = ScriptedTier(4, ["a"])
    slow_load = ReadPastTheDeadline(clock, Future())
    tier.load = slow_load  # type: ignore[method-assign]
    arena = batches(tier, timeout=WAIT_S)
    assert arena.load_prefix([b"late"], [0], clock.now + 0.5) == 0
    assert slow_load.calls == 1  # begun before the deadline, under way after it
    del tier.load  # the scripted load again: every key found at once
    assert failures(arena.store_all({b"next": 1}, clock.now + WAIT_S)) == {}
    assert arena.load_prefix([b"again"], [2], clock.now + WAIT_S) == 1
    slow_load.read.set_result(stored([b"late"]))
    tier.end_stores()
    assert tier.arena.num_free == 4


class CtrlCBeforeItsCallback(Future[TransferResult]):
    """A store's future as the caller sees it when Ctrl-C lands as it adds its callback."""

    def add_done_callback(self, fn: object) -> None:
        raise KeyboardInterrupt


def test_an_offload_interrupted_as_its_store_began_leaves_its_host_usable() -> None:
    # Found by review: Ctrl-C (KeyboardInterrupt) between the tier's store and its callback
    # left a record of the store that nothing ended: once its timeout passed (here at once),
    # its host was overdue for good (every later offload to it failed "host overdue", every
    # restore stopped at its keys) and flush() waited for it until its timeout, each time.
    # The record owns the store's slot: both go once the store ended, callback or not.
    tier = ScriptedTier(4, ["a"])
    interrupted = CtrlCBeforeItsCallback()
    tier.store = lambda keys, slots, placed: interrupted  # type: ignore[method-assign]
    arena = batches(tier, timeout=0.0)  # a store is overdue as soon as it began
    with pytest.raises(KeyboardInterrupt):
        arena.store_all({b"interrupted": 0}, time.monotonic() + WAIT_S)
    del tier.store  # the scripted store again
    assert tier.arena.num_free == 3  # the store is under way: the tier reads its slot
    assert not arena.wait_idle(time.monotonic() + 0.01)  # flush() waits for it
    interrupted.set_result(stored([b"interrupted"]))  # it ended
    assert failures(arena.store_all({b"after": 1}, time.monotonic() + WAIT_S)) == {}
    tier.end_stores()
    assert arena.wait_idle(time.monotonic() + WAIT_S)
    assert arena.load_prefix([b"after"], [2], time.monotonic() + WAIT_S) == 1
    assert tier.arena.num_free == 4  # before: 3, the interrupted store's slot lost


def test_after_a_ctrl_c_lost_a_slot_a_full_arena_offload_and_restore_still_work() -> None:
    # Found by review: a slot that nothing hands back (Ctrl-C inside the tier's load, or a
    # second one inside the tier's store again) stayed in the room batches are sized to:
    # every later offload or restore of an arena's worth of pages (here 4) waited for it until
    # its deadline, then failed every page ("capacity") or restored none, for good. The room is
    # now the free slots and those of transfers under way: batches of 3, nothing waits.
    tier = ScriptedTier(4, ["a"], frozen=set())

    def interrupted(keys: list[Key], slots: list[int]) -> Future[TransferResult]:
        raise KeyboardInterrupt  # the tier may have begun the read: its slot stays out

    tier.load = interrupted  # type: ignore[method-assign]
    arena = batches(tier, timeout=WAIT_S)
    with pytest.raises(KeyboardInterrupt):
        arena.load_prefix([b"interrupted"], [0], time.monotonic() + WAIT_S)
    del tier.load  # the scripted load again
    assert tier.arena.num_free == 3  # the lost slot
    keys = [f"after-{i}".encode() for i in range(4)]
    deadline = time.monotonic() + 5.0  # before: both waited until it, then failed
    assert failures(arena.store_all({k: i for i, k in enumerate(keys)}, deadline)) == {}
    assert arena.load_prefix(keys, [4, 5, 6, 7], deadline) == 4
    assert arena.wait_idle(time.monotonic() + WAIT_S)
    assert tier.arena.num_free == 3


def test_an_offload_interrupted_inside_the_tiers_store_gets_its_slots_back() -> None:
    # Found by review: Ctrl-C (KeyboardInterrupt) inside the tier's store, before it returned
    # its future, lost the batch's arena slots for good, the other host's (never sent) too:
    # nothing returned them. Now the slots of the other host come back at once, and the
    # interrupted store is made again (its keys join the transfer under way), so its slots
    # come back once that ended, and not before (the tier may still be reading them).
    peers = ["a", "b"]
    tier = ScriptedTier(4, peers)
    scripted_store = tier.store

    def interrupted(keys: list[Key], slots: list[int], placed: list[str]) -> Future[TransferResult]:
        del tier.store  # the scripted store again from now on
        scripted_store(keys, slots, placed)  # the tier sent them...
        raise KeyboardInterrupt  # ...and Ctrl-C landed before it returned

    tier.store = interrupted  # type: ignore[method-assign]
    arena = batches(tier, timeout=WAIT_S)
    todo = {keys_on("a", peers, 1)[0]: 0, keys_on("b", peers, 1)[0]: 1}
    with pytest.raises(KeyboardInterrupt):
        arena.store_all(todo, time.monotonic() + WAIT_S)
    assert len(tier.stores) == 1  # b's key was never sent
    assert tier.arena.num_free == 3  # b's slot is back; a's store may still read its slot
    assert not arena.wait_idle(time.monotonic() + 0.05)  # flush() waits for it
    tier.end_stores()
    assert tier.arena.num_free == 4
    assert arena.wait_idle(time.monotonic() + WAIT_S)


def test_a_restore_interrupted_inside_the_tiers_load_gets_the_other_hosts_slots_back() -> None:
    # Found by review: Ctrl-C (KeyboardInterrupt) inside the tier's load, before it returned its
    # future, lost the whole batch's arena slots for good: those of the hosts whose reads had
    # begun (held by nothing, so never back once the reads ended) and of those not asked yet.
    # Now the reads begun are held until they end, as when the wait for them is interrupted;
    # only the interrupted load's slots stay out (the tier may have begun that read).
    peers = ["a", "b", "c"]
    tier = ScriptedTier(6, peers)
    reads: list[tuple[list[Key], Future[TransferResult]]] = []

    def load(keys: list[Key], slots: list[int]) -> Future[TransferResult]:
        if reads:
            raise KeyboardInterrupt  # in the second host's load
        reads.append((list(keys), Future()))  # the first host's read stays under way
        return reads[-1][1]

    tier.load = load  # type: ignore[method-assign]
    arena = batches(tier, timeout=WAIT_S)
    keys = [keys_on(host, peers, 1)[0] for host in peers]
    with pytest.raises(KeyboardInterrupt):
        arena.load_prefix(keys, [0, 1, 2], time.monotonic() + WAIT_S)
    assert tier.arena.num_free == 4  # the third host's slot is back; the first's read holds one
    (read_keys, read), *_ = reads
    read.set_result(stored(read_keys))
    assert tier.arena.num_free == 5  # all but the interrupted load's slot


@pytest.mark.parametrize("where", ["started", "log"])
def test_a_restore_interrupted_as_it_holds_a_late_read_leaves_its_host_usable(
    monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    # Found by review: Ctrl-C (KeyboardInterrupt) as a restore held the slots of a read past
    # its deadline: between the read's record and its callback ("started"), the record was
    # never ended, its host "overdue" for good (every later offload to it failed "host
    # overdue", every restore stopped at its keys); anywhere in that step ("log"), the slots
    # of the other hosts' reads, done, never came back. Now the record owns the read's slot
    # and goes, slot and all, once the read ended, callback or not; the other slots come back.
    peers = ["a", "b"]
    tier = ScriptedTier(4, peers, frozen=set())
    late: list[tuple[list[Key], Future[TransferResult]]] = []
    on_b = keys_on("b", peers, 1)

    def load(keys: list[Key], slots: list[int]) -> Future[TransferResult]:
        read: Future[TransferResult] = Future()
        if keys == on_b:
            read.set_result(stored(keys))  # b answers at once
        else:
            late.append((list(keys), read))  # a's read stays under way past the deadline
            clock.now += 1.0
        return read

    def interrupt_started(shares: host_shares.HostShares, *args: object) -> None:
        real_started(shares, *args)  # type: ignore[arg-type]
        raise KeyboardInterrupt

    def interrupt_log(message: str, *args: object) -> None:
        if message.startswith("restore from"):
            raise KeyboardInterrupt

    tier.load = load  # type: ignore[method-assign]
    real_started = host_shares.HostShares.started
    clock = on_the_clock(monkeypatch)
    if where == "started":
        monkeypatch.setattr(host_shares.HostShares, "started", interrupt_started)
    else:
        monkeypatch.setattr(arena_slots.log, "warning", interrupt_log)
    arena = batches(tier, timeout=0.0)  # a read is overdue as soon as it is held
    with pytest.raises(KeyboardInterrupt):
        arena.load_prefix([keys_on("a", peers, 1)[0], *on_b], [0, 1], clock.now + 0.5)
    monkeypatch.undo()
    for keys, read in late:
        read.set_result(stored(keys))  # a answers: its read ended
    del tier.load
    (later_on_a,) = keys_on("a", peers, 2)[1:]
    assert failures(arena.store_all({later_on_a: 2}, time.monotonic() + WAIT_S)) == {}
    assert arena.load_prefix([later_on_a], [3], time.monotonic() + WAIT_S) == 1
    assert tier.arena.num_free == 4  # before, "started": 3, the read's slot lost


def test_a_flush_after_an_offload_interrupted_as_it_was_tracked_does_not_wait() -> None:
    # Found by review: Ctrl-C (KeyboardInterrupt) between counting an offload as pending and
    # adding its callback left it pending for good: every later flush() waited its whole
    # timeout and returned False, and close() logged that offloads were still in flight.
    tier = ScriptedTier(4, ["a"], frozen=set())
    arena = batches(tier, timeout=WAIT_S)
    offload = CtrlCBeforeItsCallback()
    with pytest.raises(KeyboardInterrupt):
        arena.track(offload)
    offload.set_result(stored([]))
    assert arena.wait_idle(time.monotonic() + 1.0)


def test_an_offload_interrupted_as_it_asks_for_the_hosts_gets_its_slots_back() -> None:
    # Found by review (a KeyboardInterrupt injected at every line): Ctrl-C between the batch's
    # slots coming and its first store (here as it waits for the tier's lock to see its
    # hosts) lost all of them for good, though nothing was sent: an offload of the whole
    # arena left none, and every later offload failed "capacity", every restore loaded none.
    tier = ScriptedTier(4, ["a"], frozen=set())
    looks = iter([["a"], None])

    def peers() -> list[str]:
        hosts = next(looks, ["a"])
        if hosts is None:  # the batch's second look, after the copy: Ctrl-C lands
            raise KeyboardInterrupt
        return hosts

    tier.peers = peers  # type: ignore[method-assign]
    arena = batches(tier, timeout=WAIT_S)
    keys = [f"k-{i}".encode() for i in range(4)]
    with pytest.raises(KeyboardInterrupt):
        arena.store_all({k: i for i, k in enumerate(keys)}, time.monotonic() + WAIT_S)
    assert tier.stores == [] and tier.arena.num_free == 4  # before: 0
    assert (
        failures(arena.store_all({k: i for i, k in enumerate(keys)}, time.monotonic() + 5.0)) == {}
    )


def test_a_restore_interrupted_before_its_first_read_gets_its_slots_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Found by review (a KeyboardInterrupt injected at every line): Ctrl-C between the batch's
    # slots coming and its first read (here as it reads the clock for the reads' timeout)
    # lost all of them for good.
    tier = ScriptedTier(4, ["a"], frozen=set())
    arena = batches(tier, timeout=WAIT_S)
    clock = iter([True, False])  # the restore's deadline check, then the reads' timeout

    def monotonic() -> float:
        if not next(clock, True):
            raise KeyboardInterrupt
        return time.monotonic()

    monkeypatch.setattr(arena_batches, "time", types.SimpleNamespace(monotonic=monotonic))
    with pytest.raises(KeyboardInterrupt):
        arena.load([b"k"], ["a"], [0], time.monotonic() + WAIT_S)
    assert tier.arena.num_free == 4  # before: 3


def test_a_store_whose_slots_come_back_as_ctrl_c_lands_leaves_its_host_usable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Found by review: a store's callback runs on whichever thread resolves its future, the
    # generation loop's too (the tier polls there as it submits); Ctrl-C (KeyboardInterrupt)
    # as that callback returned the slots, before it ended the store's record, left the record
    # for good: its host "overdue" (every later offload to it failed "host overdue", every
    # restore stopped at its keys) and flush() waiting its whole timeout, each time. The
    # record now goes first; only the store's slot is lost.
    tier = ScriptedTier(4, ["a"])  # stores stay under way until the test ends them
    arena = batches(tier, timeout=0.0)  # a store is overdue as soon as it began
    arena.store_all({b"interrupted": 0}, time.monotonic() + WAIT_S)
    free = tier.arena.free

    def interrupted(slots: list[int]) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(tier.arena, "free", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tier.end_stores()  # the callback runs here, on the caller's thread
    monkeypatch.setattr(tier.arena, "free", free)
    tier._frozen = set()  # the host answers at once from now on
    assert failures(arena.store_all({b"after": 1}, time.monotonic() + WAIT_S)) == {}
    assert arena.load_prefix([b"after"], [2], time.monotonic() + WAIT_S) == 1
    assert arena.wait_idle(time.monotonic() + 1.0)
    assert tier.arena.num_free == 3  # all but the interrupted store's slot


class CtrlCAsItsCallbacksRun(Future[TransferResult]):
    """A store's future resolved on the caller's thread, Ctrl-C landing before its callbacks
    ran (at a callback's first line, or anywhere before it ended the store)."""

    def _invoke_callbacks(self) -> None:
        raise KeyboardInterrupt


def test_a_store_whose_callback_ctrl_c_stopped_leaves_its_host_usable_and_flush_idle() -> None:
    # Found by review (a KeyboardInterrupt injected at every line): Ctrl-C at the start of a
    # store's done-callback, run on the caller's thread, left the store's record for good:
    # its host "overdue" (every later offload to it failed "host overdue") and flush()
    # waiting out its whole timeout, each time, and its slot lost. The record owns its slot,
    # and whoever looks at the records next drops it, slot and all, once its future resolved.
    tier = ScriptedTier(4, ["a"], frozen=set())
    interrupted = CtrlCAsItsCallbacksRun()
    tier.store = lambda keys, slots, placed: interrupted  # type: ignore[method-assign]
    arena = batches(tier, timeout=0.0)  # a store is overdue as soon as it began
    arena.store_all({b"interrupted": 0}, time.monotonic() + WAIT_S)
    del tier.store  # the scripted store again
    with pytest.raises(KeyboardInterrupt):
        interrupted.set_result(stored([b"interrupted"]))
    assert arena.wait_idle(time.monotonic() + 1.0)  # before: False, after the whole second
    assert failures(arena.store_all({b"after": 1}, time.monotonic() + WAIT_S)) == {}
    assert arena.load_prefix([b"after"], [2], time.monotonic() + WAIT_S) == 1
    assert tier.arena.num_free == 4


@pytest.mark.parametrize(
    ("owner", "name"),
    [(host_shares.HostShares, "started"), (arena_slots.ArenaSlots, "_started")],
    ids=["record-made", "record-begun"],
)
def test_a_store_interrupted_as_its_record_is_made_gets_its_slot_back_once_it_ended(
    monkeypatch: pytest.MonkeyPatch, owner: type, name: str
) -> None:
    # Found by review (a KeyboardInterrupt injected at every line): Ctrl-C after the tier's
    # store returned, before the store's record was made, lost its slot for good (the tier
    # may still read it, so the offload could not free it; nothing else would). The record is
    # made on the way out; its slot comes back once the store ended. Found again at
    # ``_started``'s entry ("record-begun": the batch had handed the slot on already); the
    # batch now hands it on once the record is made, and until then makes the store again.
    tier = ScriptedTier(4, ["a"])  # stores stay under way until the test ends them
    arena = batches(tier, timeout=WAIT_S)
    real = getattr(owner, name)

    def interrupted(*args: object, **kwargs: object) -> None:
        monkeypatch.setattr(owner, name, real)
        raise KeyboardInterrupt  # as the record is about to be made

    monkeypatch.setattr(owner, name, interrupted)
    with pytest.raises(KeyboardInterrupt):
        arena.store_all({b"interrupted": 0}, time.monotonic() + WAIT_S)
    assert tier.arena.num_free == 3  # the store is under way: the tier reads its slot
    assert len(tier.stores) == 1  # made again, if at all, it joined the store under way
    tier.end_stores()
    assert arena.wait_idle(time.monotonic() + 1.0)
    assert tier.arena.num_free == 4  # before: 3, for good


class JoinAsItCopies(NoCopies):
    """Page copies during which host ``b`` joins the tier (the tier's redial)."""

    def __init__(self, peers: list[str]) -> None:
        self._peers = peers

    def gather(self, pages: list[int], slots: list[int]) -> None:
        if "b" not in self._peers:
            self._peers.append("b")


def test_a_host_that_joins_as_an_offload_runs_takes_at_most_its_share() -> None:
    # Found by review: an offload looked at the hosts once, before its waits for slots and
    # its copies; a host that joined meanwhile (the tier's redial) got the pages it now wins
    # in a batch sized for the hosts before, here the whole arena for one host, all counted
    # as that host's. Frozen, the new host held the whole arena until its session was lost,
    # and the healthy host's next pages waited, then failed. The hosts are looked at again
    # once the slots came and the pages were copied, and the batch is sized again if they
    # changed.
    peers = ["a"]
    tier = ScriptedTier(4, peers, frozen={"b"})
    arena = ArenaBatches(tier, JoinAsItCopies(peers), 10.0)  # type: ignore[arg-type]
    both = ["a", "b"]
    todo = {k: i for i, k in enumerate([*keys_on("a", both, 2), *keys_on("b", both, 2)])}
    parts = arena.store_all(todo, time.monotonic() + WAIT_S)
    assert tier.arena.num_free == 2  # b's 2 pages hold half the arena, a's came back
    assert failures(parts) == {}
    (later,) = keys_on("a", both, 3)[2:]
    assert failures(arena.store_all({later: 5}, time.monotonic() + 1.0)) == {}
    tier.end_stores()
    assert tier.arena.num_free == 4


def test_a_host_that_joins_inside_the_tiers_store_does_not_make_the_other_overdue() -> None:
    # Found by review: a host that joined inside the tier's store (after the batch's last look
    # at the hosts) got the batch's keys, but the store was counted against the host the batch
    # was sized for: while the new host, frozen, held the store (until its session was lost,
    # ~10 s), the healthy host was "overdue" and its next pages failed at once. The tier's
    # store now says which hosts it sent to; a store to one host counts as that host's.
    both, peers = ["a", "b"], ["a"]
    tier = ScriptedTier(4, peers, frozen={"b"})
    scripted_store = tier.store

    def joining_store(
        keys: list[Key], slots: list[int], placed: list[str] | None = None
    ) -> Future[TransferResult]:
        if "b" not in peers:
            peers.append("b")  # b joins inside the tier's store: its keys go to b
        return scripted_store(keys, slots, placed)

    tier.store = joining_store  # type: ignore[method-assign]
    arena = batches(tier, timeout=0.0)  # a store is overdue as soon as it began
    (on_b,), (on_a,) = keys_on("b", both, 1), keys_on("a", both, 1)
    assert failures(arena.store_all({on_b: 0}, time.monotonic() + WAIT_S)) == {}
    assert (
        failures(arena.store_all({on_a: 1}, time.monotonic() + WAIT_S)) == {}
    )  # before: a overdue
    tier.end_stores()
    assert tier.arena.num_free == 4


class CountedCopies(NoCopies):
    """Counts the batches packed into the arena."""

    def __init__(self) -> None:
        self.gathers = 0

    def gather(self, pages: list[int], slots: list[int]) -> None:
        self.gathers += 1


def test_an_offload_whose_hosts_change_at_every_look_settles_at_once() -> None:
    # Found by review: an offload sizes a batch again when the hosts changed as it waited for
    # slots; hosts that change at every look (a host joining and leaving again and again) had
    # it copy the batch into the arena, give the slots back and size it again until its
    # deadline: ~45,000 copies in a 5 s deadline, the default 30 s of the loop's thread
    # spinning. A batch is sized again once; if the hosts changed again, it is stored as sized.
    looks = iter(range(10**9))
    tier = ScriptedTier(4, ["a"], frozen=set())
    tier.peers = lambda: ["a", "b"][: 1 + next(looks) % 2]  # type: ignore[method-assign]
    copies = CountedCopies()
    arena = ArenaBatches(tier, copies, WAIT_S)  # type: ignore[arg-type]
    parts = arena.store_all({b"k": 0, b"l": 1}, time.monotonic() + 2.0)
    assert copies.gathers == 2  # the first try, and the batch sized again once
    assert failures(parts) == {}
    assert tier.arena.num_free == 4


def test_a_batch_stored_after_the_hosts_changed_counts_as_the_hosts_it_went_to() -> None:
    # Found by review: a batch whose hosts changed once its slots came was stored as sized
    # past its deadline (and, since the fix above, after it was sized again once) with each
    # key counted as its home's among the hosts before: the pages a joining host now wins were
    # counted as the old host's. The joining host froze, and the healthy old host was
    # "overdue": its next pages failed ("host overdue") until the frozen host's session was
    # lost. Each key now counts as its home's among the hosts at the store.
    looks = iter(range(10**9))
    both = ["a", "b"]
    tier = ScriptedTier(4, both, frozen={"b"})
    tier.peers = lambda: both[: 1 if next(looks) == 0 else 2]  # type: ignore[method-assign]
    arena = batches(tier, timeout=0.0)  # a store is overdue as soon as it began
    (on_b, later_on_b), (on_a, later_on_a) = keys_on("b", both, 2), keys_on("a", both, 2)
    assert failures(arena.store_all({on_b: 0, on_a: 1}, time.monotonic())) == {}
    later = {later_on_a: 2, later_on_b: 3}  # b's store is under way, past the timeout
    assert failures(arena.store_all(later, time.monotonic() + WAIT_S)) == {later_on_b: OVERDUE}
    tier.end_stores()
    assert tier.arena.num_free == 4


def test_an_offload_waiting_for_slots_ends_when_their_store_turns_overdue_as_it_looks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Found by review: a store that turned overdue between the offload's look at the hosts
    # (still due later) and its wait (``next_due`` read the clock again: nothing due any more)
    # was missed: the offload slept until its own deadline, as before 342a442. A thread
    # preempted there (the GIL, a busy CPU) is all it takes; the clock jumps past the store's
    # timeout there, as it would. The wait now wakes for every store not overdue when it
    # looked.
    clock = types.SimpleNamespace(skew=0.0, jump=0.0)
    fake_time = types.SimpleNamespace(monotonic=lambda: time.monotonic() + clock.skew)
    monkeypatch.setattr(arena_batches, "time", fake_time)
    monkeypatch.setattr(arena_slots, "time", fake_time)
    monkeypatch.setattr(host_shares, "time", fake_time)
    under_way = host_shares.HostShares.under_way  # how a wait for slots looks at the hosts

    def under_way_then_preempted(shares: host_shares.HostShares, now: float) -> Counter[str | None]:
        held = under_way(shares, now)
        clock.skew, clock.jump = clock.skew + clock.jump, 0.0
        return held

    monkeypatch.setattr(host_shares.HostShares, "under_way", under_way_then_preempted)
    tier = ScriptedTier(2, ["a"])
    arena = batches(tier, timeout=10.0)
    arena.store_all({b"first": 0, b"second": 1}, fake_time.monotonic() + WAIT_S)
    assert tier.arena.num_free == 0  # 'a' froze: its store holds the whole arena
    clock.jump = 11.0  # past the store's timeout, right after the next look
    parts: list[tuple[list[Key], Future[TransferResult]]] = []
    waiting = threading.Thread(
        target=lambda: parts.extend(
            arena.store([b"third"], [2], ["a"], fake_time.monotonic() + WAIT_S, ["a"]) or []
        ),
        daemon=True,
    )
    waiting.start()
    try:
        waiting.join(timeout=10.0)
        assert not waiting.is_alive(), "the offload waited past the frozen host's timeout"
        assert failures(parts) == {b"third": "capacity"}
    finally:
        tier.end_stores()
        waiting.join(timeout=10.0)
    assert tier.arena.num_free == 2


def test_an_offload_interrupted_between_two_hosts_stores_gets_the_unsent_slots_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Found by review: with several hosts a batch stores to each host in turn; Ctrl-C
    # (KeyboardInterrupt) after one host's store was handed its slots, before the next host's
    # store, lost the next host's slots for good, though nothing was sent to it. They now come
    # back at once; the first host's come back when its store ends.
    peers = ["a", "b"]
    tier = ScriptedTier(4, peers)  # stores stay under way until the test ends them
    started = arena_slots.ArenaSlots._started

    def interrupted_after(self: arena_slots.ArenaSlots, *args: object, **kwargs: object) -> None:
        started(self, *args, **kwargs)  # type: ignore[arg-type]
        raise KeyboardInterrupt

    monkeypatch.setattr(arena_slots.ArenaSlots, "_started", interrupted_after)
    arena = batches(tier, timeout=WAIT_S)
    todo = {keys_on("a", peers, 1)[0]: 0, keys_on("b", peers, 1)[0]: 1}
    with pytest.raises(KeyboardInterrupt):
        arena.store_all(todo, time.monotonic() + WAIT_S)
    monkeypatch.undo()
    assert len(tier.stores) == 1  # the second host's key was never sent
    assert tier.arena.num_free == 3  # before: 2
    tier.end_stores()
    assert tier.arena.num_free == 4
    assert arena.wait_idle(time.monotonic() + WAIT_S)


class CountedLooks(Future[TransferResult]):
    """A store's future that counts how often anything asks whether it resolved."""

    looks = 0

    def done(self) -> bool:
        CountedLooks.looks += 1
        return super().done()


def test_a_store_ending_looks_at_no_other_store_under_way() -> None:
    # Found by review: each store's done-callback (on the tier's thread) settled by looking
    # at every transfer under way, so n stores ending cost n * n looks: 10,000 stores under way
    # took 88 s of the tier's thread to end, its transfers stalled behind them. A callback
    # now drops its own store's record; a look at the state still settles them all.
    tier = ScriptedTier(100, ["a"])  # stores stay under way until the test ends them
    arena = batches(tier, timeout=WAIT_S)
    futures = [CountedLooks() for _ in range(100)]
    for future, slot in zip(futures, tier.arena.allocate(100), strict=True):
        arena._started(future, "a", [slot], time.monotonic() + WAIT_S)
    CountedLooks.looks = 0
    for future in futures:
        future.set_result(stored([]))
    assert CountedLooks.looks <= 2 * len(futures)  # before: 10,100: each under way, twice
    assert tier.arena.num_free == 100
    assert arena.wait_idle(time.monotonic() + 1.0)


def test_a_look_at_the_state_looks_at_no_store_under_way() -> None:
    # Found by review: each look at the state (three an offload, as many a restore) looked at
    # every store and read under way for one that had resolved unseen: ~17 ms a look at 10,000
    # of them, per-key work on the generation loop's hot path. Only a Ctrl-C can hide one (its
    # callback drops it otherwise), so a look now looks at those a Ctrl-C may have left.
    tier = ScriptedTier(104, ["a"], frozen=set())  # new stores end at once
    arena = batches(tier, timeout=WAIT_S)
    futures = [CountedLooks() for _ in range(100)]
    for future, slot in zip(futures, tier.arena.allocate(100), strict=True):
        arena._started(future, "a", [slot], time.monotonic() + WAIT_S)
    CountedLooks.looks = 0
    assert failures(arena.store_all({b"k": 0}, time.monotonic() + WAIT_S)) == {}
    assert arena.load_prefix([b"k"], [1], time.monotonic() + WAIT_S) == 1
    assert CountedLooks.looks == 0  # before: 1,200, each store under way, twice at each look
    for future in futures:
        future.set_result(stored([]))
    assert tier.arena.num_free == 104


def test_a_ctrl_c_in_a_callback_the_tiers_store_ran_loses_no_slot() -> None:
    # A store's future resolved by the tier on the generation loop's thread, as it submits the
    # next store; Ctrl-C (KeyboardInterrupt) stops its callbacks there, before the one that
    # drops its record. The next look at the state looks at every record once: the store's
    # slot comes back (looking only at the records whose callbacks were not sure to be added,
    # it was lost: the arena a slot short until a flush).
    tier = ScriptedTier(4, ["a"], frozen=set())  # the scripted stores end at once
    arena = batches(tier, timeout=WAIT_S)
    interrupted = CtrlCAsItsCallbacksRun()
    tier.store = lambda keys, slots, placed: interrupted  # type: ignore[method-assign]
    arena.store_all({b"interrupted": 0}, time.monotonic() + WAIT_S)

    def resolving_store(
        keys: list[Key], slots: list[int], placed: list[str] | None = None
    ) -> Future[TransferResult]:
        del tier.store  # the scripted store again: the next one is made again with it
        interrupted.set_result(stored([b"interrupted"]))  # its callbacks: Ctrl-C
        return tier.store(keys, slots, placed)

    tier.store = resolving_store  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        arena.store_all({b"next": 1}, time.monotonic() + WAIT_S)
    keys = [f"after-{i}".encode() for i in range(4)]
    deadline = time.monotonic() + 1.0
    assert failures(arena.store_all({k: i for i, k in enumerate(keys)}, deadline)) == {}
    assert tier.arena.num_free == 4


def _interrupt_after_the_reads_wait(frame: types.FrameType, event: str, arg: object) -> object:
    """A ``sys.settrace`` hook: ``KeyboardInterrupt`` at the first statement that
    ``ArenaBatches.load`` runs after its wait for the reads (where Ctrl-C lands as the wait
    returns; not at a ``try:``, where no signal is checked)."""
    if frame.f_code is not ArenaBatches.load.__code__:
        return None
    waited = [False]

    def local(frame: types.FrameType, event: str, arg: object) -> object:
        if event == "line":
            line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
            if waited[0] and not line.startswith("try:"):
                sys.settrace(None)
                raise KeyboardInterrupt
            waited[0] = waited[0] or "= wait(futures" in line
        return local

    return local


def test_a_restore_interrupted_as_its_wait_for_the_reads_returns_loses_no_slot() -> None:
    # Found by review (a KeyboardInterrupt injected after the wait for the reads): Ctrl-C as
    # the restore's wait for its reads returned, before it began unpacking them, lost every
    # slot of the batch for good (neither its Ctrl-C path nor the unpacking's ``finally``
    # covered that step): a restore of the whole arena left none, and every later offload
    # failed "capacity", every restore loaded nothing. Nothing runs between the two now.
    tier = ScriptedTier(4, ["a"], frozen=set())
    arena = batches(tier, timeout=WAIT_S)
    sys.settrace(_interrupt_after_the_reads_wait)
    try:
        with pytest.raises(KeyboardInterrupt):
            arena.load_prefix([b"k", b"l"], [0, 1], time.monotonic() + WAIT_S)
    finally:
        sys.settrace(None)
    assert tier.arena.num_free == 4  # before: 2


class CountedSlots(list[int]):
    """A transfer's slots that count how often anything asks how many they are."""

    asked = 0

    def __len__(self) -> int:
        CountedSlots.asked += 1
        return super().__len__()


def test_a_look_at_the_hosts_overdue_costs_what_changed_not_every_transfer() -> None:
    # Found by review: each look at which hosts are overdue (and at the slots under way)
    # summed every transfer under way: ~2.7 ms a look at 10,000 of them, three looks an
    # offload. The slots are now counted by host as transfers start, turn overdue and end.
    shares = host_shares.HostShares()
    futures: list[Future[TransferResult]] = [Future() for _ in range(100)]
    for i, future in enumerate(futures):  # the i-th is overdue at time i
        shares.started(future, "ab"[i % 2], CountedSlots([i]), float(i))
    CountedSlots.asked = 0
    for now in range(100):  # one more turns overdue at each look
        assert shares.overdue(float(now)) == Counter({"a": now // 2 + 1, "b": (now + 1) // 2})
        assert shares.under_way(float(now)).total() == 99 - now
        assert shares.next_due(float(now)) == (now + 1 if now < 99 else float("inf"))
    for future in futures:
        assert len(shares.ended(future)) == 1
    assert CountedSlots.asked == 3 * len(futures)  # before: 10,100, each transfer at each look
    assert shares.overdue(100.0) == Counter() == shares.under_way(100.0)  # no host left in
    empty: Future[TransferResult] = Future()
    shares.started(empty, "c", [], 0.0)  # a transfer of no slots: its host is overdue still
    assert "c" in shares.overdue(100.0)


@pytest.mark.parametrize("step", ["started", "turned overdue", "ended"])
def test_a_ctrl_c_as_the_hosts_slots_are_counted_leaves_no_host_overdue_for_good(
    monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    # The slots by host are counts that follow the records; a Ctrl-C (KeyboardInterrupt) that
    # stops one midway must not leave a host counted overdue, or its slots under way, after
    # its transfers ended (its pages would fail "host overdue" for good): the next look
    # counts every transfer again.
    shares = host_shares.HostShares()
    future: Future[TransferResult] = Future()
    real = host_shares.HostShares._count
    calls = {"started": 1, "turned overdue": 2, "ended": 4}[step]

    def count(self: host_shares.HostShares, *args: object, **kwargs: bool) -> None:
        nonlocal calls
        calls -= 1
        if not calls:
            raise KeyboardInterrupt  # before the count changed
        real(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(host_shares.HostShares, "_count", count)
    with pytest.raises(KeyboardInterrupt):
        shares.started(future, "a", [0], 1.0)
        shares.overdue(1.0)
        shares.ended(future)
    assert shares.under_way(0.5) == Counter({"a": 1}) if step == "started" else True
    shares.ended(future)
    assert shares.overdue(2.0) == Counter() == shares.under_way(2.0)
    assert shares.next_due(2.0) == float("inf")


def _lines(fn: types.FunctionType, first: str, last: str) -> set[int]:
    """The line numbers of ``fn`` from the first holding ``first`` to the next holding ``last``."""
    source, start = inspect.getsourcelines(fn)
    begin = next(i for i, line in enumerate(source) if first in line)
    end = next(i for i, line in enumerate(source) if i >= begin and last in line)
    return set(range(start + begin, start + end + 1))


def _ctrl_c_at_line(
    where: dict[types.CodeType, set[int] | None], *at: int
) -> tuple[object, list[str]]:
    """A ``sys.settrace`` hook that raises ``KeyboardInterrupt`` at each ``at``-th line run of
    ``where`` (code: its lines, ``None``: all; comprehensions in it too), and what it hit. Not
    at a ``with``, ``try``, ``except`` or ``finally`` line: a signal lands at none of them (and
    one raised as a ``with`` exits would leave its lock held)."""
    nested = {
        inner: None
        for code in where
        for inner in code.co_consts
        if isinstance(inner, types.CodeType)
    }
    traced = {**nested, **where}
    seen: list[str] = []

    def local(frame: types.FrameType, event: str, arg: object) -> object:
        line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
        lines = traced[frame.f_code]
        if (
            event == "line"
            and (lines is None or frame.f_lineno in lines)
            and not line.startswith(("with ", "try:", "except", "finally:"))
        ):
            seen.append(line)
            if len(seen) == max(at):
                sys.settrace(None)
            if len(seen) in at:
                raise KeyboardInterrupt
        return local

    return (lambda frame, event, arg: local if frame.f_code in traced else None), seen


@pytest.mark.parametrize("call", ["store", "load"])
def test_a_ctrl_c_as_slots_are_handed_out_or_given_back_loses_none_and_frees_none_twice(
    call: str,
) -> None:
    # Found by review (a KeyboardInterrupt injected at every line): Ctrl-C as the arena handed
    # a batch its slots (as ``_acquire`` returned them, before the batch's ``try``), between
    # a store's two ``try`` blocks, or in the restore's ``finally`` that gives the slots
    # back (its comprehension, ``_release``'s lock) lost the batch's slots for good: the
    # arena shrank until a restart. The arena now hands them out into the batch's list in
    # the step that takes them, and the giving back skips those already back and is made
    # again when interrupted: every slot comes back, none twice (``ValueError``).
    where: dict[types.CodeType, set[int] | None] = {
        arena_slots.ArenaSlots._acquire.__code__: None,
        arena_slots.ArenaSlots._release.__code__: None,
        BlockArena.allocate.__code__: None,
        BlockArena.free_taken.__code__: None,
    }
    if call == "store":
        where[ArenaBatches.store.__code__] = _lines(ArenaBatches.store, "self._acquire(", "raise")
    else:
        where[ArenaBatches.load.__code__] = _lines(
            ArenaBatches.load, "self._acquire(", "due = time.monotonic()"
        ) | _lines(ArenaBatches.load, "finally:  # a Ctrl-C too", "return count")
    for k in itertools.count(1):
        tier = ScriptedTier(4, ["a"], frozen=set())  # stores and reads end at once
        arena = batches(tier, timeout=WAIT_S)
        hook, seen = _ctrl_c_at_line(where, k)
        sys.settrace(hook)  # type: ignore[arg-type]
        try:
            if call == "store":
                arena.store([b"k", b"l"], [0, 1], ["a", "a"], time.monotonic() + WAIT_S, ["a"])
            else:
                arena.load([b"k", b"l"], ["a", "a"], [0, 1], time.monotonic() + WAIT_S)
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
        assert arena.wait_idle(time.monotonic() + 1.0)
        assert tier.arena.num_free == 4, f"Ctrl-C at {seen[-1]!r} lost slots"
        if len(seen) < k:  # it ran through: every line was hit once
            break
    assert k > 10


class ReadPastTheDeadline:
    """The tier's load of a read begun just before its restore's deadline, on the test's
    clock: the clock moves past the deadline, the read stays under way (``read``)."""

    def __init__(self, clock: Clock, read: Future[TransferResult]) -> None:
        self._clock, self.read = clock, read
        self.calls = 0

    def __call__(self, keys: list[Key], slots: list[int]) -> Future[TransferResult]:
        self._clock.now += 1.0
        self.calls += 1
        return self.read


def test_a_ctrl_c_as_a_restore_holds_its_late_reads_frees_no_slot_they_may_write(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Found by review (a KeyboardInterrupt injected at every line): Ctrl-C after the wait for
    # the reads returned with one still under way, before ``_hold`` had marked its slots in
    # use (as the call began), freed them in the restore's ``finally``: the next batch took
    # them while the read could still land in them (its bytes under that batch's keys). The
    # late reads are held inside the step that waits for them now; a Ctrl-C there holds
    # those not yet held, none twice, and every slot comes back once the read ended.
    where: dict[types.CodeType, set[int] | None] = {
        ArenaBatches.load.__code__: _lines(ArenaBatches.load, "= wait(futures", "self._hold("),
        arena_slots.ArenaSlots._hold.__code__: None,
        arena_slots.ArenaSlots._started.__code__: None,
        arena_slots.ArenaSlots._record.__code__: None,
    }
    clock = on_the_clock(monkeypatch)
    for k in itertools.count(1):
        tier = ScriptedTier(4, ["a"], frozen=set())
        read: Future[TransferResult] = Future()
        tier.load = ReadPastTheDeadline(clock, read)  # type: ignore[method-assign]
        arena = batches(tier, timeout=WAIT_S)
        hook, seen = _ctrl_c_at_line(where, k)
        sys.settrace(hook)  # type: ignore[arg-type]
        try:
            arena.load([b"k", b"l"], ["a", "a"], [0, 1], clock.now + 0.5)
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
        at = repr(seen[-1])
        assert tier.arena.num_free == 2, f"Ctrl-C at {at} freed slots a read may still write"
        read.set_result(stored([b"k", b"l"]))
        assert arena.wait_idle(clock.now + 1.0)
        assert tier.arena.num_free == 4, f"Ctrl-C at {at} lost slots"
        if len(seen) < k:  # it ran through: every line was hit once
            break
    assert k > 10


class EndsAsItIsLookedAt(Future[TransferResult]):
    """A read that ends (on the tier's thread) just after a look found it under way, once
    ``armed``."""

    armed = False

    def done(self) -> bool:
        if self.armed and not super().done():
            self.armed = False
            self.set_result(stored([]))
            return False  # as the look saw it
        return super().done()


def test_a_ctrl_c_after_a_late_read_was_held_does_not_hold_it_twice(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A Ctrl-C (KeyboardInterrupt) as a restore holds its late reads sends it down the path
    # that holds every read still under way; one held already must not be held again: if it
    # ended between that look and its second record, both records handed its slots back
    # (the second a double free, ``ValueError`` in its callback; had the slots been taken
    # again meanwhile, a slot freed under another batch).
    clock = on_the_clock(monkeypatch)
    tier = ScriptedTier(4, ["a"], frozen=set())
    read = EndsAsItIsLookedAt()
    tier.load = ReadPastTheDeadline(clock, read)  # type: ignore[method-assign]
    arena = batches(tier, timeout=WAIT_S)
    real_started = arena._started

    def started_then_ctrl_c(*args: object, **kwargs: object) -> None:
        real_started(*args, **kwargs)  # type: ignore[arg-type]
        read.armed = True  # it ends just after the next look
        raise KeyboardInterrupt

    arena._started = started_then_ctrl_c  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        arena.load([b"k", b"l"], ["a", "a"], [0, 1], clock.now + 0.5)
    del arena._started
    read.armed = False
    if not read.done():
        read.set_result(stored([]))
    assert arena.wait_idle(clock.now + 1.0)
    assert tier.arena.num_free == 4
    assert not [r for r in caplog.records if r.levelname == "ERROR"]  # before: double free


@pytest.mark.parametrize("call", ["store", "load"])
def test_a_second_ctrl_c_in_the_handler_of_the_first_loses_no_slot_for_good(
    call: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Found by review (a KeyboardInterrupt injected at every line, then a second at each of the
    # lines after it): a second Ctrl-C as the handler of the first gave the slots back, one
    # inside the arena's slot pool as it took or freed slots, or one in a done-callback as it
    # dropped a record lost those slots for good: the arena shrank until a restart. The next
    # batch now gives each slot left without an owner back (a store interrupted in the tier is
    # made again), none twice; only a load interrupted in the tier keeps its slots (it may
    # have begun a read that nothing reports the end of).
    ctrl_c_lines = [
        ArenaBatches.store if call == "store" else ArenaBatches.load,
        *(getattr(ArenaBatches, name) for name in ("_acquire", "_release", "_rejoin")),
        *(getattr(ArenaBatches, name) for name in ("_started", "_record", "_hold")),
        *(getattr(ArenaBatches, name) for name in ("_ended", "_hand_back", "_keep")),
        BlockArena.allocate,
        BlockArena.free,
        BlockArena.free_taken,
        SlotPool.allocate,
        SlotPool.free,
    ]
    where: dict[types.CodeType, set[int] | None] = {fn.__code__: None for fn in ctrl_c_lines}
    runs = 0
    for first in itertools.count(1):
        for second in [None, *range(first + 1, first + 40)]:
            tier = ScriptedTier(4, ["a"], frozen=set())  # stores and reads end at once
            arena = batches(tier, timeout=WAIT_S)
            at = (first,) if second is None else (first, second)
            hook, seen = _ctrl_c_at_line(where, *at)
            sys.settrace(hook)  # type: ignore[arg-type]
            try:
                if call == "store":
                    arena.store_all({b"k": 0, b"l": 1}, time.monotonic() + WAIT_S)
                else:
                    arena.load_prefix([b"k", b"l"], [0, 1], time.monotonic() + WAIT_S)
            except KeyboardInterrupt:
                pass
            finally:
                sys.settrace(None)
            runs += 1
            hit = [seen[i - 1] for i in at if i <= len(seen)]
            assert failures(arena.store_all({b"next": 2}, time.monotonic() + WAIT_S)) == {}
            assert arena.wait_idle(time.monotonic() + WAIT_S)
            kept = 2 if any("self._manager.load(" in line for line in hit) else 0
            assert tier.arena.num_free == 4 - kept, f"Ctrl-C at {hit} lost slots"
            assert not [r for r in caplog.records if r.levelname == "ERROR"], hit  # freed twice
            if len(seen) < max(at):  # it ran through: no line left for this interrupt
                break
        if len(seen) < first:
            break
    assert runs > 100
