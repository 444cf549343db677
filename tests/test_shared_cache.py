"""``SharedCache``, the host-side index of a shared pool: grants, commits, pins, LRU eviction,
namespace quotas, quarantine and the event stream (pure bookkeeping, no server)."""

from __future__ import annotations

import pytest

from torch_kv_tier.remote.leases import SlotPool
from torch_kv_tier.remote.shared_cache import SharedCache


def _cache(num_blocks: int = 8, **kwargs: object) -> SharedCache:
    kwargs.setdefault("max_granted", num_blocks)
    cache = SharedCache(SlotPool(num_blocks), **kwargs)  # type: ignore[arg-type]
    cache.join("a", "model-x")
    cache.join("b", "model-x")
    cache.join("c", "model-y")
    return cache


def _store(cache: SharedCache, session: str, keys: list[object], now: float = 0.0) -> list[int]:
    slots = cache.grant(session, len(keys), now)
    assert len(slots) == len(keys)
    assert cache.commit(session, keys, slots) == len(keys)  # type: ignore[arg-type]
    return slots


def test_a_key_committed_by_one_session_is_found_by_another_of_its_namespace_only() -> None:
    cache = _cache()
    slots = _store(cache, "a", [b"k1", b"k2"])
    _, found = cache.pin("b", [b"k2", b"k1", b"nope"], 0.0)
    assert found == [slots[1], slots[0], -1]
    _, other = cache.pin("c", [b"k1"], 0.0)
    assert other == [-1]  # another model never sees the block


def test_granted_slots_are_private_until_committed_and_not_reused() -> None:
    cache = _cache(num_blocks=4)
    first = cache.grant("a", 3, 0.0)
    second = cache.grant("b", 3, 0.0)
    assert len(first) == 3 and len(second) == 1  # the pool has 4 slots
    assert not set(first) & set(second)
    assert cache.commit("b", [b"x"], first[:1]) == 0  # not b's slot: ignored
    _, found = cache.pin("a", [b"x"], 0.0)
    assert found == [-1]


def test_a_key_stored_twice_keeps_its_first_copy_and_frees_the_second_slot() -> None:
    cache = _cache(num_blocks=2)
    a_slot = cache.grant("a", 1, 0.0)
    b_slot = cache.grant("b", 1, 0.0)
    assert cache.commit("a", [b"k"], a_slot) == 1
    assert cache.commit("b", [b"k"], b_slot) == 0
    _, found = cache.pin("b", [b"k"], 0.0)
    assert found == a_slot
    assert cache.grant("b", 1, 0.0) == b_slot  # free again, nothing had to be evicted
    assert cache.evictions == 0


def test_a_full_pool_evicts_the_least_recently_used_key_and_never_a_pinned_one() -> None:
    cache = _cache(num_blocks=3)
    _store(cache, "a", [b"k0", b"k1", b"k2"])
    cache.touch("b", [b"k0"])  # k1 is now the oldest
    pin_id, _ = cache.pin("b", [b"k1"], 0.0)  # ... but pinned: k2 goes first
    assert len(cache.grant("a", 1, 0.0)) == 1
    _, found = cache.pin("a", [b"k0", b"k1", b"k2"], 0.0)
    assert found[2] == -1 and -1 not in found[:2]
    cache.unpin("b", [pin_id])
    cache.unpin("a", [2])
    assert cache.pinned == 0


def test_pins_expire_after_their_ttl() -> None:
    cache = _cache(num_blocks=1, pin_ttl_s=5.0)
    _store(cache, "a", [b"k"])
    cache.pin("b", [b"k"], now=0.0)
    assert cache.grant("a", 1, now=4.0) == []  # the only slot is pinned
    assert cache.grant("a", 1, now=5.0) != []  # the pin expired: k is evicted
    _, found = cache.pin("b", [b"k"], now=5.0)
    assert found == [-1]


def test_a_namespace_at_its_quota_evicts_its_own_keys_not_anothers() -> None:
    cache = _cache(num_blocks=8, quota=4)
    _store(cache, "c", [b"y0", b"y1", b"y2"])  # model-y first: the oldest keys
    _store(cache, "a", [b"x0", b"x1", b"x2", b"x3"])
    assert len(cache.grant("a", 2, 0.0)) == 2  # at quota: x0 and x1 are evicted
    _, ys = cache.pin("c", [b"y0", b"y1", b"y2"], 0.0)
    assert -1 not in ys
    _, xs = cache.pin("a", [b"x0", b"x1", b"x2", b"x3"], 0.0)
    assert xs[:2] == [-1, -1] and -1 not in xs[2:]


def test_an_expired_sessions_grants_are_quarantined_and_a_clean_ones_freed() -> None:
    cache = _cache(num_blocks=2, quarantine_s=30.0)
    lost = cache.grant("a", 1, 0.0)
    cache.leave("a", 10.0, clean=False)
    assert cache.quarantined == 1
    clean = cache.grant("b", 1, 10.0)
    assert clean != lost
    cache.leave("b", 10.0, clean=True)
    cache.join("d", "model-x")
    assert cache.grant("d", 2, 20.0) == clean  # the lost slot still waits
    assert cache.grant("d", 1, 40.0) == lost


def test_events_report_final_states_in_numbered_batches() -> None:
    cache = _cache(num_blocks=2)
    _store(cache, "a", [b"k0", b"k1"])
    (ns, seq, stored, evicted), *rest = cache.take_events(max_keys=100)
    assert (ns.name, seq, stored, evicted, rest) == ("model-x", 1, [b"k0", b"k1"], [], [])
    slot = cache.grant("a", 1, 0.0)  # evicts k0
    cache.commit("a", [b"k2"], slot)
    batches = cache.take_events(max_keys=1)
    assert [(s, st, ev) for _, s, st, ev in batches] == [(2, [], [b"k0"]), (3, [b"k2"], [])]
    keys, event_seq = cache.snapshot("b")
    assert sorted(keys) == [b"k1", b"k2"] and event_seq == 3  # type: ignore[type-var]


def test_a_key_stored_and_evicted_between_two_batches_is_reported_evicted() -> None:
    cache = _cache(num_blocks=1)
    _store(cache, "a", [b"k0"])
    _store(cache, "a", [b"k1"])  # evicts k0
    [(_, _, stored, evicted)] = cache.take_events(max_keys=100)
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
    [(_, _, stored, evicted)] = cache.take_events(max_keys=100)
    assert (stored, evicted) == ([b"k1"], [b"k0"])


def test_bad_settings_raise() -> None:
    with pytest.raises(ValueError, match="quota"):
        SharedCache(SlotPool(4), quota=0)
    with pytest.raises(ValueError, match="TTL"):
        SharedCache(SlotPool(4), pin_ttl_s=0)


def test_a_session_holds_at_most_max_granted_uncommitted_slots() -> None:
    cache = _cache(num_blocks=64, max_granted=4)
    first = cache.grant("a", 10, 0.0)
    assert len(first) == 4 and cache.grant("a", 1, 0.0) == []
    cache.commit("a", [b"k0", b"k1"], first[:2])
    assert len(cache.grant("a", 10, 0.0)) == 2  # committing made room in its share
    assert len(cache.grant("b", 10, 0.0)) == 4  # every session has its own


def test_shared_grants_draw_only_what_they_need_so_private_leases_still_fit() -> None:
    pool = SlotPool(64)
    cache = SharedCache(pool, max_granted=4)
    cache.join("a", "model-x")
    assert len(cache.grant("a", 512, 0.0)) == 4
    assert pool.take(60) == range(4, 64)  # a private lease of every other slot
