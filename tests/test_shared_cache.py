"""``SharedCache``, the host-side index of a shared pool: grants, commits with digests, LRU
eviction, namespace quotas, held grants of sessions that ended uncleanly and the event stream
(pure bookkeeping, no server)."""

from __future__ import annotations

from collections import OrderedDict
from unittest import mock

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from torch_kv_tier.remote import protocol as p
from torch_kv_tier.remote import shared_events, shared_snapshot, slot_owners
from torch_kv_tier.remote.leases import Session, SlotPool
from torch_kv_tier.remote.shared_cache import SharedCache
from torch_kv_tier.remote.shared_events import Namespace
from torch_kv_tier.remote.shared_service import SharedService
from torch_kv_tier.remote.shared_snapshot import SCAN_SLOTS
from torch_kv_tier.remote.slot_owners import FORGET_AFTER, SlotOwners


def _cache(num_blocks: int = 8, **kwargs: object) -> SharedCache:
    kwargs.setdefault("max_granted", num_blocks)
    cache = SharedCache(SlotPool(num_blocks), **kwargs)  # type: ignore[arg-type]
    cache.join("a", "model-x")
    cache.join("b", "model-x")
    cache.join("c", "model-y")
    return cache


def _store(cache: SharedCache, session: str, keys: list[object]) -> list[int]:
    slots = cache.grant(session, len(keys))
    assert len(slots) == len(keys)
    digests = [hash(k) & 0xFFFF for k in keys]
    assert cache.commit(session, keys, slots, digests) == len(keys)  # type: ignore[arg-type]
    return slots


def _found(cache: SharedCache, session: str, keys: list[object]) -> list[int]:
    """Each key's slot in the session's snapshot, -1 when it is not stored."""
    stored, slots, _, _ = shared_snapshot.whole(cache, session)
    where = dict(zip(stored, slots))
    return [where.get(k, -1) for k in keys]  # type: ignore[call-overload]


def test_a_key_committed_by_one_session_is_found_by_another_of_its_namespace_only() -> None:
    cache = _cache()
    slots = _store(cache, "a", [b"k1", b"k2"])
    assert _found(cache, "b", [b"k2", b"k1", b"nope"]) == [slots[1], slots[0], -1]
    assert _found(cache, "c", [b"k1"]) == [-1]  # another model never sees the block
    keys, _, digests, _ = shared_snapshot.whole(cache, "b")
    assert dict(zip(keys, digests)) == {b"k1": hash(b"k1") & 0xFFFF, b"k2": hash(b"k2") & 0xFFFF}


def test_granted_slots_are_private_until_committed_and_not_reused() -> None:
    cache = _cache(num_blocks=4)
    first = cache.grant("a", 3)
    second = cache.grant("b", 3)
    assert len(first) == 3 and len(second) == 1  # the pool has 4 slots
    assert not set(first) & set(second)
    assert cache.commit("b", [b"x"], first[:1], [0]) == 0  # not b's slot: ignored
    assert _found(cache, "a", [b"x"]) == [-1]


def test_a_key_stored_twice_keeps_its_first_copy_frees_the_second_and_announces_it() -> None:
    cache = _cache(num_blocks=2)
    a_slot = cache.grant("a", 1)
    b_slot = cache.grant("b", 1)
    assert cache.commit("a", [b"k"], a_slot, [7]) == 1
    cache.take_events(max_keys=100)
    assert cache.commit("b", [b"k"], b_slot, [7]) == 0
    assert _found(cache, "b", [b"k"]) == a_slot
    # b published k locally in its own slot: the host tells it where k really is
    [(_, _, stored, slots, digests, _)] = cache.take_events(max_keys=100)
    assert (stored, slots, digests) == ([b"k"], a_slot, [7])
    assert cache.grant("b", 1) == b_slot  # free again, nothing had to be evicted
    assert cache.evictions == 0


