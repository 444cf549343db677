"""The tier-owned regions of ``TierManager``'s peers: ``add_peer``'s and a private lease's
(``PrivateRegions._add_private``), registered with the transport, then published for
placement (see ``connected_hosts`` for the sessions these leases come with).

``PrivateRegions`` is a part of ``TierManager`` (the base class of ``ConnectedHosts``; its own
base ``lost_hosts.LostHosts`` stops dialling a host ``add_peer`` replaces and tells a join of
it under way not to publish it).

Threading: ``_add_private`` runs unlocked, taking the manager's lock for its table updates;
NIXL registrations never run under it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch_kv_tier.connections import CONNECT_TIMEOUT_S
from torch_kv_tier.lost_hosts import LostHosts
from torch_kv_tier.records import Peer
from torch_kv_tier.transport.base import check_peer_region

if TYPE_CHECKING:
    from torch_kv_tier.index import BlockIndex


class PrivateRegions(LostHosts):
    """Tier-owned regions of ``TierManager`` (module docstring)."""

    # The manager's state this part uses (set by ``TierManager.__init__``).
    _index: BlockIndex

    if TYPE_CHECKING:  # implemented by ConnectedHosts

        def _register(
            self, peer_id: str, meta: bytes, base: int, num_blocks: int, block_len: int
        ) -> None: ...

    def _add_private(
        self,
        peer_id: str,
        agent_metadata: bytes,
        base_addr: int,
        num_blocks: int,
        block_len: int,
        slots: range | None,
        session: Any,
    ) -> None:
        """Register a tier-owned region (``add_peer``, or a private lease's ``session``)
        (unlocked). A registration of ``peer_id`` it replaces is dropped first; its session
        ends as a lost one's does (``_flush_then_end``). ``add_peer`` over a connected
        host (or one lost and dialled again) stops dialling it, as ``remove_peer`` does; its
        ended sessions are still released. ``add_peer`` of a host joining (never published
        then) registers once that join ended, so that it lets go of its own region only
        (``TimeoutError`` past ``CONNECT_TIMEOUT_S``). A lease whose host the user removed as
        it registered is not published (``ConnectionError``, ``_stopped_join``)."""
        # bad input raises before the old registration and its keys are dropped
        check_peer_region(peer_id, base_addr, num_blocks, block_len, self.transport.block_len, 0)
        slots = range(num_blocks) if slots is None else slots
        if slots.step != 1 or not slots or slots.start < 0 or slots.stop > num_blocks:
            raise ValueError(
                f"slots {slots!r} must be a non-empty step-1 range in [0, {num_blocks})"
            )
        old: tuple[Any, bool] = (None, True)
        with self._lock:
            self._check_open()
            dial = None if session is not None else self._stop_dialling(peer_id)
            joining = None if session is not None else self._joining.get(peer_id)
            if peer_id in self._peers:
                old = self._drop_to_end(peer_id)
        self._flush_then_end(*old)
        if dial is not None:
            with self._lock:
                self._send_releases(dial.address)
        if joining is not None and not joining.await_end(CONNECT_TIMEOUT_S):
            raise TimeoutError(
                f"add_peer({peer_id!r}): the tier's join of that host, which this replaces (it "
                f"will not publish it), still ran after {CONNECT_TIMEOUT_S:g} s (NIXL "
                "registering its region, say): add_peer again once it ended"
            )
        self._register(peer_id, agent_metadata, base_addr, num_blocks, block_len)
        with self._lock:
            self._check_open()
            removed = None if session is None else self._stopped_join(peer_id)
            if removed is not None:
                raise removed
            self._peers[peer_id] = Peer(
                self._index.add_peer(peer_id, slots), verifies=self.verify, session=session
            )
