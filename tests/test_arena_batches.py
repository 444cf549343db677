"""The torch loop's arena batches against a scripted tier: when a host is overdue, and for how
long an offload waits for slots. No host runs: the tier's store futures resolve when a test says
(a frozen host's never do until then), so each test takes well under a second."""

from __future__ import annotations

import threading
import time
import types
from collections import Counter
from concurrent.futures import Future

import pytest
from arena_support import (
    WAIT_S,
    Clock,
    NoCopies,
    ReadPastTheDeadline,
    ScriptedTier,
    batches,
    failures,
    keys_on,
    on_the_clock,
    stored,
)

from torch_kv_tier.integrations.torch_loop import arena_batches, arena_slots, host_shares
from torch_kv_tier.integrations.torch_loop.arena_batches import ArenaBatches
from torch_kv_tier.integrations.torch_loop.host_shares import OVERDUE
from torch_kv_tier.integrations.torch_loop.offload_results import (
    OffloadError,
    combine,
    failed_now,
)
from torch_kv_tier.keys import Key
from torch_kv_tier.results import TransferResult


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
    tier.placing_peers = lambda: ["a", "b"][: 1 + next(looks) % 2]  # type: ignore[method-assign]
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
    tier.placing_peers = lambda: both[: 1 if next(looks) == 0 else 2]  # type: ignore[method-assign]
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


@pytest.mark.parametrize("failing", [1, 2])
def test_an_offload_stopped_after_it_sent_a_batch_names_the_pages_sent_and_those_not(
    failing: int,
) -> None:
    # Found by review: a copy out of the cache that failed in a later batch (out of memory,
    # say) was raised as it was, though the earlier batches had been sent (and were stored):
    # the caller could not tell which pages to offload again. It is raised as it is only
    # before any batch was sent now, else as an OffloadError naming both (its cause: the
    # failure).
    tier = ScriptedTier(2, ["a"], frozen=set())  # stores end at once
    arena = batches(tier, timeout=WAIT_S)
    copies: list[list[int]] = []

    def gather(pages: list[int], slots: list[int]) -> None:
        copies.append(pages)
        if len(copies) == failing:
            raise MemoryError("out of memory (injected)")

    arena._pages.gather = gather  # type: ignore[method-assign]
    todo = {b"a": 10, b"b": 11, b"c": 12, b"d": 13}
    with pytest.raises((MemoryError, OffloadError)) as err:
        arena.store_all(todo, time.monotonic() + WAIT_S)
    if failing == 1:  # nothing sent: as it is
        assert type(err.value) is MemoryError
    else:
        assert isinstance(err.value, OffloadError)
        assert isinstance(err.value.__cause__, MemoryError)
        message = str(err.value)
        assert "handed 2 pages (page_ids [10, 11])" in message
        assert "2 pages (page_ids [12, 13]) were not sent" in message
        assert [keys for keys, _ in tier.stores] == [[b"a", b"b"]]
    assert tier.arena.num_free == 2


class RefusesAStore(ScriptedTier):
    """A scripted tier that refuses the ``refused``-th store (as a closed tier does)."""

    def __init__(self, refused: int) -> None:
        super().__init__(2, ["a"], frozen=set())  # stores end at once
        self.refused, self.calls = refused, 0

    def store(
        self, keys: list[Key], slots: list[int], placed: list[str] | None = None
    ) -> Future[TransferResult]:
        self.calls += 1
        if self.calls == self.refused:
            raise RuntimeError("the tier is closed (injected)")
        return super().store(keys, slots, placed)


@pytest.mark.parametrize("refused", [1, 2])
def test_an_offload_stopped_part_way_names_a_batch_failed_at_once_as_not_sent(
    refused: int,
) -> None:
    # Found by review: a batch that failed at once (the tier's refusal here; no slots in time
    # or an overdue host alike) was named among the pages "handed to the tier" when a later
    # batch's copy failed, and one such batch alone made the failure an OffloadError saying
    # its pages were handed over: the caller was told not to offload again pages that were
    # never stored. They are named with the pages not sent now; none handed, the failure is
    # raised as it is.
    tier = RefusesAStore(refused)
    arena = batches(tier, timeout=WAIT_S)
    copies: list[list[int]] = []

    def gather(pages: list[int], slots: list[int]) -> None:
        copies.append(pages)
        if len(copies) == refused + 1:
            raise MemoryError("out of memory (injected)")

    arena._pages.gather = gather  # type: ignore[method-assign]
    todo = {b"a": 10, b"b": 11, b"c": 12, b"d": 13, b"e": 14, b"f": 15}
    with pytest.raises((MemoryError, OffloadError)) as err:
        arena.store_all(todo, time.monotonic() + WAIT_S)
    stored_keys = [key for keys, future in tier.stores for key in keys]
    if refused == 1:  # the refused batch, then the failed copy: nothing handed to the tier
        assert type(err.value) is MemoryError
        assert stored_keys == []
    else:
        assert isinstance(err.value, OffloadError)
        message = str(err.value)
        assert "handed 2 pages (page_ids [10, 11])" in message
        assert "4 pages (page_ids [12, 13, 14, 15]) were not sent or failed at once" in message
        assert stored_keys == [b"a", b"b"]
    assert tier.arena.num_free == 2


def test_a_strict_offload_of_many_failed_pages_raises_a_short_error() -> None:
    # Found by review: a strict offload raised OffloadError with every failed key and its
    # reason in the message (~110,000 characters for 10,000 pages). It counts them by reason
    # and names at most 4 keys now.
    keys = [f"key-{i}".encode() for i in range(10_000)]
    parts = [(keys[:64], failed_now(keys[:64], "capacity", "test"))]
    parts.append((keys[64:], failed_now(keys[64:], "no peers", "test")))
    error = combine(keys, parts, time.perf_counter(), strict=True).exception()
    assert isinstance(error, OffloadError)
    message = str(error)
    assert len(message) < 300, message
    assert "failed 10000 of 10000 pages {'capacity': 64, 'no peers': 9936}" in message
    assert "(keys b'key-0', b'key-1', b'key-2', b'key-3', ...)" in message