def test_a_commit_of_fresh_stored_and_repeated_keys_and_foreign_slots_takes_each_alone() -> None:
    cache = _cache(num_blocks=8)
    [old] = _store(cache, "a", [b"old"])
    mine = cache.grant("a", 4)
    theirs = cache.grant("b", 1)
    keys = [b"new1", b"old", b"new1", b"new2", b"x"]
    slots = [mine[0], mine[1], mine[2], mine[3], theirs[0]]
    assert cache.commit("a", keys, slots, [1, 2, 3, 4, 5]) == 2  # type: ignore[arg-type]
    # the first copy of a key wins (stored before, or earlier in the message); b's slot is b's
    assert _found(cache, "b", [b"new1", b"old", b"new2", b"x"]) == [mine[0], old, mine[3], -1]
    assert cache.commit("b", [b"x"], theirs, [6]) == 1  # b's slot was never taken from it
    assert sorted(cache.grant("a", 2)) == sorted(mine[1:3])  # the two unused slots, free again


def test_a_commits_keys_are_evicted_in_the_order_it_named_them() -> None:
    cache = _cache(num_blocks=4)
    slots = _store(cache, "a", [b"k0", b"k1", b"k2", b"k3"])
    assert cache.grant("b", 2) == slots[:2]  # the pool is full: k0 and k1 go first
    assert _found(cache, "b", [b"k0", b"k1", b"k2", b"k3"]) == [-1, -1, *slots[2:]]


def test_a_full_pool_evicts_the_least_recently_used_key() -> None:
    cache = _cache(num_blocks=3)
    _store(cache, "a", [b"k0", b"k1", b"k2"])
    cache.touch("b", [b"k0"])  # k1 is now the oldest
    assert len(cache.grant("a", 1)) == 1
    assert _found(cache, "a", [b"k0", b"k1", b"k2"])[1] == -1


def test_a_namespace_at_its_quota_evicts_its_own_keys_not_anothers() -> None:
    cache = _cache(num_blocks=8, quota=4)
    _store(cache, "c", [b"y0", b"y1", b"y2"])  # model-y first: the oldest keys
    _store(cache, "a", [b"x0", b"x1", b"x2", b"x3"])
    assert len(cache.grant("a", 2)) == 2  # at quota: x0 and x1 are evicted
    assert -1 not in _found(cache, "c", [b"y0", b"y1", b"y2"])
    xs = _found(cache, "a", [b"x0", b"x1", b"x2", b"x3"])
    assert xs[:2] == [-1, -1] and -1 not in xs[2:]


def test_an_unclean_sessions_grants_are_held_until_released_and_a_clean_ones_freed() -> None:
    cache = _cache(num_blocks=2)
    lost = cache.grant("a", 1)
    cache.leave("a", 0.0, clean=False)  # it may still write there: held, with no timer
    assert (cache.held.blocks, len(cache.held)) == (1, 1)
    clean = cache.grant("b", 1)
    assert clean != lost
    cache.leave("b", 0.0, clean=True)
    cache.join("d", "model-x")
    assert cache.grant("d", 2) == clean  # the held slot is nobody's, however long it waits
    assert cache.release(["not-a-session"]) == 0
    assert cache.held.since(0.0) == [] and cache.held.since(0.5) == ["a"]  # a hold timeout's view
    assert cache.release(["a"]) == 1 and cache.held.blocks == 0
    assert cache.grant("d", 1) == lost


def test_events_report_final_states_with_slots_and_digests_in_numbered_batches() -> None:
    cache = _cache(num_blocks=2)
    first = _store(cache, "a", [b"k0", b"k1"])
    (ns, seq, stored, slots, _, evicted), *rest = cache.take_events(max_keys=100)
    assert (ns.name, seq, stored, slots, evicted, rest) == (
        "model-x",
        1,
        [b"k0", b"k1"],
        first,
        [],
        [],
    )
    slot = cache.grant("a", 1)  # evicts k0
    cache.commit("a", [b"k2"], slot, [5])
    batches = cache.take_events(max_keys=1)
    assert [(s, st, sl, dg, ev) for _, s, st, sl, dg, ev in batches] == [
        (2, [], [], [], [b"k0"]),
        (3, [b"k2"], slot, [5], []),
    ]
    keys, _, _, event_seq = shared_snapshot.whole(cache, "b")
    assert sorted(keys) == [b"k1", b"k2"] and event_seq == 3  # type: ignore[type-var]


