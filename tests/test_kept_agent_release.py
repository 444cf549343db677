"""A NIXL agent kept until the process exits (``agent_lifetime``: a post failed with a remote
disconnect once NIXL made its request) is never destroyed, so its UCX worker runs on, and with it
any transfer released while it may still run (cancelled, or in flight at close). Its transport
must then never say its region is released (``on_released``): the tier settles the loads it
cancelled at close there (their callers reuse the blocks), vLLM unmaps the region."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
import torch
from remote_peer import RemotePeer
from transport_support import BLOCK, FaultyAgent, random_blocks

from torch_kv_tier.arena import BlockArena
from torch_kv_tier.manager import TierManager
from torch_kv_tier.transport import NixlTransport, agent_lifetime

RESULT_TIMEOUT_S = 10.0
WITHHELD = "release callback(s) never run"


class nixlRemoteDisconnectError(Exception):  # noqa: N801 (the binding's class name)
    pass


class DisconnectsOnPost(FaultyAgent):
    """Real agent whose posts raise a remote disconnect once the request is made (what NIXL
    raises when the peer's endpoint fails during the post): the agent is then kept."""

    def __init__(self, agent: Any) -> None:
        super().__init__(agent, set())

    def transfer(self, handle: Any) -> str:
        raise nixlRemoteDisconnectError(
            "postXferReq: remote agent was disconnected after transfer request creation"
        )


@pytest.fixture
def kept(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The agents the transport asks to keep until exit (not kept: the test process goes on)."""
    agents: list[object] = []
    monkeypatch.setattr(agent_lifetime, "keep_until_exit", lambda agent, name: agents.append(agent))
    return agents


def keep(t: NixlTransport, peer_id: str) -> None:
    """Make ``t``'s agent kept until exit by a post that disconnects once made."""
    real = t._agent
    t._agent = DisconnectsOnPost(real)
    assert t.read_blocks(peer_id, [3], [3]) is None
    t._agent = real


def still_running(t: NixlTransport) -> None:
    """Make ``t``'s transfers report ``PROC`` (a read on the wire), whatever the real one did."""
    spy = FaultyAgent(t._agent, set())
    spy.check_xfer_state = lambda handle: "PROC"  # type: ignore[attr-defined]
    t._agent = spy


@pytest.mark.parametrize("when", ["before close", "after close"])
@pytest.mark.parametrize("released", ["in flight at close", "cancelled"])
def test_a_kept_agent_with_a_transfer_released_early_never_says_its_region_is_released(
    peer: RemotePeer,
    kept: list[object],
    caplog: pytest.LogCaptureFixture,
    when: str,
    released: str,
) -> None:
    """The callbacks ran once the transport closed, kept agent or not; a read released in
    flight then ran on in the kept agent's worker. Now they never run, and a warning says so
    and what to do."""
    ran: list[str] = []
    t = NixlTransport("kept", random_blocks(8))
    t.add_remote_peer("p", *peer.peer_args())
    keep(t, "p")
    assert len(kept) == 1
    tid = t.read_blocks("p", [0, 1], [0, 1])
    still_running(t)
    if released == "cancelled":
        assert t.cancel([tid]) == []  # type: ignore[list-item]
    if when == "before close":
        t.on_released(lambda: ran.append("callback"))
    t.close()
    if when == "after close":
        t.on_released(lambda: ran.append("callback"))
    assert ran == []
    assert WITHHELD in caplog.text and "restart the process" in caplog.text


@pytest.mark.parametrize("agent", ["kept, nothing released early", "not kept"])
def test_a_transport_with_nothing_left_running_says_its_region_is_released(
    peer: RemotePeer, kept: list[object], caplog: pytest.LogCaptureFixture, agent: str
) -> None:
    ran: list[str] = []
    t = NixlTransport("quiet", random_blocks(8))
    t.add_remote_peer("p", *peer.peer_args())
    if agent == "not kept":
        t.read_blocks("p", [0], [0])  # in flight at close: the agent's destruction ends it
    else:
        keep(t, "p")
    t.on_released(lambda: ran.append("before"))
    t.close()
    t.on_released(lambda: ran.append("after"))
    assert ran == ["before", "after"]
    assert WITHHELD not in caplog.text


def test_a_load_cancelled_at_close_on_a_kept_agent_never_resolves(
    peer: RemotePeer, peer2: RemotePeer, kept: list[object], caplog: pytest.LogCaptureFixture
) -> None:
    """What a user relied on: a load cancelled at close resolved "closed" and its caller
    reused block 1, while the kept agent's worker might still read into it. Now it stays
    pending: its block is never handed back."""
    caplog.set_level(logging.WARNING)
    arena = BlockArena(4, BLOCK)
    transport = NixlTransport("tier", arena.tensor)
    tier = TierManager(arena, transport)
    tier.add_peer("p", *peer.peer_args())
    arena.tensor[0].fill_(0xAA)
    assert tier.store(["a"], [0]).result(timeout=RESULT_TIMEOUT_S).ok
    tier.add_peer("q", *peer2.peer_args())
    keep(transport, "q")
    still_running(transport)  # the read stays in flight until close gives up on it
    load = tier.load(["a"], [1])
    tier.close(timeout=0.2)
    assert not load.done(), "a load resolved while its read might still land"
    assert WITHHELD in caplog.text
    assert torch.all(arena.tensor[2:] == 0)


def wait_done(t: NixlTransport, tid: int) -> None:
    """Until NIXL reports ``tid`` ``DONE``, without polling the transport (not reported yet)."""
    handle = t._transfers._transfers[tid].handle
    deadline = time.monotonic() + RESULT_TIMEOUT_S
    while str(t._agent.check_xfer_state(handle)) != "DONE":
        assert time.monotonic() < deadline, "the read never completed"


@pytest.mark.parametrize("released", ["in flight at close", "cancelled"])
def test_a_kept_agent_whose_transfers_ended_before_their_release_says_its_region_is_released(
    peer: RemotePeer, kept: list[object], caplog: pytest.LogCaptureFixture, released: str
) -> None:
    """A read over (DONE) but not polled yet when it was cancelled or the transport closed
    withheld the region for good, though nothing of it could land any more."""
    ran: list[str] = []
    t = NixlTransport("ended", random_blocks(8))
    t.add_remote_peer("p", *peer.peer_args())
    keep(t, "p")
    tid = t.read_blocks("p", [0, 1], [0, 1])
    assert tid is not None
    wait_done(t, tid)
    if released == "cancelled":
        assert t.cancel([tid]) == []
    t.on_released(lambda: ran.append("callback"))
    t.close()
    assert ran == ["callback"]
    assert WITHHELD not in caplog.text


@pytest.mark.parametrize("failure", ["post failed part-way", "state ERR"])
def test_a_kept_agent_without_fences_that_reported_a_failure_never_says_its_region_is_released(
    peer: RemotePeer, kept: list[object], caplog: pytest.LogCaptureFixture, failure: str
) -> None:
    """Without fences (``fence_failures=False``) a failed transfer's handle is released at once,
    while NIXL's UCX backend may still run its other blocks: on a kept agent they may land
    after close, yet its callbacks ran."""
    ran: list[str] = []
    t = NixlTransport("unfenced", random_blocks(8), fence_failures=False)
    t.add_remote_peer("p", *peer.peer_args())
    keep(t, "p")
    real = t._agent
    spy = FaultyAgent(real, {"transfer"} if failure == "post failed part-way" else set())
    if failure == "state ERR":
        spy.check_xfer_state = lambda handle: "ERR"  # type: ignore[attr-defined]
    t._agent = spy
    tid = t.read_blocks("p", [0, 1], [0, 1])
    if tid is not None:
        assert list(t.poll().failed) == [tid]
    t._agent = real
    t.on_released(lambda: ran.append("callback"))
    t.close()
    assert ran == []
    assert WITHHELD in caplog.text
