"""A disk journal's frames damaged at random (found by review): ``disk_frames.parse`` never
raises, returns only records that were written, those before the damage in their order, and
reads a bounded number of bytes however the damage reads as frame lengths."""

from __future__ import annotations

import zlib
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torch_kv_tier.keys import MAX_INT_KEY, MAX_KEY_BYTES, MIN_INT_KEY, Key
from torch_kv_tier.remote import disk_frames
from torch_kv_tier.remote.disk_frames import DEL, PUT, Record
from torch_kv_tier.remote.protocol import MAX_FINGERPRINT

_records = st.lists(
    st.tuples(
        st.sampled_from([PUT, DEL]),
        st.integers(0, 1 << 20),
        st.text(max_size=40),
        st.one_of(st.binary(max_size=64), st.text(max_size=16), st.integers(0, (1 << 64) - 1)),
        st.integers(0, (1 << 64) - 1),
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(_records, st.data())
def test_damage_never_raises_nor_yields_a_record_not_written(
    records: list[Record], data: st.DataObject
) -> None:
    journal = bytearray(disk_frames.frames(records))
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, len(journal) - 1))
        kind = data.draw(st.sampled_from(["flip", "zeros", "garbage", "cut"]))
        if kind == "flip":
            journal[at] ^= 1 << data.draw(st.integers(0, 7))
        elif kind == "cut":
            del journal[at:]
            break
        else:
            n = data.draw(st.integers(1, 64))
            fill = bytes(n) if kind == "zeros" else data.draw(st.binary(min_size=n, max_size=n))
            journal[at : at + n] = fill
    parsed = disk_frames.parse(bytes(journal))
    assert parsed.records == records[: len(parsed.records)]  # before the damage, in order
    written = set(map(repr, records))
    assert all(repr(record) in written for record in parsed.after)


def _count_hashed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the payloads ``disk_frames`` hashes from now on, as it hashes them."""
    hashed: list[int] = []

    def crc32(payload: Any) -> int:
        hashed.append(len(payload))
        return zlib.crc32(payload)

    monkeypatch.setattr(disk_frames, "zlib", SimpleNamespace(crc32=crc32))
    return hashed


def test_a_search_past_damage_reads_no_frame_longer_than_a_record_can_be(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Damage whose bytes read as frame lengths reaching inside the journal (as random bytes do
    with odds of its size in 4 GiB) had each position of the search hash that many bytes: 76 s
    for a 16 MiB journal with 64 KiB damaged (crafted lengths), growing with the square of its
    size. A length past ``MAX_PAYLOAD`` is no frame: none of its bytes is read, and a search
    costs ``RESYNC_BYTES * MAX_PAYLOAD`` at most, whatever the size (here made small)."""
    monkeypatch.setattr(disk_frames, "RESYNC_BYTES", 64)
    monkeypatch.setattr(disk_frames, "MAX_PAYLOAD", 4096, raising=False)
    record: Record = (PUT, 7, "ns", b"k" * 32, 1 << 63)
    good = disk_frames.frames([record] * 20_000)  # ~1.2 MiB on each side of the damage
    damage = bytes([0, 0, 16, 0]) * 16  # lengths of 1 MiB, 4 KiB, 16 bytes, 256 MiB in turn
    hashed = _count_hashed(monkeypatch)
    parsed = disk_frames.parse(good + damage + good)
    assert len(parsed.records) == 20_000 and parsed.bad_at == len(good)
    assert len(parsed.after) == 20_000  # found again past the damage
    assert sum(hashed) <= 2 * len(good) + 64 * 4096


@pytest.mark.parametrize("key", [b"\xff" * MAX_KEY_BYTES, "\U0010ffff" * 16, MIN_INT_KEY])
def test_the_longest_record_a_session_can_make_reads_back(key: Key) -> None:
    """``MAX_PAYLOAD`` bounds what a frame may hold: the longest record a host writes (a
    namespace of ``MAX_FINGERPRINT`` four-byte characters, the handshake's limit since the disk
    tier exists, a key at its limit, 64-bit slot and digest) still reads, among others."""
    longest: Record = (PUT, MAX_INT_KEY, "\U0010ffff" * MAX_FINGERPRINT, key, MAX_INT_KEY)
    records = [(DEL, 0, "ns", b"k", 0), longest, (PUT, 1, "ns", b"k", 1)]
    assert disk_frames.parse(disk_frames.frames(records)).records == records


def test_damage_that_reads_as_lengths_near_a_frames_limit_costs_a_bounded_search(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A page of small integers (another file's, say) past a journal's first record: every
    fourth position reads as a length under 1 MiB, the old ``MAX_PAYLOAD`` (a frame's limit),
    so the search hashed 16 GiB (9 s) per such journal. A length is now bounded by the longest
    record: under 32 MiB hashed."""
    hashed = _count_hashed(monkeypatch)
    good = disk_frames.frame((PUT, 0, "ns", b"k", 1), 0)
    damage = bytes([1, 255, 15, 0]) * (1 << 20)  # 4 MiB: lengths of 1 MiB - 255 at every 4th
    parsed = disk_frames.parse(good + b"\x01" + damage)
    assert parsed.records == [(PUT, 0, "ns", b"k", 1)] and not parsed.searched_all
    assert sum(hashed) < 32 << 20


def test_a_journal_reads_only_under_the_header_of_the_generation_asked() -> None:
    """Disk format 3: a journal starts with a header naming its generation. Whole records of an
    older journal at a file's start (no header, or an older one's) read as none of its records
    (every frame that reads is past the damage, at byte 0); a record whose order is not past
    the generation is not of this journal either."""
    records: list[Record] = [(PUT, 0, "ns", b"k", 1), (DEL, 0, "ns", b"k", 0)]
    body = disk_frames.frames(records, [6, 7])
    parsed = disk_frames.parse(disk_frames.header(5) + body, generation=5)
    assert (parsed.records, parsed.bad_at, parsed.generation) == (records, None, 5)
    for older, named in ((disk_frames.header(4) + body, 4), (body, None)):
        parsed = disk_frames.parse(older, generation=5)
        assert (parsed.records, parsed.bad_at, parsed.after) == ([], 0, records)
        assert parsed.generation == named
    below = disk_frames.header(5) + disk_frames.frames(records, [5, 7])
    assert disk_frames.parse(below, generation=5).records == []