def test_a_key_stored_and_evicted_between_two_batches_is_reported_evicted() -> None:
    cache = _cache(num_blocks=1)
    _store(cache, "a", [b"k0"])
    _store(cache, "a", [b"k1"])  # evicts k0
    [(_, _, stored, _, _, evicted)] = cache.take_events(max_keys=100)
    assert (stored, evicted) == ([b"k1"], [b"k0"])


def test_a_key_stored_and_evicted_twice_between_two_batches_is_reported_once() -> None:
    """Regression (found by ``torch-kv-tier shared-stress``): a key evicted twice within one
    batch was listed twice, and the tiers' copies of the index failed on the second removal
    (``KeyError`` on the session's I/O thread: every tier lost the host)."""
    cache = _cache(num_blocks=1)
    _store(cache, "a", [b"k0"])
    cache.take_events(max_keys=100)
    for key in (b"k1", b"k0", b"k1"):  # each store evicts the other key
        _store(cache, "a", [key])
    [(_, _, stored, _, _, evicted)] = cache.take_events(max_keys=100)
    assert (stored, evicted) == ([b"k1"], [b"k0"])


def test_a_namespace_with_no_session_and_no_key_is_forgotten() -> None:
    cache = SharedCache(SlotPool(4))
    for i in range(100):  # a client cycling through fingerprints leaves nothing behind
        cache.join(f"s{i}", f"model-{i}")
        cache.leave(f"s{i}", 0.0, clean=True)
    assert cache.namespaces == {}
    cache.join("a", "kept")
    _store(cache, "a", [b"k"])
    cache.leave("a", 0.0, clean=True)
    assert list(cache.namespaces) == ["kept"]  # it still has a key


def test_a_namespace_whose_last_key_is_evicted_after_its_sessions_left_is_forgotten() -> None:
    """Each namespace that stored a key and whose sessions then left stayed in the cache for
    good once other namespaces evicted that key: a client cycling through fingerprints grew the
    host's namespaces (and its stats, and the loop's scan for events) without bound."""
    cache = SharedCache(SlotPool(1))
    for i in range(100):  # each store evicts the key of the namespace before it
        cache.join(f"s{i}", f"model-{i}")
        _store(cache, f"s{i}", [b"k"])
        cache.leave(f"s{i}", 0.0, clean=True)
        cache.take_events(max_keys=100)
    assert list(cache.namespaces) == ["model-99"]  # the one that still has its key


def test_slots_a_promotion_writes_are_counted_granted_not_free_until_it_ends() -> None:
    """A promotion's slots (``take_for``: the disk writes them) were counted by the
    namespace but not in the host's ``granted`` total: stats and metrics showed them free."""
    cache = _cache(num_blocks=4)
    ns = cache.namespace_of("a")
    first, second = cache.take_for(ns, 2)
    assert (cache.granted, cache.free_slots()) == (2, 2)
    cache.promoted(ns, b"k", first, 7)
    cache.unpromoted(ns, second)
    assert (cache.stored, cache.granted, cache.free_slots()) == (1, 0, 3)


def test_bad_settings_raise() -> None:
    with pytest.raises(ValueError, match="quota"):
        SharedCache(SlotPool(4), quota=0)
    with pytest.raises(ValueError, match="max granted"):
        SharedCache(SlotPool(4), max_granted=0)


