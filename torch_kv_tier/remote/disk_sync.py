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

Threading: ``hand_over``, ``submit``, ``idle``, ``wait`` and ``close`` on the owner's thread;
jobs on the sync thread. A job that raises is logged, never raised (``DiskDir``'s own failures
are logged by it)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial

from torch_kv_tier.remote.disk_journal import DiskDir, Record

logger = logging.getLogger(__name__)

FSYNC_PERIOD_S = 1.0


class JournalSync:
    """One thread running batches of jobs on the journals of ``dirs`` (module docstring)."""

    def __init__(self, dirs: Sequence[DiskDir], name: str) -> None:
        self._dirs = dirs
        self._last_sync = time.monotonic()
        self._cond = threading.Condition()
        self._batch: Sequence[Callable[[], object]] | None = None  # handed over, not done
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def hand_over(
        self, live_keys: int, live_records: Callable[[int], list[Record]], *, force: bool
    ) -> None:
        """Hand the records appended over, unless a batch still runs: written, synced at most
        every ``FSYNC_PERIOD_S`` (always with ``force``); a journal past 4x the ``live_keys``
        rewritten with ``live_records(its index)`` (a stale one, whose write failed: at its
        ``retry_at``, or with ``force``)."""
        if not self.idle():
            return
        now = time.monotonic()
        sync = force or now - self._last_sync >= FSYNC_PERIOD_S
        jobs: list[Callable[[], object]] = []
        for f, d in enumerate(self._dirs):
            compact = d.records > 4 * live_keys + 4096
            if (force or now >= d.retry_at) if d.stale else compact:
                jobs += [partial(d.flush, *d.take_pending(), sync=False)]
                jobs += [partial(d.rewrite, live_records(f))]
            elif d.pending or sync:
                jobs.append(partial(d.flush, *d.take_pending(), sync=sync))
        if sync:
            self._last_sync = now
        if jobs:
            self.submit(jobs)

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
