"""The records of a disk directory's journal (``disk_journal``) as bytes: each framed by its
payload's length and CRC-32 (``frame``), read back up to the first frame that does not read
(``parse``), with what lies past that frame: a crash that cut an append leaves nothing readable
after it; damage in the middle (a bad sector, a lost page) leaves records that still read, found
again by a bounded scan. Each payload carries the record's order (``seq``), strictly increasing
along a journal: a frame whose order is not past the one before it does not read, as bytes the
file system wrote twice (a page written again after a crash, on a record boundary) would replay
an old record after those that undid it. A journal of disk format 3 starts with a header frame
(``header``) naming its generation, the order its records follow, which the directory's
``meta.json`` names too: whole records of an older journal at the very start of a file (nothing
before them to be out of order with: a file system that returns an old file's blocks after a
crash) do not read, their header naming another generation, or none.

Pure functions of their arguments, no I/O; safe from any thread.
"""

from __future__ import annotations

import itertools
import re
import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from torch_kv_tier.keys import MAX_INT_KEY, MAX_KEY_BYTES, Key
from torch_kv_tier.remote.protocol import MAX_FINGERPRINT

PUT, DEL = 1, 0
RESYNC_BYTES = 64 << 10  # unreadable bytes past a bad frame searched for frames, at most
_FRAME = struct.Struct("<II")  # payload length, CRC-32 of the payload
_ZEROS = bytes(_FRAME.size)
_NOT_ZERO = re.compile(rb"[^\x00]")
_encoder = msgspec.msgpack.Encoder()  # keeps bytes, str and int keys apart
# a record's payload, at most (354 bytes): its namespace is a session's config fingerprint
# (``MAX_FINGERPRINT`` characters, 4 UTF-8 bytes each at most), its key ``MAX_KEY_BYTES``, its
# slot, digest and order 64-bit. A longer length is damage, not a frame: no byte of it is read,
# so a search hashes ``RESYNC_BYTES * MAX_PAYLOAD`` bytes at most (under 23 MiB)
MAX_PAYLOAD = len(
    _encoder.encode(
        (
            PUT, MAX_INT_KEY, "\U0010ffff" * MAX_FINGERPRINT, bytes(MAX_KEY_BYTES), MAX_INT_KEY,
            MAX_INT_KEY,
        )
    )
)  # fmt: skip
# op, slot, namespace, key, digest, order: msgpack keeps key types
_decoder = msgspec.msgpack.Decoder(tuple[int, int, str, Any, int, int])
# disk format 1's records, with no order: read once, as a directory of that format is migrated
_unordered = msgspec.msgpack.Decoder(tuple[int, int, str, Any, int])
_HEADER = "journal"  # a header's payload: this, then the journal's generation
_header = msgspec.msgpack.Decoder(tuple[str, int])  # a record's payload does not decode as one

Record = tuple[int, int, str, Key, int]  # op, slot, namespace, key, digest


@dataclass
class Parsed:
    """A journal's bytes read (``parse``)."""

    records: list[Record]  # up to the first frame that does not read
    bad_at: int | None = None  # that frame's byte; None: every byte read
    after: list[Record] = field(default_factory=list)  # frames past it that read
    searched_all: bool = True  # False: more than RESYNC_BYTES unreadable, the rest not searched
    # the greatest order of a record read, before ``bad_at`` or past it, or of the header's
    # generation where that is greater
    last_seq: int = -1
    generation: int | None = None  # what the header read names (format 3); None: no header


def frame(record: Record, seq: int) -> bytes:
    """``record`` framed, ``seq`` its order in the journal (past every record before it)."""
    payload = _encoder.encode((*record, seq))
    return _FRAME.pack(len(payload), zlib.crc32(payload)) + payload


def header(generation: int) -> bytes:
    """The header frame a journal of disk format 3 starts with: its ``generation``, an order
    below those of its records and past those of every older journal's."""
    payload = _encoder.encode((_HEADER, generation))
    return _FRAME.pack(len(payload), zlib.crc32(payload)) + payload