def test_a_session_holds_at_most_max_granted_uncommitted_slots() -> None:
    cache = _cache(num_blocks=64, max_granted=4)
    first = cache.grant("a", 10)
    assert len(first) == 4 and cache.grant("a", 1) == []
    cache.commit("a", [b"k0", b"k1"], first[:2], [0, 0])
    assert len(cache.grant("a", 10)) == 2  # committing made room in its share
    assert len(cache.grant("b", 10)) == 4  # every session has its own


def test_shared_grants_draw_only_what_they_need_so_private_leases_still_fit() -> None:
    pool = SlotPool(64)
    cache = SharedCache(pool, max_granted=4)
    cache.join("a", "model-x")
    assert len(cache.grant("a", 512)) == 4
    assert pool.take(60) == range(4, 64)  # a private lease of every other slot


def test_a_grant_of_many_slots_evicts_the_least_recently_used_keys_oldest_first() -> None:
    cache = _cache(num_blocks=8)
    keys = [f"k{i}" for i in range(8)]
    slots = dict(zip(keys, _store(cache, "a", keys)))
    cache.touch("a", ["k0", "k1"])
    cache.take_events(64)
    granted = cache.grant("b", 5)
    assert granted == [slots[k] for k in ("k2", "k3", "k4", "k5", "k6")]
    assert cache.take_events(64)[0][5] == ["k2", "k3", "k4", "k5", "k6"]  # evicted, in order
    assert _found(cache, "a", ["k0", "k1", "k7"]) == [slots["k0"], slots["k1"], slots["k7"]]
    assert cache.evictions == 5


def test_a_grant_takes_the_free_slots_first_then_evicts_for_the_rest() -> None:
    cache = _cache(num_blocks=8)
    stored = _store(cache, "a", ["k0", "k1", "k2", "k3", "k4", "k5"])
    granted = cache.grant("b", 4)
    assert len(set(granted)) == 4 and set(granted).isdisjoint(stored[2:])
    assert set(granted) == set(range(8)) - set(stored) | set(stored[:2])
    assert _found(cache, "a", ["k0", "k1", "k2"]) == [-1, -1, stored[2]]


def test_grants_come_in_ascending_slots_whatever_order_they_were_freed_or_evicted_in() -> None:
    """A tier writes and reads a call's blocks into its granted slots in order, and adjacent
    slots are one transfer segment: grants after a session left (its slots freed) and grants
    that evict keys stored out of slot order still come ascending."""
    cache = _cache(num_blocks=64)
    cache.grant("a", 40)
    cache.leave("a", 0.0, clean=True)  # its 40 slots are free again
    assert cache.grant("b", 16) == list(range(16))
    assert cache.grant("b", 16) == list(range(16, 32))
    slots = cache.grant("c", 32)  # the 8 free slots left and 24 drawn from the pool
    assert slots == sorted(slots)
    backwards = list(reversed(slots))
    assert cache.commit("c", [f"k{i}" for i in range(32)], backwards, [0] * 32) == 32
    assert cache.grant("c", 32) == slots  # evicted newest slot first, granted ascending


