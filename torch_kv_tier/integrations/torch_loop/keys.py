"""Prefix keys for paged KV caches: chained hashes of full pages of token ids.

Page ``i``'s key digests the key of page ``i - 1`` and the token ids of page ``i``, so a key names
the whole prefix up to the end of its page: two sequences share key ``i`` exactly when they share
their first ``(i + 1) * page_size`` tokens. Keys come from :mod:`hashlib` over a fixed byte layout
(little-endian int64 token ids), so the same prefix maps to the same keys in every process and on
every host (unlike :func:`hash`, which is salted per process).
"""

from __future__ import annotations

import hashlib
import operator
import struct
from collections.abc import Iterable

__all__ = ["KEY_BYTES", "prefix_keys"]

KEY_BYTES = 16
"""Length in bytes of every key returned by :func:`prefix_keys`."""

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def prefix_keys(token_ids: Iterable[int], page_size: int, *, namespace: bytes = b"") -> list[bytes]:
    """Return one key per *full* page of ``token_ids``; a trailing partial page gets none.

    ``namespace`` seeds the chain: give each model (weights, dtype, page layout) its own namespace
    so that two models never read each other's KV blocks under the same tokens.

    ``token_ids`` may be any iterable of ints, including a 1-D integer tensor or array. Raises
    ``ValueError`` for ``page_size < 1`` or a token id outside the int64 range, ``TypeError`` for
    a non-integer ``page_size`` or token id.
    """
    if isinstance(page_size, bool) or not hasattr(type(page_size), "__index__"):
        raise TypeError(f"page_size must be an int, got {type(page_size).__name__} {page_size!r}")
    page_size = operator.index(page_size)
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    as_list = getattr(token_ids, "tolist", None)  # tensors and arrays: one conversion, not n
    ids = [_as_int(t) for t in (as_list() if callable(as_list) else token_ids)]
    page_struct = struct.Struct(f"<{page_size}q")
    chain = hashlib.blake2b(namespace, digest_size=KEY_BYTES, person=b"torch-kv-tier").digest()
    keys: list[bytes] = []
    for start in range(0, len(ids) - page_size + 1, page_size):
        digest = hashlib.blake2b(chain, digest_size=KEY_BYTES)
        digest.update(page_struct.pack(*ids[start : start + page_size]))
        chain = digest.digest()
        keys.append(chain)
    return keys


def _as_int(token: object) -> int:
    try:
        value = operator.index(token)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"token ids must be integers, got {token!r}") from None
    if not _INT64_MIN <= value <= _INT64_MAX:
        raise ValueError(f"token id {value} does not fit in int64")
    return value
