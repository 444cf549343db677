"""Batches of pages through the offloader's arena: their slots, their copies, their transfers.

An offload or restore larger than the arena goes in batches of at most the arena's size
(``store_all``, ``load_prefix``). For each, :class:`ArenaBatches` lends a batch free arena slots
(waiting for them until the caller's deadline), packs cache pages into them and hands them to the
tier's ``store``, or has the tier ``load`` into them and unpacks the loaded prefix into cache
pages (:mod:`.page_copy`). A slot goes back to the arena once nothing can touch it any more:
after the copy out for a load, when the tier's future resolved for a store (or a load that timed
out or whose wait was interrupted, which may still land). It also counts the offloads still
pending, which ``PagedKVOffloader.flush`` waits for.

A host frozen past the timeout keeps the slots of its reads until it resumes (or dies), which
may be never. So a restore batch reads from each host separately, and a restore stops before
the first key of a host whose reads timed out until they end (``_overdue``). With more than one
host, a batch reads from one host at most half the slots that overdue reads leave (rounded
down, at least one; the cost: a longer prefix on one host goes in more round trips). So the
first frozen host holds at most half the arena, a second one half the rest, and so on: ``k``
frozen hosts leave the other hosts' offloads and restores at least ``arena >> k`` slots (none
once that is 0: a batch always takes one slot, so that small arenas work). Half the free slots
would make the cap depend on the stores in flight at the time; ``arena / (hosts + 1)`` would
cut every batch to a third of the arena with two hosts, frozen or not.

Threading: ``store_all``, ``load_prefix`` (and ``store``/``load``, of one batch) and
``wait_idle`` run on the offloader's caller thread (the generation loop); store completions run
on the tier's background thread and only return slots and retire futures. ``self._changed`` (a
condition on ``self._lock``) guards the arena's allocator and the set of pending futures (the
tier's store futures and the offloads ``PagedKVOffloader.offload`` returned), and wakes whoever
waits for either.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import Future, wait

from torch_kv_tier.integrations.torch_loop.offload_results import (
    Batch,
    OffloadError,
    failed_now,
)
from torch_kv_tier.integrations.torch_loop.page_copy import PageCopier
from torch_kv_tier.keys import Key
from torch_kv_tier.manager import TierManager
from torch_kv_tier.results import TransferResult

__all__ = ["ArenaBatches"]

log = logging.getLogger(__name__)


class ArenaBatches:
    """Stores and loads batches of pages through ``manager``'s arena (module docstring); must
    be the arena's only user. ``timeout`` is the offloader's, named in its log lines."""

    def __init__(self, manager: TierManager, pages: PageCopier, timeout: float) -> None:
        self._manager = manager
        self._pages = pages
        self._timeout = timeout
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._pending: set[Future[TransferResult]] = set()
        self._stuck = 0  # slots of restores that timed out, held until their reads end
        self._overdue: Counter[str | None] = Counter()  # those slots by host (peer id)

    def store_all(self, todo: dict[Key, int], deadline: float) -> list[Batch]:
        """:meth:`store` ``todo`` (key: page, in order) in batches of at most the slots that
        restores which timed out leave; each batch's keys and future, for
        :func:`.offload_results.combine`."""
        keys, batches, lo = list(todo), [], 0
        while lo < len(keys):
            chunk = keys[lo : lo + (self._room() or len(keys))]  # none left: all fail at once
            batches.append((chunk, self.store(chunk, [todo[k] for k in chunk], deadline)))
            lo += len(chunk)
        return batches

    def load_prefix(self, keys: list[Key], pages: list[int], deadline: float) -> int:
        """:meth:`load` ``keys`` into ``pages`` in batches (module docstring) until one comes
        back short; how many leading pages came back. A failed copy into the cache raises
        ``OffloadError`` naming the pages written before it and those it may have partly
        written."""
        restored = 0
        while restored < len(keys):
            holders = self._batch(keys[restored : restored + max(1, self._room())])
            chunk = keys[restored : restored + len(holders)]
            if not chunk:  # its next key is on a host whose reads are overdue
                break
            try:
                got = self.load(chunk, holders, pages[restored : restored + len(chunk)], deadline)
            except Exception as exc:  # copying into the cache failed part-way
                raise OffloadError(
                    f"restore wrote {restored} of {len(keys)} stored pages (page_ids[0:{restored}]"
                    f"), then failed copying into page_ids[{restored}:{restored + len(chunk)}], "
                    f"which may be partly written: {exc!r}"
                ) from exc
            restored += got
            if got < len(chunk):
                break
        return restored

    def store(self, keys: list[Key], pages: list[int], deadline: float) -> Future[TransferResult]:
        """Pack ``pages`` into free slots (waiting until ``deadline`` for them) and store them
        under ``keys``; the pages may change once this returns. The future fails every key
        with "capacity" when no slots came in time, or with the tier's refusal; a failed copy
        raises (its slots are back, nothing was sent)."""
        slots = self._acquire(len(keys), deadline)
        if slots is None:
            return failed_now(keys, "capacity", self._no_slots())
        try:
            self._pages.gather(pages, slots)
        except BaseException:  # e.g. out of memory for the packed pages: nothing was sent
            self._release(slots)
            raise
        try:
            future = self._manager.store(keys, slots)
        except Exception as exc:
            self._release(slots)
            return failed_now(keys, str(exc), "tier refused the store")
        with self._lock:
            self._pending.add(future)
        future.add_done_callback(lambda done: self._release(slots, done))
        return future

    def load(
        self, keys: list[Key], holders: list[str | None], pages: list[int], deadline: float
    ) -> int:
        """Load ``keys`` (read from ``holders``, one load per host) into free slots and unpack
        the loaded prefix into ``pages``; returns its length (0 when ``deadline`` has passed:
        no read is started that could not be waited for, or no slots came by then). A host
        that refused, failed or did not answer by then ends the prefix
        at its first key; the slots of a read still under way are held until it ends (also when
        the wait for it is interrupted, a ``KeyboardInterrupt`` raised on). A failed copy into
        the cache raises; its slots are back."""
        if time.monotonic() >= deadline:  # its reads would be given up at once, held as overdue
            log.warning("restore out of its %.1f s timeout, recomputing the rest", self._timeout)
            return 0
        slots = self._acquire(len(keys), deadline)
        if slots is None:
            log.warning("%s for a restore", self._no_slots())
            return 0
        futures: dict[Future[TransferResult], tuple[str | None, list[int]]] = {}
        loaded: set[Key] = set()
        failed: dict[Key, str] = {}
        try:
            for host, (host_keys, host_slots) in _by_host(keys, holders, slots).items():
                futures[self._manager.load(host_keys, host_slots)] = host, host_slots
        except Exception as exc:  # the tier closed meanwhile: the reads submitted still end
            log.warning("tier refused a load, recomputing: %s", exc)
        try:
            done, late = wait(futures, timeout=max(0.0, deadline - time.monotonic()))
        except BaseException:  # interrupted (Ctrl-C): no read may land in a slot reused
            in_use = self._hold(futures, [f for f in futures if not f.done()], "was interrupted")
            self._release([slot for slot in slots if slot not in in_use])
            raise
        in_use = self._hold(
            futures, late, f"timed out after {self._timeout:.1f} s, recomputing the rest"
        )
        for future in done:
            try:
                result = future.result()
            except Exception as exc:
                log.warning("restore failed, recomputing: %s", exc)
                continue
            loaded.update(result.keys)
            failed.update(result.failed)
        count = next((i for i, key in enumerate(keys) if key not in loaded), len(keys))
        if count < len(keys) and keys[count] in failed:
            log.warning("restore stopped at page %d: %s", count, failed[keys[count]])
        try:
            self._pages.scatter(slots[:count], pages[:count])
        finally:
            self._release([slot for slot in slots if slot not in in_use])
        return count

    def track(self, offload: Future[TransferResult]) -> None:
        """Count ``offload`` as pending (``wait_idle`` waits for it) until it resolves."""
        with self._lock:
            self._pending.add(offload)
        offload.add_done_callback(self._retire)

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
        unended: Iterable[Future[TransferResult]],
        why: str,
    ) -> set[int]:
        """Keep the slots of the ``unended`` of ``reads`` (future: host, slots) until each
        ends, as overdue (``_read_ended``; at once for one that ended meanwhile); returns those
        slots. ``why``: how the restore ended before them, for the log."""
        held: set[int] = set()
        for future in unended:  # the tier may still write into these slots
            host, slots = reads[future]
            with self._lock:
                self._stuck += len(slots)
                self._overdue[host] += len(slots)
            held.update(slots)
            future.add_done_callback(functools.partial(self._read_ended, host, slots))
            log.warning(
                "restore from %s %s; its reads hold %d arena slots until they end",
                host,
                why,
                len(slots),
            )
        return held

    def _batch(self, keys: list[Key]) -> list[str | None]:
        """The host of each leading key of ``keys`` the next restore batch reads: up to the
        first key of a host whose reads are overdue, or (with several hosts) one past half the
        slots that overdue reads leave (at least one) on one host."""
        holders = self._manager.holders(keys)
        several = len(self._manager.peers()) > 1
        with self._lock:
            overdue = set(self._overdue)
            room = self._manager.arena.num_blocks - self._stuck
        per_host = max(1, room // 2 if several else room)
        if not overdue and len(holders) <= per_host:  # the usual: nothing to cut, no per-key pass
            return holders
        counts: Counter[str | None] = Counter()
        for i, host in enumerate(holders):
            counts[host] += 1
            if host in overdue or counts[host] > per_host:
                if host in overdue:
                    log.info("restore stops at a key of %s, whose reads are overdue", host)
                return holders[:i]
        return holders

    def _acquire(self, n: int, deadline: float) -> list[int] | None:
        """``n`` free slots, waiting until ``deadline`` for them; ``None`` if none came, at once
        while restores that timed out hold too many for ``n`` ever to be free (a frozen host
        would otherwise cost the loop a whole timeout per call for as long as it is frozen)."""
        arena = self._manager.arena
        with self._lock:
            while arena.num_free < n:
                left = deadline - time.monotonic()
                if left <= 0 or n > arena.num_blocks - self._stuck:
                    return None
                self._changed.wait(left)
            return arena.allocate(n)

    def _room(self) -> int:
        """How many slots a batch may take: those restores that timed out do not hold."""
        with self._lock:
            return self._manager.arena.num_blocks - self._stuck

    def _no_slots(self) -> str:
        with self._lock:
            stuck = self._stuck
        held = f" ({stuck} held by restores that timed out, until their reads end)" if stuck else ""
        return f"no free arena slots within the timeout{held}"

    def _retire(self, offload: Future[TransferResult]) -> None:
        """Forget a resolved offload's future; wakes ``wait_idle``."""
        with self._lock:
            self._pending.discard(offload)
            self._changed.notify_all()

    def _read_ended(self, host: str | None, slots: list[int], _: object) -> None:
        """A timed-out restore's read from ``host`` into ``slots`` ended: they are free again."""
        with self._lock:
            self._stuck -= len(slots)
            self._overdue[host] -= len(slots)
            if not self._overdue[host]:
                del self._overdue[host]
        self._release(slots)

    def _release(self, slots: list[int], store: Future[TransferResult] | None = None) -> None:
        """Return arena slots (and retire the store that used them); wakes waiters."""
        with self._lock:
            self._manager.arena.free(slots)
            if store is not None:
                self._pending.discard(store)
            self._changed.notify_all()


def _by_host(
    keys: list[Key], holders: list[str | None], slots: list[int]
) -> dict[str | None, tuple[list[Key], list[int]]]:
    """``keys`` and their ``slots`` by the host each key is read from (``holders``)."""
    if len(set(holders)) == 1:  # the usual: one host, no per-key pass
        return {holders[0]: (keys, slots)}
    reads: dict[str | None, tuple[list[Key], list[int]]] = {}
    for key, host, slot in zip(keys, holders, slots, strict=True):
        host_keys, host_slots = reads.setdefault(host, ([], []))
        host_keys.append(key)
        host_slots.append(slot)
    return reads
