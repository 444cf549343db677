"""Finishing a transfer, one method per operation: ``_finish_store`` publishes what a store
wrote (or returns or fences its slots), ``_finish_load`` verifies what a load read and unpins it,
and ``_settle`` settles the keys of the requests the op served.

``Finishes`` is a part of ``TierManager`` (the base class of ``transfers.Transfers``, which
calls ``_finish`` when the transport reported an op, or when it is abandoned with a reason).

Threading: every method runs with the manager's lock held; settled requests wait in ``_ready``
for ``Transfers._flush`` to resolve their futures unlocked.

Failure model: a store that failed (``TRANSFER_FAILED``) may still land part-way unless the
transport's failures are final (``DataTransport.failures_are_final``: the NIXL transport's are),
so its slots stay fenced for good and its peer's session unclean (``_lost_write``); any other
reason, or a final failure, returns its slots. A load whose blocks fail their digests settles
those keys "missing" and forgets them on that slot.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from torch_kv_tier.digest import BlockDigests
from torch_kv_tier.index import BlockIndex, drain
from torch_kv_tier.keys import Key
from torch_kv_tier.peer_slots import PeerSlots
from torch_kv_tier.records import Op, Peer, Request
from torch_kv_tier.results import MISSING, TRANSFER_FAILED, Counters
from torch_kv_tier.shared_host import SharedHost
from torch_kv_tier.transport.base import DataTransport

logger = logging.getLogger(__name__)


class Finishes:
    """Applying finished ops to the index (module docstring)."""

    # The manager's state this part uses (set by ``TierManager.__init__``).
    transport: DataTransport
    _index: BlockIndex
    _digests: BlockDigests
    _peers: dict[str, Peer]
    _storing: dict[Key, Op]
    _ready: list[Request]
    _block_len: int
    _counters: Counters

    if TYPE_CHECKING:  # implemented by SharedHosts

        def _refill(self, host: SharedHost) -> None: ...
        def _launch_awaiting(self, host: SharedHost) -> bool: ...

    def _finish(self, op: Op, reason: str | None) -> None:
        """Apply a finished (or abandoned) op to the index and settle its requests' keys."""
        peer = op.peer if self._peers.get(op.peer_id) is op.peer else None
        if op.kind == "store":
            self._finish_store(op, peer, reason)
        else:
            self._finish_load(op, peer, reason)

    def _finish_store(self, op: Op, peer: Peer | None, reason: str | None) -> None:
        storing = self._storing
        if not op.discarded:  # every key still maps to this op (only a discard unmaps one)
            drain(map(storing.pop, op.keys))
            keys, slots, digests = op.keys, op.remote, op.digests
            unused: list[int] = []
        else:
            keys, slots, digests, unused = [], [], [], []
            for key, slot, digest in zip(op.keys, op.remote, op.digests):
                if storing.get(key) is op:
                    del storing[key]
                if key in op.discarded:
                    unused.append(slot)
                else:
                    keys.append(key)
                    slots.append(slot)
                    digests.append(digest)
        if reason == TRANSFER_FAILED and not self.transport.failures_are_final:
            self._lost_write(op)  # its peer is dropped next, its waiting stores fail
        elif peer is not None:
            if reason is None:
                self._publish(peer, keys, slots, digests)
            else:
                unused = op.remote
            if unused:
                peer.return_slots(unused)
            if reason is None and unused and isinstance(peer, SharedHost) and peer.awaiting:
                self._launch_awaiting(peer)  # the slots of discarded keys, as a grant's
        if reason is None:
            n = len(op.keys)
            self._counters.blocks_stored += n
            op.owner.nbytes += n * self._block_len
            if peer is not None:
                peer.written += n * self._block_len
        self._settle(op, [], reason)

    def _lost_write(self, op: Op) -> None:
        """A write that failed may have sent part of its blocks, which can land any time (NIXL
        reports a failure while other parts are in flight, and a failed post frees what it sent
        without cancelling it): its slots stay fenced for good, and its session unclean."""
        logger.warning(
            "a write of %d blocks to %s failed: its slots stay fenced and its session is held "
            "(part of it may still land)",
            len(op.remote),
            op.peer_id,
        )
        self._index.fence(op.peer_id, op.remote)
        op.peer.lost_writes += 1

    def _publish(self, peer: Peer, keys: list[Key], slots: list[int], digests: list[int]) -> None:
        """Make written ``keys`` visible; a shared host learns them with a commit, which
        returns their slots from this tier's share of grants, so stores waiting for slots may
        ask again."""
        self._index.publish(peer.slots, keys, slots, digests)
        if keys and isinstance(peer, SharedHost):
            peer.commit(keys, slots, digests)
            if peer.awaiting:
                self._refill(peer)

    def _finish_load(self, op: Op, peer: Peer | None, reason: str | None) -> None:
        if peer is not None and isinstance(peer.slots, PeerSlots):
            peer.slots.unpin(op.remote)
        bad: list[Key] = []
        if reason is None:
            if op.peer.verifies:
                bad = self._digests.mismatched(op.local, op.keys, op.digests)
            if bad:
                self._counters.verify_failed += len(bad)
                logger.warning(
                    "%d of %d blocks read from %s do not hold their keys' bytes (rewritten or "
                    "torn meanwhile): reported missing",
                    len(bad),
                    len(op.keys),
                    op.peer_id,
                )
                if peer is not None:
                    slot_of = dict(zip(op.keys, op.remote))
                    self._index.discard_read(op.peer_id, bad, [slot_of[k] for k in bad])
            n = len(op.keys) - len(bad)
            self._counters.blocks_loaded += n
            op.owner.nbytes += n * self._block_len
            if peer is not None:
                peer.read += n * self._block_len
                if isinstance(peer, SharedHost):  # a key whose bytes failed is not kept warm
                    peer.touch(_without(op.keys, bad))
        self._settle(op, bad, reason)

    def _settle(self, op: Op, bad: list[Key], reason: str | None) -> None:
        """Settle ``op``'s keys with ``reason``, except ``bad`` ones, which are "missing";
        nothing for an op that settled when it outlived ``transfer_timeout_s`` (``overdue``)."""
        if op.expired:
            return
        if bad:
            op.owner.settle(_without(op.keys, bad), reason)
            op.owner.settle(bad, MISSING)
        else:
            op.owner.settle(op.keys, reason)
        self._ready_if_settled(op.owner)
        for request, keys in op.joined.items():
            request.settle(keys, reason)
            self._ready_if_settled(request)

    def _ready_if_settled(self, request: Request) -> None:
        if request.pending == 0 and not request.queued:
            request.queued = True
            self._ready.append(request)


def _without(keys: list[Key], bad: list[Key]) -> list[Key]:
    """``keys`` less ``bad`` ones, in order."""
    if not bad:
        return keys
    rejected = set(bad)
    return [k for k in keys if k not in rejected]
