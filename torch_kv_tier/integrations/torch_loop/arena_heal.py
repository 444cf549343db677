"""The offloader's heal after a Ctrl-C: every arena slot an interrupted batch left gets an owner
again, or comes back, none twice.

No line is safe from a Ctrl-C (``KeyboardInterrupt``, which lands on the main thread only), a
second one in the handler of the first included. So :class:`ArenaHeal` marks a batch open
(``_begin``) until it ends normally, and the next batch heals what one that did not left
(``_heal``, one pass over the records): the tier's store it was in is made again (``_rejoin``),
each of its reads under way without a record gets one, and each slot that no record owns and
that no transfer may use comes back, none twice; the slots of a load that a Ctrl-C stopped in
the tier after it began (``TierManager.load``'s ``begun``) stay out until its future resolves
(``_keep``: for good if it never does; a failed read's until the tier no longer withholds
them), those of one stopped before it began come back; those whose hand-back a Ctrl-C stopped
(``_unkeep``) are handed back again. A Ctrl-C out of one of the tier's calls (``interrupted``)
has the next batch heal too.

Threading: the caller's thread (the generation loop) only: ``_open``, ``_calling`` and
``_reads`` are its own; what the heal reads or changes of the records and the arena it does
under :class:`.arena_slots.ArenaSlots`' lock.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future

from torch_kv_tier.integrations.torch_loop.arena_slots import ArenaSlots
from torch_kv_tier.integrations.torch_loop.page_copy import PageCopier
from torch_kv_tier.keys import Key
from torch_kv_tier.manager import TierManager
from torch_kv_tier.results import TransferResult

__all__ = ["ArenaHeal"]

log = logging.getLogger(__name__)

# The tier's store or load a batch is in: host, keys, slots, and ``None`` for a store, for a
# load the list that gains its future once it began (``TierManager.load``'s ``begun``).
Calling = tuple[str | None, list[Key], list[int], list[Future[TransferResult]] | None]


class ArenaHeal(ArenaSlots):
    """:class:`.arena_slots.ArenaSlots` that heal, at the next batch, what a Ctrl-C left
    (module docstring); the base of ``ArenaBatches``. Built as ``ArenaSlots`` is."""

    def __init__(self, manager: TierManager, pages: PageCopier, timeout: float) -> None:
        super().__init__(manager, pages, timeout)
        # The caller's thread only (``_begin``): a batch began and has not ended normally;
        # the tier's store or load it is in (``Calling``); the reads it began (future: host,
        # slots).
        self._open = False
        self._calling: Calling | None = None
        self._reads: dict[Future[TransferResult], tuple[str | None, list[int]]] = {}

    def interrupted(self) -> None:
        """A ``KeyboardInterrupt`` came out of a call of the tier on this thread (a store, a
        load, a connect: any that resolves futures): it may have stopped the callbacks of
        futures the tier resolved there; the next look at the records looks at every one."""
        with self._lock:
            self._rescan = True
        self._open = True  # (the caller's thread) the next batch heals what it may have lost

    def _begin(self) -> None:
        """At the start of a batch (``store_all``, ``load_prefix``; the caller's thread): heal
        what the last one left if it did not end normally (any exception, or a Ctrl-C at any
        line, a second one in a handler too), or if slots are missing (a Ctrl-C in a
        done-callback that the tier ran on this thread outside a batch, as it handed a
        transfer's slots back; or in ``_unkeep``, which it ran there: ``_kept_ended``), then
        mark this one open until it ends; ask the tier about
        the failed reads' slots that ``_settle`` withheld (``_withhold``)."""
        if self._open or self._missing() or self._kept_ended():
            self._heal()
        self._open = True
        with self._lock:
            unasked, self._unasked = self._unasked, []
        if unasked:  # (a Ctrl-C before it: they stay out, never reused)
            self._withhold(unasked)

    def _missing(self) -> bool:
        """Whether fewer slots are free than the records and ``_kept`` leave (no batch open: a
        Ctrl-C lost some), from counts alone."""
        arena = self._manager.arena
        with self._lock:
            held = self._shares.held() + len(self._kept) + len(self._withheld)
            return arena.num_free + held < arena.num_blocks

    def _heal(self) -> None:
        """Give every slot an interrupted batch left an owner again, or back (``_begin``):
        the tier's store it was in is made again (``_rejoin``), the tier's load it was in keeps
        its slots until that load's future resolves, if it began (``_keep``: its reads ended;
        a record would make its host overdue, for good should the future never resolve), each
        of its reads under way without a record gets one (its slots back once it ended), the
        slots still kept for a future that resolved are handed back (``_kept_ended``); then
        every taken slot that no record owns and that is not kept comes back (``reclaim``:
        those a Ctrl-C lost in a handler, in the arena's allocator or in a done-callback, and
        those of a load stopped before it began).
        Interrupted itself, it leaves ``_open`` set: the next batch heals again."""
        due = time.monotonic() + self._timeout
        for future, (host, slots) in list(self._reads.items()):
            if not future.done() and not self._holds(future):
                self._started(future, host, slots, due, store=False)
        if self._calling is not None:
            host, keys, slots, begun = self._calling
            returned = any(slots is s for _, s in self._reads.values())  # (load's future known)
            if not returned and self._unowned(slots):
                if begun is None:
                    self._rejoin(host, keys, slots, due)
                elif begun:  # (none: it began no read, the slots are reclaimed below)
                    self._keep(slots, f"a load from {host} interrupted in the tier", begun[0])
            self._calling = None
        self._reads.clear()
        for read, kept in self._kept_ended().items():  # (their ``_unkeep`` stopped: made again)
            self._unkeep(kept, read)
        with self._lock:
            self._rescan = True
            self._settle()
            out = self._shares.owned() | self._kept.keys() | self._withheld
            lost = self._manager.arena.reclaim(out)
            self._hand_back([], bool(lost))
        if lost:
            log.warning("%d arena slots an interrupted batch lost are back", len(lost))

    def _holds(self, future: Future[TransferResult]) -> bool:
        with self._lock:
            return self._shares.holds(future)

    def _unowned(self, slots: list[int]) -> bool:
        """Whether ``slots`` are all taken and no record owns any: a store whose tier call a
        Ctrl-C stopped is made again then (``_rejoin``), a load's slots kept."""
        arena = self._manager.arena
        with self._lock:
            return not any(map(arena.is_free, slots)) and self._shares.owned().isdisjoint(slots)

    def _keep(
        self, slots: list[int], why: str, until: Future[TransferResult] | None = None
    ) -> None:
        """Keep ``slots`` out of the arena (``why``, logged): a transfer may use them. They come
        back once ``until`` resolved (a load's future: its reads ended; a failed read's once
        the tier no longer withholds them, ``_unkeep``), if ever; without it, never (nothing
        will report when that transfer ended). Kept again for the same future (a heal
        interrupted, made again), they come back once; a Ctrl-C in the callback: the next
        batch's heal makes it again (``_kept_ended``) or reclaims those it handed over."""
        with self._lock:
            self._kept.update(dict.fromkeys(slots, until))
        until_when = "until its reads end" if until else "for good"
        log.warning("%s keeps %d arena slots %s", why, len(slots), until_when)
        if until is not None:
            until.add_done_callback(lambda read: self._unkeep(slots, read))

    def _unkeep(self, slots: list[int], read: Future[TransferResult]) -> None:
        """``read``, which ``_keep`` kept ``slots`` for, resolved: those still kept for it come
        back (none twice); those of a failed read stay kept, for the tier's word that it no
        longer withholds them (``TierManager.withheld_until``, whose future resolves ok), and
        come back then. Stopped by a Ctrl-C (on the caller's thread: the future resolved in a
        tier's call there) at any line, the slots it had not handed over are still kept for a
        resolved future: the next batch's heal makes it again (``_kept_ended``), so none is
        freed while the tier withholds it, nor kept for good. A future that raised or was
        cancelled counts as a failed read's (the tier's futures resolve with results)."""
        ok = not read.cancelled() and read.exception() is None and read.result().ok
        if not ok:  # (asked again if a Ctrl-C comes before they are kept for it)
            gate = self._manager.withheld_until(slots)
            with self._lock:
                for slot in slots:
                    if self._kept.get(slot) is read:
                        self._kept[slot] = gate
            gate.add_done_callback(lambda ended: self._unkeep(slots, ended))
            return
        with self._lock:
            slots = [slot for slot in slots if self._kept.get(slot) is read]
            for slot in slots:
                del self._kept[slot]
            self._hand_back(slots, True)

    def _kept_ended(self) -> dict[Future[TransferResult], list[int]]:
        """The slots still kept for a future that resolved, by future: its ``_unkeep`` was
        stopped (a Ctrl-C) before it took them, or is about to take them (on the tier's
        thread: a second ``_unkeep`` takes none twice). Usually none kept: no cost."""
        ended: dict[Future[TransferResult], list[int]] = {}
        with self._lock:
            for slot, until in self._kept.items():
                if until is not None and until.done():
                    ended.setdefault(until, []).append(slot)
        return ended

    def _rejoin(self, host: str | None, keys: list[Key], slots: list[int], due: float) -> None:
        """The tier's store of ``keys`` from ``slots`` was interrupted before it returned its
        future: it may have sent any of them. The same store again returns a future that
        resolves once no transfer reads the slots (``TierManager.store``: a stored key succeeds
        at once, one in flight joins its store, the others are sent now), and the slots come
        back then. If the tier refuses it (closed), they stay out of the arena: whether a
        transfer still reads them cannot be told (logged). It names the store in ``_calling``
        (the caller clears it): a second interrupt here, in the tier's store too, leaves them
        to the next batch's ``_heal``, which makes the store again."""
        self._calling = host, keys, slots, None  # (the first may have come before it was set)
        try:
            future = self._manager.store(keys, slots)
        except Exception as exc:
            self._keep(slots, f"a store to {host} interrupted in the tier ({exc})")
            return
        self._started(future, host, slots, due)
