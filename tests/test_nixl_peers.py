"""``NixlPeers``' remote agents under a registration that races the release of another, with an
agent that loads and removes by name in this process (no NIXL): an agent a load hands back is
never removed under it."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from torch_kv_tier.transport.faults import PeerHealth
from torch_kv_tier.transport.nixl_inflight import NixlInflight
from torch_kv_tier.transport.nixl_peers import NixlPeers


class _Agent:
    """Agents are loaded from metadata and named after it; ``during_load`` runs inside
    ``add_remote_agent``, after the agent is loaded and before its name is returned."""

    def __init__(self) -> None:
        self.loaded: set[str] = set()
        self.during_load: Callable[[], None] | None = None

    def add_remote_agent(self, metadata: bytes) -> bytes:
        name = "agent-" + metadata.decode()
        self.loaded.add(name)  # loading it again hands back the same name
        if self.during_load is not None:
            self.during_load()
        return name.encode()

    def get_xfer_descs(self, descs: Any, mem_type: str) -> Any:
        return descs

    def prep_xfer_dlist(self, name: str, descs: Any) -> object:
        if name not in self.loaded:
            raise RuntimeError("NIXL_ERR_NOT_FOUND: remote agent not loaded")
        return object()

    def release_dlist_handle(self, handle: Any) -> None:
        pass

    def remove_remote_agent(self, name: str) -> None:
        self.loaded.discard(name)


def _register(peers: NixlPeers, lock: threading.Lock, peer_id: str, metadata: bytes) -> Any:
    with lock:
        gen = peers.next_generation(peer_id)
    peer = peers.build(peer_id, metadata, 0, 4, "DRAM", 0)
    assert peers.publish(peer, gen)
    return peer


def _a_retired_registration() -> tuple[threading.Lock, _Agent, NixlPeers, Any]:
    """Peer "P", registered from metadata ``M`` and removed with transfer 7 in flight: retired
    until it resolves."""
    lock, agent = threading.Lock(), _Agent()
    peers = NixlPeers("t", 64, lock)
    peers.agent = agent
    old = _register(peers, lock, "P", b"M")
    old.inflight.add(7)
    with lock:
        peers.remove("P", park=False)
    return lock, agent, peers, old


def test_a_retired_registration_released_during_a_load_of_its_metadata_keeps_the_agent() -> None:
    """Found by review: a peer removed with a transfer in flight is registered again from the
    same metadata; the transfer resolves while the new registration loads the agent (NIXL hands
    back the one already loaded). Its release removed that agent, and the new registration
    failed with NOT_FOUND."""
    lock, agent, peers, old = _a_retired_registration()

    def transfer_7_resolves() -> None:  # on the poller's thread
        def resolve() -> None:
            with lock:
                peers.transfer_ended(old, 7)

        thread = threading.Thread(target=resolve)
        thread.start()
        thread.join()

    agent.during_load = transfer_7_resolves
    _register(peers, lock, "P", b"M")
    assert agent.loaded == {"agent-M"}


def test_an_agent_kept_for_a_load_that_failed_is_removed() -> None:
    """The same release during a load that then fails: nothing uses the agent any more, and it
    is removed once the load returned."""
    lock, agent, peers, old = _a_retired_registration()

    def resolve_then_fail() -> None:
        with lock:
            peers.transfer_ended(old, 7)
        assert agent.loaded == {"agent-M"}  # kept while the load runs
        raise RuntimeError("NIXL_ERR_BACKEND: the load failed")

    agent.during_load = resolve_then_fail
    with pytest.raises(RuntimeError, match="the load failed"):
        _register(peers, lock, "P", b"M")
    assert agent.loaded == set()


class nixlRemoteDisconnectError(Exception):  # noqa: N801 (the binding's class name)
    pass


class _XferAgent(_Agent):
    """``_Agent`` that posts transfers; every state check raises a remote disconnect (the
    host's UCX endpoint failed)."""

    def make_prepped_xfer(self, *args: Any) -> object:
        return object()

    def transfer(self, handle: Any) -> str:
        return "PROC"

    def check_xfer_state(self, handle: Any) -> str:
        raise nixlRemoteDisconnectError("NIXL_ERR_REMOTE_DISCONNECT")

    def release_xfer_handle(self, handle: Any) -> None:
        pass


def test_a_dropped_peer_whose_endpoint_a_transfer_then_saw_failed_has_its_agent_removed() -> None:
    """Found in /tmp/ucxs logs: a host dropped for its lost control connection (its agent is to
    park, ``drop_remote_peer``) with a READ in flight, whose state check then raised a remote
    disconnect: the agent was parked, failed endpoint and all, so the host dialled again got it
    back and its next transfer failed. Now an agent a transfer saw disconnected is removed."""
    lock, agent = threading.Lock(), _XferAgent()
    peers = NixlPeers("t", 64, lock)
    peers.agent = agent
    inflight = NixlInflight("t", peers, PeerHealth("t"))
    peer = _register(peers, lock, "P", b"M")
    with lock:
        tid = inflight.post("READ", object(), [0], peer, [0])
        peers.remove("P", park=True)  # the drop of a host whose control connection was lost
        assert list(inflight.poll(None).failed) == [tid]  # the READ ends: a remote disconnect
    assert agent.loaded == set()  # removed, not parked: a redial loads a fresh agent
