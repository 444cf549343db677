"""``KeyTable``: a shared host's key -> slot map in 8 B per key, checked against a dict."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torch_kv_tier import digest, key_table, keys, slot_maps
from torch_kv_tier.digest import block_digest
from torch_kv_tier.index import BlockIndex
from torch_kv_tier.key_table import KeyTable
from torch_kv_tier.keys import Key, key_fingerprint, key_fingerprints

CAPACITY = 1000  # 10 slot bits: fingerprints keep their high 54 bits
HIGH = ~((1 << 10) - 1) & ((1 << 64) - 1)
U64 = st.integers(0, (1 << 64) - 1)


def _fps(values: list[int]) -> np.ndarray:
    return np.array(values, dtype=np.uint64)


def _check(table: KeyTable, model: dict[int, int], probes: list[int]) -> None:
    """``model``: the high bits of each stored fingerprint -> its slot."""
    assert len(table) == len(model)
    asked = list(model) + probes
    got = table.slots(_fps(asked)).tolist()
    assert got == [model.get(fp & HIGH, -1) for fp in asked]
    assert [table.contains_one(fp) for fp in asked] == [fp & HIGH in model for fp in asked]
    # entries, tombstones included, stay within 1/32 of the live ones past the recent part
    assert table.nbytes <= 8 * (len(model) + max(key_table.MIN_RECENT, len(model) // 16) + 64)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["insert", "remove", "reset"]),
            st.lists(st.tuples(U64, st.integers(0, CAPACITY - 1)), max_size=40),
        ),
        max_size=30,
    ),
    st.lists(U64, max_size=10),
)
def test_the_table_answers_as_a_dict_of_fingerprints(ops, probes) -> None:
    """Random inserts, removals and resets, merges into the main array included (a recent part
    of at most 16 entries here): every lookup answers as a dict of the fingerprints' high bits
    would (values that agree there are one fingerprint)."""
    table, model = KeyTable(CAPACITY), {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(key_table, "MIN_RECENT", 16)
        for op, pairs in ops:
            pairs = list({fp & HIGH: (fp, slot) for fp, slot in pairs}.values())  # one per group
            fps, slots = _fps([f for f, _ in pairs]), np.array([s for _, s in pairs], np.int64)
            groups = {fp & HIGH: slot for fp, slot in pairs}
            if op == "insert":
                table.insert(fps, slots)
                model.update(groups)
            elif op == "remove":
                assert table.remove(fps) == sum(g in model for g in groups)
                for g in groups:
                    model.pop(g, None)
            else:
                table.reset(fps, slots)
                model = groups
            _check(table, model, probes)


def test_keys_of_one_fingerprint_cost_a_miss_never_two_answers() -> None:
    """Two fingerprints that agree above the slot bits are one group: storing one replaces the
    other and removing either removes the group. (A load then reads the remaining slot and
    checks it against the digest seeded with its own key: the other key's bytes are a miss.)"""
    table = KeyTable(CAPACITY)
    a, b = _fps([0xABCD << 40]), _fps([(0xABCD << 40) | 0x3FF])  # same bits above the low 10
    table.insert(a, np.array([5]))
    table.insert(b, np.array([7]))
    assert len(table) == 1 and table.slots(a).tolist() == table.slots(b).tolist() == [7]
    assert table.remove(a) == 1 and len(table) == 0
    assert not table.contains(b).any() and not table.contains_one(int(b[0]))


def test_a_stored_key_learnt_again_in_its_slot_is_one_entry() -> None:
    """A tier publishes its own commit, then the host's event for it arrives: one entry."""
    table = KeyTable(CAPACITY)
    fps = key_fingerprints([b"k1", b"k2"])
    table.insert(fps, np.array([1, 2]))
    table.insert(fps, np.array([1, 2]))
    assert len(table) == 2 and table.nbytes == 16
    table.insert(fps[:1], np.array([3]))  # moved: the old entry goes
    assert len(table) == 2 and table.slots(fps).tolist() == [3, 2]


def test_a_million_keys_take_8_bytes_each() -> None:
    n = 1 << 20
    fps = np.random.default_rng(0).integers(0, 1 << 63, n, dtype=np.uint64)
    table = KeyTable(n)
    table.reset(fps, np.arange(n))
    assert table.nbytes == 8 * n
    assert table.slots(fps[::997]).tolist() == list(range(0, n, 997))


def test_fingerprints_tell_key_types_apart_and_are_stable() -> None:
    keys = [b"a", "a", 97, -1, (1 << 64) - 1]
    fps = key_fingerprints(keys).tolist()
    assert len(set(fps)) == len(keys)
    assert fps == [key_fingerprint(k) for k in keys]
    assert key_fingerprints([b"\x00" * 32]).tolist() == [key_fingerprint(b"\x00" * 32)]


@pytest.mark.parametrize(
    ("capacity", "fingerprint_bits"), [(2**24, 39), (2**24 - 1, 40), (200_000, 46), (1000, 54)]
)
def test_fingerprint_bits_as_the_docs_state(capacity: int, fingerprint_bits: int) -> None:
    """The slot bits hold every slot and the all-ones tombstone: a pool of 2**24 slots keeps 39
    fingerprint bits (found by review: the docs said 40, and halved the odds they derive)."""
    table = KeyTable(capacity)
    assert 64 - bin(table._mask_int).count("1") == fingerprint_bits
    assert table._mask_int > capacity - 1  # the last slot is not the tombstone


def test_keys_whose_digest_seeds_agree_are_two_entries_of_a_compact_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: a compact copy keyed its table by the digests' own seeds, so two keys
    whose seeds agree (odds 2**-64 a pair, so keys stored / 2**64 for any key looked up) were
    one entry: a load of a key never stored read the other's slot and its bytes passed the
    check, seeded alike (wrong bytes reported ok). Here the seeds of ``asked`` and ``stored``
    are made to agree; the copy still tells them apart, so ``asked`` is a miss."""
    stored, asked = b"stored".ljust(32, b"\0"), b"asked".ljust(32, b"\0")
    seed = key_fingerprint  # the digests' seed (family 0), made to collide for ``asked``

    def colliding(key: Key, family: int = 0) -> int:
        return seed(stored if key == asked and family == 0 else key, family)

    def colliding_all(keys: Sequence[Key], family: int = 0) -> np.ndarray:
        return np.array([colliding(k, family) for k in keys], dtype=np.uint64)

    for module in (keys, digest, slot_maps):
        monkeypatch.setattr(module, "key_fingerprint", colliding, raising=False)
        monkeypatch.setattr(module, "key_fingerprints", colliding_all, raising=False)
    block = bytes(range(64))
    assert block_digest(block, asked) == block_digest(block, stored)  # it would verify
    index = BlockIndex(compact=True)
    host = index.add_shared_peer("h", 8)
    index.apply_host_changes(host, [stored], [3], [block_digest(block, stored)], [], True)
    index.publish(host, [b"own"], [4], [block_digest(block, b"own")])  # one not yet echoed
    assert index.lookup([stored]) == 1 and index.lookup([asked]) == 0
    assert index.locate([asked], [0]) == ({}, [asked])
