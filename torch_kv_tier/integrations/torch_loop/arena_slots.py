"""The offloader's arena slots and the transfers that hold them: which are free, which a store
or read under way holds (and until when it is not overdue), and the offloads still pending.

:class:`ArenaSlots` lends a batch free slots (``_acquire``, waiting until its deadline), sizes
it to the room and the hosts' shares (``_batch_size``, :mod:`.host_shares`), and takes the
slots back once nothing can touch them: when a store's future resolved (``_started``), when a
read that its restore stopped waiting for ended (``_hold``), or at once (``_release``). It
counts the offloads still pending (``track``), which ``wait_idle`` (``PagedKVOffloader.flush``)
waits for. A Ctrl-C (``KeyboardInterrupt``) between a transfer's record and its callback drops
the record: no host is left overdue, and no flush waits, for something that nothing ends.

Threading: ``self._changed`` (a condition on ``self._lock``) guards the arena's allocator, the
pending futures and the records of transfers under way, and wakes whoever waits for any of them;
the callbacks run on the tier's background thread (or the caller's, for a future resolved at
once).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from concurrent.futures import Future

from torch_kv_tier.integrations.torch_loop.host_shares import HostShares, fitting
from torch_kv_tier.integrations.torch_loop.page_copy import PageCopier
from torch_kv_tier.manager import TierManager
from torch_kv_tier.results import TransferResult

__all__ = ["ArenaSlots"]

log = logging.getLogger(__name__)


class ArenaSlots:
    """The arena slots of ``manager`` that batches take and the transfers that hold them
    (module docstring); the base of ``ArenaBatches``. ``timeout`` is the offloader's: how long
    a transfer may be under way before its host is overdue; named in the log lines."""

    def __init__(self, manager: TierManager, pages: PageCopier, timeout: float) -> None:
        self._manager = manager
        self._pages = pages
        self._timeout = timeout
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._pending: set[Future[TransferResult]] = set()
        self._shares = HostShares()  # the transfers under way, and which are past the timeout

    def _started(
        self,
        future: Future[TransferResult],
        host: str | None,
        slots: list[int],
        due: float,
        *,
        store: bool = True,
    ) -> None:
        """Hand ``slots`` back once ``future`` (a store to ``host``; not ``store``: a read
        from it) resolved; until then it is under way (a store also pending), overdue from
        ``due`` on."""
        # The record first, so that the slots are in the room until the callback returns
        # them (a future resolved meanwhile: at once, record and all). A Ctrl-C before the
        # callback is added drops the record (none is left that nothing ends: its host
        # overdue, ``wait_idle`` waiting, for good) and loses the slots, out of the room.
        try:
            with self._lock:
                if store:
                    self._pending.add(future)
                self._shares.started(future, host, len(slots), due)
            future.add_done_callback(functools.partial(self._release, slots))
        except BaseException:
            with self._lock:
                self._pending.discard(future)
                self._shares.ended(future)
            raise

    def track(self, offload: Future[TransferResult]) -> None:
        """Count ``offload`` as pending (``wait_idle`` waits for it) until it resolves."""
        try:  # a Ctrl-C before the callback was added: no pending offload that nothing ends
            with self._lock:
                self._pending.add(offload)
            offload.add_done_callback(self._retire)
        except BaseException:
            self._retire(offload)
            raise

    def wait_idle(self, deadline: float) -> bool:
        """Wait until no store or offload is pending; ``False`` if ``deadline`` came first."""
        with self._lock:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
        return True

    def _hold(
        self,
        reads: dict[Future[TransferResult], tuple[str | None, list[int]]],
        unended: list[Future[TransferResult]],
        due: float,
        why: str,
        in_use: set[int],
    ) -> None:
        """Keep the slots of the ``unended`` of ``reads`` (future: host, slots) until each
        ends (at once for one that ended meanwhile), under way until ``due``, overdue from then
        on; ``why``: how the restore ended before them, for the log. Adds those slots to
        ``in_use`` first, so that a caller interrupted here (Ctrl-C) frees none of them: a read
        whose callback was not added keeps its slots for good, and leaves no record that
        nothing ends (``_started``)."""
        in_use.update(slot for future in unended for slot in reads[future][1])
        for future in unended:  # the tier may still write into these slots
            host, slots = reads[future]
            self._started(future, host, slots, due, store=False)
            log.warning(
                "restore from %s %s; its reads hold %d arena slots until they end",
                host,
                why,
                len(slots),
            )

    def _batch_size(self, homes: list[str | None], several: bool, deadline: float) -> int:
        """How many of the keys whose hosts are ``homes`` the next store or restore batch
        takes: those the slots of overdue hosts leave room for, each host's share less its
        transfers under way (with ``several`` hosts, half what others leave), up to the first
        key of an overdue host, waiting (until ``deadline``) while the first key's host has no
        share left (0: it is overdue, or had none by then); all of them once no room is left
        (they fail at once)."""
        with self._lock:
            while True:
                seen = time.monotonic()
                held, under_way = self._shares.overdue(seen), self._shares.under_way(seen)
                room = self._shares.room(self._manager.arena.num_free, under_way)
                if not room:
                    return len(homes)
                share = functools.partial(
                    self._shares.share, room=room, under_way=under_way, several=several
                )
                if several:
                    n = fitting(homes[:room], share, held)
                else:  # the usual: one host (or none), no per-key pass
                    n = 0 if homes[0] in held else max(0, min(len(homes), share(homes[0])))
                if n or homes[0] in held or not self._wait(deadline, seen):
                    return n

    def _acquire(self, n: int, deadline: float) -> list[int] | None:
        """``n`` free slots, waiting until ``deadline`` for them; ``None`` if none came, at once
        while restores that timed out hold too many for ``n`` ever to be free (a frozen host
        would otherwise cost the loop a whole timeout per call for as long as it is frozen)."""
        arena = self._manager.arena
        with self._lock:
            while arena.num_free < n:
                seen = time.monotonic()
                room = self._shares.room(arena.num_free, self._shares.under_way(seen))
                if n > room or not self._wait(deadline, seen):
                    return None
            return arena.allocate(n)

    def _wait(self, deadline: float, seen: float) -> bool:
        """Under the lock: wait until something changed (slots came back, a store or read
        ended) or a store under way turned overdue, at most until ``deadline``; ``False`` (at
        once) once it has passed. ``seen``: the time the caller asked the overdue hosts for,
        so that a store that turned overdue since ends the wait at once."""
        now = time.monotonic()
        if now >= deadline:
            return False
        self._changed.wait(min(deadline, self._shares.next_due(seen)) - now)
        return True

    def _room(self) -> int:
        """How many slots a batch may take (``HostShares.room``)."""
        with self._lock:
            free = self._manager.arena.num_free
            return self._shares.room(free, self._shares.under_way(time.monotonic()))

    def _no_slots(self) -> str:
        with self._lock:
            stuck = self._shares.overdue().total()
        held = (
            f" ({stuck} held by hosts past the timeout, until their transfers end)" if stuck else ""
        )
        return f"no free arena slots within the timeout{held}"

    def _retire(self, offload: Future[TransferResult]) -> None:
        """Forget a resolved offload's future; wakes ``wait_idle``."""
        with self._lock:
            self._pending.discard(offload)
            self._changed.notify_all()

    def _release(self, slots: list[int], transfer: Future[TransferResult] | None = None) -> None:
        """Return arena slots (and retire the store or read that used them, at once: the
        slots are never out of the room meanwhile); wakes waiters. The record goes first: a
        Ctrl-C as a callback runs on the caller's thread loses the slots, never leaves a record
        that nothing ends (its host overdue, ``wait_idle`` waiting, for good)."""
        with self._lock:
            if transfer is not None:
                self._pending.discard(transfer)
                self._shares.ended(transfer)
            self._changed.notify_all()
            self._manager.arena.free(slots)
