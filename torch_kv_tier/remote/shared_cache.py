"""``SharedCache``: the host-side index of a shared pool (which key lives in which slot).

Pure bookkeeping (no I/O, no clock): tested directly. Not thread-safe: the server guards it
with its state lock, like the ``LeaseTable`` whose ``SlotPool`` it draws its slots from (slots
a private lease holds are never touched here).

Model. Keys are namespaced (the config fingerprint of the sessions that store them): two models
never see each other's blocks. A slot is in exactly one state:

- *free*: drawn from the pool, not yet handed out;
- *granted* to one session: only that session may write it, nothing is published there;
- *stored*: holds a committed key of one namespace, with the digest of its bytes;
- *held*: granted to a session that ended without a clean disconnect, whose client may still
  write there: nobody else gets it until that client releases the session (``held_slots``).

A store is ``grant`` (a private batch of slots, ahead of time), a one-sided write by the client,
then ``commit`` with the bytes' digests: the key becomes visible, most recently used. A load is
a one-sided read of the slot the reader's copy of the index names, checked against the digest:
nothing here pins a slot, so a slot evicted and rewritten during a read costs that reader a
miss, never wrong bytes.

Capacity is one LRU over every stored slot, refreshed by ``touch``. When a grant needs slots
and none is free, the least recently used key is evicted; a namespace at its quota evicts its
own keys instead, so one tenant cannot take another's share (``shared_eviction``). Every change
is logged per namespace (``take_events``, batched by ``shared_events``) for the server to push
to the sessions.

Slots come from the server's ``SlotPool`` only as grants need them; a stored slot stays with the
shared cache (reused for shared keys), and the free ones go back to the pool when a private lease
asks for slots (``return_free``), so private leases get every slot the shared pool has not
filled. A slot is free only once nobody may write it (never a granted or held one).

A disk behind the pool (``attach_disk``, see ``disk_tier``): an evicted key whose disk copy is
complete stays known, *on disk* (announced in slot ``protocol.ON_DISK``) until the disk drops
it; a slot the disk is copying from is not evicted (the next least recently used key is). A
promotion takes slots like a grant, for the host itself (``take_for``), and publishes the key
like a commit (``promoted``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from torch_kv_tier.keys import Key
from torch_kv_tier.remote import shared_events, shared_snapshot
from torch_kv_tier.remote.held_slots import HeldSlots
from torch_kv_tier.remote.leases import SlotPool
from torch_kv_tier.remote.shared_events import DiskSide, EventBatch, Namespace
from torch_kv_tier.remote.shared_eviction import evict_from, evict_oldest
from torch_kv_tier.remote.shared_snapshot import Page, Snapshot
from torch_kv_tier.remote.slot_owners import SlotOwners


class SharedCache:
    """Slots of one host's pool shared by every session of a namespace (module docstring).

    ``quota`` caps the slots one namespace may use (stored plus granted; default: the whole
    pool); ``max_granted`` caps the slots one session may hold granted and uncommitted
    (default: a sixteenth of the pool, at most 4096), so that a session's reserve never evicts
    much of what others stored, and so that a session that ends uncleanly holds little.
    """

    def __init__(
        self, pool: SlotPool, *, quota: int | None = None, max_granted: int | None = None
    ) -> None:
        if quota is not None and quota <= 0:
            raise ValueError(f"namespace quota must be > 0 slots, got {quota}")
        if max_granted is not None and max_granted <= 0:
            raise ValueError(f"max granted slots must be > 0, got {max_granted}")
        self.pool = pool
        self.quota = pool.num_blocks if quota is None else quota
        self.max_granted = (
            max(1, min(4096, pool.num_blocks // 16)) if max_granted is None else max_granted
        )
        self.namespaces: dict[str, Namespace] = {}
        self.evictions = 0
        self.refused = 0  # slots committed by a session they were not granted to (ignored)
        # slots freed, or filled (evictable), by a commit, a promotion, a release...: a waiting
        # promotion may find one now (``disk_tier``)
        self.slot_changes = 0
        self.namespaces_made = 0  # namespaces made so far (the server freezes their entries)
        self._free: list[int] = []
        self._digests = [0] * pool.num_blocks  # slot -> digest of the key stored there
        self._lru: OrderedDict[tuple[str, Key], int] = OrderedDict()  # every stored key
        self._owners = SlotOwners(pool.num_blocks)  # slot -> its stored key (for snapshots)
        self._grants: dict[str, tuple[Namespace, set[int]]] = {}  # session -> its granted slots
        self.held: HeldSlots[list[int]] = HeldSlots()  # ended sessions' uncommitted grants
        self.disk: DiskSide | None = None
        self.seen: Callable[[str, Sequence[Key]], None] | None = None  # commits and touches

    def attach_disk(self, disk: DiskSide, seen: Callable[[str, Sequence[Key]], None]) -> None:
        """Put ``disk`` behind the pool; ``seen`` hears each commit's and touch's keys."""
        self.disk, self.seen = disk, seen

    # -- sessions -----------------------------------------------------------------------------

    def join(self, session_id: str, namespace: str) -> None:
        """A shared session of ``namespace`` starts."""
        ns = self.namespaces.get(namespace)
        if ns is None:
            ns = self.namespaces[namespace] = Namespace(namespace)
            self.namespaces_made += 1
        ns.sessions += 1
        self._grants[session_id] = (ns, set())

    def leave(self, session_id: str, now: float, *, clean: bool) -> None:
        """A session ended: its uncommitted grants are free again at once after a ``clean``
        disconnect (its client has no write in flight), else held until ``release``. A
        namespace with no session and no key left is forgotten."""
        entry = self._grants.pop(session_id, None)
        if entry is None:
            return
        ns, granted = entry
        ns.granted -= len(granted)
        ns.sessions -= 1
        if granted:
            if clean:
                self._free_again(granted)
            else:
                self.held.hold(session_id, list(granted), now)
        self._forget_if_unused(ns)

    def release(self, session_ids: Iterable[str]) -> int:
        """Ended sessions whose client reported every write resolved: their held slots are free
        again. Unknown ids are ignored (only the client knows a session's id). Returns the
        number of slots freed."""
        return self.held.release(session_ids, self._free_again)

    # -- stores -------------------------------------------------------------------------------

    def grant(self, session_id: str, want: int) -> list[int]:
        """Up to ``want`` slots only ``session_id`` may write: free ones, else the slots of
        evicted keys. Fewer, or none, when the session already holds ``max_granted``, the
        namespace is at its quota with nothing of its own to evict, or every slot is granted or
        held."""
        ns, granted = self._grants[session_id]
        slots = self.take_for(ns, min(want, self.max_granted - len(granted)))
        granted.update(slots)
        return slots

    def take_for(self, ns: Namespace, want: int) -> list[int]:
        """Up to ``want`` slots charged to ``ns`` as granted (a grant, or a promotion's)."""
        slots: list[int] = []
        while len(slots) < want:  # in runs: every key evicted below may be ns's own
            room = self.quota - ns.used - len(slots)  # slots ns may take beyond its own
            if room <= 0:
                run = evict_from(ns, self._lru, self._owners, self.disk, want - len(slots))
                self.evictions += len(run)
            else:
                n = min(want - len(slots), room)
                run = self._take_free(n)
                if not run:
                    run = evict_oldest(self._lru, self.namespaces, self._owners, self.disk, n)
                    self.evictions += len(run)
            if not run:
                break
            slots += run
        ns.granted += len(slots)
        # Ascending: a tier writes and reads a call's blocks in the order it was granted their
        # slots, and a run of adjacent slots is one transfer segment instead of one per block
        # (evicted keys' slots come in recency order, free ones in the order they were freed).
        slots.sort()
        return slots

    def promoted(self, ns: Namespace, key: Key, slot: int, digest: int) -> bool:
        """A promotion brought ``key`` into ``slot`` (taken with ``take_for``): publish it, as a
        commit does. A key stored meanwhile keeps that copy; the slot is free again."""
        ns.granted -= 1
        self.slot_changes += 1
        if key in ns.entries:
            self._free.append(slot)
            return False
        ns.entries[key] = slot
        self._digests[slot] = digest
        pair = (ns.name, key)
        self._lru[pair] = slot
        self._owners.record([slot], [pair])
        ns.stored.append(key)
        return True

    def unpromoted(self, ns: Namespace, slot: int) -> None:
        """A promotion into ``slot`` failed: the slot is free again."""
        ns.granted -= 1
        self.slot_changes += 1
        self._free.append(slot)

    def left_disk(self, namespace: str, key: Key) -> None:
        """The disk dropped ``key``: announce it evicted unless it is in DRAM."""
        ns = self.namespaces.get(namespace)
        if ns is not None and key not in ns.entries:
            ns.evicted.append(key)

    def oldest(self, n: int) -> list[tuple[str, Key, int]]:
        """The ``n`` least recently used stored keys, oldest first: (namespace, key, slot)."""
        out: list[tuple[str, Key, int]] = []
        for (name, key), slot in self._lru.items():
            if len(out) >= n:
                break
            out.append((name, key, slot))
        return out

    def digest_of(self, slot: int) -> int:
        return self._digests[slot]

    def return_free(self) -> int:
        """Give the free slots back to the pool (a private lease is about to draw from it: a
        free slot serves either); returns how many. Granted and held slots stay: their writer
        may still write them."""
        free = self._free
        self.pool.give_back_slots(free)
        self._free = []
        return len(free)

    def free_slots(self) -> int:
        """Slots a grant could take without evicting."""
        return len(self._free) + self.pool.free

    def commit(
        self, session_id: str, keys: Sequence[Key], slots: Sequence[int], digests: Sequence[int]
    ) -> int:
        """Publish ``keys``, written into granted ``slots`` with bytes of ``digests``; returns
        how many were published.

        A slot not granted to this session is ignored and counted in ``refused`` (a client's
        bug: its key stays unpublished, the slot whoever's it is). A key already stored keeps
        its first copy, the slot is free again, and the key is announced again so that the
        committer's copy of the index learns its slot. A key published whose disk copy holds
        other bytes (or unknown ones: digest 0) loses that copy: once this one left DRAM, the old
        one would come back.
        """
        entry = self._grants.get(session_id)
        if entry is None:
            return 0
        ns, granted = entry
        if self.seen is not None:
            self.seen(ns.name, keys)
        table, disk, lru, free = self._digests, self.disk, self._lru, self._free
        name, entries, stored = ns.name, ns.entries, ns.stored
        published: list[int] = []
        pairs: list[tuple[str, Key]] = []
        taken = 0
        for key, slot, digest in zip(keys, slots, digests):
            if slot not in granted:
                self.refused += 1
                continue
            granted.discard(slot)
            taken += 1
            stored.append(key)
            if key in entries:
                free.append(slot)
                continue
            entries[key] = slot
            table[slot] = digest
            pair = (name, key)
            lru[pair] = slot
            published.append(slot)
            pairs.append(pair)
            if disk is not None:
                old = disk.digest(ns.name, key)
                if old is not None and (old != digest or not digest):
                    disk.remove(name, key)
        ns.granted -= taken
        self.slot_changes += taken
        self._owners.record(published, pairs)
        return len(published)

    def touch(self, session_id: str, keys: Iterable[Key]) -> None:
        """Mark stored ``keys`` most recently used (unknown keys are ignored)."""
        ns, _ = self._grants[session_id]
        if self.seen is not None:
            keys = list(keys)
            self.seen(ns.name, keys)
        entries, lru = ns.entries, self._lru
        for key in keys:
            if key in entries:
                entries.move_to_end(key)
                lru.move_to_end((ns.name, key))

    # -- observation --------------------------------------------------------------------------

    def begin_snapshot(self, session_id: str) -> Snapshot:
        """A snapshot of the session's namespace, walked a part at a time (``snapshot_part``):
        its ``event_seq`` is the event sequence number it is current for (``shared_snapshot``:
        the events numbered after it bring every change made while it is walked)."""
        return shared_snapshot.begin(self._grants[session_id][0], self._owners, self.disk)

    def snapshot_part(self, snap: Snapshot) -> Page:
        """The stored keys, their slots and digests, in the next slots ``snap`` walks, a bounded
        part (``shared_snapshot.walk``; ``snap.done`` after the last part)."""
        return shared_snapshot.walk(snap, self._owners, self._digests, self.disk)

    def namespace_of(self, session_id: str) -> Namespace:
        return self._grants[session_id][0]

    def has_events(self) -> bool:
        """Whether a namespace stored or evicted a key since the last ``take_events``."""
        return any(ns.stored or ns.evicted for ns in self.namespaces.values())

    def take_events(self, max_keys: int) -> list[EventBatch]:
        """Changes since the last call, in numbered batches of final states
        (``shared_events.take_events``). A namespace whose sessions all left is forgotten here
        once its last key was evicted."""
        batches = shared_events.take_events(
            list(self.namespaces.values()), self._digests, self.disk, max_keys
        )
        for ns in list(self.namespaces.values()):
            self._forget_if_unused(ns)
        return batches

    @property
    def stored(self) -> int:
        return len(self._lru)

    @property
    def granted(self) -> int:
        """Slots granted and not committed yet: to sessions, and to promotions in flight."""
        return sum(ns.granted for ns in self.namespaces.values())

    # -- internals ----------------------------------------------------------------------------

    def _forget_if_unused(self, ns: Namespace) -> None:
        """Forget ``ns`` when no session, key or grant (a promotion's included) is left: a
        session that joins later starts it again, with what the disk holds of it."""
        if not ns.sessions and not ns.entries and not ns.granted:
            del self.namespaces[ns.name]

    def _free_again(self, slots: Iterable[int]) -> None:
        """Return ``slots`` to the free list, the lowest last: taken first, in ascending runs."""
        self.slot_changes += 1
        self._free.extend(sorted(slots, reverse=True))

    def _take_free(self, n: int) -> list[int]:
        """Up to ``n`` free slots, lowest first: ones freed here before, else drawn from the
        pool (only as many as the grant needs, so the rest stays available to private
        leases)."""
        free = self._free
        if not free:
            run = self.pool.take(n) if self.pool.free else None
            if run is None:
                return []
            self._free_again(run)
        taken = free[: -n - 1 : -1]
        if taken:
            del free[-len(taken) :]
        return taken
