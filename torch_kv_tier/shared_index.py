"""``SharedIndex``: the part of ``index.BlockIndex`` that follows shared hosts: joining one (its
copy held in a dict or compact table), applying the host's index events to that copy, the keys
the host holds on its disk only, and finding the slots of a load when it is the only peer.

``SharedIndex`` is the base class of ``BlockIndex`` (which holds the tables: ``peers``,
``shared``, ``compact``); see the ``index`` module docstring for what the copy of a host is.

Threading: none; the owner (``TierManager``, under its lock) serialises every call.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from typing import TYPE_CHECKING, Literal

from torch_kv_tier.keys import Key
from torch_kv_tier.peer_slots import PeerSlots
from torch_kv_tier.remote.replica import Commits
from torch_kv_tier.slot_maps import CompactSlots, DictSlots, SharedSlots

COMPACT_AFTER_SLOTS = 1 << 20  # a dict copy of that many keys is ~150 MB
EventKind = Literal["stored", "evicted", "discarded", "lost"]

AnyPeer = PeerSlots | SharedSlots


class SharedIndex:
    """Shared-host behaviour of ``BlockIndex`` (module docstring)."""

    # The index's state this part uses (set by ``BlockIndex.__init__``).
    peers: dict[str, AnyPeer]
    shared: list[SharedSlots]
    compact: bool | None

    if TYPE_CHECKING:  # implemented by BlockIndex

        @property
        def events_enabled(self) -> bool: ...
        def _peers_changed(self) -> None: ...
        def _unheld(self, keys: Sequence[Key]) -> list[Key]: ...
        def _log(self, kind: EventKind, keys: list[Key], peer_id: str) -> None: ...

    def add_shared_peer(self, peer_id: str, capacity: int) -> SharedSlots:
        """A new shared host (its keys arrive with ``apply_host_changes``)."""
        if peer_id in self.peers:
            raise ValueError(f"peer {peer_id!r} is registered; remove it first")
        followed = capacity + sum(peer.capacity for peer in self.shared)
        compact = self.compact if self.compact is not None else followed > COMPACT_AFTER_SLOTS
        keep = self.events_enabled
        slot_map = CompactSlots(capacity, keep_keys=keep) if compact else DictSlots()
        disk = CompactSlots(1, keep_keys=keep) if compact else DictSlots()
        peer = SharedSlots(peer_id, capacity, slot_map, disk)
        self.peers[peer_id] = peer
        self.shared.append(peer)
        self._peers_changed()
        return peer

    def apply_host_changes(
        self,
        peer: SharedSlots,
        stored: list[Key],
        slots: list[int],
        digests: list[int],
        evicted: list[Key],
        reset: bool,
        sent: Commits = (),
    ) -> None:
        """A shared host's key set changed: ``stored`` keys now live in ``slots`` with
        ``digests`` (``reset``: they are all of it now, but for what this tier ``sent`` after
        the snapshot was taken: ``SharedSlots.reset``)."""
        logged = self.events_enabled
        if reset:
            kept = [*stored, *chain.from_iterable(keys for keys, _, _ in sent)] if logged else []
            was = list(set(peer.map.keys()).difference(kept)) if logged else []
            new = self._unheld(kept) if logged else []
            peer.reset(stored, slots, digests, sent)
        else:
            evicted = list(dict.fromkeys(evicted))
            was = [k for k, h in zip(evicted, peer.map.contains(evicted)) if h] if logged else []
            peer.forget(evicted)
            new = self._unheld(stored) if logged else []
            peer.learn(stored, slots, digests)
        self._log("evicted", self._unheld(was), peer.peer_id)
        self._log("stored", new, peer.peer_id)

    # -- keys on a host's disk ----------------------------------------------------------------

    def has_disk_keys(self) -> bool:
        """Whether a shared host announced keys it holds on its disk only."""
        return any(len(peer.disk) for peer in self.shared)

    def disk_holder(self, key: Key) -> SharedSlots | None:
        """The shared host holding ``key`` on its disk only; ``None``: none."""
        for peer in self.shared:
            if peer.disk.contains_one(key):
                return peer
        return None

    def on_disk(self, keys: Sequence[Key]) -> dict[SharedSlots, list[int]]:
        """The positions in ``keys`` of those held on a host's disk only, by host."""
        found: dict[SharedSlots, list[int]] = {}
        taken: set[int] = set()
        for peer in self.shared:
            if len(peer.disk):
                for i, has in enumerate(peer.disk.contains(keys)):
                    if has and i not in taken:
                        found.setdefault(peer, []).append(i)
                        taken.add(i)
        return found

    # -- loads --------------------------------------------------------------------------------

    @staticmethod
    def _locate_on(
        peer: SharedSlots, keys: Sequence[Key], local: Sequence[int]
    ) -> tuple[dict[AnyPeer, tuple[list, list, list, list]], list[Key]]:
        """``BlockIndex.locate`` when ``peer`` is the only peer."""
        slots = peer.map.slots(keys)
        if -1 not in slots:
            found, missing = (list(keys), list(local), slots), []
        else:
            hits = [i for i, s in enumerate(slots) if s >= 0]
            found = ([keys[i] for i in hits], [local[i] for i in hits], [slots[i] for i in hits])
            missing = [k for k, s in zip(keys, slots) if s < 0]
        if not found[0]:
            return {}, missing
        return {peer: (*found, peer.digests[found[2]].tolist())}, missing
