"""``BlockIndex`` bookkeeping: eviction and pins, shared hosts' copies and their digests, fenced
slots, placement, a dict or compact copy by the slots followed."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from torch_kv_tier.digest import block_digest
from torch_kv_tier.index import COMPACT_AFTER_SLOTS, BlockIndex
from torch_kv_tier.key_table import KeyTable
from torch_kv_tier.keys import Placement, home_peer
from torch_kv_tier.slot_maps import CompactSlots, DictSlots


def test_reserve_evicts_oldest_unpinned_and_hands_their_slots_over() -> None:
    index = BlockIndex(events=True)
    peer = index.add_peer("p", range(10, 14))
    slots = index.reserve(peer, 4)
    assert slots == [10, 11, 12, 13]
    index.publish(peer, ["a", "b", "c", "d"], slots, [1, 2, 3, 4])
    groups, missing = index.locate(["a"], [0])
    assert missing == [] and groups[peer] == (["a"], [0], [10], [1])  # slot and its digest
    assert index.reserve(peer, 2) == [11, 12]  # "a" is pinned (and most recent): b, c go
    assert index.lookup(["a", "d", "b"]) == 2 and index.evictions == 2
    index.discard(["a"])  # pinned: its slot is freed on the last unpin, not now
    assert index.reserve(peer, 5) == [13]  # only "d" was evictable
    peer.unpin([10])
    assert peer.pool.is_free(10)
    kinds = [(kind, key) for kind, key, _ in index.take_events()]
    assert kinds[-4:] == [("evicted", "b"), ("evicted", "c"), ("discarded", "a"), ("evicted", "d")]


class _CountedPins(dict):
    """A peer's pins that count the slots looked up in them."""

    looked_up = 0

    def __contains__(self, slot: object) -> bool:
        self.looked_up += 1
        return super().__contains__(slot)


def test_eviction_beside_a_load_in_flight_looks_at_its_victims_only() -> None:
    """While any slot of a peer was pinned (a load in flight), every store that evicted scanned
    every key the peer holds for its victims: per-key Python over the whole index per store."""
    index = BlockIndex()
    peer = index.add_peer("p", range(10_000))
    index.publish(peer, list(range(10_000)), index.reserve(peer, 10_000), [0] * 10_000)
    index.locate([9_999], [0])  # pins the newest key's slot
    peer.pins = pins = _CountedPins(peer.pins)
    assert index.reserve(peer, 2) == [0, 1]  # the two oldest keys' slots
    assert index.lookup([0, 1, 2]) == 0 and index.lookup([2]) == 1
    assert pins.looked_up <= 4


@pytest.mark.parametrize("compact", [False, True], ids=["dict", "compact"])
def test_a_shared_keys_stale_slot_answers_the_digest_of_what_is_there_now(compact: bool) -> None:
    """A shared host's copy keeps one digest per slot. A key whose slot went to another key
    before the copy heard of the eviction (the tier's own commit is published before the host's
    older events arrive) is located with the new key's digest, which its bytes (the new key's)
    fail: a miss, never the other key's bytes. Events applied later leave the host's truth."""
    index = BlockIndex(compact=compact)
    peer = index.add_shared_peer("h", 8)
    old, new = b"k-old".ljust(32, b"\0"), b"k-new".ljust(32, b"\0")
    block = bytes(range(64))
    index.apply_host_changes(peer, [old], [5], [block_digest(b"old bytes", old)], [], False)
    index.publish(peer, [new], [5], [block_digest(block, new)])  # slot 5 now holds `new`
    groups, missing = index.locate([old, new], [0, 1])
    assert missing == []
    ((_, _, slots, digests),) = groups.values()
    assert slots == [5, 5] and digests == [block_digest(block, new)] * 2
    assert block_digest(block, old) != digests[0]  # `old` reads `new`'s bytes: a miss
    index.apply_host_changes(peer, [], [], [], [old], False)  # the eviction arrives
    assert index.lookup([old]) == 0 and index.lookup([new]) == 1
    assert index.locate([old], [0]) == ({}, [old])