_OPS = st.lists(
    st.tuples(
        st.sampled_from(
            ["join", "grant", "commit", "touch", "leave", "release", "promote", "lease"]
        ),
        st.integers(0, 2),  # a session
        st.integers(1, 9),  # a count, a key; odd: an unclean leave
    ),
    max_size=80,
)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 12), st.integers(1, 12), st.booleans(), _OPS)
@example(4, 4, False, [("grant", 0, 1), ("grant", 0, 3), ("leave", 0, 1), ("grant", 1, 4)])
@example(2, 2, True, [("grant", 0, 1), ("promote", 0, 2), ("leave", 0, 2), ("promote", 1, 3)])
def test_every_slot_has_one_owner_and_everything_ended_leaves_nothing_granted_or_held(
    num_blocks: int, max_granted: int, quota: bool, ops: list[tuple[str, int, int]]
) -> None:
    """Odd but legal sequences (duplicate and foreign commits, a session ending twice, releases
    of sessions that were never held, promotions, private leases drawn beside the cache) never
    give one slot two owners: a slot is stored, granted to one session or promotion, held for
    one ended session, leased, or free. Once
    every session ended and was released, nothing is granted or held and only namespaces with
    keys are left."""
    cache = SharedCache(
        SlotPool(num_blocks), quota=num_blocks // 2 or 1 if quota else None, max_granted=max_granted
    )
    granted: dict[str, set[int]] = {}  # live session -> slots it was granted, not committed
    held: dict[str, set[int]] = {}  # ended session -> slots it may still write
    promoting: list[tuple[Namespace, int]] = []
    leases: list[range] = []  # private leases drawn from the pool beside the cache

    def check() -> None:
        owned = [slot for _, _, slot in cache.oldest(num_blocks)]
        owned += [slot for slots in (*granted.values(), *held.values()) for slot in slots]
        owned += [slot for _, slot in promoting]
        owned += [slot for lease in leases for slot in lease]
        assert len(owned) == len(set(owned)), owned
        assert len(owned) + cache.free_slots() == num_blocks
        assert cache.granted == sum(map(len, granted.values())) + len(promoting)
        assert cache.held.blocks == sum(map(len, held.values()))

    for op, who, n in ops:
        sid = f"s{who}"
        if op == "join" or sid not in granted:
            if sid not in granted and sid not in held:
                cache.join(sid, f"model-{n % 2}")
                granted[sid] = set()
        elif op == "grant":
            slots = cache.grant(sid, n)
            assert not set(slots) & granted[sid]
            granted[sid].update(slots)
        elif op == "commit":  # its own slots, a foreign one, keys stored before or twice
            mine = sorted(granted[sid])[: n % 4 + 1]
            slots = [*mine, *[s for s in range(num_blocks) if s not in granted[sid]][-1:]]
            keys = [f"k{(n + i) % 5}" for i in range(len(slots))]
            cache.commit(sid, keys, slots, [7] * len(slots))
            granted[sid].difference_update(mine)
        elif op == "touch":
            cache.touch(sid, [f"k{n % 5}", "never-stored"])
        elif op == "leave":
            cache.leave(sid, 0.0, clean=n % 2 == 0)
            uncommitted = granted.pop(sid)
            if n % 2 and uncommitted:
                held[sid] = uncommitted
            cache.leave(sid, 0.0, clean=True)  # ending twice changes nothing
        elif op == "release":
            cache.release([sid, "never-held"])
            held.pop(sid, None)
        elif op == "lease":  # a private lease, once the free slots went back; or its end
            if n % 2 and leases:
                cache.pool.give_back(leases.pop())
            else:
                cache.return_free()
                leases += [lease] if (lease := cache.pool.take(n)) else []
        else:  # a promotion into a slot taken for the namespace, which lands or fails
            ns = cache.namespace_of(sid)
            if n % 3 == 0 and promoting:
                owner, slot = promoting.pop()
                cache.promoted(owner, f"k{n % 5}", slot, 9)
            elif n % 3 == 1 and promoting:
                cache.unpromoted(*promoting.pop())
            else:
                promoting += [(ns, slot) for slot in cache.take_for(ns, 1)]
        if op in ("grant", "commit", "leave"):
            cache.take_events(max_keys=3)
        check()

    for owner, slot in promoting:
        cache.unpromoted(owner, slot)
    promoting.clear()
    for sid in list(granted):
        cache.leave(sid, 0.0, clean=True)
    granted.clear()
    cache.release(list(held))
    held.clear()
    for lease in leases:
        cache.pool.give_back(lease)
    leases.clear()
    cache.take_events(max_keys=3)
    check()
    assert (cache.granted, cache.held.blocks, len(cache.held)) == (0, 0, 0)
    assert all(ns.entries and not ns.sessions for ns in cache.namespaces.values())


