"""``NixlPeers``: the remote regions a ``NixlTransport`` registered, each a NIXL remote agent and
a prepared descriptor list over the region's blocks, and the release of both once nothing uses
them.

Registration generations. Every registration and removal of a peer id bumps its generation
(``next_generation``); a registration publishes only if its generation is still current,
otherwise it releases what it built and reports itself superseded. So a removal during a
registration wins, and a failed re-registration leaves the working one published.

Lifetime. A registration replaced or removed while transfers to it are in flight is *retired*:
it keeps its descriptors and remote agent until its last transfer resolves
(``transfer_ended``), so that transfer's state check stays meaningful and a re-added peer id
never shares a destination that may still be written.

Remote agents. Loading metadata already loaded hands back the same name, not its ownership, so
an agent is shared by every registration that loaded it, and removed once none uses it, unless
its peer was *dropped* (``remove(park=True)``: a peer that will likely be registered again from
the same metadata: ``NixlRegistration.drop_remote_peer``), and its endpoint was not seen failed
(``endpoint_failed``: loaded again, NIXL would hand it back, failed endpoint and all).
Then the agent stays loaded, *parked* under the peer id, until that peer id is published with
another agent (the host restarted), registered from other metadata (NIXL
hands back an agent already loaded under the same name as it was, and an agent name may outlive
its process), removed, or the transport closes. NIXL keeps the sockets of a removed remote agent
open (ai-dynamo/nixl#2025: about 10 per removal, on this side and on the host's), so removing
and loading again the agent of a host that is still the same process (a tier drops a host after
a reset control connection or a long freeze, then dials it again) would leak them at every
drop; a parked agent is simply loaded again. Parking holds no descriptors: nothing can be
transferred to a parked agent until a registration is published. While a registration loads
its metadata, an agent loaded from the same metadata is not removed (the load may be handing
it back); once the load returned, it goes unless that registration uses it.

Threading: the owner's lock (``lock``, the transport's) guards every table. ``build`` runs
unlocked on the transport's registration thread (the expensive half: seconds for a big region)
and takes the lock only to note the agent it builds; ``publish`` takes it itself; every other
method expects the caller to hold it.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from torch_kv_tier.transport.nixl_agent import descriptors

# The transport's logger: these lines are the transport's (``NixlTransport <name>: ...``).
logger = logging.getLogger("torch_kv_tier.transport.nixl")


@dataclass(eq=False)
class NixlPeer:
    """One registration of a remote region; ``inflight`` holds its unresolved transfer ids."""

    peer_id: str
    nixl_name: str
    dlist: Any
    num_blocks: int
    metadata: bytes  # what its agent was loaded from
    inflight: set[int] = field(default_factory=set)


class NixlPeers:
    """The registrations of one transport (module docstring). ``agent`` is the transport's NIXL
    agent, ``None`` once it closed (or when NIXL is missing): nothing is released then."""

    def __init__(self, owner: str, block_len: int, lock: threading.Lock) -> None:
        self.agent: Any = None
        self._owner = owner  # the transport's name, for logs
        self._block_len = block_len
        self._lock = lock
        self._published: dict[str, NixlPeer] = {}
        self._retired: list[NixlPeer] = []  # unpublished, with transfers still in flight
        self._building: list[str] = []  # remote agent names of registrations being built
        # metadata whose agent is being loaded (one at a time: one registration thread), and
        # the agents a release left loaded meanwhile: the load may hand back one of them
        self._loading: bytes | None = None
        self._kept_for_load: list[str] = []
        self._parked: dict[str, tuple[str, bytes]] = {}  # peer id -> (agent, its metadata)
        self._parking: set[str] = set()  # dropped peer ids: their agents park when released
        self._failed: set[str] = set()  # loaded agents a transfer saw disconnected: never parked
        self._gen: dict[str, int] = {}

    def get(self, peer_id: str) -> NixlPeer | None:
        """The published registration of ``peer_id``."""
        return self._published.get(peer_id)

    def is_published(self, peer: NixlPeer) -> bool:
        return self._published.get(peer.peer_id) is peer

    def next_generation(self, peer_id: str) -> int:
        """A new generation of ``peer_id``: every registration begun before it is superseded."""
        gen = self._gen[peer_id] = self._gen.get(peer_id, 0) + 1
        return gen

    def abandon(self, peer_id: str, gen: int) -> None:
        """Registration ``gen`` of ``peer_id`` may no longer publish; one begun after it may."""
        if self._gen.get(peer_id) == gen:
            self.next_generation(peer_id)

    def build(
        self,
        peer_id: str,
        metadata: bytes,
        base_addr: int,
        num_blocks: int,
        mem_type: str,
        device_id: int,
    ) -> NixlPeer:
        """Load the peer's agent and prepare its descriptors (unlocked). On failure, the remote
        agent is removed unless another registration uses it; a failed preparation raises NIXL's
        error itself (vLLM's contract) with a note naming the region (NIXL's says only its
        status)."""
        agent = self.agent
        with self._lock:  # a parked agent loaded from other metadata would be handed back as is
            parked = self._parked.get(peer_id)
            if parked is not None and (parked[1] != metadata or parked[0] in self._failed):
                self._unpark(peer_id)
            self._loading = metadata
        nixl_name = ""
        try:
            loaded = agent.add_remote_agent(metadata)
            nixl_name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        finally:
            with self._lock:
                self._loading = None
                if nixl_name:
                    self._building.append(nixl_name)
                kept, self._kept_for_load = self._kept_for_load, []
                gone = [name for name in kept if not self._name_in_use(name)]
            for name in gone:  # not what the load handed back
                self._remove_agent(peer_id, name)
        try:
            descs = descriptors(base_addr, num_blocks, self._block_len, device_id)
            xfer_descs = agent.get_xfer_descs(descs, mem_type=mem_type)
            dlist = agent.prep_xfer_dlist(nixl_name, xfer_descs)
        except Exception as exc:
            with self._lock:
                self._building.remove(nixl_name)
                in_use = self._name_in_use(nixl_name)
            if not in_use:
                self._remove_agent(peer_id, nixl_name)
            exc.add_note(
                f"peer {peer_id!r}: NIXL could not prepare {num_blocks} blocks of "
                f"{self._block_len} B at {base_addr:#x}; the region must lie in memory the peer "
                "registered (NIXL_ERR_NOT_FOUND when it does not): check base_addr and num_blocks "
                "against what the peer advertised"
            )
            raise
        return NixlPeer(peer_id, nixl_name, dlist, num_blocks, metadata)

    def publish(self, peer: NixlPeer, gen: int) -> bool:
        """Publish ``peer`` if ``gen`` is still current and the transport open (``agent``),
        replacing (retiring) an older registration; else release it. Takes the lock."""
        with self._lock:
            self._building.remove(peer.nixl_name)
            fresh = self.agent is not None and self._gen.get(peer.peer_id) == gen
            if fresh:
                old = self._published.get(peer.peer_id)
                self._published[peer.peer_id] = peer
                if old is not None:
                    self._retire(old)
                self._parking.discard(peer.peer_id)
                self._unpark(peer.peer_id)  # unless the new registration loaded it again
        if fresh:
            logger.info(
                "NixlTransport %s: peer %s = %s, %d blocks",
                self._owner,
                peer.peer_id,
                peer.nixl_name,
                peer.num_blocks,
            )
            return True
        logger.info(
            "NixlTransport %s: discarding superseded registration of peer %s",
            self._owner,
            peer.peer_id,
        )
        with self._lock:
            if self.agent is not None:
                self._release(peer)
        return False

    def supersede_all(self) -> None:
        """A new generation of every peer id: no registration under way publishes (closing)."""
        for peer_id in list(self._gen):
            self.next_generation(peer_id)

    def remove(self, peer_id: str, *, park: bool) -> None:
        """Unpublish ``peer_id`` (retired until its transfers resolve) and supersede any
        registration of it still being built; ``park``: its agent stays loaded (module
        docstring), else it goes, parked or not."""
        self.next_generation(peer_id)
        if park:
            self._parking.add(peer_id)
        else:
            self._parking.discard(peer_id)
            self._unpark(peer_id)
        peer = self._published.pop(peer_id, None)
        if peer is not None:
            self._retire(peer)

    def remove_all(self) -> None:
        """Unpublish every registration and remove every parked agent (the transport is
        closing)."""
        for peer_id in list(self._published):
            self._retire(self._published.pop(peer_id))
        for peer_id in list(self._parked):
            self._unpark(peer_id)

    def endpoint_failed(self, peer: NixlPeer) -> None:
        """A transfer to ``peer`` ended with a remote disconnect, whatever the peer's state
        (published or not, faulted first by another cause or not): its agent's UCX endpoint
        failed, so that agent is removed once no registration uses it, never parked."""
        self._failed.add(peer.nixl_name)

    def transfer_ended(self, peer: NixlPeer, tid: int) -> None:
        """Transfer ``tid`` to ``peer`` resolved: a retired registration it was the last
        transfer of is released."""
        peer.inflight.discard(tid)
        if not peer.inflight and peer in self._retired:
            self._retired.remove(peer)
            self._release(peer)

    def _retire(self, peer: NixlPeer) -> None:
        """An unpublished registration: release it now, or once its transfers resolve."""
        if peer.inflight:
            self._retired.append(peer)
        else:
            self._release(peer)

    def _release(self, peer: NixlPeer) -> None:
        """Release a registration's descriptors, and its remote agent once no registration
        uses it: parked for a dropped peer, else removed (module docstring). A failed
        descriptor release does not stop the agent's step."""
        try:
            self.agent.release_dlist_handle(peer.dlist)
        except Exception as exc:
            logger.warning(
                "NixlTransport %s: releasing %s's descriptors failed: %s",
                self._owner,
                peer.peer_id,
                exc,
            )
        if self._name_in_use(peer.nixl_name):
            return
        if self._loading == peer.metadata:  # the load under way may hand this agent back
            self._kept_for_load.append(peer.nixl_name)
            return
        if (
            peer.peer_id not in self._parking
            or peer.peer_id in self._published
            or peer.nixl_name in self._failed
        ):  # removed, or it has another agent, or its endpoint failed
            self._remove_agent(peer.peer_id, peer.nixl_name)
            return
        self._unpark(peer.peer_id)  # an older agent of the peer (this one is not parked: above)
        self._parked[peer.peer_id] = (peer.nixl_name, peer.metadata)

    def _unpark(self, peer_id: str) -> None:
        """Forget ``peer_id``'s parked agent, and remove it unless a registration uses it."""
        parked = self._parked.pop(peer_id, None)
        if parked is not None and not self._name_in_use(parked[0]):
            if self._loading == parked[1]:  # the load under way may hand it back
                self._kept_for_load.append(parked[0])
            else:
                self._remove_agent(peer_id, parked[0])

    def _name_in_use(self, nixl_name: str) -> bool:
        return (
            nixl_name in self._building
            or any(name == nixl_name for name, _ in self._parked.values())
            or any(p.nixl_name == nixl_name for p in self._published.values())
            or any(p.nixl_name == nixl_name for p in self._retired)
        )

    def _remove_agent(self, peer_id: str, nixl_name: str) -> None:
        self._failed.discard(nixl_name)  # a later load makes a new agent, with new endpoints
        try:
            self.agent.remove_remote_agent(nixl_name)
        except Exception as exc:
            logger.warning(
                "NixlTransport %s: removing remote agent %s of %s failed: %s",
                self._owner,
                nixl_name,
                peer_id,
                exc,
            )