@pytest.mark.parametrize("compact", [False, True], ids=["dict", "compact"])
def test_a_read_that_fails_its_digest_forgets_its_key_only_where_it_read_it(compact: bool) -> None:
    """Found by review: a read of a slot rewritten meanwhile fails its digest and its key is
    forgotten; but when an event moved the key to another slot while the read was in flight
    (evicted, then stored again by another tier), that newer entry was forgotten too, and the
    tier missed a key its host held until it stored it again itself."""
    index = BlockIndex(compact=compact)
    peer = index.add_shared_peer("h", 16)
    index.apply_host_changes(peer, [b"k", b"j"], [3, 4], [111, 112], [], True)
    groups, _ = index.locate([b"k", b"j"], [0, 1])
    assert groups[peer][2] == [3, 4]  # the reads go to slots 3 and 4
    index.apply_host_changes(peer, [b"k"], [5], [222], [], False)  # k moved meanwhile
    index.discard_read("h", [b"k", b"j"], [3, 4])  # both failed their digests
    assert index.holder(b"k") is peer and peer.find([b"k"])[0] == [5]
    assert index.holder(b"j") is None


@pytest.mark.parametrize("compact", [False, True], ids=["dict", "compact"])
def test_a_snapshot_keeps_what_the_tier_sent_after_it_was_taken(compact: bool) -> None:
    """What this tier commits after a snapshot's request went out (while joining, or in a
    resync later) reaches the host after the snapshot was taken and is echoed later: the
    snapshot, which replaces the copy, must not hide it meanwhile (a load would miss a key its
    store just reported stored). A key the snapshot has keeps the host's slot: its first commit
    won. A commit sent before the request is the snapshot's to answer for: found by review, a
    compact copy kept it although the snapshot showed it evicted, so a store of that key
    reported it stored without writing it, and its load read whatever held the slot (a miss)."""
    index = BlockIndex(compact=compact)
    peer = index.add_shared_peer("h", 8)
    mine, both, gone = (k.ljust(32, b"\0") for k in (b"mine", b"both", b"gone"))
    index.publish(peer, [gone], [3], [13])  # sent before the request, evicted before the snapshot
    index.publish(peer, [mine, both], [1, 2], [11, 12])
    sent = [([mine], [1], [11]), ([both], [2], [12])]
    index.apply_host_changes(peer, [both], [6], [16], [], True, sent)  # the snapshot
    groups, missing = index.locate([mine, both], [0, 1])
    assert missing == []
    ((_, _, slots, digests),) = groups.values()
    assert (slots, digests) == ([1, 6], [11, 16])
    assert index.lookup([gone]) == 0 and index.holders([gone]) == [None]
    index.apply_host_changes(peer, [both], [6], [16], [], True)  # nothing sent after it
    assert index.lookup([both, mine]) == 1


def test_keys_of_one_crc32_still_have_different_digests() -> None:
    """Digests are seeded with the key's 64-bit fingerprint: two keys whose CRC-32 (the placement
    hash, and the digest seed before) agree still bind the same bytes to different digests, so
    a stale entry read through one of them is a miss (with a 32-bit seed, it passed)."""
    a, b = bytes.fromhex("292c99bfb5b820b7"), bytes.fromhex("11983d82cb0bebd2")
    assert zlib.crc32(a) == zlib.crc32(b)
    block = bytes(range(256)) * 4
    assert block_digest(block, a) != block_digest(block, b)


@pytest.mark.parametrize("compact", [False, True], ids=["dict", "compact"])
def test_a_key_on_two_peers_is_found_on_either_and_lost_only_with_the_last(compact: bool) -> None:
    """A shared host's copy answers for its own keys (no second per-key map): a key on a
    tier-owned peer and on two shared hosts is read from the tier-owned one first, then from
    the hosts in the order they joined; dropping one peer loses only the keys no other holds."""
    index = BlockIndex(events=True, compact=compact)
    own = index.add_peer("own", range(4))
    h1, h2 = index.add_shared_peer("h1", 8), index.add_shared_peer("h2", 8)
    index.apply_host_changes(h1, [b"a", b"b"], [1, 2], [11, 12], [], False)
    index.apply_host_changes(h2, [b"b", b"c"], [3, 4], [13, 14], [], False)
    index.publish(own, [b"c"], index.reserve(own, 1), [99])
    assert index.holders([b"a", b"b", b"c", b"d"]) == [h1, h1, own, None]
    assert index.lookup([b"a", b"b", b"c", b"d"]) == 3 and index.key_count == 5
    assert not index.none_stored([b"d", b"c"]) and index.none_stored([b"d"])
    assert index.remove_peer("h1") == [b"a"]  # b is still on h2
    groups, missing = index.locate([b"a", b"b", b"c"], [0, 1, 2])
    assert missing == [b"a"] and groups[h2] == ([b"b"], [1], [3], [13])
    index.apply_host_changes(h2, [], [], [], [b"c"], False)  # still on the tier-owned peer
    assert index.holder(b"c") is own
    events = [(kind, key) for kind, key, _ in index.take_events()]
    # (the tier's own store of c is logged too: publish logs what this tier stored)
    assert events == [("stored", k) for k in (b"a", b"b", b"c", b"c")] + [("lost", b"a")]