def test_a_snapshots_pages_are_walked_as_they_are_asked_not_copied_whole_at_the_first() -> None:
    """Found by review: the first page of a join's snapshot copied every key of its namespace,
    those on disk included, on the host's loop: 0.5 s at 1 M keys on disk, 1.8 s at 4 M, while
    every other tier's commits, grants and heartbeats waited. Each page now walks a bounded
    part of the host's slots (``shared_snapshot``): a key evicted after the first page is not
    in a later one (its event tells the tier), and a cursor no snapshot is at is refused."""
    n = 3 * SCAN_SLOTS
    service = SharedService(SlotPool(n), quota=None, max_granted=4096)
    session = Session("t", "t", "test", range(0), 0.0, 0.0, shared=True, namespace="m")
    service.join(session)
    keys = [b"k%d" % i for i in range(n)]
    for start in range(0, n, 4096):
        slots = service.cache.grant("t", 4096)
        service.cache.commit("t", keys[start : start + 4096], slots, [1] * 4096)
    first = service.answer(session, p.SnapshotRequest(1, "t", 0), 0.0)
    assert isinstance(first, p.SnapshotPage) and first.next_cursor > 0
    assert keys[-1] not in first.keys  # in the last slot
    service.cache.touch("t", keys[:-1])
    assert service.cache.grant("t", 1) == [n - 1]  # keys[-1] evicted
    later: list[object] = []
    cursor = first.next_cursor
    while cursor >= 0:
        page = service.answer(session, p.SnapshotRequest(2, "t", cursor), 0.0)
        assert isinstance(page, p.SnapshotPage) and page.event_seq == first.event_seq
        later += page.keys
        cursor = page.next_cursor
    assert keys[-1] not in later and len(first.keys) + len(later) == n - 1
    refused = service.answer(session, p.SnapshotRequest(3, "t", 5), 0.0)
    assert isinstance(refused, p.Error) and "cursor 0" in refused.reason


def test_a_host_whose_namespaces_come_and_go_remembers_only_the_ones_its_slots_hold() -> None:
    """Every namespace name ever stored kept a number (what snapshots pick slots by): a host
    whose tenants' namespaces came and went grew without bound. The names no slot holds are
    forgotten now, and snapshots still find the keys of every namespace stored."""
    cache = _cache(num_blocks=16)
    kept = _store(cache, "a", [b"kept"])
    tenants = 3 * FORGET_AFTER
    for i in range(tenants):
        cache.join(f"tenant-{i}", f"fingerprint-{i}")
        _store(cache, f"tenant-{i}", [b"k"])
        cache.leave(f"tenant-{i}", 0.0, clean=True)
        cache.touch("a", [b"kept"])  # the oldest is another tenant's key: evicted
    assert len(cache._owners._ids) <= 2 * FORGET_AFTER  # (the names known, by number)
    assert _found(cache, "b", [b"kept"]) == kept
    cache.join("late", f"fingerprint-{tenants - 1}")
    assert _found(cache, "late", [b"k"]) != [-1]
    cache.join("early", "fingerprint-0")
    assert _found(cache, "early", [b"k"]) == [-1]  # evicted long ago


