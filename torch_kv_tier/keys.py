"""Logical block keys and their placement across peers.

Placement is rendezvous hashing over a fixed ring of ``BUCKETS`` buckets: a key hashes once
(a stable 32-bit hash, the same in every process) to a bucket, and each bucket's home is the peer
with the highest mixed score for that bucket, computed once per peer set for all buckets at once.
Per key that is one hash and one list lookup, whatever the number of peers; adding a peer moves
only the buckets (so the keys) it now wins, and the order peers are given in does not matter.
"""

from __future__ import annotations

import functools
import hashlib
import zlib
from collections.abc import Collection, Iterable, Sequence
from itertools import repeat
from typing import Union, cast

import numpy as np
import xxhash

Key = Union[bytes, str, int]  # noqa: UP007  (a runtime alias, usable on Python 3.10)

BUCKETS = 1 << 16
MAX_KEY_BYTES = 64  # a bytes key, or a str key's UTF-8 encoding (vLLM's block hashes: 32)
MIN_INT_KEY, MAX_INT_KEY = -(1 << 63), (1 << 64) - 1  # int keys travel as 64-bit integers
MAX_KEYS_PER_CALL = 1 << 16
_KEY_TYPES = frozenset({bytes, str, int})
_MASK64 = (1 << 64) - 1


def check_keys(keys: Sequence[Key]) -> list[Key]:
    """Return ``keys`` as a list; ``TypeError`` for a non-key (a bool too), one key or a set in
    place of a sequence of keys (``_not_one_key``), ``ValueError`` for a repeat, a key out of
    the limits (``MAX_KEY_BYTES``, ``MIN_INT_KEY``..``MAX_INT_KEY``) or more than
    ``MAX_KEYS_PER_CALL`` keys. A key of a subclass of bytes, str or int (an ``IntEnum``, say)
    is checked and returned as its plain value. Per call: C-level passes for keys of exactly
    these types, per-key Python only for subclasses or to word an error.
    """
    out = list(_not_one_key(keys, ordered=True))
    if len(out) > MAX_KEYS_PER_CALL:
        raise ValueError(
            f"{len(out)} keys in one call; at most {MAX_KEYS_PER_CALL}: split the call"
        )
    types = set(map(type, out))
    if not _KEY_TYPES.issuperset(types):
        out = [_plain(key) for key in out]
        types = set(map(type, out))
    problem = limits_problem(out, types)
    if problem is not None:
        raise ValueError(problem)
    if len(set(out)) != len(out):
        raise ValueError("a key appears twice in one call; pass each key once")
    return out


def plain_keys(keys: Iterable[Key], *, ordered: bool) -> Sequence[Key]:
    """``keys`` as a sequence of plain bytes, str or int keys, for a call that only looks them
    up (``lookup``, ``holders``, ``touch``...): ``TypeError`` as ``check_keys`` words it for one
    key or (when ``ordered``: the call answers per position) a set in place of keys, and for a
    bool or another non-key (which would otherwise match the int key it equals). The limits and
    repeats are not checked: a key out of them is simply not stored. Per call: one C-level pass
    over the keys' types when each is exactly bytes, str or int.
    """
    if type(keys) is not list and type(keys) is not tuple:  # the usual: no more to check
        keys = _not_one_key(keys, ordered=ordered)
        if not isinstance(keys, Sequence):  # a generator, say: walked more than once
            keys = list(keys)
    if _KEY_TYPES.issuperset(map(type, keys)):
        return keys
    return [_plain(key) for key in keys]


def plain_key(key: object) -> Key:
    """``key`` as the plain bytes, str or int it is; ``TypeError`` as ``check_keys`` words it
    for a bool or a non-key."""
    return key if type(key) in _KEY_TYPES else _plain(key)  # type: ignore[return-value]


def _not_one_key(keys: Iterable[Key], *, ordered: bool) -> Iterable[Key]:
    """``keys``, unless it is one key or a buffer passed in place of keys (iterated, it would
    name the one-character or int keys it holds), or, when ``ordered``, a set (its order is
    arbitrary, so what a call answers or pairs per position would be too): ``TypeError`` then,
    saying what to pass instead."""
    if isinstance(keys, bytes | str):
        advice = "pass [key]"
    elif isinstance(keys, bytearray):
        advice = "pass [bytes(key)]"
    elif isinstance(keys, memoryview):
        advice = "pass [bytes(view)] for one key, or view.tolist() for its items as int keys"
    elif ordered and isinstance(keys, set | frozenset):
        raise TypeError(
            f"keys must be a sequence of keys, got a {type(keys).__name__}, whose order is "
            "arbitrary: pass a list, in the order the call answers or pairs them with blocks"
        )
    else:
        return keys
    raise TypeError(f"keys must be a sequence of keys, got one {type(keys).__name__}: {advice}")


def _plain(key: object) -> Key:
    """``key`` as the plain bytes, str or int its type derives from (measured and hashed as
    one); ``TypeError`` for a bool or a non-key."""
    if isinstance(key, bytes):
        return bytes(memoryview(key))
    if isinstance(key, str):
        return str.__str__(key)
    if isinstance(key, int) and not isinstance(key, bool):
        return int.__index__(key)
    advice = ""
    if hasattr(type(key), "__index__") and not isinstance(key, bool):  # numpy's ints, say
        advice = ": pass Python ints (a numpy array's .tolist() gives them)"
    raise TypeError(f"keys must be bytes, str or int, got {type(key).__name__}: {key!r}{advice}")