def test_a_discard_forgets_a_shared_hosts_keys_in_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """A discard forgot a shared host's keys one at a time: a compact copy paid numpy's
    per-call cost for each (~0.1 ms here), under the tier's lock (2,000 keys held it 0.2 s)."""
    index = BlockIndex(events=True, compact=True)
    own = index.add_peer("own", range(8))
    host = index.add_shared_peer("h", 4096)
    keys = [b"k%d" % i for i in range(1000)]
    index.apply_host_changes(host, keys, list(range(1000)), list(range(1000)), [], False)
    index.publish(own, [b"mine"], index.reserve(own, 1), [7])
    index.take_events()
    removals: list[int] = []
    remove = KeyTable.remove

    def counted(table: KeyTable, fingerprints: np.ndarray) -> int:
        removals.append(len(fingerprints))
        return remove(table, fingerprints)

    monkeypatch.setattr(KeyTable, "remove", counted)
    index.discard([b"mine", *keys[:500], b"unknown", keys[0]])
    assert removals == [500]  # one pass for the host's keys (a repeated key counts once)
    assert index.lookup(keys[:1]) == 0 and index.lookup(keys[500:]) == 500
    assert index.holder(b"mine") is None and own.pool.num_free == 8
    assert [(kind, key) for kind, key, _ in index.take_events()] == [
        ("discarded", key) for key in [b"mine", *keys[:500]]
    ]


def test_fenced_slots_stay_out_of_a_new_registration_until_released() -> None:
    index = BlockIndex()
    index.add_peer("p", range(4))
    index.fence("p", [0, 1])
    index.remove_peer("p")
    peer = index.add_peer("p", range(4))
    assert peer.pool.num_free == 2 and index.reserve(peer, 4) == [2, 3]
    index.unfence("p", [0])
    assert index.reserve(peer, 4) == [0]
    index.unfence("p", [1])  # the transport reported the last late write
    assert index.fenced("p") == 0 and peer.pool.is_free(1)


def test_placement_is_balanced_stable_and_cheap_to_query() -> None:
    peers = [f"host{i}" for i in range(4)]
    keys = [f"key-{i}".encode() for i in range(20_000)]
    homes = Placement(peers).homes(keys)
    counts = [homes.count(p) for p in peers]
    assert min(counts) > 0.8 * len(keys) / 4  # within 20 % of an even share
    assert Placement(reversed(peers)).homes(keys) == homes
    assert all(home_peer(k, peers) == h for k, h in zip(keys[:100], homes))
    assert home_peer(3, ["only"]) == "only" and home_peer(b"x", []) is None


def test_a_tier_follows_hosts_in_a_dict_until_their_pools_add_up_to_a_million_slots() -> None:
    """The copy of a host is a dict (fastest per call) while the pools followed stay within
    ``COMPACT_AFTER_SLOTS``; a host that takes them past it is held compact (16 B per key)."""
    index = BlockIndex()
    small = index.add_shared_peer("small", COMPACT_AFTER_SLOTS // 2)
    big = index.add_shared_peer("big", COMPACT_AFTER_SLOTS // 2 + 1)
    assert isinstance(small.map, DictSlots) and isinstance(big.map, CompactSlots)
    keys = [f"k{i}".encode() for i in range(1000)]
    index.apply_host_changes(big, keys, list(range(1000)), list(range(1000)), [], False)
    index.publish(big, [b"own"], [1000], [7])  # this tier's commit, not yet echoed
    assert index.lookup([*keys, b"own", b"x"]) == 1001 and index.holder(b"own") is big
    groups, missing = index.locate([keys[3], b"own", b"x"], [0, 1, 2])
    assert missing == [b"x"] and groups[big][2:] == ([3, 1000], [3, 7])
    index.apply_host_changes(big, [b"own"], [1000], [7], keys[:500], False)  # the echo
    assert index.lookup(keys) == 0 and index.lookup(keys[500:]) == 500
    assert big.stored == 501 and big.map.nbytes <= 8 * 1501  # tombstones until a merge
