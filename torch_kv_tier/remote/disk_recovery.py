"""What a restarted host's disk directories still hold (``DiskStore.recover``).

The journal of each directory is replayed (the last record of a slot wins), every surviving
block is read and checked against its digest (xxh3-64 seeded with its key, as
``digest.BlockDigests``). A block cut by a crash, a file truncated or corrupted, a record cut
at the journal's tail, a block unreadable (EIO) cost those keys, nothing else (a journal damaged
in the middle, or of another generation than ``meta.json`` names, costs every key it names:
``DiskDir.read_records``); so does a key found in two directories (a ``DEL`` lost to a crash or
a full disk: which copy is the newer is unknown; a copy that cannot be read counts, as it may
be the newer, and is overwritten unread), or in one where a start cut short overwrote another
copy (``_spoil``: a block holding the complement of its record's bytes). Each directory's
losses are logged (a warning saying how many of its blocks), as is a journal found missing
(``disk_journal``): a restart says what it dropped.

Threading: runs on the caller's thread, before any other I/O on the directories.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
from collections import OrderedDict
from collections.abc import Mapping, Sequence

from torch_kv_tier.digest import block_digest
from torch_kv_tier.keys import Key
from torch_kv_tier.remote.disk_journal import DiskDir

logger = logging.getLogger(__name__)

Pair = tuple[str, Key]
_COMPLEMENT = bytes(255 - b for b in range(256))  # each byte's complement (``_spoil``)
_UNMARK = bytes(b ^ 0x55 for b in range(256))  # a complement to neither it nor its complement


def verified_index(
    dirs: Sequence[DiskDir], block_len: int
) -> tuple[OrderedDict[Pair, tuple[int, int]], int]:
    """The keys whose blocks verify: ``(namespace, key) -> (global slot, digest)``, least
    recently used first (journal order; global slot ``g`` is slot ``g // n`` of directory
    ``g % n``), and how many keys were dropped. Never raises for a block it cannot read."""
    n = len(dirs)
    dropped = 0
    row = mmap.mmap(-1, block_len)  # page-aligned, as O_DIRECT reads need
    found: list[tuple[int, int, str, Key, int]] = []  # journal order, slot, ns, key, digest
    spoiled: set[Pair] = set()  # a copy's block overwritten by a start cut short (``_spoil``)
    # a copy's block unreadable (it may verify at a later start): global slot -> key, digest
    unread: dict[int, tuple[Pair, int]] = {}
    try:
        for f, d in enumerate(dirs):
            live = d.live()
            dropped += d.dropped  # a journal damaged: every key it named (``read_records``)
            kept = len(found)
            for j, (order, ns, key, digest) in live.items():
                try:
                    got = os.preadv(d.fd, [row], j * block_len)
                except OSError as exc:  # a bad sector costs its key, not the start
                    logger.warning("disk: block %d of %s unreadable: %s", j, d.path, exc)
                    got = -1
                    unread[j * n + f] = (ns, key), digest
                if got == block_len and block_digest(row, key) == digest:
                    found.append((order, j * n + f, ns, key, digest))
                elif (
                    got == block_len and block_digest(row[:].translate(_COMPLEMENT), key) == digest
                ):
                    spoiled.add((ns, key))
            lost = len(live) - (len(found) - kept)
            if lost:
                logger.warning(
                    "disk: %d of the %d blocks the journal of %s names dropped: they no longer "
                    "hold their keys' bytes (a write cut by a crash, blocks.dat truncated, "
                    "corrupted or replaced); those keys are misses", lost, len(live), d.path,
                )  # fmt: skip
            dropped += lost
    finally:
        row.close()
    found.sort(key=lambda entry: entry[0])  # orders of two directories: roughly
    # the directories whose journal names a copy that verifies or cannot be read: an
    # unreadable copy may be the newer one, so the other is not served alone
    homes: dict[Pair, set[int]] = {}
    for slot, (pair, _) in unread.items():
        homes.setdefault(pair, set()).add(slot % n)
    for _, slot, ns, key, _ in found:
        homes.setdefault((ns, key), set()).add(slot % n)
    index: OrderedDict[Pair, tuple[int, int]] = OrderedDict()
    twice: dict[int, Pair] = {}  # global slot -> its key
    for _, slot, ns, key, digest in found:
        if len(homes[(ns, key)]) > 1 or (ns, key) in spoiled:  # which copy is newer: unknown
            twice[slot] = (ns, key)
            continue
        index.pop((ns, key), None)  # two slots of one journal: the later one stays
        index[(ns, key)] = (slot, digest)
    if twice:
        logger.warning(
            "disk: %d blocks dropped: their keys are in two directories (a removal's record "
            "lost; or were, another copy overwritten by a start cut short), and which copy is the "
            "newer is unknown; those keys are misses", len(twice),
        )  # fmt: skip
        done = _spoil(dirs, list(twice), block_len, _COMPLEMENT)
        bad = {twice[slot] for slot in twice if slot not in done}  # a copy left as it was
        # then, once its other copies are marked, a copy that could not be read is overwritten
        # unread (a write remaps a bad sector): it may read at a later start, and be the only
        # copy a journal names once the others' are rewritten
        marked = set(twice.values()) - bad
        blind = {
            slot: _blank(block_len, pair[1], digest)
            for slot, (pair, digest) in unread.items()
            if pair in marked
        }
        bad |= {
            unread[slot][0] for slot in blind.keys() - _spoil(dirs, list(blind), block_len, blind)
        }
        # every copy of a key overwritten and synced: unmarked, so that a journal still naming
        # one once its rewrite is refused costs no copy of that key stored since (a miss where
        # a hit was possible)
        _spoil(dirs, [slot for slot in done if twice[slot] not in bad], block_len, _UNMARK)
    return index, dropped + len(twice)


def _spoil(
    dirs: Sequence[DiskDir], slots: list[int], block_len: int, table: bytes | Mapping[int, bytes]
) -> set[int]:
    """Overwrite the blocks of global ``slots`` with their bytes translated by ``table`` (or,
    a mapping, with its bytes for each slot, unread), then sync their block files; returns
    the slots overwritten and synced. First with their complement (``_COMPLEMENT``): before
    the journals naming them are rewritten one by one, so that a crash between two of those
    rewrites (or one refused: a full disk) leaves no record naming a block that still
    verifies (a key dropped for being in two directories was then found in one only, and its
    copy there, maybe the older one, served). A crash between two of the overwrites leaves one
    copy overwritten, which the next start knows by its complement (``verified_index``: every
    copy of its key dropped). Then a copy that could not be read, once every other copy of its
    key is its complement, synced, with bytes that do not verify (``_blank``). Then, once every
    copy of a key is so overwritten and synced, with ``_UNMARK``: its blocks hold neither their
    bytes nor their complement (the original bytes XOR 0xAA), so a journal whose rewrite was
    refused no longer drops a copy stored since. A block that cannot be overwritten is
    logged: a start after such a crash may serve it."""
    n = len(dirs)
    row = mmap.mmap(-1, block_len)  # page-aligned, as O_DIRECT needs
    done: set[int] = set()
    try:
        for slot in slots:
            d, j = dirs[slot % n], slot // n
            try:
                if isinstance(table, bytes):
                    _translate(d.fd, j * block_len, row, table)
                else:
                    _overwrite(d.fd, j * block_len, row, table[slot])
                done.add(slot)
            except OSError as exc:
                logger.error(
                    "disk: block %d of %s, whose key is in another directory too, cannot be "
                    "overwritten (%s): %s", j, d.path, exc,
                    "a start after a crash before every journal is rewritten may serve it, "
                    "maybe the older copy" if table is not _UNMARK else "a copy of that key "
                    "stored since is a miss at a restart before its journal is rewritten",
                )  # fmt: skip
        for f in {slot % n for slot in done}:
            try:
                os.fdatasync(dirs[f].fd)
            except OSError as exc:
                logger.error("disk: blocks of %s overwritten, not synced: %s", dirs[f].path, exc)
                done = {slot for slot in done if slot % n != f}
    finally:
        row.close()
    return done


def _translate(fd: int, at: int, row: mmap.mmap, table: bytes) -> None:
    """Write the block at byte ``at`` of ``fd`` again translated by ``table``, through
    ``row``; raises ``OSError`` where it cannot, or either is cut short."""
    if os.preadv(fd, [row], at) != len(row):
        raise OSError(errno.EIO, "block read cut short")
    _overwrite(fd, at, row, row[:].translate(table))


def _overwrite(fd: int, at: int, row: mmap.mmap, data: bytes) -> None:
    """Write ``data`` as the block at byte ``at`` of ``fd``, through ``row``; raises
    ``OSError`` where it cannot, or the write is cut short."""
    row[:] = data
    if os.pwritev(fd, [row], at) != len(row):
        raise OSError(errno.EIO, "block write cut short")


def _blank(block_len: int, key: Key, digest: int) -> bytes:
    """A block's bytes that do not verify as ``key``'s of ``digest``: zeros, or, where those
    would (its bytes were zeros), ones."""
    zeros = bytes(block_len)
    return zeros if block_digest(zeros, key) != digest else b"\xff" * block_len
