"""``DiskTier``: a shared pool's disk behind its DRAM (``serve --disk``): what goes to disk, when,
and promotions back.

Copies ahead of eviction. The disk writes a key's block while the key still lives in DRAM,
once the key is among the least recently used of a pool with few free slots (``step``), so an
eviction usually finds the copy complete: the key is then announced *on disk* (slot
``protocol.ON_DISK``) and its slot is reused at once. A slot being copied is not evicted (the
next least recently used key is). A key evicted with no copy is gone, as without a disk. Every write
goes from the pool's DRAM slot to the file through NIXL's POSIX backend (``DiskStore``): no byte
crosses Python. A disk whose writes fail (full, read-only, EIO) costs nothing it holds: the
copies back off while none is done (``_back_off_copies``: bounded, ended by a copy done), and a
directory whose last write failed loses no key for writes and takes only a probe now and then,
the others taking the copies (``DiskIndex.take_slot``; stat ``disk_writes_failing``).

Admission: a key is copied only once it was *seen* ``admit_after`` times (a commit, a second
commit of the same key by another engine, a load's recency report), counted in ``SeenCounts``,
a count-min sketch of its fingerprint that outlives the key's eviction and halves every
``AGE_EVERY`` sightings. The default, 2 ("seen twice", as Dynamo KVBM writes its SSD tier), keeps
blocks stored once and never read off the disk; ``--disk-admit 1`` copies every block.

Promotion. A tier that wants a key announced on disk sends ``Promote(keys)``; each loop turn
(``step``) takes the promotions asked since the last one, takes DRAM slots for them as a grant
would (``SharedCache.take_for``: free slots, else the least recently used keys), and posts one
read per disk file; reads of several turns overlap. A completed read publishes the key in its
new slot with the digest its block had when it was stored, as a commit does: a disk that
returned other bytes fails the reader's check, a miss, never a hit. A promotion that finds no
DRAM slot (its namespace at its quota, every slot granted, held or being copied) waits: it is
tried again once a slot may have come free (``_slot_mark``) or after ``PROMOTE_BACKOFF_S``,
not at every turn, for at most ``PROMOTE_RETRY_S``. A read the disk gave up
(stuck past ``DiskStore.request_timeout_s``) fails the promotion, and its slot is withheld
from the pool until the read ends: its bytes may still land there. Its key stays on disk, as
does that of a read refused meanwhile, so it stays announced on disk (a key announced evicted
that the disk still holds goes out as on disk: ``shared_events.take_events``) and is promoted
when asked again; the disk drops it if the read then ends failed, announced as it ends.

Threading: not thread-safe; the server's loop thread calls every method with its state lock
held, like ``SharedCache``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from torch_kv_tier.keys import Key, key_fingerprints
from torch_kv_tier.remote.shared_cache import SharedCache
from torch_kv_tier.remote.shared_events import Namespace

if TYPE_CHECKING:
    from torch_kv_tier.remote.disk_store import DiskStore

logger = logging.getLogger(__name__)

SPILL_BATCH = 256  # blocks one copy request writes at most
MAX_SPILLS_IN_FLIGHT = 4  # copy requests in flight at once
MIN_SPILL_WINDOW = 256  # least recently used keys the copies run ahead over, at least
COPY_SHARE = 8  # at most 1/8 of the pool's slots is being copied at once...
MIN_COPY_BUDGET = 16  # ...or this many
PROMOTE_RETRY_S = 5.0  # a promotion that finds no DRAM slot is tried again this long...
PROMOTE_BACKOFF_S = 0.05  # ...once a slot may have come free (``_slot_mark``), or this often
COPY_PERIOD_S = 0.002  # the copies ahead of eviction are looked for at most this often
COPY_IDLE_PERIOD_S = 0.05  # ...and after a look that found none, this often (``_copy_due``)
COPY_BACKOFF_S = 0.1  # copies that all failed are looked for again after this long...
COPY_BACKOFF_MAX_S = 10.0  # ...twice as long after each such poll in a row, at most this


class SeenCounts:
    """How often keys were seen lately: a count-min sketch of ``ROWS`` x 2**16 counters of one
    byte over the keys' 64-bit fingerprints (each row indexed by 16 other bits), saturating at
    15, every counter halved once ``AGE_EVERY`` sightings were added. 256 KiB whatever the key
    count; it overestimates (two keys sharing every counter), never underestimates before
    aging."""

    ROWS = 4
    AGE_EVERY = 1 << 20
    CAP = 15

    def __init__(self) -> None:
        self._table = np.zeros((self.ROWS, 1 << 16), dtype=np.uint8)
        self._added = 0

    @staticmethod
    def _columns(namespace: str, keys: Sequence[Key]) -> list[np.ndarray]:
        fps = key_fingerprints(keys) ^ np.uint64(xxhash.xxh3_64_intdigest(namespace.encode()))
        return [((fps >> np.uint64(16 * r)) & np.uint64(0xFFFF)).astype(np.intp) for r in range(4)]

    def add(self, namespace: str, keys: Sequence[Key]) -> None:
        if not keys:
            return
        for row, cols in zip(self._table, self._columns(namespace, keys)):
            row[cols] = np.minimum(row[cols] + 1, self.CAP)
        self._added += len(keys)
        if self._added >= self.AGE_EVERY:
            self._table >>= 1
            self._added = 0

    def counts(self, namespace: str, keys: Sequence[Key]) -> np.ndarray:
        """An upper bound of each key's recent sightings."""
        cols = self._columns(namespace, keys)
        return np.min([row[c] for row, c in zip(self._table, cols)], axis=0)


