"""Block digests: what a load checks its bytes against, so it returns the bytes its key names or
a miss, whatever wrote the slot meanwhile.

A digest is xxh3-64 of a block's bytes, seeded with the key's stable 64-bit fingerprint
(``keys.key_fingerprint``): it binds the bytes to their key. (A 32-bit seed, as before, let the
bytes of any key whose seed equals the asked key's pass its check: odds of 2**-32 per stale
read, which a busy fleet reaches in weeks. With 64 bits, a read of another key's bytes passes
with odds of 2**-64.) A store computes the digests of its source
blocks before it writes them; the index keeps each stored key's digest (a shared host publishes
it with the key); a load recomputes the digests of the blocks it brought in and reports a key
whose digest differs as "missing". That catches, whatever the transport or its timing: a torn
read (a slot evicted and rewritten while it was read), a late write of another key (a writer
that froze and resumed after its slot was handed on), a stale index entry, and a write whose
bytes had not all landed when its commit was read. A late write of the *same* key carries the
same bytes, so it is harmless.

One algorithm for every tier, because tiers of one model share a host whether their arenas are
in host or GPU memory. xxh3 runs at ~20 GB/s per core here (16 KiB to 1 MiB blocks). A CUDA
arena's blocks are copied to host memory first: there is no maintained xxh3 for CUDA, and a
device-only checksum could not be checked by a host-memory tier reading the same key. Each
calling thread has its own pinned staging buffer (at most ``STAGING_BYTES``, or one block if
larger), filled by one gather and one device-to-host copy per ``STAGING_BYTES`` of the call. On
an H200 a copy into pageable memory (``.cpu()``, as before) ran at 1.6 to 14 GB/s and held a
CUDA tier's digests to 1.3 to 4.7 GB/s; through pinned staging they run at 3.4 to 11 GB/s, the
rest being xxh3 on one core (``torch-kv-tier digest-cost --device cuda``). One buffer per thread
because stores digest on their caller's thread and loads on the tier's poller thread, at once.

The GIL is kept while hashing. python-xxhash 4 releases it for every input over 64 KiB; a block
hashed in one call would then hand the GIL away once per block, and beside any busy Python
thread of the process each hand-back waits out the interpreter's switch interval (5 ms): a
19 us digest of a 1 MiB block took 5.2 ms, and a store of 16 such blocks 91 ms. So a block over
``CHUNK`` bytes is fed to one xxh3 state in ``CHUNK``-byte pieces (the digest is the same as in
one call, and the same for every xxhash version); the interpreter may still switch threads
between blocks.

Threading: safe from any thread; the only state is the host arena's row views (read-only) and a
CUDA arena's staging buffers (one per thread).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import xxhash

from torch_kv_tier.keys import Key, key_fingerprint

if TYPE_CHECKING:
    import torch

CHUNK = 64 << 10  # the longest input python-xxhash hashes without releasing the GIL
STAGING_BYTES = 16 << 20  # a CUDA arena's pinned host staging, per thread: the copy's full speed

_xxh3 = xxhash.xxh3_64_intdigest
_xxh3_state = xxhash.xxh3_64


def _pieces(block: Any) -> list[memoryview]:
    """``block``'s bytes as views of at most ``CHUNK`` bytes each."""
    view = memoryview(block).cast("B")
    return [view[start : start + CHUNK] for start in range(0, len(view), CHUNK)]


def _digest_of_pieces(pieces: list[memoryview], seed: int) -> int:
    """xxh3-64 of the pieces' bytes one after the other (the same as of those bytes at once)."""
    state = _xxh3_state(seed=seed)
    deque(map(state.update, pieces), 0)
    return state.intdigest()


class BlockDigests:
    """Digests of the blocks of one arena tensor (``uint8 [num_blocks, block_len]``)."""

    def __init__(self, blocks: torch.Tensor) -> None:
        self._blocks = blocks
        self._whole = blocks.shape[1] <= CHUNK  # a block is then hashed in one call
        # Each row's view (or its pieces), made once: hashing a row is then one C call (each).
        self._rows = self._host_rows(blocks.numpy()) if blocks.device.type == "cpu" else None
        self._staging = threading.local()  # .buffer: this thread's host copy of device blocks

    def _host_rows(self, rows: Any) -> list[Any]:
        return list(rows) if self._whole else list(map(_pieces, rows))

    def of(self, idxs: Sequence[int], keys: Sequence[Key]) -> list[int]:
        """The digest of block ``idxs[i]`` as the bytes of ``keys[i]``."""
        digest = _xxh3 if self._whole else _digest_of_pieces
        if self._rows is not None:
            rows = self._rows
            return [digest(rows[i], key_fingerprint(k)) for i, k in zip(idxs, keys)]
        per_copy = max(1, STAGING_BYTES // self._blocks.shape[1])
        out: list[int] = []
        for start in range(0, len(idxs), per_copy):
            part = self._staged(idxs[start : start + per_copy])
            out += map(digest, part, map(key_fingerprint, keys[start : start + per_copy]))
        return out

    def _staged(self, idxs: Sequence[int]) -> list[Any]:
        """Rows ``idxs`` of a device arena, copied into this thread's pinned staging buffer
        (valid until this thread's next call)."""
        import torch  # not at the top: a host's disk tier uses ``block_digest`` alone

        buffer = getattr(self._staging, "buffer", None)
        if buffer is None or buffer.shape[0] < len(idxs):
            buffer = torch.empty(
                (len(idxs), self._blocks.shape[1]),
                dtype=torch.uint8,
                pin_memory=self._blocks.is_cuda,
            )
            self._staging.buffer = buffer
        host = buffer[: len(idxs)]
        host.copy_(self._blocks[list(idxs)])  # synchronous: the host reads it next
        return self._host_rows(host.numpy())

    def mismatched(
        self, idxs: Sequence[int], keys: Sequence[Key], expected: Sequence[int]
    ) -> list[Key]:
        """The keys whose block in ``idxs`` does not hold the bytes ``expected`` names."""
        got = self.of(idxs, keys)
        if got == list(expected):
            return []
        return [k for k, g, e in zip(keys, got, expected) if g != e]


def block_digest(block: Any, key: Key) -> int:
    """The digest of one block's bytes (any buffer) as ``key`` (what ``BlockDigests.of``
    computes)."""
    return _digest_of_pieces(_pieces(block), key_fingerprint(key))