def test_forgetting_departed_namespaces_makes_no_pass_over_the_slots(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Forgetting the names of departed tenants renumbered every slot in numpy: 40 ms of the
    host's loop at 4 M slots (300 ms wall on a loaded machine), each time. Each name's count of
    slots holding it is kept instead, so forgetting is a pass over the names only."""

    def whole_pool_pass(*_: object, **__: object) -> None:
        raise AssertionError("a pass over every slot of the pool")

    for name in ("bincount", "take", "unique"):
        monkeypatch.setattr(np, name, whole_pool_pass)
    owners = SlotOwners(1 << 16)
    for i in range(3 * FORGET_AFTER):
        owners.record([i], [(f"tenant-{i}", b"k")])
        owners.clear([i])
    assert len(owners._ids) <= FORGET_AFTER + 1


_OWNER_OPS: st.SearchStrategy[tuple[str, list[int], list[int]]] = st.one_of(
    st.tuples(  # keys of namespaces (by number) written into distinct slots, over what they held
        st.just("record"),
        st.lists(st.integers(0, 11), max_size=4, unique=True),
        st.lists(st.integers(0, 9), min_size=4, max_size=4),
    ),
    st.tuples(st.just("clear"), st.lists(st.integers(0, 11), max_size=4, unique=True), st.just([])),
    st.tuples(st.just("begin"), st.just([]), st.just([])),  # a walk begins: its stamp
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_OWNER_OPS, max_size=60))
def test_a_walk_lists_the_slots_its_namespace_held_when_it_began_across_reused_numbers(
    ops: list[tuple[str, list[int], list[int]]],
) -> None:
    """Against a plain map of slots to keys: after every write, overwrite, clear and walk
    begun, with names forgotten and their numbers reused after every 2 names (1024 on a host),
    ``held_by`` lists for each namespace exactly the slots written by the walk's stamp that
    hold its key now: never another namespace's, never an evicted key, none missing."""
    with mock.patch.object(slot_owners, "FORGET_AFTER", 2):
        owners = SlotOwners(12)
        now: dict[int, tuple[str, int]] = {}  # slot -> (namespace, stamp of its write)
        stamp = 0
        for op, slots, numbers in ops:
            names = [f"ns{n}" for n in numbers[: len(slots)]]
            if op == "record":
                owners.record(slots, [(name, b"k") for name in names])
                now.update((slot, (name, owners.count)) for slot, name in zip(slots, names))
            elif op == "clear":
                owners.clear(slots)
                for slot in slots:
                    now.pop(slot, None)
            else:
                stamp = owners.count
            for name in map("ns{}".format, range(10)):
                held, _ = owners.held_by(0, 12, stamp, name)
                assert held == sorted(
                    s for s, (ns, at) in now.items() if ns == name and at <= stamp
                )


def test_a_namespace_some_slot_holds_is_never_forgotten_and_a_reused_number_names_one() -> None:
    """A namespace's number is forgotten only once no slot holds its keys (a slot overwritten
    or cleared stops counting), and a number reused by a later namespace never shows that
    namespace's keys to a snapshot of the earlier one, nor the other way round."""
    cache = _cache(num_blocks=4, max_granted=4)
    kept = _store(cache, "c", [b"y0", b"y1"])  # model-y: two slots, one evicted below
    cache.join("t", "tenant")
    _store(cache, "t", [b"t0", b"t1"])
    cache.touch("c", [b"y1"])
    cache.commit("t", [b"t2"], cache.grant("t", 1), [2])  # the pool is full: y0 evicted
    assert _found(cache, "c", [b"y0", b"y1"]) == [-1, kept[1]]
    for i in range(3 * FORGET_AFTER):  # tenants come and go, each evicting the oldest key
        cache.touch("c", [b"y1"])
        cache.join(f"n{i}", f"passing-{i}")
        cache.commit(f"n{i}", [b"p"], cache.grant(f"n{i}", 1), [3])
        cache.leave(f"n{i}", 0.0, clean=True)
    owners = cache._owners
    assert len(owners._ids) <= 2 * FORGET_AFTER and "model-y" in owners._ids
    assert _found(cache, "c", [b"y1"]) == [kept[1]]
    last = f"passing-{3 * FORGET_AFTER - 1}"
    cache.join("late", last)
    assert _found(cache, "late", [b"p"]) != [-1]
    assert _found(cache, "c", [b"p"]) == [-1]
    cache.join("early", "passing-0")
    assert _found(cache, "early", [b"p"]) == [-1]  # evicted long ago, its number reused
    names = [pair[0] for pair in owners.pairs if pair is not None]
    counts = {n: names.count(n) for n in owners._ids}
    assert {n: int(owners._held[i]) for n, i in owners._ids.items()} == counts


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(st.booleans(), st.lists(st.tuples(st.integers(0, 7), st.sampled_from("xyz")))),
        max_size=12,
    )
)
def test_slot_owners_count_each_namespaces_slots_through_records_overwrites_and_clears(
    steps: list[tuple[bool, list[tuple[int, str]]]],
) -> None:
    """What snapshots pick slots by (``held_by``) and what forgetting names relies on (each
    namespace's count of slots) match a plain model, whether a record names one namespace (a
    commit) or several, over slots cleared first or overwritten."""
    owners = SlotOwners(8)
    model: dict[int, str] = {}
    for i, (clear, step) in enumerate(steps):
        slots = list(dict.fromkeys(slot for slot, _ in step))
        names = dict(step)
        if clear:
            owners.clear(slots)
            for slot in slots:
                model.pop(slot, None)
        else:
            owners.record(slots, [(names[slot], (i, slot)) for slot in slots])
            model.update((slot, names[slot]) for slot in slots)
        for name, number in owners._ids.items():
            assert owners._held[number] == sum(n == name for n in model.values())
        for name in "xyz":
            held, _ = owners.held_by(0, 8, owners.count, name)
            assert held == sorted(slot for slot, n in model.items() if n == name)


