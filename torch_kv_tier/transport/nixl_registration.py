"""The peer-registration part of ``NixlTransport``: adding, removing and dropping peers.

``NixlRegistration`` is a base class of ``NixlTransport``: a registration (``add_remote_agent``
plus one descriptor per remote block, seconds for a big region) runs on the transport's
``registrar`` thread, outside the transport's lock; ``nixl_peers`` builds and publishes it.

Generations (``nixl_peers``). Every ``add_remote_peer_async`` and ``remove_remote_peer`` starts
a new generation of the peer: a registration superseded while it ran releases what it built and
its future fails ("superseded"), so a removal during a registration wins, and a failed
re-registration leaves the working one published.

Threading: any method from any thread; each takes the transport's lock for its table updates
and never holds it while NIXL loads a remote agent.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING

from torch_kv_tier.transport.base import BlockRegion, check_peer_region
from torch_kv_tier.transport.faults import PeerHealth
from torch_kv_tier.transport.nixl_peers import NixlPeers
from torch_kv_tier.transport.registrar import Registrar

# How long ``add_remote_peer`` waits for a registration (NIXL's local work: milliseconds here).
REGISTRATION_TIMEOUT_S = 60.0


class NixlRegistration:
    """Peer registration of ``NixlTransport`` (module docstring)."""

    # The transport's state this part uses (set by ``NixlTransport.__init__``).
    _lock: threading.Lock
    _peers: NixlPeers
    _health: PeerHealth
    _registrar: Registrar
    _last_registration: Future[None] | None  # the registrar runs them in order
    _region: BlockRegion

    if TYPE_CHECKING:  # implemented by NixlTransport

        def _check_open(self) -> None: ...

    def add_remote_peer(
        self,
        peer_id: str,
        agent_metadata: bytes,
        base_addr: int,
        num_blocks: int,
        block_len: int,
        *,
        mem_type: str = "DRAM",
        device_id: int = 0,
    ) -> None:
        """Register a peer region and wait for it; see ``add_remote_peer_async``.

        Raises ``TimeoutError`` when the registration has not finished within
        ``REGISTRATION_TIMEOUT_S``: it is then abandoned (it can no longer publish the peer; a
        working registration of it is kept), so the caller's view and the transport's agree.
        """
        future, gen = self._register(
            peer_id, agent_metadata, base_addr, num_blocks, block_len, mem_type, device_id
        )
        try:
            future.result(timeout=REGISTRATION_TIMEOUT_S)
        except FutureTimeout:
            with self._lock:
                self._peers.abandon(peer_id, gen)  # it can no longer publish the peer
            try:  # unless it did just before: its future then resolves at once
                published = future.exception(timeout=1.0) is None
            except FutureTimeout:
                published = False
            if published:
                return
            raise TimeoutError(
                f"registering peer {peer_id!r} did not finish within {REGISTRATION_TIMEOUT_S:g}"
                " s (NIXL's add_remote_agent or prep_xfer_dlist did not return); it was abandoned"
                " and will not take effect (an earlier registration of the peer, if any, stays in"
                " use): check the peer's agent metadata, then call add_remote_peer again"
            ) from None

    def add_remote_peer_async(
        self,
        peer_id: str,
        agent_metadata: bytes,
        base_addr: int,
        num_blocks: int,
        block_len: int,
        *,
        mem_type: str = "DRAM",
        device_id: int = 0,
    ) -> Future[None]:
        """Register a peer region on the registration thread (extension: its memory kind).

        Bad arguments raise here (``check_peer_region``), before the peer's agent is loaded.
        The future fails with NIXL's error (nothing is published, a
        known peer keeps its working registration) or with ``RuntimeError`` "superseded" when
        the peer was removed or registered again (or the transport closed) meanwhile.
        """
        return self._register(
            peer_id, agent_metadata, base_addr, num_blocks, block_len, mem_type, device_id
        )[0]

    def _register(
        self,
        peer_id: str,
        agent_metadata: bytes,
        base_addr: int,
        num_blocks: int,
        block_len: int,
        mem_type: str,
        device_id: int,
    ) -> tuple[Future[None], int]:
        """``add_remote_peer_async``, and the generation of the peer its registration is."""
        check_peer_region(
            peer_id, base_addr, num_blocks, block_len, self._region.block_len, device_id
        )
        if mem_type not in ("DRAM", "VRAM"):
            raise ValueError(f"peer mem_type must be 'DRAM' or 'VRAM', got {mem_type!r}")

        def register() -> None:
            with self._lock:
                self._check_open()  # closed while it waited: nothing to build
            peer = self._peers.build(
                peer_id, bytes(agent_metadata), base_addr, num_blocks, mem_type, device_id
            )
            if not self._peers.publish(peer, gen):
                raise RuntimeError(
                    f"registration of peer {peer_id!r} was superseded (the peer was removed or "
                    "registered again, or the transport closed, while this registration ran)"
                )

        with self._lock:
            self._check_open()
            gen = self._peers.next_generation(peer_id)
            future = self._last_registration = self._registrar.submit(register)
        return future, gen

    def remove_remote_peer(self, peer_id: str) -> None:
        """Unpublish ``peer_id`` at once, also over a registration still running.

        Its in-flight transfers stay in flight and are reported by ``poll`` when they resolve;
        its descriptors and remote agent are released after the last of them.
        """
        with self._lock:
            self._check_open()
            self._health.forget(peer_id)
            self._peers.remove(peer_id, park=False)

    def drop_remote_peer(self, peer_id: str) -> None:
        """``remove_remote_peer``, except that the peer's remote agent stays loaded (parked)
        until the peer id is registered again from other metadata, removed, or the transport
        closes: NIXL keeps a removed agent's sockets open (``nixl_peers``). Not an agent a
        transfer saw disconnected, before or after the drop, whatever fault came first
        (``NixlPeers.endpoint_failed``): its UCX endpoint failed, and a parked agent loaded again
        would bring it back (posts to the host would fail again), so it is removed."""
        with self._lock:
            self._check_open()
            self._health.forget(peer_id)
            self._peers.remove(peer_id, park=True)
