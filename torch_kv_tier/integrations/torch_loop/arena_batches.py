"""Batches of pages through the offloader's arena: their slots, their copies, their transfers.

An offload or restore larger than the arena goes in batches of at most the arena's size
(``store_all``, ``load_prefix``). For each, :class:`ArenaBatches` lends a batch free arena slots
(waiting for them until the caller's deadline), packs cache pages into them and hands them to the
tier's ``store``, or has the tier ``load`` into them and unpacks the loaded prefix into cache
pages (:mod:`.page_copy`). Its base :class:`.arena_slots.ArenaSlots` lends the slots, sizes the
batches and takes the slots back once nothing can touch them any more; between the two,
:class:`.arena_heal.ArenaHeal` heals at the next batch what a Ctrl-C left.

A host frozen past the timeout keeps the slots of its reads until it resumes (or dies), which
may be never, and those of its stores until its session is lost. So a batch reads from, and
stores to, each host separately (its slots of one host come back when that host's transfer
ended), takes at most a share of the arena from one host, and skips hosts that hold slots past
their timeout (:mod:`.host_shares`).

Threading: ``store_all``, ``load_prefix`` (and ``store``/``load``, of one batch) and
``wait_idle`` run on the offloader's caller thread (the generation loop); store completions run
on the tier's background thread and only return slots and retire futures (``ArenaSlots``, whose
lock guards the slots and the records of transfers under way).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, wait

from torch_kv_tier.integrations.torch_loop.arena_heal import ArenaHeal
from torch_kv_tier.integrations.torch_loop.host_shares import (
    OVERDUE,
    by_host,
    homes_among,
    keys_without,
)
from torch_kv_tier.integrations.torch_loop.offload_results import (
    Batch,
    OffloadError,
    fail_hosts,
    failed_now,
    partly_sent,
)
from torch_kv_tier.keys import Key
from torch_kv_tier.results import TransferResult
from torch_kv_tier.tier_threads import on_tier_thread, refused

__all__ = ["ArenaBatches"]

log = logging.getLogger(__name__)


class _CopyFailed(Exception):
    """A copy of loaded blocks into the cache failed (its ``__cause__``): the pages it was to
    write may be partly written (``load_prefix`` names them)."""


class ArenaBatches(ArenaHeal):
    """Stores and loads batches of pages through ``manager``'s arena (module docstring); must
    be the arena's only user. Built as :class:`.arena_slots.ArenaSlots` is; heals what a Ctrl-C
    left at the next batch (:class:`.arena_heal.ArenaHeal`)."""

    def store_all(self, todo: dict[Key, int], deadline: float) -> list[Batch]:
        """:meth:`store` ``todo`` (key: page, in order) in batches of at most the slots that
        overdue hosts leave, each taking at most its share from one host; the keys of an
        overdue host fail at once (:data:`.host_shares.OVERDUE`). The hosts are looked at for
        each batch (a host may join or leave as an offload waits). Each part's keys and future,
        for :func:`.offload_results.combine`. What stops it (a refusal to wait on a tier's
        thread, a failed copy) is raised as it is before it handed the tier any page, else as
        ``OffloadError`` naming the pages sent and those not sent or failed at once
        (:func:`.offload_results.partly_sent`)."""
        self._begin()
        keys, batches = list(todo), []
        try:
            peers: list[str] | None = None
            resized = False  # the next batch was sized again for hosts that changed: not twice
            while keys:
                if peers != (looked := self._manager.placing_peers()):  # at first, or they changed
                    peers, homes = looked, homes_among(keys, looked)
                held = self._overdue()
                if held and held.keys() & set(homes):  # no slot for a host that may not give back
                    batches.append(fail_hosts(keys, homes, held, OVERDUE))
                    keys, homes = keys_without(keys, homes, held)
                    continue
                n, late = self._batch_size(homes, len(peers) > 1, deadline)
                if not n:  # its first key's host is overdue, or its share was still held in time
                    why = OVERDUE if late else "capacity"
                    batches.append(fail_hosts(keys, homes, {homes[0]}, why))
                    keys, homes = keys_without(keys, homes, {homes[0]})
                    continue
                pages = [todo[k] for k in keys[:n]]
                stores = self.store(keys[:n], pages, homes[:n], deadline, peers, resize=not resized)
                if stores is None:  # the hosts changed as it waited for slots: sized again
                    resized = True
                    continue
                batches.extend(stores)
                keys, homes, resized = keys[n:], homes[n:], False
        except Exception as exc:  # (a refusal to wait on a tier thread, a failed copy)
            error = partly_sent(todo, batches, keys, exc)
            if error is None:  # none handed to the tier
                raise
            raise error from exc
        self._open = False
        return batches

    def load_prefix(self, keys: list[Key], pages: list[int], deadline: float) -> int:
        """:meth:`load` ``keys`` into ``pages`` in batches (module docstring) until one comes
        back short; how many leading pages came back. A failed copy into the cache raises
        ``OffloadError`` naming the pages written before it and those it may have partly
        written."""
        self._begin()
        restored = 0
        while restored < len(keys):
            holders = self._manager.holders(keys[restored : restored + max(1, self._room())])
            n, _ = self._batch_size(holders, len(self._manager.placing_peers()) > 1, deadline)
            if not n:
                log.info("restore stops at a key of %s, whose transfers hold its share", holders[0])
                break
            chunk, holders = keys[restored : restored + n], holders[:n]
            try:
                got = self.load(chunk, holders, pages[restored : restored + len(chunk)], deadline)
            except _CopyFailed as failed:  # (a refusal or a bug is raised as it is)
                exc = failed.__cause__
                raise OffloadError(
                    f"restore wrote {restored} of {len(keys)} stored pages (page_ids[0:{restored}]"
                    f"), then failed copying into page_ids[{restored}:{restored + len(chunk)}], "
                    f"which may be partly written: {exc!r}"
                ) from exc
            restored += got
            if got < len(chunk):
                break
        self._open = False
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
        every look cost one copy more, not a spin until the deadline), and a store whose
        future waits for one other host's transfers only (``placed``: a host that joined as
        the tier's store ran, or the host of a store in flight that its keys joined) as that
        host's; one that waits for several hosts' as its keys' home's (where the new keys
        went: a frozen host among the others makes that home overdue too, until its store
        ended; the frozen host's own earlier store counts as its own). A
        store's slots come back when it resolved (overdue once under way for the timeout:
        however late in its offload it started, a healthy host's store is not); the pages may
        change once this returns.
        Each store's keys and future, which fails every key with "capacity" when no slots came
        in time, or with the tier's refusal; a failed copy raises (its slots are back, nothing
        was sent), as does a ``KeyboardInterrupt`` before the first store, and one in the
        tier's store or between two hosts' stores (the slots of what it may have sent come back
        once that ended, those of the hosts not sent to at once), also as the arena hands the
        slots out (``_acquire``)."""
        slots: list[int] = []  # (``_acquire`` puts them here in the step that takes them)
        try:  # nothing is sent until the loop below: anything that raises first frees them
            if not self._acquire(len(keys), deadline, slots):
                return [(keys, failed_now(keys, "capacity", self._no_slots()))]
            self._pages.gather(pages, slots)  # (e.g. out of memory for the packed pages)
            now = self._manager.placing_peers()  # (Ctrl-C as it waits for the tier's lock)
            again = now != peers and resize and time.monotonic() < deadline
            if again:  # sized for other hosts
                self._release(slots)
                return None
            if now != peers:
                homes = homes_among(keys, now)  # as the tier places them now
            due = time.monotonic() + self._timeout
            stores: list[Batch] = []
            unsent = list(by_host(keys, homes, slots).items())  # parts whose slots are the batch's
            calling = None
        except BaseException:
            self._release(slots)
            raise
        try:
            while unsent:
                placed: list[str] = []  # where the tier sent them
                host, (host_keys, host_slots) = calling = unsent[0]
                self._calling = host, host_keys, host_slots, None  # (``_heal`` makes it again)
                try:
                    future = self._manager.store(host_keys, host_slots, placed)
                except Exception as exc:
                    self._calling = None
                    del unsent[0]  # (before they go: a Ctrl-C between loses them, not twice)
                    self._release(host_slots)
                    failed = failed_now(host_keys, str(exc), "tier refused a store")
                    stores.append((host_keys, failed))
                    continue
                host = placed[0] if len(placed) == 1 else host  # (a Ctrl-C here: _rejoin)
                self._started(future, host, host_slots, due)  # the record's slots
                self._calling = None
                del unsent[0]
                stores.append((host_keys, future))
        except BaseException:  # Ctrl-C: the other hosts' slots come back at once
            self.interrupted()
            if unsent and unsent[0] is calling:  # in or after the tier's store: it may have sent
                del unsent[0]
                if self._unowned(host_slots):  # else a record has them, or had: it ended
                    self._rejoin(host, host_keys, host_slots, due)
                self._calling = None
            self._release([slot for _, (_, slots) in unsent for slot in slots])
            raise
        return stores

    def load(
        self, keys: list[Key], holders: list[str | None], pages: list[int], deadline: float
    ) -> int:
        """Load ``keys`` (read from ``holders``, one load per host) into free slots and unpack
        the loaded prefix into ``pages``; returns its length (0 when ``deadline`` has passed:
        no read is started that could not be waited for, or no slots came by then). A host
        that refused, failed or did not answer by then ends the prefix at its first key; the
        slots of a read still under way are held until it ends (also when the wait for it is
        interrupted, a ``KeyboardInterrupt`` raised on; one inside the tier's load keeps that
        load's slots out of the room until its future resolves, the next batch frees them if
        it began no read, and frees the other hosts' unsent ones). A failed copy into the
        cache raises; its slots are back. The slots of a read that failed or timed out come
        back once the tier no longer withholds them (``_withhold``). On a tier's thread, reads
        still under way once begun raise ``RuntimeError`` instead of a wait (their slots held
        until they end, as on a Ctrl-C)."""
        if time.monotonic() >= deadline:  # its reads would be given up at once, held as overdue
            log.warning("restore out of its %.1f s timeout, recomputing the rest", self._timeout)
            return 0
        futures = self._reads  # (kept for ``_heal``: a second Ctrl-C may lose these locals)
        loaded: set[Key] = set()
        failed: dict[Key, str] = {}
        in_use: set[int] = set()  # slots a read may still write into: never freed here
        held: list[Future[TransferResult]] = []  # reads whose records own their slots (_hold)
        due = 0.0  # (set once the slots came; no read starts before)
        slots: list[int] = []  # (``_acquire`` puts them here in the step that takes them)
        try:  # from here on, a Ctrl-C frees every slot no read may still write
            if not self._acquire(len(keys), deadline, slots):
                log.warning("%s for a restore", self._no_slots())
                return 0
            due = time.monotonic() + self._timeout  # when a read still under way is overdue
            try:
                for host, (host_keys, host_slots) in by_host(keys, holders, slots).items():
                    begun: list[Future[TransferResult]] = []  # (its future: it may have begun)
                    self._calling = host, host_keys, host_slots, begun
                    futures[self._manager.load(host_keys, host_slots, begun)] = host, host_slots
                    self._calling = None
            except Exception as exc:  # the tier closed meanwhile: the reads submitted still end
                self._calling = None
                log.warning("tier refused a load, recomputing: %s", exc)
            if on_tier_thread() and not all(f.done() for f in futures):  # (held as on Ctrl-C)
                raise refused("PagedKVOffloader.restore() with its reads under way")
            done, late = wait(futures, timeout=max(0.0, deadline - time.monotonic()))
            self._hold(futures, list(late), due, "timed out, recomputing the rest", in_use, held)
        except (
            BaseException
        ) as exc:  # interrupted (Ctrl-C), refused: no read may land in a slot reused
            self.interrupted()
            if self._calling is not None:  # ``_heal`` keeps its slots until its reads end
                in_use.update(self._calling[2])
            unended = [f for f in futures if f not in held and not f.done()]
            stop = f"ended early by {type(exc).__name__} ({exc})"  # (a refusal on a tier thread)
            why = "was interrupted" if isinstance(exc, KeyboardInterrupt) else stop
            self._hold(futures, unended, due, why, in_use, held)
            self._release(slots, in_use)  # (a second Ctrl-C before it: ``_heal`` frees them)
            raise
        withheld: list[int] = []  # a failed read's slots: the tier may withhold them
        try:  # at once: a Ctrl-C between the two would keep every slot
            for future in done:
                try:
                    result = future.result()
                except Exception as exc:
                    log.warning("restore failed, recomputing: %s", exc)
                    continue
                loaded.update(result.keys)
                failed.update(result.failed)
                if not result.ok:
                    withheld.extend(futures[future][1])
            with self._lock:  # (one step: a Ctrl-C keeps them out, never frees them)
                self._withheld.update(withheld)
                in_use.update(withheld)
            count = next((i for i, key in enumerate(keys) if key not in loaded), len(keys))
            if count < len(keys) and keys[count] in failed:
                log.warning("restore stopped at page %d: %s", count, failed[keys[count]])
            try:
                self._pages.scatter(slots[:count], pages[:count])
            except Exception as exc:
                raise _CopyFailed from exc
        finally:  # a Ctrl-C too: the others' slots come back, the held reads' when they end
            try:
                self._release(slots, in_use)
            except BaseException:  # a Ctrl-C in it: once more (it skips those already back)
                self._release(slots, in_use)
                raise
            if withheld:  # back once the tier accepts them again (a failed copy too)
                self._withhold(withheld)
        futures.clear()  # (those under way are held: their records own their slots)
        return count
