"""NixlTransport's registration of peers' regions off the caller's thread: a removal meanwhile
wins, one that outlives its wait is never published nor supersedes a later or working one, and
cancel modes and close (idempotent, not held by a stuck registration) release everything."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from remote_peer import RemotePeer
from transport_support import BLOCK, FaultyAgent, drain

from torch_kv_tier.transport import (
    NixlTransport,
    PollResult,
    nixl_registration,
)
from torch_kv_tier.transport import nixl as nixl_module

# -- registration -------------------------------------------------------------------------------


class BlockingPrep(FaultyAgent):
    """Real agent whose ``prep_xfer_dlist`` for a remote agent (or the call named ``blocks``)
    waits for ``release``."""

    def __init__(
        self, agent: Any, fail: set[str] | None = None, blocks: str = "prep_xfer_dlist"
    ) -> None:
        super().__init__(agent, fail or set())
        self.entered = threading.Event()
        self.release = threading.Event()
        self.threads: list[int] = []
        self.blocks = blocks

    def __getattr__(self, name: str) -> Any:
        call = super().__getattr__(name)
        if name != self.blocks:
            return call

        def blocking(*args: Any, **kwargs: Any) -> Any:
            self.threads.append(threading.get_ident())
            self.entered.set()
            assert self.release.wait(30)
            return call(*args, **kwargs)

        return blocking


def test_registration_runs_off_the_caller_and_a_removal_meanwhile_wins(
    local: NixlTransport, peer: RemotePeer, peer2: RemotePeer
) -> None:
    local.add_remote_peer("q", *peer2.peer_args())
    blocking = BlockingPrep(local._agent)
    local._agent = blocking
    future = local.add_remote_peer_async("p", *peer.peer_args())
    assert blocking.entered.wait(10)
    assert threading.get_ident() not in blocking.threads
    # The registration holds no lock the caller needs: transfers and removal go on.
    tid = local.write_blocks("q", [3], [3])
    assert drain(local, {tid})[0] == {tid}
    local.remove_remote_peer("p")
    blocking.release.set()
    with pytest.raises(RuntimeError, match="superseded"):
        future.result(timeout=10)
    assert local.write_blocks("p", [0], [0]) is None
    assert blocking.calls["remove_remote_agent"] == 1 and blocking.calls["release_dlist_handle"]
    local._agent = blocking._agent
    local.add_remote_peer_async("p", *peer.peer_args()).result(timeout=10)
    tid = local.write_blocks("p", [1], [1])
    assert drain(local, {tid})[0] == {tid}


def test_a_registration_that_outlives_its_wait_raises_and_is_never_published(
    local: NixlTransport, peer: RemotePeer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(nixl_registration, "REGISTRATION_TIMEOUT_S", 0.5)
    blocking = BlockingPrep(local._agent)
    local._agent = blocking
    with pytest.raises(TimeoutError, match="did not finish within 0.5 s.*add_remote_peer again"):
        local.add_remote_peer("p", *peer.peer_args())
    blocking.release.set()  # the abandoned registration now completes: it must not publish
    local._registrar.submit(lambda: None).result(timeout=10)  # runs after it (one thread)
    assert blocking.calls["remove_remote_agent"] == 1  # its agent, released
    local._agent = blocking._agent
    assert local.write_blocks("p", [0], [0]) is None  # unknown peer
    local.add_remote_peer("p", *peer.peer_args())  # a registration in time still works
    tid = local.write_blocks("p", [2], [2])
    assert drain(local, {tid})[0] == {tid}


def test_a_registration_that_outlives_its_wait_never_supersedes_a_later_one(
    local: NixlTransport, peer: RemotePeer, peer2: RemotePeer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: ``add_remote_peer`` giving up on its registration started a new
    generation of the peer, so a registration of it begun meanwhile on another thread (the
    peer's newer metadata) failed "superseded" although nothing removed it or replaced it."""
    monkeypatch.setattr(nixl_registration, "REGISTRATION_TIMEOUT_S", 0.5)
    local.region.owner[6] = 6
    blocking = BlockingPrep(local._agent)
    local._agent = blocking
    later: list[Any] = []

    def register_again() -> None:  # while the first registration is stuck
        assert blocking.entered.wait(10)
        later.append(local.add_remote_peer_async("p", *peer2.peer_args()))

    thread = threading.Thread(target=register_again)
    thread.start()
    try:
        with pytest.raises(TimeoutError, match="did not finish within 0.5 s"):
            local.add_remote_peer("p", *peer.peer_args())
        thread.join(timeout=10)
        assert later, "the second registration was not submitted"
    finally:
        blocking.release.set()
    later[0].result(timeout=10)  # the later registration stands
    local._agent = blocking._agent
    tid = local.write_blocks("p", [6], [6])
    assert drain(local, {tid})[0] == {tid}
    assert int(peer2.get([6]).sum()) == 6 * BLOCK and int(peer.get([6]).sum()) == 0