class _Untouchable(Namespace):
    """A namespace a push must leave alone: nothing of it changed."""

    def __setattr__(self, name: str, value: object) -> None:
        if getattr(self, "sealed", False):
            raise AssertionError(f"a push rewrote {name} of a namespace that did not change")
        super().__setattr__(name, value)


def test_a_push_makes_no_pass_over_the_namespaces_that_did_not_change() -> None:
    """Every push (each 10 ms while a tier stores) rebuilt the event lists of every namespace
    the host knows: 11 ms of the loop per push with 10,000 namespaces holding keys. Only the
    namespaces that changed are gone through now; they get their batch as before."""
    quiet = _Untouchable("quiet", OrderedDict({b"q": 0}))
    quiet.sealed = True
    busy = Namespace("busy", OrderedDict({b"k": 1}), stored=[b"k"], evicted=[b"gone"])
    batches = shared_events.take_events([quiet, busy], [0, 7], None, max_keys=100)
    assert batches == [(busy, 1, [b"k"], [1], [7], [b"gone"])]
    assert quiet.event_seq == 0 and (busy.stored, busy.evicted) == ([], [])


def test_a_commit_of_slots_not_granted_is_counted_and_logged_once_per_session(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Found by the host review: a commit naming slots its session was not granted (never, or
    committed already: a client's bug) was ignored without a trace. A commit has no answer to
    carry an error; the host now counts every such slot (``commit_slots_refused``) and logs a
    warning once per session, however often it does it, and a session that commits what it
    was granted adds to neither."""
    service = SharedService(SlotPool(16), quota=None, max_granted=8)
    good, bad = (
        Session(sid, f"s{i}", sid, range(0), 0.0, 0.0, shared=True, namespace="m")
        for i, sid in enumerate(("good", "bad"))
    )
    service.join(good)
    service.join(bad)
    caplog.set_level("WARNING", logger="torch_kv_tier.remote.shared_service")
    mine = service.cache.grant("good", 2)
    assert service.answer(good, p.Commit(1, "good", [b"g0", b"g1"], mine, [1, 2]), 0.0) is None
    assert service.stats()["commit_slots_refused"] == 0 and not caplog.records
    theirs = service.cache.grant("bad", 1)
    service.answer(bad, p.Commit(2, "bad", [b"x", b"y"], [*theirs, mine[0]], [3, 4]), 0.0)
    for seq in range(3, 13):  # it keeps doing it: counted, not logged again
        service.answer(bad, p.Commit(seq, "bad", [b"z"], [mine[1]], [5]), 0.0)
    assert service.stats()["commit_slots_refused"] == 11
    assert [r.getMessage().split(" committed")[0] for r in caplog.records] == ["session s1 (bad)"]
    assert "1 slots it was not granted" in caplog.records[0].getMessage()
    published = shared_snapshot.whole(service.cache, "good")[0]
    assert published == [b"g0", b"g1", b"x"]  # its own slot published
