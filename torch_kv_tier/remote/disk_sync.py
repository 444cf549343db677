"""``JournalSync``: the disk journals' writes, syncs and compactions (``DiskDir.flush`` and
``rewrite``) on a thread of their own, for ``disk_store.DiskStore``: a slow or hung device (an
``fsync`` that takes minutes, a stuck NFS mount) stalls that thread, never the host's loop and
its control plane (handshakes, heartbeats, stats).

``hand_over`` decides what each journal needs (its records appended written, a sync at most every
``FSYNC_PERIOD_S``, a compaction) and hands that over as one batch of jobs, unless the last batch
still runs: the records appended meanwhile wait in memory, handed over later. Jobs run in the order
given, batches in the order handed over, so a journal's records keep their order, and a job syncs
the block file before the records naming its blocks (``DiskDir.flush``): the crash consistency of
running them on the owner's thread.

A compaction (a journal past 4x the live keys, or a stale one) builds its live records, framed,
on the owner's thread ``COMPACT_SLOTS`` slots per ``hand_over``, never all at once (at millions
of keys that stalled the host's control plane for seconds), while every record appended since
it began is still written to the old journal and kept as its *tail* (those appended before, not
yet written, go to the old journal only: the index it builds holds their changes).
Its new journal is the records built, then that tail: a slot changed after the build read it has
a later record in the tail, and the last record of a slot wins (``DiskDir.live``), so it
recovers to the index as it is when the rewrite is handed over, as a compaction built at once
would. A crash before the rewrite finds the old journal, with every record as before.

Threading: ``hand_over``, ``compacting``, ``submit``, ``idle``, ``wait`` and ``close`` on the
owner's thread; jobs on the sync thread. A job that raises is logged, never raised (``DiskDir``'s
own failures are logged by it)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

from torch_kv_tier.remote.disk_frames import Record, frames
from torch_kv_tier.remote.disk_journal import DiskDir

logger = logging.getLogger(__name__)

FSYNC_PERIOD_S = 1.0
COMPACT_SLOTS = 2048  # slots a compaction builds per ``hand_over`` (a few ms)
LiveRecords = Callable[[int, int, int], list[Record]]  # directory, slots [start, stop)


@dataclass
class _Compaction:
    """A compaction being built (module docstring): the records of slots below ``next``, and
    its tail, ``count`` records in all, framed (``disk_frames.frames``): the journals' thread
    writes them with no million objects to free while it holds the GIL."""

    # its journal's generation (``DiskDir.reserve``d): slot ``j``'s record is of order
    # ``generation + 1 + j``, the tail's are past them
    generation: int
    # the records taken as it began: appended before it, so the index it builds holds them and
    # its tail does not (their orders are below its own); written to the old journal only
    fresh: bool = True
    next: int = 0
    built: list[bytes] = field(default_factory=list)
    tail: list[bytes] = field(default_factory=list)
    count: int = 0


class JournalSync:
    """One thread running batches of jobs on the journals of ``dirs`` (module docstring)."""

    def __init__(self, dirs: Sequence[DiskDir], name: str) -> None:
        self._dirs = dirs
        self._last_sync = time.monotonic()
        self._cond = threading.Condition()
        self._batch: Sequence[Callable[[], object]] | None = None  # handed over, not done
        self._closing = False
        self._compactions: dict[int, _Compaction] = {}  # directory -> compaction being built
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def hand_over(self, live_keys: int, live_records: LiveRecords, *, force: bool) -> None:
        """Begin the compactions due, unless a batch still runs: of a journal past 4x the
        ``live_keys`` (after its ``retry_at``, where one failed), or a stale one, whose write
        failed (at its ``retry_at``, or with ``force``).
        Build each compaction at most ``COMPACT_SLOTS`` slots further (to its end with
        ``force``): ``live_records(directory, start, stop)`` gives the live records of its
        slots ``[start, stop)``. Then, unless a batch still runs, hand the records appended
        over: written, synced at most every ``FSYNC_PERIOD_S`` (always with ``force``), and
        each compaction built as the rewrite of its journal."""
        idle, now = self.idle(), time.monotonic()
        for f, d in enumerate(self._dirs):  # what a batch sets is read only while none runs
            if d.stale:
                due = force or now >= d.retry_at
            else:  # a compaction that failed (``DiskDir.rewrite``) is tried again at retry_at
                due = d.records > 4 * live_keys + 4096 and now >= d.retry_at
            if idle and due and f not in self._compactions:
                # its tail: the records appended from now on, in order after those built
                self._compactions[f] = _Compaction(d.reserve(1 + d.slots))
        budget = None if force else COMPACT_SLOTS
        for f, c in self._compactions.items():
            stop = self._dirs[f].slots
            if budget is not None:
                stop = min(stop, c.next + budget)
                budget -= stop - c.next
            records = live_records(f, c.next, stop)
            c.built.append(frames(records, [c.generation + 1 + record[1] for record in records]))
            c.next, c.count = stop, c.count + len(records)
        if not idle:
            return
        sync = force or now - self._last_sync >= FSYNC_PERIOD_S
        jobs: list[Callable[[], object]] = []
        for f, d in enumerate(self._dirs):
            data, count = d.take_pending()
            if data or sync:
                jobs.append(partial(d.flush, data, count, sync=sync))
            building = self._compactions.get(f)
            if building is not None:
                if data and not building.fresh:
                    building.tail.append(data)
                    building.count += count
                building.fresh = False
                if building.next >= d.slots:
                    del self._compactions[f]
                    parts = building.built + building.tail
                    jobs.append(
                        partial(
                            d.rewrite, (), parts, building.count,
                            generation=building.generation, compaction=True,
                        )
                    )  # fmt: skip
        if sync:
            self._last_sync = now
        if jobs:
            self.submit(jobs)

    def compacting(self) -> bool:
        """Whether a compaction is being built (the owner then calls ``hand_over`` often)."""
        return bool(self._compactions)

    def submit(self, jobs: Sequence[Callable[[], object]]) -> bool:
        """Hand ``jobs`` over, unless a batch still runs (then False: nothing handed over)."""
        with self._cond:
            if self._batch is not None or self._closing:
                return False
            self._batch = jobs
            self._cond.notify_all()
            return True

    def idle(self) -> bool:
        """Whether no batch runs (what its jobs set may then be read)."""
        with self._cond:
            return self._batch is None

    def wait(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for the batch running; whether none runs."""
        with self._cond:
            return self._cond.wait_for(lambda: self._batch is None, max(0.0, timeout))

    def close(self, timeout: float) -> bool:
        """Stop the thread once its batch is done, waiting at most ``timeout`` seconds;
        whether it stopped (False: a job still hangs, the thread is left to it). Idempotent."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(max(0.0, timeout))
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._batch is not None or self._closing)
                batch = self._batch
            if batch is None:
                return
            for job in batch:
                try:
                    job()
                except Exception:
                    logger.exception("disk: a journal job failed")
            with self._cond:
                self._batch = None
                self._cond.notify_all()
