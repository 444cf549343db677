"""The server's answers to shared-session messages, over a ``SharedCache``.

Turns the control messages of shared sessions (grants, commits, pins, touches, snapshots; see
``protocol``) into ``SharedCache`` calls, serves snapshots in pages, and batches the cache's
events into ``Events`` frames for every session of the namespace that changed.

Threading: as ``SharedCache``: the server calls it under its state lock, from its loop thread.
"""

from __future__ import annotations

from typing import Any

from torch_kv_tier.remote import protocol as p
from torch_kv_tier.remote.leases import Session, SlotPool
from torch_kv_tier.remote.shared_cache import SharedCache

SharedMessage = p.GrantRequest | p.Commit | p.PinRequest | p.Unpin | p.Touch | p.SnapshotRequest
SHARED_MESSAGES = (p.GrantRequest, p.Commit, p.PinRequest, p.Unpin, p.Touch, p.SnapshotRequest)
MAX_GRANT = 4096  # slots one grant may ask for


class SharedService:
    """Shared-session message handling for one server (module docstring)."""

    def __init__(
        self,
        pool: SlotPool,
        *,
        quota: int | None,
        max_granted: int | None,
        pin_ttl_s: float,
        quarantine_s: float,
    ) -> None:
        self.cache = SharedCache(
            pool,
            quota=quota,
            max_granted=max_granted,
            pin_ttl_s=pin_ttl_s,
            quarantine_s=quarantine_s,
        )
        self._snapshots: dict[str, tuple[list[Any], int]] = {}  # session -> keys, event seq

    def join(self, session: Session) -> None:
        self.cache.join(session.session_id, session.namespace)

    def leave(self, session: Session, now: float, *, clean: bool) -> None:
        self._snapshots.pop(session.session_id, None)
        self.cache.leave(session.session_id, now, clean=clean)

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
            if len(message.keys) == len(message.slots):
                cache.commit(sid, message.keys, message.slots)
            return None
        if isinstance(message, p.Touch):
            cache.touch(sid, message.keys)
            return None
        if isinstance(message, p.Unpin):
            cache.unpin(sid, message.pin_ids)
            return None
        if isinstance(message, p.GrantRequest):
            want = min(max(message.want, 0), MAX_GRANT)
            return p.Granted(message.seq, cache.grant(sid, want, now) if want else [])
        if isinstance(message, p.PinRequest):
            pin_id, slots = cache.pin(sid, message.keys, now)
            return p.Pinned(message.seq, pin_id, slots, cache.pin_ttl_s)
        return self._snapshot_page(sid, message)

    def _snapshot_page(self, sid: str, request: p.SnapshotRequest) -> p.SnapshotPage:
        if request.cursor <= 0 or sid not in self._snapshots:
            self._snapshots[sid] = self.cache.snapshot(sid)
            start = 0
        else:
            start = request.cursor
        keys, event_seq = self._snapshots[sid]
        stop = start + p.MAX_KEYS_PER_MESSAGE
        if stop >= len(keys):
            del self._snapshots[sid]
            stop = -1
        return p.SnapshotPage(
            request.seq, keys[start : stop if stop > 0 else None], event_seq, stop
        )

    def events(self, sessions: list[Session]) -> list[tuple[bytes, p.Events]]:
        """Frames to push for the changes since the last call: ``(identity, Events)``."""
        batches = self.cache.take_events(p.MAX_KEYS_PER_MESSAGE)
        if not batches:
            return []
        by_namespace: dict[str, list[bytes]] = {}
        for session in sessions:
            if session.shared:
                by_namespace.setdefault(session.namespace, []).append(session.identity)
        return [
            (identity, p.Events(0, seq, stored, evicted))
            for ns, seq, stored, evicted in batches
            for identity in by_namespace.get(ns.name, ())
        ]

    def stats(self) -> dict[str, Any]:
        cache = self.cache
        return {
            "shared_stored_blocks": cache.stored,
            "shared_granted_blocks": cache.granted,
            "shared_pinned_blocks": cache.pinned,
            "shared_quarantined_blocks": cache.quarantined,
            "shared_evictions": cache.evictions,
            "namespace_quota": cache.quota,
            "max_granted": cache.max_granted,
            "namespaces": {
                ns.name or "(none)": {"stored": len(ns.entries), "granted": ns.granted}
                for ns in cache.namespaces.values()
            },
        }
