"""A tier's copy of a host's index (``SharedSlots``) holding the keys the host's disk tier
announces on disk (``disk_tier.DiskTier`` over ``SharedCache`` and
``disk_tier_support.FakeDisk``), and the disk's slot owners."""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest
from disk_tier_support import disk_host
from hypothesis import example, given, settings
from hypothesis import strategies as st

from torch_kv_tier.index import BlockIndex
from torch_kv_tier.remote import shared_snapshot
from torch_kv_tier.remote.protocol import ON_DISK
from torch_kv_tier.remote.slot_owners import SlotOwners


@pytest.mark.parametrize("compact", [False, True], ids=["dict-copy", "compact-copy"])
def test_a_tiers_copy_counts_keys_on_disk_and_forgets_them_when_promoted(compact: bool) -> None:
    index = BlockIndex(compact=compact)
    peer = index.add_shared_peer("host", 16)
    index.apply_host_changes(peer, [b"a", b"b", b"c"], [3, ON_DISK, ON_DISK], [7, 0, 0], [], True)
    assert index.lookup([b"a", b"b", b"c", b"d"]) == 3
    assert index.holder(b"b") is None and index.disk_holder(b"b") is peer
    assert index.on_disk([b"a", b"b", b"c"]) == {peer: [1, 2]}
    groups, missing = index.locate([b"a", b"b"], [0, 1])
    assert missing == [b"b"]
    index.apply_host_changes(peer, [b"b"], [5], [9], [b"c"], False)  # promoted; c dropped
    assert index.holder(b"b") is peer and not index.has_disk_keys()
    assert index.lookup([b"a", b"b", b"c"]) == 2
    index.apply_host_changes(peer, [b"a"], [ON_DISK], [0], [], False)  # a left DRAM
    assert index.holder(b"a") is None and index.disk_holder(b"a") is peer


_JOIN_OPS = st.lists(
    st.tuples(
        st.sampled_from(["store", "touch", "step", "promote", "other", "events"]),
        st.integers(0, 11),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(_JOIN_OPS, _JOIN_OPS)
@example(  # stored again into a slot the walk had not reached: not found twice
    [("store", 2), ("store", 0), ("step", 0), ("step", 0)],
    [("store", 8), ("events", 1), ("store", 1)],
)
@example(  # copied to the disk again after the walk began: not found twice
    [],
    [("store", 0), ("store", 2), ("step", 0), ("step", 0), ("store", 2), ("events", 1)]
    + [("store", 11), ("step", 0), ("step", 0), ("store", 2), ("store", 1)],
)
def test_a_joining_tiers_copy_is_the_hosts_index_whatever_changed_while_its_pages_were_walked(
    before: list[tuple[str, int]], during: list[tuple[str, int]]
) -> None:
    """A snapshot is walked a slot per page here (``shared_snapshot``), with stores, evictions,
    copies to disk, the disk's evictions, promotions and other namespaces' stores between its
    pages: its pages name no key twice, and with the events numbered after it applied as a
    tier applies them (``replica``), the copy is exactly the host's index, slots and digests."""
    cache, disk, tier = disk_host(num_blocks=6, disk_slots=8)
    cache.join("t", "ns")  # the tier that joins
    cache.join("o", "other")
    batches: list[Any] = []
    clock = iter(range(1, 1000))

    def change(op: str, n: int) -> None:
        if op in ("store", "other"):
            sid = "s" if op == "store" else "o"
            keys = [f"k{(n + i) % 12}" for i in range(1 + n % 3)]
            slots = cache.grant(sid, len(keys))
            cache.commit(sid, keys[: len(slots)], slots, [next(clock) for _ in slots])
        elif op == "touch":
            cache.touch("s", [f"k{n}"])
        elif op == "step":
            tier.step(now=float(next(clock)))
        elif op == "promote":
            tier.promote(cache.namespace_of("s"), [f"k{n}"], float(next(clock)))
        else:
            batches.extend(cache.take_events(max_keys=3))

    for op, n in before:
        change(op, n)
    with (
        mock.patch.object(shared_snapshot, "CHUNK", 1),
        mock.patch.object(shared_snapshot, "SCAN_SLOTS", 1),
        mock.patch.object(shared_snapshot, "MAX_WALK", 1),
    ):
        snap = cache.begin_snapshot("t")
        pages = []
        for op, n in during:
            if op == "events" and n % 2 and not snap.done:  # a page asked instead
                pages.append(cache.snapshot_part(snap))
            else:
                change(op, n)
        while not snap.done:
            pages.append(cache.snapshot_part(snap))
    batches.extend(cache.take_events(max_keys=3))

    found = [key for keys, _, _ in pages for key in keys]
    assert len(found) == len(set(found)), found
    copy = {k: (s, d) for page in pages for k, s, d in zip(*page)}
    for ns, seq, stored, slots, digests, evicted in batches:
        if ns.name == "ns" and seq > snap.event_seq:
            for key in evicted:
                copy.pop(key, None)
            copy.update({k: (s, d) for k, s, d in zip(stored, slots, digests)})
    entries = cache.namespace_of("t").entries
    host = {k: (s, cache.digest_of(s)) for k, s in entries.items()}
    host.update({k: (ON_DISK, 0) for name, k in disk.keys if name == "ns" and k not in entries})
    assert copy == host


def test_slot_owners_pick_a_namespaces_slots_written_before_a_stamp_and_holding_it_now() -> None:
    owners = SlotOwners(6)
    owners.record([0, 1, 2], [("a", "k0"), ("b", "k1"), ("a", "k2")])
    stamp = owners.count
    owners.clear([2])
    owners.record([2, 3], [("b", "k3"), ("a", "k4")])  # after the stamp: not walked
    owners.clear([1])
    assert owners.held_by(0, 6, stamp, "a") == ([0], 2)
    assert owners.held_by(0, 6, stamp, "b") == ([], 2)
    assert owners.held_by(1, 6, owners.count, "a") == ([3], 3)
    assert owners.held_by(0, 6, owners.count, "never recorded") == ([], 4)
