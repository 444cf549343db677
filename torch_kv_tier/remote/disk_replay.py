"""A disk directory's journal as a start reads it (``disk_journal.DiskDir.read_records``): its
records up to the first frame that does not read (``disk_frames.parse``). A tail cut by a crash
costs that record; damage with records that still read past it (a bad sector, a page lost to a
power loss) costs every record, as the one lost may be the ``DEL`` of a key whose old block
still verifies; a journal whose header names another generation than ``meta.json`` (an older
journal's bytes, a journal and ``meta.json`` of different times, one the last host could
neither empty nor remove) costs every record too. Each is logged, saying how many records and
keys it cost; a start then rewrites the journal from what it kept.

Functions of their arguments and of the journal file, safe from any thread; ``read`` raises
``DiskError`` saying what to do where the journal cannot be read (EIO).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from torch_kv_tier.keys import Key
from torch_kv_tier.remote.disk_files import DiskError
from torch_kv_tier.remote.disk_frames import PUT, Parsed, Record, parse
from torch_kv_tier.remote.disk_header import FORMAT, Header

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Replay:
    """A journal read (``read``)."""

    records: list[Record]  # those a start uses
    next_seq: int  # past every order read (even damage's, not used) and past the generation
    dropped: int | None  # keys that damage or another generation cost; None: nothing lost


def read(path: Path, header: Header, slots: int) -> Replay:
    """The records of directory ``path``'s ``journal.log`` (module docstring), read as of the
    format and generation ``header`` (``meta.json``) names, for ``slots`` slots."""
    journal = path / "journal.log"
    try:
        data = journal.read_bytes()
    except OSError as exc:
        raise DiskError(
            f"{journal} cannot be read ({exc.strerror or exc}): restore it, or move it away "
            f"to start {path} afresh (its blocks are then forgotten)"
        ) from exc
    fmt, generation = header.format, header.generation
    parsed = parse(data, ordered=fmt > 1, generation=generation if fmt == FORMAT else None)
    next_seq = max(parsed.last_seq + 1, (generation or 0) + 1)
    if parsed.bad_at is None:
        return Replay(parsed.records, next_seq, None)
    if parsed.generation != generation:
        return Replay([], next_seq, _other_journal(path, header, parsed, slots))
    if parsed.after or not parsed.searched_all:
        return Replay([], next_seq, _damaged_journal(path, parsed, len(data), slots))
    logger.warning(
        "disk: journal of %s cut at byte %d of %d (a crash or power loss in the middle of an "
        "append): the record cut is lost (which key it named cannot be known: a miss if it "
        "stored one, back with the bytes it had if it removed one), the %d before it are "
        "kept; nothing to do",
        path, parsed.bad_at, len(data), len(parsed.records),
    )  # fmt: skip
    return Replay(parsed.records, next_seq, None)


def live(records: list[Record], slots: int) -> dict[int, tuple[int, str, Key, int]]:
    """Slot -> (position in the journal, namespace, key, digest) of each slot (below
    ``slots``) whose last record of ``records`` is a ``PUT`` (the last record of a slot wins)."""
    last: dict[int, tuple[int, str, Key, int]] = {}
    for order, (op, j, ns, key, digest) in enumerate(records):
        if op == PUT and 0 <= j < slots:
            last[j] = (order, ns, key, digest)
        else:
            last.pop(j, None)
    return last


def _damaged_journal(path: Path, parsed: Parsed, size: int, slots: int) -> int:
    """A frame that does not read with records past it: damage, not a crash's cut. No record
    is used: the one lost may be the ``DEL`` of a key whose old block still verifies, and
    replaying the others would bring that key back with bytes it no longer names. Logged;
    returns the keys it costs."""
    dropped = len(live(parsed.records + parsed.after, slots))
    logger.error(
        "disk: journal of %s damaged at byte %d of %d: %d records before it and %d after it "
        "still read%s, but the record lost may have removed a key whose old block still "
        "verifies, so none is used: the %d keys they name, and the lost record's, are "
        "misses (this start rewrites the journal); if this recurs, check the device of %s "
        "(bad sectors, a failing disk)",
        path, parsed.bad_at, size, len(parsed.records), len(parsed.after),
        "" if parsed.searched_all else " (more may: the rest was not searched)",
        dropped, path,
    )  # fmt: skip
    return dropped


def _other_journal(path: Path, header: Header, parsed: Parsed, slots: int) -> int | None:
    """A journal whose header names another generation than ``header`` (``parsed.generation``;
    None: no header): none of its records (``parsed.after``) is used, each may be an older
    journal's, replayed with none of the records that undid it. Logged, returning the keys it
    costs, unless a header alone (a journal emptied, ``DiskDir._past_orders``): nothing lost,
    None."""
    found, records = parsed.generation, parsed.after
    if found is not None and not records:
        return None
    dropped = len(live(records, slots))
    named = header.generation
    logger.error(
        "disk: journal of %s starts with %s, but its meta.json names %s: bytes of an older "
        "journal (a file system that returned old blocks after a crash), or a journal and "
        "meta.json of different times (one restored by hand, or a crash of a version that "
        "wrote meta.json after the journal, a migration's too; or one the last host could "
        "neither empty nor remove, which it logged); none of its %d records is "
        "used: the %d keys they name are misses (this start rewrites the journal)",
        path, "no header" if found is None else f"generation {found}",
        f"no header (disk format {header.format})" if named is None
        else f"generation {named}",
        len(records), dropped,
    )  # fmt: skip
    return dropped
