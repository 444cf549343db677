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
may be never, and those of its stores until its session is lost. So a batch reads from, and
stores to, each host separately (its slots of one host come back when that host's transfer
ended), takes at most a share of the arena from one host, and skips hosts that hold slots past
their timeout (:mod:`.host_shares`).

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
from concurrent.futures import Future, wait

from torch_kv_tier.integrations.torch_loop.host_shares import (
    OVERDUE,
    HostShares,
    by_host,
    fitting,
    homes_among,
    keys_without,
)
from torch_kv_tier.integrations.torch_loop.offload_results import (
    Batch,
    OffloadError,
    fail_hosts,
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
    be the arena's only user. ``timeout`` is the offloader's: how long a store may be under
    way before its host is overdue; named in the log lines."""

    def __init__(self, manager: TierManager, pages: PageCopier, timeout: float) -> None:
        self._manager = manager
        self._pages = pages
        self._timeout = timeout
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._pending: set[Future[TransferResult]] = set()
        self._shares = HostShares()  # the transfers under way, and which are past the timeout

    def store_all(self, todo: dict[Key, int], deadline: float) -> list[Batch]:
        """:meth:`store` ``todo`` (key: page, in order) in batches of at most the slots that
        overdue hosts leave, each taking at most its share from one host; the keys of an
        overdue host fail at once (:data:`.host_shares.OVERDUE`). The hosts are looked at for
        each batch (a host may join or leave as an offload waits). Each part's keys and future,
        for :func:`.offload_results.combine`."""
        keys, batches = list(todo), []
        peers: list[str] | None = None
        resized = False  # the next batch was sized again for hosts that changed: not twice
        while keys:
            if peers != (looked := self._manager.peers()):  # at first, or the hosts changed
                peers, homes = looked, homes_among(keys, looked)
            with self._lock:
                held = self._shares.overdue()
            if held and held.keys() & set(homes):  # no slot for a host that may not give it back
                batches.append(fail_hosts(keys, homes, held, OVERDUE))
                keys, homes = keys_without(keys, homes, held)
                continue
            n = self._batch_size(homes, len(peers) > 1, deadline)
            if not n:  # its first key's host is overdue, or its share was still held in time
                with self._lock:
                    late = homes[0] in self._shares.overdue()
                batches.append(fail_hosts(keys, homes, {homes[0]}, OVERDUE if late else "capacity"))
                keys, homes = keys_without(keys, homes, {homes[0]})
                continue
            pages = [todo[k] for k in keys[:n]]
            stores = self.store(keys[:n], pages, homes[:n], deadline, peers, resize=not resized)
            if stores is None:  # the hosts changed as it waited for slots: sized again
                resized = True
                continue
            batches.extend(stores)
            keys, homes, resized = keys[n:], homes[n:], False
        return batches

    def load_prefix(self, keys: list[Key], pages: list[int], deadline: float) -> int:
        """:meth:`load` ``keys`` into ``pages`` in batches (module docstring) until one comes
        back short; how many leading pages came back. A failed copy into the cache raises
        ``OffloadError`` naming the pages written before it and those it may have partly
        written."""
        restored = 0
        while restored < len(keys):
            holders = self._manager.holders(keys[restored : restored + max(1, self._room())])
            n = self._batch_size(holders, len(self._manager.peers()) > 1, deadline)
            if not n:
                log.info("restore stops at a key of %s, whose transfers hold its share", holders[0])
                break
            chunk, holders = keys[restored : restored + n], holders[:n]
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

    def store(
        self,
        keys: list[Key],
        pages: list[int],
        homes: list[str | None],
        deadline: float,
        peers: list[str],
        *,
        resize: bool = True,
    ) -> list[Batch] | None:
        """Pack ``pages`` into free slots (waiting until ``deadline`` for them) and store them
        under ``keys``, one store per host (``homes``: each key's among ``peers``). If the
        tier's hosts are others once the slots came and the pages were copied: ``None``,
        nothing sent and the slots back, when ``resize`` and before ``deadline`` (the batch
        was sized for them); else the batch is stored as sized, each key counted as its home's
        among the hosts now (a batch is sized again at most once, so hosts that change at
        every look cost one copy more, not a spin until the deadline). A store's slots come
        back when it resolved (overdue once under way for the timeout: however late in its
        offload it started, a healthy host's store is not); the pages may change once this
        returns.
        Each store's keys and future, which fails every key with "capacity" when no slots came
        in time, or with the tier's refusal; a failed copy raises (its slots are back, nothing
        was sent), and so does a ``KeyboardInterrupt`` in the tier's store (the slots of what it
        may have sent come back once that ended, the others at once)."""
        slots = self._acquire(len(keys), deadline)
        if slots is None:
            return [(keys, failed_now(keys, "capacity", self._no_slots()))]
        try:
            self._pages.gather(pages, slots)
        except BaseException:  # e.g. out of memory for the packed pages: nothing was sent
            self._release(slots)
            raise
        if (now := self._manager.peers()) != peers:
            if resize and time.monotonic() < deadline:
                self._release(slots)
                return None
            homes = homes_among(keys, now)  # as the tier places them now
        stores: list[Batch] = []
        due = time.monotonic() + self._timeout
        parts = list(by_host(keys, homes, slots).items())
        for i, (host, (host_keys, host_slots)) in enumerate(parts):
            try:
                future = self._manager.store(host_keys, host_slots)
            except Exception as exc:
                self._release(host_slots)
                stores.append((host_keys, failed_now(host_keys, str(exc), "tier refused a store")))
                continue
            except BaseException:  # Ctrl-C inside the tier's call: it may have sent some keys
                self._release([slot for _, (_, unsent) in parts[i + 1 :] for slot in unsent])
                self._rejoin(host, host_keys, host_slots, due)
                raise
            self._started(future, host, host_slots, due)
            stores.append((host_keys, future))
        return stores

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

    def _rejoin(self, host: str | None, keys: list[Key], slots: list[int], due: float) -> None:
        """The tier's store of ``keys`` from ``slots`` was interrupted before it returned its
        future: it may have sent any of them. The same store again returns a future that
        resolves once no transfer reads the slots (``TierManager.store``: a stored key succeeds
        at once, one in flight joins its store, the others are sent now), and the slots come
        back then. If the tier refuses it (closed), they stay out of the arena: whether a
        transfer still reads them cannot be told (logged). A second interrupt here loses them
        too."""
        try:
            future = self._manager.store(keys, slots)
        except Exception as exc:
            log.warning(
                "an interrupted store to %s keeps %d arena slots: %s", host, len(slots), exc
            )
            return
        self._started(future, host, slots, due)

    def load(
        self, keys: list[Key], holders: list[str | None], pages: list[int], deadline: float
    ) -> int:
        """Load ``keys`` (read from ``holders``, one load per host) into free slots and unpack
        the loaded prefix into ``pages``; returns its length (0 when ``deadline`` has passed:
        no read is started that could not be waited for, or no slots came by then). A host
        that refused, failed or did not answer by then ends the prefix
        at its first key; the slots of a read still under way are held until it ends (also when
        the wait for it is interrupted, a ``KeyboardInterrupt`` raised on; one inside the tier's
        load keeps that load's slots for good, out of the room, and frees the other hosts'
        unsent ones). A failed copy into the cache raises; its slots are back."""
        if time.monotonic() >= deadline:  # its reads would be given up at once, held as overdue
            log.warning("restore out of its %.1f s timeout, recomputing the rest", self._timeout)
            return 0
        slots = self._acquire(len(keys), deadline)
        if slots is None:
            log.warning("%s for a restore", self._no_slots())
            return 0
        futures: dict[Future[TransferResult], tuple[str | None, list[int]]] = {}
        due = time.monotonic() + self._timeout  # when a read still under way is overdue
        loaded: set[Key] = set()
        failed: dict[Key, str] = {}
        unsure: list[int] = []  # a read's slots as the tier's load, which may begin it, runs
        try:
            try:
                for host, (host_keys, host_slots) in by_host(keys, holders, slots).items():
                    unsure = host_slots
                    futures[self._manager.load(host_keys, host_slots)] = host, host_slots
                    unsure = []
            except Exception as exc:  # the tier closed meanwhile: the reads submitted still end
                unsure = []
                log.warning("tier refused a load, recomputing: %s", exc)
            done, late = wait(futures, timeout=max(0.0, deadline - time.monotonic()))
        except BaseException:  # interrupted (Ctrl-C): no read may land in a slot reused
            in_use = set(unsure)  # nothing will say when a read it may have begun ended
            try:
                unended = [f for f in futures if not f.done()]
                self._hold(futures, unended, due, "was interrupted", in_use)
            finally:
                if unsure:
                    log.warning("a load interrupted in the tier keeps %d arena slots", len(unsure))
                self._release([slot for slot in slots if slot not in in_use])
            raise
        in_use = set()
        try:
            self._hold(futures, list(late), due, "timed out, recomputing the rest", in_use)
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
            self._pages.scatter(slots[:count], pages[:count])
        finally:  # a Ctrl-C too: the others' slots come back, the held reads' when they end
            self._release([slot for slot in slots if slot not in in_use])
        return count

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
        slots are never out of the room meanwhile); wakes waiters."""
        with self._lock:
            self._manager.arena.free(slots)
            if transfer is not None:
                self._pending.discard(transfer)
                self._shares.ended(transfer)
            self._changed.notify_all()
