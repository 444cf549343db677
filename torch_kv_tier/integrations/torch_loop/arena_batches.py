"""Batches of pages through the offloader's arena: their slots, their copies, their transfers.

An offload or restore larger than the arena goes in batches of at most the arena's size
(``store_all``, ``load_prefix``). For each, :class:`ArenaBatches` lends a batch free arena slots
(waiting for them until the caller's deadline), packs cache pages into them and hands them to the
tier's ``store``, or has the tier ``load`` into them and unpacks the loaded prefix into cache
pages (:mod:`.page_copy`). A slot goes back to the arena once nothing can touch it any more:
after the copy out for a load, when the tier's future resolved for a store (or a load that timed
out, which may still land). It also counts the offloads still pending, which
``PagedKVOffloader.flush`` waits for.

Threading: ``store_all``, ``load_prefix`` (and ``store``/``load``, of one batch) and
``wait_idle`` run on the offloader's caller thread (the generation loop); store completions run
on the tier's background thread and only return slots and retire futures. ``self._changed`` (a
condition on ``self._lock``) guards the arena's allocator and the set of pending futures (the
tier's store futures and the offloads ``PagedKVOffloader.offload`` returned), and wakes whoever
waits for either.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

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

    def store_all(self, todo: dict[Key, int], deadline: float) -> list[Batch]:
        """:meth:`store` ``todo`` (key: page, in order) in batches of at most the arena's size;
        each batch's keys and future, for :func:`.offload_results.combine`."""
        keys, size = list(todo), self._manager.arena.num_blocks
        batches = (keys[lo : lo + size] for lo in range(0, len(keys), size))
        return [(chunk, self.store(chunk, [todo[k] for k in chunk], deadline)) for chunk in batches]

    def load_prefix(self, keys: list[Key], pages: list[int], deadline: float) -> int:
        """:meth:`load` ``keys`` into ``pages`` in batches of at most the arena's size until one
        comes back short; how many leading pages came back. A failed copy into the cache raises
        ``OffloadError`` naming the pages written before it and those it may have partly
        written."""
        restored, size = 0, self._manager.arena.num_blocks
        while restored < len(keys):
            chunk = keys[restored : restored + size]
            try:
                got = self.load(chunk, pages[restored : restored + len(chunk)], deadline)
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

    def load(self, keys: list[Key], pages: list[int], deadline: float) -> int:
        """Load ``keys`` into free slots and unpack the loaded prefix into ``pages``; returns
        its length (0 when no slots came by ``deadline``, or the tier refused, failed or did not
        answer by then). A failed copy into the cache raises; its slots are back."""
        slots = self._acquire(len(keys), deadline)
        if slots is None:
            log.warning("%s for a restore", self._no_slots())
            return 0
        try:
            future = self._manager.load(keys, slots)
        except Exception as exc:
            self._release(slots)
            log.warning("tier refused a load, recomputing: %s", exc)
            return 0
        try:
            result = future.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            # The tier may still write into these slots: hand them back only once it is done.
            with self._lock:
                self._stuck += len(slots)
            future.add_done_callback(lambda _: self._release(slots, stuck=True))
            log.warning("restore timed out after %.1f s, recomputing the rest", self._timeout)
            return 0
        except Exception as exc:
            self._release(slots)
            log.warning("restore failed, recomputing: %s", exc)
            return 0
        loaded = set(result.keys)
        count = next((i for i, key in enumerate(keys) if key not in loaded), len(keys))
        if count < len(keys):
            log.warning("restore stopped at page %d: %s", count, result.failed.get(keys[count]))
        try:
            self._pages.scatter(slots[:count], pages[:count])
        finally:
            self._release(slots)
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

    def _release(
        self, slots: list[int], store: Future[TransferResult] | None = None, stuck: bool = False
    ) -> None:
        """Return arena slots (and retire the store that used them; ``stuck``: a timed-out
        restore's); wakes waiters."""
        with self._lock:
            self._manager.arena.free(slots)
            self._stuck -= len(slots) if stuck else 0
            if store is not None:
                self._pending.discard(store)
            self._changed.notify_all()
