"""The header of a ``--disk`` directory, ``meta.json`` (``disk_journal``): its disk format, block
length, slots and, from format 3 on, the generation its journal's header names
(``disk_frames.header``). A directory made for other blocks, or a header that cannot be read,
names other fields or an unknown format, is refused, not reinterpreted, the message saying
what to do (a value's damage reads as other blocks, and needs no checksum, as recovery verifies
every block whatever the header says). Formats 1 (records without their order) and 2 (no
journal generation) are read as such once, then migrated as the journal is rewritten.
A rewrite of the journal writes the header naming the new journal before renaming it over the
old one (``write``); a start completes a rename that a crash cut (``roll_forward``).

Functions of their arguments and of the files they name: ``read`` from any thread, ``write``
and ``roll_forward`` by the holder of the directory's lock (``disk_files.lock``).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from torch_kv_tier.remote.disk_files import DiskError, sync_directory, write_durably
from torch_kv_tier.remote.disk_frames import MAX_PAYLOAD, parse, read_header

logger = logging.getLogger(__name__)

# 2: each journal record carries its order; 3: each journal starts with its generation
FORMAT = 3
_FIELDS = {"format", "block_len", "slots"}  # and, in format 3, "generation"


@dataclass(frozen=True)
class Header:
    """A directory's header as read: its ``format`` (1 and 2 read once, then migrated) and, in
    ``FORMAT``, the ``generation`` its journal's header must name."""

    format: int
    generation: int | None
    written: bool = True  # False: there was none; to write (``encode``) once usable

    def encode(self, block_len: int, slots: int) -> bytes:
        """``meta.json``'s bytes, for blocks of ``block_len`` bytes in ``slots`` slots."""
        fields: dict[str, int | None] = {"format": self.format, "block_len": block_len}
        fields["slots"] = slots
        if self.format == FORMAT:
            fields["generation"] = self.generation
        return json.dumps(fields).encode()


def read(path: Path, block_len: int, slots: int) -> Header:
    """The header of directory ``path``; raises ``DiskError`` saying what to do where it is of
    other blocks, of an unknown format, or cannot be read. Where there is none (a new
    directory, or one whose header was removed), the journal's own header says its generation
    (none: a journal of format 2, or no journal), and the header is ``written`` False."""
    meta = path / "meta.json"
    if not meta.exists():
        return Header(*_journal_format(path), written=False)
    try:
        have = json.loads(meta.read_bytes())
        if not isinstance(have, dict) or have.keys() not in (_FIELDS, _FIELDS | {"generation"}):
            raise ValueError(f"{have!r} is no header")
    except ValueError as exc:  # JSON or UTF-8 damage, or a field's name
        raise DiskError(
            f"{meta} cannot be read ({exc}): {damaged(path)}, or pass an empty directory"
        ) from exc
    fmt, generation = have["format"], have.get("generation")
    if type(fmt) is not int or fmt not in (1, 2, FORMAT):
        raise DiskError(
            f"{meta} names format {fmt!r}, not {FORMAT}: use the torch-kv-tier that made it, or "
            f"pass an empty directory; if this one made it, {damaged(path)}"
        )
    if (fmt == FORMAT) != (type(generation) is int and generation >= 0):
        raise DiskError(
            f"{meta} names format {fmt} with generation {generation!r}: {damaged(path)}"
        )
    if (have["block_len"], have["slots"]) != (block_len, slots):  # damage reads the same: say both
        raise DiskError(
            f"{path} holds {have['slots']!r} blocks of {have['block_len']!r} bytes, not {slots} "
            f"of {block_len}: pass the --block-len and --disk-bytes it was made with, or an empty "
            f"directory; if those are the ones passed, {damaged(path)}"
        )
    if fmt != FORMAT:
        logger.info(
            "disk: %s is of disk format %d (%s): read as such once, then migrated to format %d "
            "as this start rewrites its journal", path, fmt,
            "journal records without their order" if fmt == 1 else "no journal generation", FORMAT,
        )  # fmt: skip
    return Header(fmt, generation)


def write(path: Path, header: Header, block_len: int, slots: int) -> None:
    """Write directory ``path``'s ``meta.json`` as ``header`` (``Header.encode``), whole or not
    at all, durably; raises ``OSError`` with it as it was."""
    os.close(write_durably(path / "meta.json", header.encode(block_len, slots)))


def roll_forward(path: Path, header: Header) -> None:
    """Complete a rewrite of the journal that a crash cut between ``meta.json`` naming its
    generation and its rename (``DiskDir.rewrite``): where ``journal.log``'s header names another
    generation than ``header`` and ``journal.tmp``'s names it, rename ``journal.tmp`` over it
    (logged). Never an older journal: ``meta.json`` names a ``journal.tmp`` only once it is
    written whole and synced, no other journal names its generation (each is past every order
    used before it), and one whose rename failed, left as its removal failed too, is not
    renamed once ``journal.log`` holds a record past its last (appended since, or the header of
    a journal emptied since: ``DiskDir._name_again``), nor over an empty ``journal.log``
    (emptied, its header refused by a full disk: ``DiskDir._past_orders``; or a new directory's,
    whose keys are none); logged, its keys misses.
    Raises ``OSError`` where the files cannot be read or renamed."""
    tmp, journal = path / "journal.tmp", path / "journal.log"
    if header.format != FORMAT or _generation(tmp) != header.generation:
        return
    if _generation(journal) == header.generation:  # renamed: a later rewrite's file, cut
        return
    empty = not journal.exists() or not journal.stat().st_size
    if empty or _last_order(journal) > _last_order(tmp):
        logger.warning(
            "disk: %s: meta.json names journal.tmp, whose rename failed, and journal.log %s: "
            "journal.tmp not used (the keys of journal.log are misses)", path,
            "is empty (emptied, or new)" if empty else "holds records past it",
        )  # fmt: skip
        return
    os.replace(tmp, journal)
    sync_directory(journal)
    logger.info(
        "disk: %s: a crash cut the rewrite of its journal before its rename, after meta.json "
        "named it: rename done, nothing lost", path,
    )  # fmt: skip


def _generation(journal: Path) -> int | None:
    """The generation the header of file ``journal`` names (None: none, or no such file)."""
    try:
        with open(journal, "rb") as file:
            return read_header(file.read(8 + MAX_PAYLOAD))[1]
    except FileNotFoundError:
        return None


def _last_order(journal: Path) -> int:
    """The greatest order the records or header of file ``journal`` name (-1: none, or no such
    file)."""
    try:
        data = journal.read_bytes()
    except FileNotFoundError:
        return -1
    return parse(data, generation=read_header(data)[1]).last_seq


def _journal_format(path: Path) -> tuple[int, int | None]:
    """The format and generation of ``path``'s journal, by its header (format 2: none)."""
    journal = path / "journal.log"
    if not journal.exists() or not journal.stat().st_size:
        return FORMAT, 0  # a new directory (or its journal lost: logged by ``DiskDir``)
    generation = _generation(journal)
    return (2, None) if generation is None else (FORMAT, generation)


def damaged(path: Path) -> str:
    """What to do with a damaged header. Removing it is safe: recovery checks each block
    against its digest whatever the header says (other blocks are misses, never served)."""
    return (
        f"{path / 'meta.json'} is damaged: restore it, or remove it: the next start writes a new "
        f"one and keeps the blocks of {path} that still verify"
    )
