"""A Ctrl-C as ``add_peer`` (or a connect's join) waits for the NIXL registration of a host's
region: the tier is left without that host, its registration abandoned (no agent entry left
behind), and a retried ``add_peer`` adds it fully."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

import pytest
import torch
from late_write_support import BLOCK, LateWriteTransport
from remote_support import BLOCK_LEN, fake_session, fill_random

from torch_kv_tier.arena import BlockArena
from torch_kv_tier.manager import TierManager
from torch_kv_tier.remote import ServerProcess

RESULT_TIMEOUT_S = 20.0


class BackgroundRegistration(LateWriteTransport):
    """Registers on a thread of its own, as the NIXL transport does, once ``release`` is set;
    ``remove_remote_peer`` drops a registration still running (``DataTransport``'s contract).
    ``interrupt``: the next wait for a registration gets a ``KeyboardInterrupt``, as a Ctrl-C
    would, while the registration goes on."""

    def __init__(self, region: torch.Tensor) -> None:
        super().__init__(region)
        self.release = threading.Event()
        self.interrupt = False
        self._generation: dict[str, int] = {}
        self.done: list[threading.Thread] = []

    def add_remote_peer_async(self, *args: Any, **kwargs: Any) -> Future[None]:
        peer_id = args[0]
        generation = self._generation[peer_id] = self._generation.get(peer_id, 0) + 1
        future: Future[None] = InterruptedFuture() if self.interrupt else Future()
        self.interrupt = False

        def register() -> None:
            self.release.wait(RESULT_TIMEOUT_S)
            if self._generation[peer_id] == generation:  # else superseded: dropped
                self.add_remote_peer(*args)
            future.set_result(None)

        thread = threading.Thread(target=register, daemon=True)
        thread.start()
        self.done.append(thread)
        return future

    def remove_remote_peer(self, peer_id: str) -> None:
        self._generation[peer_id] = self._generation.get(peer_id, 0) + 1
        super().remove_remote_peer(peer_id)

    def knows(self, peer_id: str) -> bool:
        return peer_id in self._peers


class InterruptedFuture(Future[None]):
    """A registration's future whose waiter gets a Ctrl-C."""

    def result(self, timeout: float | None = None) -> None:
        raise KeyboardInterrupt


def test_an_add_peer_interrupted_as_it_registers_leaves_no_half_added_host() -> None:
    """Found by review: a Ctrl-C as ``add_peer`` waited for the registration of the host's
    region left that registration running: it completed in the transport (a NIXL agent entry
    of a peer the tier does not know, never removed), although ``peers()`` does not list it."""
    arena = BlockArena(8, BLOCK)
    transport = BackgroundRegistration(arena.tensor)
    transport.remotes[b"p"] = torch.zeros(4, BLOCK, dtype=torch.uint8)
    with TierManager(arena, transport) as tier:
        transport.interrupt = True
        with pytest.raises(KeyboardInterrupt):
            tier.add_peer("p", b"p", 0, 4, BLOCK)
        transport.release.set()
        for thread in transport.done:
            thread.join(timeout=RESULT_TIMEOUT_S)
        assert tier.peers() == []
        assert not transport.knows("p"), "the interrupted registration was left behind"
        tier.add_peer("p", b"p", 0, 4, BLOCK)  # retried: the host is added fully
        assert tier.peers() == ["p"] and transport.knows("p")
        arena.tensor[0].fill_(7)
        assert tier.store(["k"], [0]).result(timeout=RESULT_TIMEOUT_S).ok
        assert tier.load(["k"], [1]).result(timeout=RESULT_TIMEOUT_S).ok
        assert torch.equal(arena.tensor[1], arena.tensor[0])


def test_a_connect_interrupted_as_it_registers_leaves_no_half_added_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same Ctrl-C in a connect's join of a private lease: the host's session ends (it
    holds no slots of it), the tier neither lists nor dials it, its NIXL registration is
    abandoned once it completes, and connecting again works."""
    with (
        ServerProcess.start(64, BLOCK_LEN) as server,
        TierManager.create(16, BLOCK_LEN, name="interrupted-join") as tier,
    ):
        register = tier.transport.add_remote_peer_async
        registrations: list[Future[None]] = []

        def interrupted(*args: Any) -> Future[None]:
            registrations.append(register(*args))
            return InterruptedFuture()

        monkeypatch.setattr(tier.transport, "add_remote_peer_async", interrupted)
        with pytest.raises(KeyboardInterrupt):
            tier.connect(server.address, private=True, slots=8)
        monkeypatch.undo()
        (registration,) = registrations
        registration.exception(timeout=RESULT_TIMEOUT_S)  # it ran on: it has ended now
        peer = server_peer_id(server.address)
        assert tier.peers() == [] and not tier._dials and not tier._joining
        known = tier.transport._peers.get(peer)  # type: ignore[attr-defined]
        assert known is None, "its registration was left behind"
        with fake_session(server.address, private=False) as observer:
            sessions = observer.stats()["sessions"]
            assert len(sessions) == 1, f"the interrupted connect's session is open: {sessions}"
        assert tier.connect(server.address, private=True, slots=8) == peer
        fill_random(tier)
        assert tier.store(["k"], [0]).result(timeout=RESULT_TIMEOUT_S).ok
        assert tier.load(["k"], [1]).result(timeout=RESULT_TIMEOUT_S).ok


def server_peer_id(address: str) -> str:
    """The peer id the host at ``address`` answers with."""
    with fake_session(address, private=False) as session:
        return str(session.peer_id)
