"""A caller that retries at once after its host was lost (in the future's done-callback, or
right after ``result()``) sees the tier without that host: by the time a store or load future
settles "peer lost" or "transfer failed" for a lost host, the host is out of placement and
``peers()``, ``stats().peers_dropped`` counts it, its keys' ``lost`` events are recorded, and
``contains``/``lookup`` no longer report its keys. A re-store goes to another host; a re-load
of one of its keys is a miss on the calling thread, never a wait for a timeout."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import pytest
import torch
from late_write_support import BLOCK, LateWriteTransport, late_write_tier
from remote_support import wait_for
from test_stray_reads import StrayReadTransport

from torch_kv_tier.arena import BlockArena
from torch_kv_tier.keys import home_peer
from torch_kv_tier.manager import TierManager
from torch_kv_tier.results import TransferResult

RESULT_TIMEOUT_S = 10.0
PEERS = ("a", "b")


def homed_on(peer_id: str, n: int, prefix: str) -> list[str]:
    """``n`` keys whose rendezvous home among ``PEERS`` is ``peer_id``."""
    keys = (f"{prefix}{i}" for i in range(10_000))
    return [k for k in keys if home_peer(k, PEERS) == peer_id][:n]


@dataclass
class Seen:
    """What a retry saw of the tier as the failed future settled (in its done-callback)."""

    failed: dict[object, str] = field(default_factory=dict)
    peers: list[str] = field(default_factory=list)
    peers_dropped: int = -1
    lost_events: list[object] = field(default_factory=list)
    still_held: list[bool] = field(default_factory=list)
    lookup: int = -1
    placed: list[str] = field(default_factory=list)
    retried: Future[TransferResult] | None = None
    # set once the callback ran (``result()`` returns before a future's callbacks run)
    ran: threading.Event = field(default_factory=threading.Event)


def retry_store_in_callback(
    tier: TierManager, held: list[str], local: list[int]
) -> tuple[Seen, Callable[[Future[TransferResult]], None]]:
    """A done-callback that looks at the tier and re-stores the failed keys from ``local``."""
    seen = Seen()

    def retry(future: Future[TransferResult]) -> None:
        result = future.result()
        seen.failed = dict(result.failed)
        seen.peers = tier.peers()
        seen.peers_dropped = tier.stats().peers_dropped
        seen.lost_events = [e.key for e in tier.take_events() if e.kind == "lost"]
        seen.still_held = [tier.contains(k) for k in held]
        seen.lookup = tier.lookup(held)
        keys = list(result.failed)
        seen.retried = tier.store(keys, local[: len(keys)], seen.placed)
        seen.ran.set()

    return seen, retry


def lose_b(transport: LateWriteTransport, how: str) -> None:
    """Fail host "b", which holds a write in flight, the way ``how`` names."""
    if how == "faulted":
        transport.fault("b", "its endpoint failed")
    elif how == "its transfer failed":
        (tid,) = transport.in_flight()
        transport.fail(tid)
    else:
        raise AssertionError(how)


@pytest.mark.parametrize("how", ["faulted", "its transfer failed", "its post refused"])
def test_a_store_retried_as_its_host_is_lost_goes_to_another_host(how: str) -> None:
    arena = BlockArena(16, BLOCK)
    arena.tensor.copy_(torch.arange(16, dtype=torch.uint8).unsqueeze(1).expand(16, BLOCK))
    with late_write_tier(arena, dict.fromkeys(PEERS, 8), events=True) as (tier, transport):
        held = homed_on("b", 2, "held")
        assert tier.store(held, [0, 1]).result(timeout=RESULT_TIMEOUT_S).ok
        tier.take_events()
        keys = homed_on("b", 2, "new")
        seen, retry = retry_store_in_callback(tier, held, [4, 5])
        if how == "its post refused":  # settles on this thread, inside ``store``
            transport.refuse_next = True
            future = tier.store(keys, [2, 3])
        else:
            transport.hold = True
            future = tier.store(keys, [2, 3])
            transport.hold = False  # the retry's writes land at once
        future.add_done_callback(retry)
        if how != "its post refused":
            lose_b(transport, how)
        first = future.result(timeout=RESULT_TIMEOUT_S)
        assert seen.ran.wait(RESULT_TIMEOUT_S)

        assert set(first.failed) == set(keys) and seen.failed == first.failed
        assert seen.peers == ["a"] and seen.peers_dropped == 1
        assert sorted(seen.lost_events) == sorted(held)  # (the new keys were never visible)
        assert seen.still_held == [False, False] and seen.lookup == 0
        assert seen.placed == ["a"]  # the lost host is out of placement
        assert seen.retried is not None
        assert seen.retried.result(timeout=RESULT_TIMEOUT_S).ok
        # right after ``result()``: the same
        placed: list[str] = []
        again = tier.store(held, [0, 1], placed)
        assert placed == ["a"] and again.result(timeout=RESULT_TIMEOUT_S).ok
        assert tier.load(keys + held, [8, 9, 10, 11]).result(timeout=RESULT_TIMEOUT_S).ok
        assert torch.equal(arena.tensor[8:10], arena.tensor[4:6])
        assert torch.equal(arena.tensor[10:12], arena.tensor[0:2])


@pytest.mark.parametrize("fails", ["reported done", "its read failed"])
def test_a_load_retried_as_its_host_is_lost_is_a_miss_at_once(fails: str) -> None:
    """A load in flight from a host that is lost settles "peer lost" once the transport
    reports its read; a load of the same keys then, from its done-callback or after
    ``result()``, settles "missing" before ``load`` returns (nothing holds those keys). So
    does one right after the fault while the first read failed and may still land (that
    load settles only when the tier closes, ``test_stray_reads``)."""
    arena = BlockArena(16, BLOCK)
    transport = StrayReadTransport(arena.tensor)
    tier = TierManager(arena, transport, events=True)
    try:
        for peer_id in PEERS:
            transport.remotes[peer_id.encode()] = torch.zeros(8, BLOCK, dtype=torch.uint8)
            tier.add_peer(peer_id, peer_id.encode(), 0, 8, BLOCK)
        keys = homed_on("b", 2, "k")
        assert tier.store(keys, [0, 1]).result(timeout=RESULT_TIMEOUT_S).ok
        transport.hold_reads = True
        future = tier.load(keys, [2, 3])
        (tid,) = transport.reads
        retried: list[Future[TransferResult]] = []
        ran = threading.Event()

        def retry(done: Future[TransferResult]) -> None:
            retried.append(tier.load(list(done.result().failed), [4, 5]))
            ran.set()

        future.add_done_callback(retry)
        transport.fault("b", "its endpoint failed")
        # the poller drops "b" (a read reported done before that would be a verified hit)
        assert wait_for(lambda: tier.peers() == ["a"], RESULT_TIMEOUT_S)
        if fails == "its read failed":
            transport.fail_read(tid)
        else:
            transport.land_read(tid, report_done=True)
            first = future.result(timeout=RESULT_TIMEOUT_S)
            assert first.failed == dict.fromkeys(keys, "peer lost")
            assert ran.wait(RESULT_TIMEOUT_S)
            (second,) = retried
            assert second.done()  # settled inside ``load``: no wait for a timeout
            assert second.result().failed == dict.fromkeys(keys, "missing")
        after = tier.load(keys, [6, 7])
        assert after.done() and after.result().failed == dict.fromkeys(keys, "missing")
    finally:
        tier.close()