def frames(records: Iterable[Record], seqs: Iterable[int] | None = None) -> bytes:
    """``records`` framed as the journal holds them (for ``DiskDir.rewrite``), in the order
    ``seqs`` (strictly increasing; by default 0, 1, 2...)."""
    return b"".join(map(frame, records, itertools.count() if seqs is None else seqs))


def parse(data: bytes, *, ordered: bool = True, generation: int | None = None) -> Parsed:
    """The records of ``data`` up to the first frame that does not read (cut short, its CRC
    wrong, no record, or its order not past the record before it), and, past that one, the
    frames that read (searched over at most ``RESYNC_BYTES`` of unreadable bytes; runs of zeros,
    as a lost page reads, cost nothing). ``ordered=False`` reads disk format 1's records, which
    carry no order (each is taken as past the one before it). ``generation`` (disk format 3)
    is the one the journal's header must name (``header``), its records' orders past it: where
    it names another (``Parsed.generation``), or there is none, or there is one where
    ``generation`` is None (a journal of format 3 where an older one is read: a crash as it was
    migrated), no record reads before byte 0, every frame that reads is past it (``after``)."""
    records: list[Record] = []
    last = -1
    pos, named = read_header(data)
    if data and named != generation:  # an older journal's bytes, or damage: none is this one's
        rest = parse(data[pos:])
        last = max(rest.last_seq, -1 if named is None else named)  # orders used: past them
        return Parsed([], 0, rest.records + rest.after, rest.searched_all, last, named)
    if named is not None:
        last = named
    pos, last = _read_run(data, pos, records, ordered, last)
    if pos == len(data):
        return Parsed(records, last_seq=last, generation=generation)
    parsed = Parsed(records, bad_at=pos, last_seq=last, generation=generation)
    budget = RESYNC_BYTES
    pos += 1
    while pos + _FRAME.size <= len(data):
        if data.startswith(_ZEROS, pos):  # no frame: skip to the last 8 bytes before non-zero
            found = _NOT_ZERO.search(data, pos)
            pos = max(pos + 1, (found.start() if found else len(data)) - _FRAME.size + 1)
            continue
        end, last = _read_run(data, pos, parsed.after, ordered)
        parsed.last_seq = max(parsed.last_seq, last)
        if end > pos:
            pos = end
            continue
        budget -= 1
        if not budget:
            parsed.searched_all = False
            break
        pos += 1
    return parsed


def read_header(data: bytes) -> tuple[int, int | None]:
    """The byte after ``data``'s first frame and the generation it names where it is a
    header (else 0 and None)."""
    if len(data) < _FRAME.size:
        return 0, None
    length, crc = _FRAME.unpack_from(data)
    payload = data[_FRAME.size : _FRAME.size + min(length, MAX_PAYLOAD)]
    if len(payload) != length or zlib.crc32(payload) != crc:
        return 0, None
    try:
        tag, generation = _header.decode(payload)
    except (msgspec.DecodeError, ValueError):
        return 0, None
    return (_FRAME.size + length, generation) if tag == _HEADER else (0, None)


def _read_run(
    data: bytes, pos: int, out: list[Record], ordered: bool, last: int = -1
) -> tuple[int, int]:
    """Append to ``out`` the records of the frames that read from ``pos`` on, each in order
    after the one before it (the first past ``last``); returns the byte after the last one
    (``pos`` if none read) and that one's order (``last`` if none)."""
    view = memoryview(data)
    while pos + _FRAME.size <= len(data):
        length, crc = _FRAME.unpack_from(data, pos)
        end = pos + _FRAME.size + length
        if length > MAX_PAYLOAD or end > len(data):  # (first: a garbage length, no frame)
            break
        payload = view[pos + _FRAME.size : end]
        if zlib.crc32(payload) != crc:
            break
        try:
            if ordered:
                op, slot, namespace, key, digest, seq = _decoder.decode(payload)
            else:
                (op, slot, namespace, key, digest), seq = _unordered.decode(payload), last + 1
        except (msgspec.DecodeError, ValueError):
            break
        if seq <= last:  # a record written again (module docstring)
            break
        out.append((op, slot, namespace, key, digest))
        last = seq
        pos = end
    return pos, last
