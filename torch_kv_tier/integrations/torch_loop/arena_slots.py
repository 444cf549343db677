"""The offloader's arena slots and the transfers that hold them: which are free, which a store
or read under way holds (and until when it is not overdue), and the offloads still pending.

:class:`ArenaSlots` lends a batch free slots (``_acquire``, waiting until its deadline), sizes
it to the room and the hosts' shares (``_batch_size``, :mod:`.host_shares`), and takes the
slots back once nothing can touch them: when a store's future resolved (``_started``), when a
read that its restore stopped waiting for ended (``_hold``), or at once (``_release``). It
counts the offloads still pending (``track``), which ``wait_idle`` (``PagedKVOffloader.flush``)
waits for.

A transfer's record owns its slots: whoever drops the record (under the lock) frees them, in
the same step, so they are freed once only. Each future's callback drops its own record
(``_ended``). Only a Ctrl-C (``KeyboardInterrupt``, which lands on the main thread only) can
keep a callback from being added, or stop one as it runs (a future resolved on the caller's
thread, inside the tier's call: a store's or load's, or a connect's, which resolves the futures
of transfers that ended meanwhile); each look at the records (``_settle``, whenever the state is
read) drops those that such a Ctrl-C may have left once their futures resolved, so that none
leaves a host overdue or a ``wait_idle`` waiting for something that ended. It looks at those
alone: a record whose ``_started`` was interrupted, and every record, once, after a Ctrl-C came
out of the tier's call (``interrupted``) and at each ``wait_idle``; looking at every record
under way at each look cost ~17 ms a look at 10,000 of them (three looks an offload).

No line is safe from a Ctrl-C, a second one in the handler of the first included, so a batch
that did not end normally leaves the next one to heal (:mod:`.arena_heal`).

The slots of a read that failed or timed out stay out until the tier no longer withholds them
(refuses loads into them and stores from them: ``TierManager.withheld_until``, ``_withhold``).

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
from collections import Counter
from collections.abc import Container
from concurrent.futures import Future, wait

from torch_kv_tier.integrations.torch_loop.host_shares import HostShares, fitting
from torch_kv_tier.integrations.torch_loop.page_copy import PageCopier
from torch_kv_tier.manager import TierManager
from torch_kv_tier.results import TransferResult
from torch_kv_tier.tier_threads import on_tier_thread, refused

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
        self._unsure: set[Future[TransferResult]] = set()  # records a callback may not drop
        self._rescan = False  # a Ctrl-C came out of the tier: look at every record once
        # Slots a transfer may use that no record owns, each with the future that frees it
        # (``None``: nothing does) (:mod:`.arena_heal`).
        self._kept: dict[int, Future[TransferResult] | None] = {}
        self._withheld: set[int] = set()  # failed reads' slots, until the tier accepts them
        self._unasked: list[int] = []  # those of them whose callback a Ctrl-C stopped

    def _started(
        self,
        future: Future[TransferResult],
        host: str | None,
        slots: list[int],
        due: float,
        *,
        store: bool = True,
        made: list[Future[TransferResult]] | None = None,
    ) -> None:
        """Hand ``slots`` back once ``future`` (a store to ``host``; not ``store``: a read
        from it) resolved; until then it is under way (a store also pending), overdue from
        ``due`` on. ``made`` (if given) gains ``future`` in the step that makes the record, so
        that a caller interrupted (Ctrl-C) before it can make the record another way, and
        one interrupted after it does not make a second (which would free the slots twice)."""
        # The record owns the slots from here on, unsure until its callback is added (a
        # Ctrl-C before that: the next look at the records frees them once the future
        # resolved). A Ctrl-C before it was made makes it on the way out (the transfer may use
        # the slots); not once made: the record may be settled, its slots freed, meanwhile.
        made = [] if made is None else made
        try:
            self._record(future, host, slots, due, store, made)
        except BaseException:
            if future not in made:
                self._record(future, host, slots, due, store, made)
            raise
        future.add_done_callback(self._ended)
        with self._lock:  # its callback drops it (or did, or was stopped: then it raised)
            self._unsure.discard(future)

    def _record(
        self,
        future: Future[TransferResult],
        host: str | None,
        slots: list[int],
        due: float,
        store: bool,
        made: list[Future[TransferResult]],
    ) -> None:
        """Record ``future`` as ``_started`` says, unsure; ``made`` gains it in the same step
        (no signal is checked between a Python function's return and a C call)."""
        with self._lock:
            self._unsure.add(future)  # first: a record is never made sure before its callback
            if store:
                self._pending.add(future)
            self._shares.started(future, host, slots, due)
            made.append(future)

    def track(self, offload: Future[TransferResult]) -> None:
        """Count ``offload`` as pending (``wait_idle`` waits for it) until it resolves."""
        with self._lock:
            self._pending.add(offload)
        offload.add_done_callback(self._ended)

    def wait_idle(self, deadline: float, call: str = "flush()") -> bool:
        """Wait until no store or offload is pending; ``False`` if ``deadline`` came first.
        Waits on the futures themselves, and looks at every record and pending future: a
        callback that never ran (Ctrl-C) cannot keep it waiting, nor keep a record after.
        ``RuntimeError`` (naming ``call``) instead of a wait on a tier's thread (only its
        callbacks end it: :mod:`torch_kv_tier.tier_threads`)."""
        while True:
            with self._lock:
                self._rescan = True
                self._settle()
                pending = list(self._pending)
            left = deadline - time.monotonic()
            if not pending or left <= 0:
                return not pending
            if on_tier_thread():
                raise refused(f"PagedKVOffloader.{call} with {len(pending)} offloads pending")
            wait(pending, timeout=left)

    def _hold(
        self,
        reads: dict[Future[TransferResult], tuple[str | None, list[int]]],
        unended: list[Future[TransferResult]],
        due: float,
        why: str,
        in_use: set[int],
        held: list[Future[TransferResult]],
    ) -> None:
        """Keep the slots of the ``unended`` of ``reads`` (future: host, slots) until each
        ends (at once for one that ended meanwhile), under way until ``due``, overdue from then
        on; ``why``: how the restore ended before them, for the log. Adds those slots to
        ``in_use`` first, so that a caller interrupted here (Ctrl-C) frees none of them, and
        each read to ``held`` in the step that makes its record: one recorded gets its slots
        back once it ended, its callback added or not (``_started``); the caller holds again
        those not in ``held`` (a second record of one would free its slots twice)."""
        in_use.update(slot for future in unended for slot in reads[future][1])
        for future in unended:  # the tier may still write into these slots
            host, slots = reads[future]
            self._started(future, host, slots, due, store=False, made=held)
            log.warning(
                "restore from %s %s; its reads hold %d arena slots until they end",
                host,
                why,
                len(slots),
            )

    def _batch_size(
        self, homes: list[str | None], several: bool, deadline: float
    ) -> tuple[int, bool]:
        """How many of the keys whose hosts are ``homes`` the next store or restore batch
        takes: those the slots of overdue hosts leave room for, each host's share less its
        transfers under way (with ``several`` hosts, half what others leave), up to the first
        key of an overdue host, waiting (until ``deadline``) while the first key's host has no
        share left (0: it is overdue, or had none by then); all of them once no room is left
        (they fail at once) unless the first key's host is overdue (0: the room is gone because
        it holds it). Returns that count and whether the first key's host was overdue at the
        look that decided it: the reason for a 0, which a later look may not tell (a store
        begun just after the deadline was set may turn overdue meanwhile)."""
        with self._lock:
            while True:
                self._settle()
                seen = time.monotonic()
                held, under_way = self._shares.overdue(seen), self._shares.under_way(seen)
                room = self._shares.room(self._manager.arena.num_free, under_way)
                late = homes[0] in held
                if not room:
                    return (0 if late else len(homes)), late
                share = functools.partial(
                    self._shares.share, room=room, under_way=under_way, several=several
                )
                if several:
                    n = fitting(homes[:room], share, held)
                else:  # the usual: one host (or none), no per-key pass
                    n = 0 if late else max(0, min(len(homes), share(homes[0])))
                if n or late or not self._wait(deadline, seen):
                    return n, late

    def _acquire(self, n: int, deadline: float, into: list[int]) -> bool:
        """Put ``n`` free slots in ``into`` (in the step that takes them from the arena, so that
        a caller interrupted as they are handed out, Ctrl-C, has them to ``_release``),
        waiting until ``deadline`` for them; ``False`` if none came, at once while restores
        that timed out hold too many for ``n`` ever to be free (a frozen host would otherwise
        cost the loop a whole timeout per call for as long as it is frozen)."""
        arena = self._manager.arena
        with self._lock:
            while True:
                self._settle()
                if arena.num_free >= n:
                    arena.allocate(n, into)
                    return True
                seen = time.monotonic()
                room = self._shares.room(arena.num_free, self._shares.under_way(seen))
                if n > room or not self._wait(deadline, seen):
                    return False

    def _wait(self, deadline: float, seen: float) -> bool:
        """Under the lock: wait until something changed (slots came back, a store or read
        ended) or a store under way turned overdue, at most until ``deadline``; ``False`` (at
        once) once it has passed, and after a wait that ``deadline`` ended, however late this
        thread woke (a busy machine): a store that turns overdue only after the deadline
        cannot then make the caller's next look tell another reason. ``True`` after one that
        something ended (notified), however late this thread woke: what ended in time (slots
        back) counts. ``seen``: the time the caller asked the overdue hosts for, so that a
        store that turned overdue since ends the wait at once. ``RuntimeError`` instead of a
        wait on a tier's thread (only its callbacks notify: :mod:`torch_kv_tier.tier_threads`)."""
        now = time.monotonic()
        if now >= deadline:
            return False
        if on_tier_thread():
            raise refused("PagedKVOffloader's wait for free arena slots (an offload or restore)")
        due = self._shares.next_due(seen)
        notified = self._changed.wait(min(deadline, due) - now)
        return notified or due < deadline or time.monotonic() < deadline

    def _room(self) -> int:
        """How many slots a batch may take (``HostShares.room``)."""
        with self._lock:
            self._settle()
            free = self._manager.arena.num_free
            return self._shares.room(free, self._shares.under_way(time.monotonic()))

    def _overdue(self) -> Counter[str | None]:
        """The slots overdue transfers hold now, by host (``HostShares.overdue``)."""
        with self._lock:
            self._settle()
            return self._shares.overdue()

    def _no_slots(self) -> str:
        """Why no slots came, for the log: those overdue hosts hold, those the tier withholds,
        and those kept after a Ctrl-C (:mod:`.arena_heal`)."""
        stuck, kept, late = self._overdue().total(), len(self._kept), len(self._withheld)
        why = (
            [f"{stuck} held by hosts past the timeout, until their transfers end"] if stuck else []
        )
        if late:
            why.append(f"{late} of reads that timed out, until their hosts report them")
        if kept:
            why.append(
                f"{kept} kept out, as a Ctrl-C stopped the tier's load that may still write "
                "them, until the tier reports its reads ended: if it never does, a new "
                "offloader (and tier) has them all"
            )
        return "no free arena slots within the timeout" + (f" ({'; '.join(why)})" if why else "")

    def _settle(self) -> None:
        """Under the lock: drop the records, and the pending futures, that resolved and that a
        Ctrl-C may have kept their callbacks from dropping (module docstring): the unsure
        ones, or all once ``_rescan``; free the slots those records owned (``HostShares``:
        once only; a Ctrl-C between loses them, never frees them twice), but those of failed
        reads: withheld, the tier asked at the next batch (``_begin``); wakes waiters if any
        ended."""
        if self._rescan:
            self._rescan = False
            resolved = [f for f in self._pending if f.done()]
            ended = self._shares.settled()  # (the unsure among them: dropped, not freed, later)
        else:
            resolved = [f for f in self._unsure if f.done()]
            self._unsure.difference_update(resolved)
            ended = [(future, self._shares.ended(future)) for future in resolved]
        freed: list[int] = []
        for future, slots in ended:
            read = slots and future not in self._pending and not future.result().ok
            (self._unasked if read else freed).extend(slots)
        self._withheld.update(self._unasked)
        self._pending.difference_update(resolved)
        self._hand_back(freed, bool(resolved))

    def _ended(self, future: Future[TransferResult]) -> None:
        """A transfer's or offload's done-callback: drop its own record and pending entry, as
        ``_settle`` would; it looks at no other (it runs once per transfer, on the tier's
        thread: looking at every transfer under way made ``n`` of them cost ``n * n`` looks
        there). Those whose callbacks a Ctrl-C stopped a later ``_settle`` drops."""
        with self._lock:
            pending = future in self._pending
            self._pending.discard(future)
            self._unsure.discard(future)
            freed = self._shares.ended(future)
            failed = bool(freed) and not pending and not future.result().ok  # a read's
            self._withheld.update(freed if failed else ())
            self._hand_back([] if failed else freed, pending)
        if failed:
            self._withhold(freed)

    def _withhold(self, slots: list[int]) -> None:
        """Hand ``slots`` of a failed read (in ``_withheld`` since the step that took them from
        their owner) back once the tier no longer withholds them (at once for most failures;
        for a timed-out read, once reported). Without this lock: the tier takes its own."""
        gate = self._manager.withheld_until(slots)  # (raising, they stay out: never reused)
        gate.add_done_callback(lambda _: self._unwithhold(slots))

    def _unwithhold(self, slots: list[int]) -> None:
        """The tier no longer withholds ``slots``: back to the arena; wakes waiters."""
        with self._lock:
            self._withheld.difference_update(slots)
            self._manager.arena.free_taken(slots)
            self._changed.notify_all()

    def _hand_back(self, freed: list[int], ended: bool) -> None:
        """Under the lock: free the slots of dropped records (``freed``) and wake waiters if
        any were, or a pending future ``ended``."""
        if freed:
            self._manager.arena.free(freed)
        if ended or freed:
            self._changed.notify_all()

    def _release(self, slots: list[int], keep: Container[int] = ()) -> None:
        """Return the arena slots of ``slots`` but ``keep`` that no record owns (none was sent,
        or its transfer cannot touch them any more); wakes waiters. Those already back are
        skipped (only the caller's thread takes slots), so a caller that a Ctrl-C
        (``KeyboardInterrupt``) stopped in it, or as it began, may call it again: none is
        freed twice."""
        with self._lock:
            self._manager.arena.free_taken(slots, keep)
            self._changed.notify_all()
