"""A transfer NIXL never completes (seen once in 180 runs of in-flight UCX resets: a store and a
load to a redialled host never resolved while its session heartbeated fine) must not leave its
caller's future pending until the tier closes: past ``transfer_timeout_s`` its peer is dropped
as if it refused the transfer, its store settles "peer lost", its load "timed out", and the
load's blocks stay withheld (refused to loads and stores) until the transport reports the read,
since it may still land (``overdue``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from remote_peer import RemotePeer
from remote_support import BLOCK_LEN, wait_until
from test_stray_reads import StrayReadTransport
from transport_support import FaultyAgent

from torch_kv_tier.arena import BlockArena
from torch_kv_tier.manager import TierManager
from torch_kv_tier.results import PEER_LOST, TIMED_OUT
from torch_kv_tier.transport import NixlTransport
from torch_kv_tier.transport import nixl as nixl_module

RESULT_TIMEOUT_S = 10.0
BOUND_S = 0.3


class NeverDone(FaultyAgent):
    """Real agent whose transfers stay ``PROC`` while ``stuck`` (a transfer UCX never ends)."""

    def __init__(self, agent: Any) -> None:
        super().__init__(agent, set())
        self.stuck = False

    def check_xfer_state(self, handle: Any) -> str:
        return "PROC" if self.stuck else str(self._agent.check_xfer_state(handle))


def start_bound(tier: TierManager) -> None:
    """Start ``tier``'s ``transfer_timeout_s``, ``BOUND_S``, from now on: every transfer posted
    ``BOUND_S`` ago or more is past it at its next look. Built off (0), so that no transfer a
    busy box slows (the fixture's store, a test's posts one after the other) is past it before
    the test has posted them all."""
    tier._overdue.timeout_s = BOUND_S


def time_out_a_load(tier: TierManager, agent: NeverDone) -> None:
    """Stall a load of ``a`` into block 2 until it settles "timed out" (its read still held)."""
    agent.stuck = True
    load = tier.load(["a"], [2])
    start_bound(tier)
    assert load.result(timeout=RESULT_TIMEOUT_S).failed == {"a": TIMED_OUT}


@pytest.fixture
def stalled(peer: RemotePeer) -> Iterator[tuple[TierManager, NeverDone]]:
    """A tier over 8 blocks, ``transfer_timeout_s`` off until :func:`start_bound`, with peer
    ``p`` holding key ``a`` (stored from block 0), and its transport's agent (set ``stuck`` to
    stall transfers)."""
    arena = BlockArena(8, BLOCK_LEN)
    transport = NixlTransport("stall", arena.tensor, passive_progress=False)
    agent = NeverDone(transport._agent)
    transport._agent = agent
    tier = TierManager(arena, transport, transfer_timeout_s=0)
    try:
        tier.add_peer("p", *peer.peer_args())
        arena.tensor[0].fill_(0xAA)
        assert tier.store(["a"], [0]).result(timeout=RESULT_TIMEOUT_S).ok
        yield tier, agent
    finally:
        agent.stuck = False
        tier.close()


def test_a_transfer_never_done_settles_after_the_bound_and_its_read_blocks_stay_withheld(
    stalled: tuple[TierManager, NeverDone],
) -> None:
    """A load and a store whose transfers NIXL kept ``PROC`` resolved only when the tier
    closed. Now they settle ("timed out", "peer lost") soon after ``transfer_timeout_s``, the
    peer and its keys are dropped, and the load's block is refused to loads and stores until
    the transport reports its read (then it is free again)."""
    tier, agent = stalled
    tier.arena.tensor[3].fill_(0xCC)
    agent.stuck = True
    load = tier.load(["a"], [2])
    store = tier.store(["c"], [3])  # (posted before the bound drops the peer: else "no peers")
    start_bound(tier)
    assert load.result(timeout=RESULT_TIMEOUT_S).failed == {"a": TIMED_OUT}
    assert store.result(timeout=RESULT_TIMEOUT_S).failed == {"c": PEER_LOST}
    assert tier.peers() == [] and not tier.contains("a")
    assert tier.stats().late_reads == 1
    with pytest.raises(ValueError, match=r"local blocks \[2\].*timed out"):
        tier.load(["a"], [2])
    with pytest.raises(ValueError, match=r"local blocks \[2\].*store from other blocks"):
        tier.store(["d"], [2])
    agent.stuck = False  # the read is reported over: nothing more of it lands
    wait_until(lambda: tier.stats().late_reads == 0, "the late read was reported")
    assert tier.store(["d"], [2]).result(timeout=RESULT_TIMEOUT_S).failed == {"d": "no peers"}


def test_withheld_until_resolves_once_the_late_read_into_those_blocks_is_reported(
    stalled: tuple[TierManager, NeverDone],
) -> None:
    """A caller that keeps a timed-out load's blocks (the torch loop's arena) learns when the
    tier accepts them again: at once for blocks no late read targets, else once the transport
    reported the read, and at close."""
    tier, agent = stalled
    assert tier.withheld_until([2, 5]).done()
    time_out_a_load(tier, agent)
    gate = tier.withheld_until([5, 2])
    assert tier.withheld_until([5]).done() and not gate.done()
    agent.stuck = False  # the read is reported over: nothing more of it lands
    assert gate.result(timeout=RESULT_TIMEOUT_S).ok and tier.stats().late_reads == 0
    tier.store(["d"], [2]).result(timeout=RESULT_TIMEOUT_S)  # accepted (no peers left)


def test_withheld_until_resolves_when_the_tier_closes(
    stalled: tuple[TierManager, NeverDone],
) -> None:
    tier, agent = stalled
    time_out_a_load(tier, agent)
    gate = tier.withheld_until([2])
    tier.close()
    assert gate.result(timeout=RESULT_TIMEOUT_S).ok


def test_a_read_still_held_at_close_is_released_with_the_transport(
    stalled: tuple[TierManager, NeverDone],
) -> None:
    """Closing the tier releases every transfer: nothing more lands, nothing is withheld."""
    tier, agent = stalled
    time_out_a_load(tier, agent)
    assert tier.stats().late_reads == 1
    tier.close()
    assert tier.stats().late_reads == 0


def test_unsettled_late_loads_the_bound_drops_the_host_and_a_late_load_waits_for_its_read() -> None:
    """``settle_late_loads=False`` (for a caller that reuses a failed load's blocks at once):
    past the bound the peer is dropped (its keys with it, its stores settle "peer lost"), but
    the load stays pending, nothing withheld, until the transport reports its read; it then
    settles once, "peer lost"."""
    arena = BlockArena(4, BLOCK_LEN)
    transport = StrayReadTransport(arena.tensor)
    transport.remotes[b"p"] = torch.zeros(4, BLOCK_LEN, dtype=torch.uint8)
    tier = TierManager(arena, transport, transfer_timeout_s=BOUND_S, settle_late_loads=False)
    try:
        tier.add_peer("p", b"p", 0, 4, BLOCK_LEN)
        arena.tensor[0].fill_(0xAA)
        assert tier.store(["a"], [0]).result(timeout=RESULT_TIMEOUT_S).ok
        transport.hold_reads = True
        load = tier.load(["a"], [1])
        wait_until(lambda: tier.peers() == [], "the bound dropped the peer")
        assert not load.done() and tier.stats().late_reads == 0
        assert not tier.contains("a")
        (read,) = transport.reads
        transport.land_read(read, report_done=True)
        assert load.result(timeout=RESULT_TIMEOUT_S).failed == {"a": PEER_LOST}
    finally:
        tier.close()


def test_settle_late_loads_must_be_a_bool() -> None:
    arena = BlockArena(4, BLOCK_LEN)
    with pytest.raises(TypeError, match="settle_late_loads must be True or False"):
        TierManager(arena, StrayReadTransport(arena.tensor), settle_late_loads="no")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("bad", "error"),
    [({"transfer_timeout_s": -1}, ValueError), ({"settle_late_loads": "no"}, TypeError)],
)
def test_create_refuses_a_bad_bound_before_it_builds_an_agent(
    monkeypatch: pytest.MonkeyPatch, bad: dict[str, Any], error: type[Exception]
) -> None:
    """``TierManager.create`` built its arena and a NIXL agent, which it never closed, before
    it refused a bad ``transfer_timeout_s``: now it refuses it first."""

    def no_agent(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a NIXL agent was built for a tier that refuses its arguments")

    monkeypatch.setattr(nixl_module, "NixlTransport", no_agent)
    with pytest.raises(error, match=next(iter(bad))):
        TierManager.create(4, BLOCK_LEN, **bad)