def key_problem(key: object) -> str | None:
    """Why ``key`` is not a key this library can store, or ``None`` when it is one."""
    if isinstance(key, int) and not isinstance(key, bool):
        if MIN_INT_KEY <= key <= MAX_INT_KEY:
            return None
        return f"int keys must be in [-2**63, 2**64 - 1] (64 bits), got {key}"
    if isinstance(key, bytes | str):
        try:
            size = len(key) if isinstance(key, bytes) else len(key.encode())
        except UnicodeEncodeError:
            return f"str keys must be text UTF-8 can encode, got {key!r}: pass bytes instead"
        if size <= MAX_KEY_BYTES:
            return None
        return (
            f"keys are at most {MAX_KEY_BYTES} bytes (a str key: its UTF-8 encoding), got "
            f"{size}: hash longer names down (vLLM's block hashes are 32 bytes)"
        )
    return f"keys must be bytes, str or int, got {type(key).__name__}"


def limits_problem(keys: list[Key], types: set[type]) -> str | None:
    """The first key of ``keys`` (all of ``types``, a subset of bytes/str/int) out of the key
    limits, worded by ``key_problem``; ``None`` when every key is within them."""
    ints: list[int]
    sized: list[bytes | str]
    if int not in types:  # the usual: no per-key pass to sort ints from the others
        ints, sized = [], keys  # type: ignore[assignment]
    elif len(types) == 1:
        ints, sized = keys, []  # type: ignore[assignment]
    else:
        ints = [k for k in keys if type(k) is int]
        sized = [k for k in keys if type(k) is not int]  # type: ignore[misc]
    widest = max(map(len, sized)) * (4 if str in types else 1) if sized else 0
    suspect = (
        (ints and (min(ints) < MIN_INT_KEY or max(ints) > MAX_INT_KEY))
        or widest > MAX_KEY_BYTES
        or (str in types and not _encodable(sized, with_bytes=bytes in types))
    )
    if suspect:
        for key in keys:
            problem = key_problem(key)
            if problem is not None:
                return problem
    return None


def _encodable(sized: list[bytes | str], *, with_bytes: bool) -> bool:
    """Whether UTF-8 encodes every str key of ``sized`` (no lone surrogate): one C-level pass
    unless bytes keys are among them."""
    texts = [k for k in sized if type(k) is str] if with_bytes else sized
    try:
        "".join(texts).encode()  # type: ignore[arg-type]
    except UnicodeEncodeError:
        return False
    return True


def key_hash(key: Key) -> int:
    """A stable 32-bit hash of ``key`` (CRC-32 of its bytes; the same in every process)."""
    if isinstance(key, bytes):
        return zlib.crc32(key)
    if isinstance(key, str):
        return zlib.crc32(key.encode(), 0x5BD1E995)
    return zlib.crc32((key & _MASK64).to_bytes(8, "little"), key >> 64 & 0xFFFFFFFF)


def key_fingerprints(keys: Sequence[Key], family: int = 0) -> np.ndarray:
    """A stable 64-bit fingerprint of each key (``uint64``): xxh3-64 of its bytes, seeded by its
    type, so ``b"a"``, ``"a"`` and an int never share one by construction. The same in every
    process. One C-level pass for the usual all-``bytes`` keys (vLLM's block hashes).

    ``family`` (a multiple of 4) picks fingerprints independent of the default ones (family 0,
    the seeds of the block digests, ``digest``): a table keyed by another family does not
    conflate two keys whose digest seeds agree (``slot_maps.CompactSlots``)."""
    n = len(keys)
    if set(map(type, keys)) <= {bytes}:
        return np.fromiter(
            map(_xxh3, cast("Sequence[bytes]", keys), repeat(family, n)), np.uint64, n
        )
    return np.fromiter(map(key_fingerprint, keys, repeat(family, n)), np.uint64, n)


def key_fingerprint(key: Key, family: int = 0) -> int:
    """``key_fingerprints`` of one key."""
    if isinstance(key, bytes):
        return _xxh3(key, family)
    if isinstance(key, str):
        return _xxh3(key.encode(), family + 1)
    return _xxh3((key & _MASK64).to_bytes(8, "little"), family + 2 + (key >> 64 & 1))


_xxh3 = xxhash.xxh3_64_intdigest


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over a uint64 array (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class Placement:
    """The home peer of every key for one set of peers (immutable; build a new one per change)."""

    def __init__(self, peers: Iterable[str]) -> None:
        self.peers = tuple(sorted(set(peers)))
        if len(self.peers) <= 1:
            self._table: list[str] = list(self.peers)
            return
        seeds = np.array(
            [
                int.from_bytes(hashlib.blake2b(p.encode(), digest_size=8).digest(), "little")
                for p in self.peers
            ],
            dtype=np.uint64,
        )
        with np.errstate(over="ignore"):
            buckets = _mix64(np.arange(BUCKETS, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15))
            scores = _mix64(buckets[:, None] ^ seeds[None, :])
        self._table = [self.peers[i] for i in scores.argmax(axis=1).tolist()]

    def home(self, key: Key) -> str | None:
        """The peer ``key`` lives on; ``None`` when there are no peers."""
        if len(self._table) <= 1:
            return self._table[0] if self._table else None
        return self._table[key_hash(key) & (BUCKETS - 1)]

    def homes(self, keys: Sequence[Key]) -> list[str]:
        """``home`` of each key (there must be at least one peer)."""
        if len(self._table) == 1:
            return [self._table[0]] * len(keys)
        table, mask = self._table, BUCKETS - 1
        return [table[key_hash(k) & mask] for k in keys]


@functools.lru_cache(maxsize=16)
def _placement(peers: frozenset[str]) -> Placement:
    return Placement(peers)


def home_peer(key: Key, peers: Collection[str]) -> str | None:
    """The peer ``key`` lives on among ``peers``; ``None`` when there are none.

    Deterministic in any process; adding a peer moves only the keys it now wins.
    """
    return _placement(frozenset(peers)).home(key)