def test_a_reregistration_that_outlives_its_wait_keeps_the_working_one(
    local: NixlTransport, peer: RemotePeer, peer2: RemotePeer, monkeypatch: pytest.MonkeyPatch
) -> None:
    local.region.owner[5] = 5
    local.add_remote_peer("p", *peer.peer_args())
    monkeypatch.setattr(nixl_registration, "REGISTRATION_TIMEOUT_S", 0.5)
    blocking = BlockingPrep(local._agent)
    local._agent = blocking
    with pytest.raises(TimeoutError, match="an earlier registration of the peer"):
        local.add_remote_peer("p", *peer2.peer_args())
    blocking.release.set()
    local._registrar.submit(lambda: None).result(timeout=10)
    local._agent = blocking._agent
    tid = local.write_blocks("p", [5], [5])  # still the first registration: peer, not peer2
    assert drain(local, {tid})[0] == {tid}
    assert int(peer.get([5]).sum()) == 5 * BLOCK


def test_a_failed_reregistration_keeps_the_working_one(
    local: NixlTransport, peer: RemotePeer, peer2: RemotePeer
) -> None:
    local.region.owner[4] = 4
    local.add_remote_peer("p", *peer.peer_args())
    faulty = FaultyAgent(local._agent, {"prep_xfer_dlist"})
    local._agent = faulty
    with pytest.raises(RuntimeError, match="injected prep_xfer_dlist"):
        local.add_remote_peer_async("p", *peer2.peer_args()).result(timeout=10)
    assert faulty.calls["remove_remote_agent"] == 1  # peer2's agent, loaded for nothing
    local._agent = faulty._agent
    tid = local.write_blocks("p", [4], [4])
    assert drain(local, {tid})[0] == {tid}
    assert int(peer.get([4]).sum()) == 4 * BLOCK


def test_cancel_modes(local: NixlTransport, peer: RemotePeer) -> None:
    local.add_remote_peer("p", *peer.peer_args())
    t1 = local.write_blocks("p", [0], [0])
    assert local.cancel([t1, 12345]) == []
    assert local.poll() == PollResult()

    t2 = local.write_blocks("p", [1], [1])
    faulty = FaultyAgent(local._agent, {"release_xfer_handle"})
    local._agent = faulty
    assert local.cancel([t2], mode="wait") == [t2]  # still draining: stays in flight
    local._agent = faulty._agent
    assert drain(local, {t2})[0] == {t2}
    t3 = local.write_blocks("p", [2], [2])
    assert local.cancel([t3, 999], mode="wait") == []
    assert local.poll() == PollResult()
    with pytest.raises(ValueError):
        local.cancel([1], mode="later")  # type: ignore[arg-type]


