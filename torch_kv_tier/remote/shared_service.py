"""The server's answers to shared-session messages, over a ``SharedCache``.

Turns the control messages of shared sessions (grants, commits, touches, snapshots; see
``protocol``) into ``SharedCache`` calls, serves snapshots in pages, and batches the cache's
events into ``Events`` frames, each encoded once and sent as the same bytes to every session of
its namespace (the host's cost per key does not grow with the number of followers).

Threading: as ``SharedCache``: the server calls it under its state lock, from its loop thread.
"""

from __future__ import annotations

import logging
from typing import Any

from torch_kv_tier.remote import protocol as p
from torch_kv_tier.remote.disk_tier import DiskTier
from torch_kv_tier.remote.leases import Session, SlotPool
from torch_kv_tier.remote.shared_cache import SharedCache
from torch_kv_tier.remote.shared_snapshot import Snapshot

logger = logging.getLogger(__name__)

SharedMessage = p.GrantRequest | p.Commit | p.Touch | p.Promote | p.SnapshotRequest
SHARED_MESSAGES = (p.GrantRequest, p.Commit, p.Touch, p.Promote, p.SnapshotRequest)
MAX_GRANT = 4096  # slots one grant may ask for


class SharedService:
    """Shared-session message handling for one server (module docstring)."""

    def __init__(self, pool: SlotPool, *, quota: int | None, max_granted: int | None) -> None:
        self.cache = SharedCache(pool, quota=quota, max_granted=max_granted)
        self._snapshots: dict[str, Snapshot] = {}  # session -> its snapshot being walked
        self._refusers: set[str] = set()  # sessions told (logged) of slots they cannot commit
        self.disk: DiskTier | None = None  # the server's disk tier, if any

    def join(self, session: Session) -> None:
        self.cache.join(session.session_id, session.namespace)

    def leave(self, session: Session, now: float, *, clean: bool) -> None:
        self._snapshots.pop(session.session_id, None)
        self._refusers.discard(session.session_id)
        self.cache.leave(session.session_id, now, clean=clean)

    def event_seq(self, session: Session) -> int:
        """The last event batch pushed to ``session``'s namespace."""
        return self.cache.namespace_of(session.session_id).event_seq

    def answer(
        self, session: Session, message: SharedMessage, now: float
    ) -> p.ServerMessage | None:
        """The reply to ``message`` from ``session`` (``None`` for messages without one)."""
        sid, cache = session.session_id, self.cache
        if not session.shared:
            return p.Error(message.seq, "this session holds a private lease, not a shared one")
        keys = getattr(message, "keys", None)
        problem = None if keys is None else p.bad_keys(keys)
        if problem is not None:
            return p.Error(message.seq, problem)
        if isinstance(message, p.Commit):
            # msgpack ints reach 2**64 - 1 at most; a negative one is no digest, and every
            # follower of the namespace would fail to apply it, then its snapshots, for good
            if message.digests and min(message.digests) < 0:
                return p.Error(message.seq, "digests must be in [0, 2**64)")
            n_keys, n_slots, n_digests = map(len, (message.keys, message.slots, message.digests))
            if not n_keys == n_slots == n_digests:
                return p.Error(
                    message.seq,
                    f"a commit needs one slot and one digest per key, got {n_keys} keys, "
                    f"{n_slots} slots and {n_digests} digests",
                )
            # no such slot was granted: the whole commit is refused, as a bad digest's is
            num_blocks = cache.pool.num_blocks
            if message.slots and not 0 <= min(message.slots) <= max(message.slots) < num_blocks:
                return p.Error(message.seq, f"slots must be in [0, {num_blocks}) on this host")
            refused = cache.refused
            cache.commit(sid, message.keys, message.slots, message.digests)
            if cache.refused > refused:
                self._refused(session, cache.refused - refused)
            return None
        if isinstance(message, p.Touch):
            cache.touch(sid, message.keys)
            return None
        if isinstance(message, p.Promote):
            if self.disk is not None:
                self.disk.promote(cache.namespace_of(sid), message.keys, now)
            return None
        if isinstance(message, p.GrantRequest):
            if message.want < 0:
                return p.Error(message.seq, f"want must be >= 0 slots, got {message.want}")
            want = min(message.want, MAX_GRANT)
            return p.Granted(message.seq, cache.grant(sid, want) if want else [])
        return self._snapshot_page(sid, message)

    def _refused(self, session: Session, slots: int) -> None:
        """``session`` committed ``slots`` slots it holds no grant of: logged once per session
        (a commit has no answer to carry an error, and a client that keeps doing it must not
        flood the log); every one is counted (``commit_slots_refused``)."""
        if session.session_id in self._refusers:
            return
        self._refusers.add(session.session_id)
        logger.warning(
            "session %s (%s) committed %d slots it was not granted (never, or committed "
            "already): their keys were not published. A client bug: is it a torch_kv_tier of "
            "another version? Logged once per session; stats' commit_slots_refused counts all",
            session.public_id,
            session.client_name,
            slots,
        )

    def _snapshot_page(self, sid: str, request: p.SnapshotRequest) -> p.ServerMessage:
        """The page of the session's snapshot at ``request.cursor`` (0: a new snapshot), each a
        bounded part of the host's slots (``shared_snapshot``); the cursor is the slots walked."""
        snap = self._snapshots.get(sid)
        if request.cursor <= 0:
            snap = self._snapshots[sid] = self.cache.begin_snapshot(sid)
        elif snap is None or request.cursor != snap.walked:
            return p.Error(
                request.seq,
                f"no snapshot of this session is at cursor {request.cursor}: ask for a new one "
                "(cursor 0)",
            )
        keys, slots, digests = self.cache.snapshot_part(snap)
        if snap.done:
            del self._snapshots[sid]
        return p.SnapshotPage(
            request.seq, keys, slots, digests, snap.event_seq, -1 if snap.done else snap.walked
        )

    def events(self, sessions: list[Session]) -> list[tuple[list[Session], bytes]]:
        """Frames to push for the changes since the last call: ``(sessions, encoded Events)``."""
        batches = self.cache.take_events(p.MAX_KEYS_PER_MESSAGE)
        if not batches:
            return []
        by_namespace: dict[str, list[Session]] = {}
        for session in sessions:
            if session.shared:
                by_namespace.setdefault(session.namespace, []).append(session)
        return [
            (by_namespace[ns.name], p.encode(p.Events(0, seq, stored, slots, digests, evicted)))
            for ns, seq, stored, slots, digests, evicted in batches
            if ns.name in by_namespace
        ]

    def stats(self) -> dict[str, Any]:
        cache = self.cache
        return {
            "shared_stored_blocks": cache.stored,
            "shared_granted_blocks": cache.granted,
            "shared_held_blocks": cache.held.blocks,
            "shared_held_sessions": len(cache.held),
            "shared_evictions": cache.evictions,
            "commit_slots_refused": cache.refused,
            "namespace_quota": cache.quota,
            "max_granted": cache.max_granted,
            # by name as is ("": no fingerprint): any string is a fingerprint, so a label for
            # the empty one could be some tier's namespace too
            "namespaces": {
                ns.name: {"stored": len(ns.entries), "granted": ns.granted}
                for ns in cache.namespaces.values()
            },
            **(self.disk.stats() if self.disk is not None else {}),
        }
