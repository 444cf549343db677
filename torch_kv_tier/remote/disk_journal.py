"""One directory of a host's disk tier: its block file, header and journal (``disk_store``).

Files: ``blocks.dat`` (slot ``j`` at offset ``j * block_len``, allocated in full at start, opened
O_DIRECT where the file system allows it), ``meta.json`` (``disk_header``: written whole or not at
all, at start where there is none and at each rewrite of the journal: after the new journal is
synced, before its rename, so that a crash between the two is completed at the next start) and
``journal.log`` (one missing from a directory with a header is logged: its blocks are
forgotten). A ``blocks.dat`` removed or replaced under a running host is logged once, at a journal
sync (``_check_in_place``). The block file holds an exclusive ``flock`` while open (``disk_files``):
a second ``DiskDir`` on the directory (another host started on it, or ``--disk`` naming it twice
under two spellings), which would write over the first one's blocks and journal, waits
``LOCK_WAIT_S`` for it, then is refused.

Journal: one record per completed write (``PUT``: slot, namespace, key, digest) or removal
(``DEL``), each framed by its length and CRC-32, with its order (``disk_frames``: a record the
file system wrote twice, replayed after those that undid it, is damage, not a record), after a
header naming the journal's generation (``FORMAT`` 3), which ``meta.json`` names too: a journal
whose header names another (an older journal's blocks returned by the file system after a crash,
or a journal and ``meta.json`` of different times) is not used, its keys misses
(``disk_replay``). A directory of format 1 or 2 is read as such at start, then migrated as its
journal is rewritten. Appends are buffered, taken
by ``take_pending`` and written by ``flush`` (one ``os.write``, more after a short write);
``fsync`` runs at most once per ``disk_sync.FSYNC_PERIOD_S``, after an ``fdatasync`` of the block
file (a process crash loses nothing written, a power loss the records of the last period, never a
block a synced record names).
A write that fails (a full disk) marks the journal ``stale``: its owner rewrites it from its index,
and records are dropped meanwhile (a compaction that fails does not: the journal it would have
replaced is whole, and appended to as before). A journal that dropped a record is emptied
(``_dropped``): the record may be the ``DEL`` of a block still intact, whose key stored since with
other bytes would come back, old bytes that verify, at the next start; so a restart before the
rewrite finds none of that directory's blocks (misses), never a removed one (the emptied journal
keeps a header naming an order past its records: the restart numbers its own past them); one
that cannot be emptied (EIO) is removed, after ``meta.json`` names a generation past its records,
to the same end (``_remove``).
``read_records`` reads up to the first frame that does not read (``disk_replay``): a crash in
the middle of an append costs that record only; damage with records past it (a bad sector) costs
every record, for the same reason, and is logged with the keys it cost. ``rewrite`` replaces the
journal by the live records whole or not at all (temporary file, fsync, rename, fsync of the
directory).

Threading: owned by one ``DiskStore``: ``append``, ``take_pending`` and ``close`` on its thread,
``flush`` and ``rewrite`` on its journals' thread (``disk_sync``), never two at once; ``records``,
``stale`` and ``retry_at``, which they set, are read by the owner while neither runs.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from torch_kv_tier.keys import Key
from torch_kv_tier.remote import disk_header, disk_replay
from torch_kv_tier.remote.disk_files import (
    DiskError,
    allocate,
    lock,
    open_blocks,
    replaced,
    sync_directory,
    write_durably,
)
from torch_kv_tier.remote.disk_frames import Record, frame, header
from torch_kv_tier.remote.disk_header import FORMAT

logger = logging.getLogger(__name__)

REWRITE_RETRY_MAX_S = 60.0


class DiskDir:
    """The files of one ``--disk`` directory (module docstring). Raises ``DiskError`` for a
    path that cannot be written, a file system without room for ``nbytes``, or a directory
    made with another block length or size. ``direct=False`` never opens the block file O_DIRECT
    (for a pool not page-aligned, whose transfers O_DIRECT refuses)."""

    def __init__(self, path: Path, nbytes: int, block_len: int, *, direct: bool = True) -> None:
        self.path = path
        self.block_len = block_len
        self.slots = nbytes // block_len
        self.fd = self.journal = -1
        self.pending = bytearray()  # records appended, not yet taken (``take_pending``)
        self._pending_count = 0
        # the order of the next record framed: past every record of the journal read at start
        # (``read_records``) and of each journal since, so that bytes of an older journal found
        # in a newer one (a block of the file system written again) are out of order, damage
        self._seq = 0
        self.records = 0  # records in the journal file
        self.stale = False  # a write failed: to be rewritten (``DiskStore`` does, at retry_at)
        self.retry_at = 0.0  # monotonic time of the next rewrite of a stale journal
        self._retry_s = 0.0  # doubles with each failed rewrite, up to REWRITE_RETRY_MAX_S
        self._emptied = False  # stale, and emptied (or tried to) since (``_dropped``)
        # records dropped, the journal neither emptied nor removed (``_dropped``): a restart
        # before its rewrite may bring back keys removed since
        self.unsafe = False
        self._moved = False  # said that blocks.dat left its path (``_check_in_place``)
        self.dropped = 0  # keys a damaged journal cost (``read_records``)
        try:
            path.mkdir(parents=True, exist_ok=True)
            self.fd, self.direct = open_blocks(path / "blocks.dat", block_len, direct)
            lock(self.fd, path)
            # the format and generation ``meta.json`` names, read under the lock (a host that
            # held it as this one waited may have rewritten the journal): a directory of format 1
            # or 2 is migrated as its journal is rewritten (``rewrite``: at ``recover``)
            self._header = disk_header.read(path, block_len, self.slots)
            disk_header.roll_forward(path, self._header)  # a rewrite cut by a crash
            allocate(self.fd, path, self.slots * block_len)
            if not self._header.written:  # only once the blocks fit: a size refused is not kept
                disk_header.write(path, self._header, block_len, self.slots)
            journal = path / "journal.log"
            if self._header.written and not journal.exists():  # a directory used before
                logger.warning(
                    "disk: %s has no journal.log (deleted or moved away; or removed by the last "
                    "host, which logged it): the blocks it held are forgotten, misses; restore it "
                    "before starting to keep them", path,
                )  # fmt: skip
            self.journal = os.open(journal, os.O_RDWR | os.O_CREAT | os.O_APPEND)
        except BaseException as exc:
            self.close()
            if isinstance(exc, OSError) and not isinstance(exc, DiskError):
                why = exc.strerror or str(exc)
                raise DiskError(
                    f"cannot use {path} for the disk tier: {why}: pass --disk a directory this "
                    "host can create (its parent must exist) or one it made, and can write"
                ) from exc
            raise

    # -- journal --------------------------------------------------------------------------

    def append(self, op: int, slot: int, namespace: str, key: Key, digest: int) -> None:
        self.pending += frame((op, slot, namespace, key, digest), self._seq)
        self._seq += 1
        self._pending_count += 1

    def reserve(self, count: int) -> int:
        """The first of ``count`` orders kept for records framed elsewhere (a compaction's, in
        slot order: ``disk_sync``): past every record appended so far, before every record
        appended from now on."""
        first = self._seq
        self._seq += count
        return first

    def take_pending(self) -> tuple[bytes, int]:
        """The records appended since the last call, and their count: for ``flush``."""
        taken = bytes(self.pending), self._pending_count
        self.pending, self._pending_count = bytearray(), 0
        return taken

    def flush(self, data: bytes, count: int, *, sync: bool) -> None:
        """Write ``count`` records taken (``take_pending``); with ``sync``, ``fdatasync`` the
        block file (each block a record names was written before the record was appended), then
        ``fsync`` the journal.
        A write or sync that fails (a full disk, EIO) is logged, never raised: the journal is
        marked ``stale`` and emptied (``_dropped``); records are then dropped until ``rewrite``
        writes it afresh."""
        if self.stale:
            if data:
                self._dropped()
            return
        try:
            view = memoryview(data)
            while view:  # a short write is no error: write the rest
                view = view[os.write(self.journal, view) :]
            if sync:  # the blocks first: a record synced names a block synced
                os.fdatasync(self.fd)
                os.fsync(self.journal)
                self._check_in_place()
            self.records += count
        except OSError as exc:
            logger.warning("disk: journal of %s not written, rewritten later: %s", self.path, exc)
            self.stale = True
            self._dropped()

    def _check_in_place(self) -> None:
        """Say once (an error) that ``blocks.dat`` is no longer the file at its path (the
        directory removed or replaced under the host): its blocks are still served from the
        file open, but a restart, which opens the path, finds none of them."""
        if self._moved or not replaced(self.path / "blocks.dat", self.fd):
            return
        self._moved = True
        logger.error(
            "disk: %s/blocks.dat was removed or replaced under this host: the blocks it held are "
            "served from the deleted file (its space is freed when the host stops), but a restart "
            "finds none of them; restore the directory, or restart the host to start it afresh",
            self.path,
        )  # fmt: skip

    def _dropped(self) -> None:
        """Records were dropped (module docstring): empty the journal, once until it is
        rewritten; where it cannot be emptied, remove it (``_remove``). Failures are logged,
        never raised."""
        if self._emptied:
            return
        self._emptied = True
        try:
            os.ftruncate(self.journal, 0)
            self._past_orders()
            os.fsync(self.journal)
        except OSError as exc:
            self._remove(exc)
            return
        self.records = 0
        logger.warning(
            "disk: journal of %s emptied (a record could not be written): a restart before it "
            "is rewritten (a line says when) finds none of its blocks", self.path,
        )  # fmt: skip

    def _remove(self, exc: OSError) -> None:
        """The journal that dropped a record cannot be emptied (``exc``: EIO): remove it, so
        that a restart before the rewrite finds none of its blocks (a journal missing, logged
        then), never a key whose removal was dropped; first ``meta.json`` names a generation
        past every record framed (``_name_past_orders``). ``unsafe`` until the rewrite (logged)
        where the directory's sync fails (a power loss may undo both), or where the journal can
        be neither removed nor made another generation's: a restart may bring such keys back."""
        named = self._name_past_orders()
        journal = self.path / "journal.log"
        try:
            os.unlink(journal)
            removed: OSError | None = None
        except FileNotFoundError:
            removed = None
        except OSError as again:
            removed = again
        synced = sync_directory(journal)
        self.unsafe = not synced or (removed is not None and not named)
        if self.unsafe:
            logger.error(
                "disk: journal of %s lost a record and cannot be emptied (%s), nor %s: a restart "
                "before it is rewritten may bring back blocks removed since; check the device "
                "of %s", self.path, exc,
                f"removed ({removed})" if removed is not None else "its removal synced",
                self.path,
            )  # fmt: skip
            return
        self.records = 0
        logger.warning(
            "disk: journal of %s lost a record and cannot be emptied (%s): %s, so a restart "
            "before it is rewritten (a line says when) finds none of its blocks", self.path, exc,
            "removed instead" if removed is None
            else f"meta.json names another generation instead (not removed: {removed})",
        )  # fmt: skip

    def _name_past_orders(self) -> bool:
        """Have ``meta.json`` name a generation past every record framed, as the journal is
        removed (``_remove``): a restart numbers its new journal past the removed one's
        records, so one of them that the file system returns in it is out of order (damage),
        and the journal, should its removal not hold, is another generation's, unused. Whether
        written; a failure is logged."""
        new = disk_header.Header(FORMAT, self.reserve(1))
        try:
            disk_header.write(self.path, new, self.block_len, self.slots)
        except OSError as exc:
            self._unbounded("to be removed, but no meta.json naming a generation past it", exc)
            return False
        self._header = new  # the generation a failed rename names again (``_name_again``)
        return True

    def _past_orders(self) -> None:
        """Give the emptied journal a header naming an order past every record framed: a
        restart before the rewrite numbers its journal past it, so a record of this one found
        in the new one is out of order (damage). One not written is logged."""
        try:
            os.write(self.journal, header(self.reserve(1)))
        except OSError as exc:
            self._unbounded("emptied, but no header naming its last order", exc)

    def _unbounded(self, what: str, exc: OSError) -> None:
        """Log that ``what`` names no order past this journal's records: not written (``exc``)."""
        logger.warning(
            "disk: journal of %s %s written (%s): a restart before it is rewritten may read "
            "records of it, if the file system returns them in the next journal, as records of "
            "that one", self.path, what, exc,
        )  # fmt: skip

    def read_records(self) -> list[Record]:
        """The journal's records that a start uses (``disk_replay.read``, which logs what a cut
        tail, damage or another generation's journal cost); ``dropped`` counts the keys lost.
        Raises ``DiskError`` saying what to do where the file cannot be read (EIO)."""
        replay = disk_replay.read(self.path, self._header, self.slots)
        self._seq = max(self._seq, replay.next_seq)
        if replay.dropped is not None:
            self.dropped = replay.dropped
        return replay.records

    def live(self) -> dict[int, tuple[int, str, Key, int]]:
        """``disk_replay.live`` of the journal's records (``read_records``)."""
        return disk_replay.live(self.read_records(), self.slots)

    def rewrite(
        self,
        live: Iterable[Record],
        framed: Sequence[bytes] = (),
        framed_count: int = 0,
        *,
        generation: int | None = None,
        compaction: bool = False,
    ) -> bool:
        """Replace the journal by its header of ``generation`` (an order ``reserve``d before
        every record of ``framed``; by default the next record's), ``live`` (framed in order
        from the next record's on: before any ``append``), then the ``framed_count`` records
        framed in ``framed`` (``frames``, ``take_pending``: in order after them), with
        ``disk_files.write_durably``, after an ``fdatasync`` of the block file (the new journal
        names blocks written since the last ``flush``), ``meta.json`` naming ``generation``
        written after the new journal is synced, before its rename (a crash between the two:
        ``disk_header.roll_forward``); then append to the new journal (logged where it had been
        emptied). Returns False when either cannot be written (a full disk, EIO: logged, never
        raised): the old journal and ``meta.json`` stay as they were, and ``retry_at`` is 1 s
        later, then twice as late after each failure in a row (at most
        ``REWRITE_RETRY_MAX_S``). ``stale`` is then set, unless this is a ``compaction`` of a
        journal not stale: that journal, whole (each record written before the compaction was),
        is appended to as before."""
        generation = self.reserve(1) if generation is None else generation
        out = bytearray(header(generation))
        count = framed_count
        for record in live:
            out += frame(record, self._seq)
            self._seq += 1
            count += 1
        new, named = disk_header.Header(FORMAT, generation), False  # named: by meta.json

        def name_it() -> None:
            nonlocal named
            disk_header.write(self.path, new, self.block_len, self.slots)
            named = True

        try:
            os.fdatasync(self.fd)
            fd = write_durably(self.path / "journal.log", out, *framed, before_rename=name_it)
        except OSError as exc:
            if named:  # the rename failed: meta.json to name the journal in place again
                self._name_again(exc)
            # a full disk: a rewrite builds every record, so back off
            self._retry_s = min(REWRITE_RETRY_MAX_S, max(1.0, 2 * self._retry_s))
            self.retry_at = time.monotonic() + self._retry_s
            if compaction and not self.stale:
                logger.warning(
                    "disk: journal of %s not compacted (%s): appended to as before, compacted "
                    "again in %.0f s; free space on its file system", self.path, exc,
                    self._retry_s,
                )  # fmt: skip
                return False
            logger.warning("disk: journal of %s not rewritten: %s", self.path, exc)
            self.stale = True
            return False
        os.close(self.journal)
        self.journal = fd
        if self._header.format != FORMAT:
            logger.info("disk: %s migrated to disk format %d", self.path, FORMAT)
        self._header = new
        if self._emptied:
            logger.info(
                "disk: journal of %s rewritten (%d records): a restart finds its blocks again",
                self.path, count,
            )  # fmt: skip
        self.records, self.stale, self._retry_s, self._emptied = count, False, 0.0, False
        self.unsafe = False
        return True

    def _name_again(self, exc: OSError) -> None:
        """``meta.json`` names a journal whose rename failed (``exc``): name the journal in
        place again. Where that fails too (logged), a restart finds none of its blocks: the
        journal renamed is removed (``write_durably``), or, where it could not be, not renamed
        at start (``disk_header.roll_forward``) once this journal holds a record past it: the
        next record dropped empties it again (``_dropped``: a header past it)."""
        try:
            disk_header.write(self.path, self._header, self.block_len, self.slots)
        except OSError as again:
            self._emptied = False
            logger.error(
                "disk: journal of %s not renamed (%s) after meta.json named it, and meta.json "
                "cannot name the old one again (%s): a restart finds none of its blocks",
                self.path, exc, again,
            )  # fmt: skip

    def close(self) -> None:
        """Write what is pending, fsync, close both files. Idempotent."""
        if self.journal >= 0:
            self.flush(*self.take_pending(), sync=True)
        for fd in (self.fd, self.journal):
            if fd >= 0:
                os.close(fd)
        self.fd = self.journal = -1