def test_close_is_idempotent_releases_everything_and_forbids_further_use(peer: RemotePeer) -> None:
    t = NixlTransport("closing", torch.zeros(8, BLOCK, dtype=torch.uint8))
    t.add_remote_peer("p", *peer.peer_args())
    t.write_blocks("p", [0], [0])
    spy = FaultyAgent(t._agent, set())
    t._agent = spy
    t.close()
    t.close()
    assert t.available is False
    for call in ("release_xfer_handle", "release_dlist_handle", "remove_remote_agent"):
        assert spy.calls.get(call, 0) >= 1, call
    assert spy.calls["deregister_memory"] == 1
    for method, args in [
        (t.get_agent_metadata, ()),
        (t.add_remote_peer, ("q", *peer.peer_args())),
        (t.remove_remote_peer, ("p",)),
        (t.write_blocks, ("p", [0], [0])),
        (t.read_blocks, ("p", [0], [0])),
        (t.poll, ()),
        (t.cancel, ([1],)),
    ]:
        with pytest.raises(RuntimeError, match="closed"):
            method(*args)


def test_close_returns_while_a_registration_is_stuck_and_releases_once_it_returns(
    peer: RemotePeer, peer2: RemotePeer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A remote metadata load that never returns held ``close()`` for good (it joined the
    registration thread without a limit). Now close returns after ``CLOSE_REGISTRATION_WAIT_S``
    without calling into the agent (a stuck load may hold NIXL's lock), and the release runs
    once the registration returns."""
    monkeypatch.setattr(nixl_module, "CLOSE_REGISTRATION_WAIT_S", 0.5)
    t = NixlTransport("stuck", torch.zeros(8, BLOCK, dtype=torch.uint8))
    t.add_remote_peer("q", *peer.peer_args())
    tid = t.write_blocks("q", [0], [0])
    blocking = BlockingPrep(t._agent, blocks="add_remote_agent")
    t._agent = blocking
    future = t.add_remote_peer_async("p", *peer2.peer_args())
    try:
        assert blocking.entered.wait(10)
        closer = threading.Thread(target=t.close)
        closer.start()
        closer.join(timeout=5)
        assert not closer.is_alive(), "close() waited for a stuck registration"
        assert t.available is False
        with pytest.raises(RuntimeError, match="closed"):
            t.poll()
        assert "deregister_memory" not in blocking.calls  # nothing touched under the load
    finally:
        blocking.release.set()
    with pytest.raises(RuntimeError, match="superseded"):
        future.result(timeout=10)  # it can no longer publish
    deadline = time.monotonic() + 10
    while blocking.calls.get("deregister_memory", 0) == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert blocking.calls["deregister_memory"] == 1
    assert blocking.released and tid is not None  # the transfer's handle
    assert blocking.calls["remove_remote_agent"] == 2  # p's (superseded) and q's
    t.close()  # idempotent


def test_a_ctrl_c_as_close_waits_for_a_registration_still_releases_the_agent_once_it_returns(
    peer2: RemotePeer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: ``close`` waits (up to ``CLOSE_REGISTRATION_WAIT_S``) for a registration
    still running; a Ctrl-C there (a tier's ``close`` ends with it) left the transport closed
    with its agent, memory registration and peers never released, nor its ``on_released``
    callbacks run (a tier's cancelled loads never settled), and a second ``close`` returned at
    once. Now the release runs once the registration returns, as past the wait; then the
    interrupt is raised."""
    t = NixlTransport("interrupted", torch.zeros(8, BLOCK, dtype=torch.uint8))
    blocking = BlockingPrep(t._agent, blocks="add_remote_agent")
    t._agent = blocking
    future = t.add_remote_peer_async("p", *peer2.peer_args())
    released = threading.Event()
    try:
        assert blocking.entered.wait(10)

        def interrupted(*_: Any, **__: Any) -> Any:
            raise KeyboardInterrupt  # Ctrl-C as close waits for the registration

        monkeypatch.setattr(nixl_module, "wait_futures", interrupted)
        with pytest.raises(KeyboardInterrupt):
            t.close()
        t.on_released(released.set)
        assert not released.is_set(), "released under a registration still running"
    finally:
        blocking.release.set()
    with pytest.raises(RuntimeError, match="superseded"):
        future.result(timeout=10)  # it can no longer publish
    assert released.wait(10), "the agent was never released"
    assert blocking.calls["deregister_memory"] == 1
