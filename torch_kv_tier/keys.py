"""Logical block keys and their placement across peers (rendezvous hashing)."""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Sequence
from typing import Union

Key = Union[bytes, str, int]  # noqa: UP007  (a runtime alias, usable on Python 3.10)


def check_keys(keys: Sequence[Key]) -> list[Key]:
    """Return ``keys`` as a list; ``TypeError`` for a non-key, ``ValueError`` for a repeat."""
    out = list(keys)
    for key in out:
        if isinstance(key, bool) or not isinstance(key, (bytes, str, int)):
            raise TypeError(f"keys must be bytes, str or int, got {type(key).__name__}: {key!r}")
    if len(set(out)) != len(out):
        raise ValueError("a key appears twice in one call; pass each key once")
    return out


def _key_bytes(key: Key) -> bytes:
    if isinstance(key, bytes):
        return b"b" + key
    if isinstance(key, str):
        return b"s" + key.encode()
    return b"i" + str(key).encode()


def home_peer(key: Key, peers: Collection[str]) -> str | None:
    """The peer with the highest hash score for ``key``; ``None`` when there are no peers.

    Deterministic in any process; adding a peer moves only the keys it now wins.
    """
    if len(peers) == 1:
        return next(iter(peers))
    kb = _key_bytes(key)
    best: tuple[bytes, str] | None = None
    for peer in peers:
        score = hashlib.blake2b(kb + b"\0" + peer.encode(), digest_size=8).digest()
        if best is None or score > best[0]:
            best = (score, peer)
    return None if best is None else best[1]