class DiskTier:
    """The disk behind one server's shared cache (module docstring)."""

    def __init__(self, cache: SharedCache, store: DiskStore, *, admit_after: int = 2) -> None:
        if admit_after < 1:
            raise ValueError(f"--disk-admit must be >= 1 sightings, got {admit_after}")
        self.cache = cache
        self.store = store
        self.admit_after = admit_after
        self.seen = SeenCounts()
        cache.attach_disk(store, self._seen)
        # promotions to start: (namespace name, key, when first asked); by name, so that one
        # asked by a session that left since is dropped with its namespace (``SharedCache.leave``)
        self._asked: list[tuple[str, Key, float]] = []
        # asked ones that found no DRAM slot: (namespace name, key) -> when first asked
        self._waiting: dict[tuple[str, Key], float] = {}
        self._retry: tuple[float, tuple[int, ...]] = (0.0, ())  # (backoff's end, _slot_mark())
        self._promoting: dict[tuple[str, Key], tuple[Namespace, int]] = {}  # -> (ns, slot)
        self._withheld: dict[int, tuple[Namespace, Key]] = {}  # reads given up, until they end
        self._next_copy = 0.0
        self._idle: tuple[float, int] | None = None  # a look found none: (until, _moves() then)
        self._sightings = 0  # keys committed or touched so far
        self._copies_failed = 0  # (``disk_copies``: those done)
        self._copy_backoff = (0.0, 0.0)  # copies failing: (no look before, seconds backed off)
        self.counters = dict.fromkeys(
            (
                "disk_promotions",
                "disk_promotions_failed",
                "disk_promotions_without_slot",
                "disk_promote_asked",
                "disk_copies",
            ),
            0,  # fmt: skip
        )

    def recover(self) -> int:
        """Find what the disk held (before the server takes sessions); returns the key count."""
        found = self.store.recover()
        logger.info("disk: %d blocks recovered and verified", len(found))
        return len(found)

    def _seen(self, namespace: str, keys: Sequence[Key]) -> None:
        self._sightings += len(keys)
        if self.admit_after > 1:
            self.seen.add(namespace, keys)

    def promote(self, ns: Namespace, keys: Sequence[Key], now: float) -> None:
        """A session asked for ``keys`` of ``ns`` (announced on disk) in DRAM: next ``step``."""
        self.counters["disk_promote_asked"] += len(keys)
        self._asked.extend((ns.name, key, now) for key in keys)

    def busy(self) -> bool:
        """Whether disk I/O is in flight, promotions were asked or a journal's compaction is
        being built (the loop then polls often). Promotions waiting for a DRAM slot are not
        (``retry_in``)."""
        return bool(self._asked) or self.store.in_flight() > 0 or self.store.compacting()

    def retry_in(self, now: float) -> float:
        """Seconds until promotions waiting for a DRAM slot are tried again at the latest
        (``math.inf`` if none wait): the loop steps by then. A step after a change that may
        have freed a slot (a commit, a release, an eviction...) tries them at once."""
        return max(0.0, self._retry[0] - now) if self._waiting else math.inf

    def step(self, now: float) -> None:
        """Collect completed disk I/O, start asked promotions (and those waiting for a slot,
        once one may have come free or after ``PROMOTE_BACKOFF_S``) and (at most every
        ``COPY_PERIOD_S``, see ``_copy_due``) the copies ahead of eviction."""
        self._collect(now)
        if self._waiting and (now >= self._retry[0] or self._slot_mark() != self._retry[1]):
            self._asked += [(name, key, since) for (name, key), since in self._waiting.items()]
            self._waiting.clear()
        if self._asked:
            self._start_promotions(now)
        due = now >= max(self._next_copy, self._copy_backoff[0]) and self._copy_due(now)
        if due and self.store.in_flight() < MAX_SPILLS_IN_FLIGHT:
            self._next_copy = now + COPY_PERIOD_S
            found_none = self._copy_ahead()
            self._idle = (now + COPY_IDLE_PERIOD_S, self._moves()) if found_none else None

    def _copy_due(self, now: float) -> bool:
        """Whether to look for copies ahead again. After a look over the window that found none
        (on disk already, or not admitted: most keys, with ``admit_after`` 2), only once as many
        keys as half the window were evicted or seen since (keys new to it come in as others
        leave it, evicted or used: they are looked at while the other half still stands between
        them and eviction), or after ``COPY_IDLE_PERIOD_S``: looking every ``COPY_PERIOD_S`` cost
        a busy host's loop most of its time (8192 keys at the default grant size, 3 ms)."""
        if self._idle is None:
            return True
        until, moves = self._idle
        return now >= until or self._moves() - moves >= self._window() // 2

    def _slot_mark(self) -> tuple[int, ...]:
        """Changes since which a promotion may find a DRAM slot it did not find before: slots
        freed or filled by the cache (a filled one may be evicted), keys evicted (a namespace
        at its quota), slots back in the pool, copies ended, done or failed (their slots
        evictable)."""
        cache, copies = self.cache, self.counters["disk_copies"] + self._copies_failed
        return (cache.slot_changes, cache.evictions, cache.pool.free, copies)

    def _moves(self) -> int:
        """Keys evicted, committed or touched so far (each may move a key into the window)."""
        return self.cache.evictions + self._sightings

    def _window(self) -> int:
        """The least recently used keys the copies run ahead over: never more than the pool
        holds. A window larger than the pool (``MIN_SPILL_WINDOW`` over a pool of 32 slots)
        let a look that found nothing wait for more keys moved than the pool holds, and the
        keys stored meanwhile were evicted with no copy (72 of 128 in ``test_disk_tier``)."""
        return min(self.cache.pool.num_blocks, max(MIN_SPILL_WINDOW, 2 * self.cache.max_granted))

    def _collect(self, now: float) -> None:
        done = self.store.poll()
        cache = self.cache
        self.counters["disk_copies"] += len(done.written)
        copies_failed = self._copies_failed
        for name, key, slot, digest in done.read:
            entry = self._promotion_ended(name, key, slot)
            if entry is not None:
                cache.promoted(entry[0], key, slot, digest)
                self.counters["disk_promotions"] += 1
        for name, key, slot in done.failed:
            entry = self._promotion_ended(name, key, slot)
            if entry is not None:
                cache.unpromoted(*entry)
                self.counters["disk_promotions_failed"] += 1
            else:  # a copy's: its DRAM slot is evictable again (``_slot_mark``)
                self._copies_failed += 1
            cache.left_disk(name, key)
        for name, key, slot in done.abandoned:  # its bytes may still land: not reused yet
            entry = self._promotion_ended(name, key, slot)  # (its key stays on disk)
            if entry is not None:
                self._withheld[slot] = (entry[0], key)
                self.counters["disk_promotions_failed"] += 1
        for slot in done.released:
            withheld = self._withheld.pop(slot, None)
            if withheld is not None:
                cache.unpromoted(withheld[0], slot)
                cache.left_disk(withheld[0].name, withheld[1])  # dropped if the read failed
        if done.written:
            self._copy_backoff = (0.0, 0.0)
        elif self._copies_failed > copies_failed:
            self._back_off_copies(now)

    def _promotion_ended(self, name: str, key: Key, slot: int) -> tuple[Namespace, int] | None:
        """The promotion of ``key`` whose read into DRAM ``slot`` ended, forgotten; ``None``
        when the I/O that ended is not its read: a copy of the same key (stored again with
        other bytes while its old copy was read), whose end leaves the read in flight and its
        slot granted."""
        entry = self._promoting.get((name, key))
        if entry is None or entry[1] != slot:
            return None
        return self._promoting.pop((name, key))

    def _back_off_copies(self, now: float) -> None:
        """Copies failed and none was done (a full or failing file system): look for copies
        again only after ``COPY_BACKOFF_S``, twice as long after each such poll in a row, at most
        ``COPY_BACKOFF_MAX_S`` (each look posts writes that fail; the store evicts no key of a
        failing directory for them, ``DiskIndex.take_slot``). A copy done ends the backoff."""
        seconds = min(COPY_BACKOFF_MAX_S, max(COPY_BACKOFF_S, 2 * self._copy_backoff[1]))
        self._copy_backoff = (now + seconds, seconds)

    def _start_promotions(self, now: float) -> None:
        """Promotions asked: those that find no DRAM slot (every slot granted, or being
        copied) wait to be tried again (``step``), for at most ``PROMOTE_RETRY_S``; those of a
        namespace forgotten meanwhile (no session left) are dropped; those of a key in a
        directory that hangs (``DiskStore.hung``: its read would be refused) fail at once,
        taking no DRAM slot: each evicted a key from DRAM for nothing while the device hung."""
        asked, self._asked = self._asked, []
        tried_all = not self._waiting  # else only new asks: the waiting ones keep their backoff
        store, promoting, namespaces = self.store, self._promoting, self.cache.namespaces
        wanted: dict[tuple[str, Key], tuple[Namespace, float]] = {}
        for name, key, since in asked:
            ns = namespaces.get(name)
            if ns is not None and key not in ns.entries and store.contains(name, key):
                wanted.setdefault((name, key), (ns, since))
        for pair in promoting.keys() & wanted.keys():
            del wanted[pair]
        for pair in [pair for pair in wanted if store.hung(*pair)]:
            del wanted[pair]
            self.counters["disk_promotions_failed"] += 1
        by_ns: dict[str, list[Key]] = {}
        for (name, key), _ in wanted.items():
            by_ns.setdefault(name, []).append(key)
        items: list[tuple[str, Key, int]] = []
        for name, keys in by_ns.items():
            ns = wanted[(name, keys[0])][0]
            slots = self.cache.take_for(ns, len(keys))
            for key, slot in zip(keys, slots):
                promoting[(name, key)] = (ns, slot)
                items.append((name, key, slot))
            for key in keys[len(slots) :]:
                since = wanted[(name, key)][1]
                if now - since < PROMOTE_RETRY_S:
                    self._waiting.setdefault((name, key), since)
                else:
                    self.counters["disk_promotions_without_slot"] += 1
        if tried_all:
            self._retry = (now + PROMOTE_BACKOFF_S, self._slot_mark())
        if items:
            for name, key in store.read(items):  # dropped by the disk meanwhile
                ns, slot = promoting.pop((name, key))
                self.cache.unpromoted(ns, slot)
                self.cache.left_disk(name, key)

    def _copy_ahead(self) -> bool:
        """Copy the least recently used keys that are admitted and not on disk yet, when the
        pool has fewer free slots than the window the copies run ahead over; whether it looked
        over the window and found none to copy."""
        cache, store = self.cache, self.store
        window = self._window()
        if cache.free_slots() >= window:
            return False
        # slots being copied cannot be evicted: keep most of the pool evictable (promotions'
        # reads alone may keep more than the share busy)
        share = max(MIN_COPY_BUDGET, cache.pool.num_blocks // COPY_SHARE)
        budget = min(SPILL_BATCH, share - len(store.busy_dram_slots()))
        if budget <= 0:
            return False
        oldest = [e for e in cache.oldest(window) if not store.contains(e[0], e[1])]
        if not oldest:
            return True
        if self.admit_after > 1:
            admitted: list[tuple[str, Key, int]] = []
            by_ns: dict[str, list[tuple[str, Key, int]]] = {}
            for entry in oldest:
                by_ns.setdefault(entry[0], []).append(entry)
            for name, entries in by_ns.items():
                counts = self.seen.counts(name, [e[1] for e in entries])
                admitted += [e for e, c in zip(entries, counts) if c >= self.admit_after]
            oldest = admitted
        items = [(name, key, cache.digest_of(slot), slot) for name, key, slot in oldest[:budget]]
        for name, key in store.write(items):
            cache.left_disk(name, key)
        return not items

    def stats(self) -> dict[str, Any]:
        return {**self.store.stats(), **self.counters, "disk_admit_after": self.admit_after}

    def close(self) -> None:
        self.store.close()
