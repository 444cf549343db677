"""A done-callback that waits for another tier future (``result()``, ``exception()``) on one of
the tier's own threads gets ``RuntimeError`` at once, not a hang: on the poller nothing polled
the transfer it waited for (the wait lasted its whole timeout), on a host session's I/O thread
that session's heartbeats and grant answers waited with it. A done future still returns at once
on any thread, a wait elsewhere is a plain wait, and the retry chained properly succeeds."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import pytest
import torch
from late_write_support import BLOCK, late_write_tier
from remote_support import fill_random, wait_until

from torch_kv_tier.arena import BlockArena
from torch_kv_tier.benchmarks.reliability_common import ucx_over_tcp
from torch_kv_tier.integrations.torch_loop import PagedKVOffloader
from torch_kv_tier.keys import home_peer
from torch_kv_tier.manager import TierManager
from torch_kv_tier.remote import ServerProcess
from torch_kv_tier.results import TransferResult
from torch_kv_tier.shared_host import SharedHost
from torch_kv_tier.tier_threads import TierFuture, TierThread

WAIT_S = 5.0  # the callback's wait: it used to last all of it
RESULT_TIMEOUT_S = 30.0


@dataclass
class Seen:
    """What a done-callback that retries, then waits for its retry, saw."""

    thread: str = ""
    own: TransferResult | None = None  # its own future's result (done: read at once)
    error: BaseException | None = None  # what the wait for the retry raised
    waited: float = -1.0
    chained: Future[TransferResult] = field(default_factory=Future)
    ran: threading.Event = field(default_factory=threading.Event)


def retry_and_wait(retry: Callable[[], Future[TransferResult]]) -> tuple[Seen, Callable]:
    """A done-callback that reads its own future, calls ``retry``, waits for the retry's
    future (the mistake), then chains a callback to it (the way that works)."""
    seen = Seen()

    def callback(future: Future[TransferResult]) -> None:
        seen.thread = threading.current_thread().name
        seen.own = future.result()
        again = retry()
        started = time.monotonic()
        try:
            again.result(timeout=WAIT_S)
        except BaseException as exc:
            seen.error = exc
        seen.waited = time.monotonic() - started
        again.add_done_callback(lambda done: seen.chained.set_result(done.result()))
        seen.ran.set()

    return seen, callback


def assert_refused_at_once(seen: Seen) -> None:
    assert seen.ran.wait(RESULT_TIMEOUT_S), "the callback never ran"
    assert isinstance(seen.error, RuntimeError), seen.error
    assert "add_done_callback" in str(seen.error) and seen.thread in str(seen.error)
    assert seen.waited < WAIT_S  # not its timeout: it raised instead of waiting


def test_a_wait_in_a_callback_on_the_poller_raises_and_a_chained_retry_succeeds() -> None:
    with late_write_tier(BlockArena(8, BLOCK), {"a": 8}) as (tier, transport):
        transport.hold = True  # writes stay in flight until landed: the poller completes them
        first = tier.store(["k0"], [0])
        seen, callback = retry_and_wait(lambda: tier.store(["k1"], [1]))
        first.add_done_callback(callback)
        (tid,) = transport.in_flight()
        transport.land(tid)
        assert_refused_at_once(seen)
        assert seen.thread == "tkvt-poller"
        assert seen.own is not None and seen.own.ok  # its own, done future: read at once
        (retried,) = transport.in_flight()  # the retry is still in flight, as it was
        transport.land(retried)
        assert seen.chained.result(timeout=RESULT_TIMEOUT_S).ok
        assert tier.lookup(["k0", "k1"]) == 2


def test_a_wait_in_a_callback_on_the_poller_for_an_offload_raises_and_a_chained_one_succeeds() -> (
    None
):
    """``PagedKVOffloader.offload``'s future (one over the tier's batch futures) refuses the
    same wait: the retry's offload is in flight as the poller runs the first one's callback."""
    keys_c = [torch.randn(4, 2, 1, 8) for _ in range(2)]
    values_c = [torch.randn(4, 2, 1, 8) for _ in range(2)]
    arena = BlockArena(8, PagedKVOffloader.block_len_for(keys_c, values_c))
    with late_write_tier(arena, {"a": 8}) as (tier, transport):
        offloader = PagedKVOffloader(keys_c, values_c, tier, timeout=RESULT_TIMEOUT_S)
        transport.hold = True
        first = offloader.offload([0], ["p0"])
        seen, callback = retry_and_wait(lambda: offloader.offload([1], ["p1"]))
        first.add_done_callback(callback)
        (tid,) = transport.in_flight()
        transport.land(tid)
        assert_refused_at_once(seen)
        assert seen.thread == "tkvt-poller"
        (retried,) = transport.in_flight()
        transport.land(retried)
        assert seen.chained.result(timeout=RESULT_TIMEOUT_S).ok
        assert offloader.lookup(["p0", "p1"]) == 2


def _wait_for_slots(tier: TierManager, host: SharedHost) -> None:
    """Have ``host``'s stores wait for a grant that nothing asks for (as while one is out):
    once the grant its join asked for (if any) was answered (that answer would bring slots, and
    launch a store waiting), its slots in hand (never written) are set aside."""

    def set_aside() -> bool:
        with tier._lock:
            if host.refilling:  # a grant request is out
                return False
            host.grants.clear()
            host.refilling = True
            return True

    wait_until(set_aside, f"{host.slots.peer_id} answered the grant its join asked for")


def test_a_wait_in_a_callback_on_a_session_io_thread_raises_and_a_chained_retry_succeeds() -> None:
    """The host of a store waiting for slots dies: its session's I/O thread drops it, and runs
    the store's callback, whose retry goes to the other host and waits for a grant there."""
    with (
        ucx_over_tcp(),
        # a session may hold 16 slots granted: 12 left to grant once its 4 are set aside
        ServerProcess.start(64, BLOCK, extra_args=["--max-grant", "16"]) as kept,
        ServerProcess.start(64, BLOCK) as killed,
        TierManager.create(8, BLOCK, name="cbwait", grant_batch=4) as tier,
    ):
        kept_id = tier.connect(kept.address)
        lost_id = tier.connect(killed.address)
        fill_random(tier)
        ids = [kept_id, lost_id]
        key = next(k for k in (f"k{i}" for i in range(1000)) if home_peer(k, ids) == lost_id)
        hosts = dict(tier._peers)
        for host in hosts.values():
            assert isinstance(host, SharedHost)
            _wait_for_slots(tier, host)
        waiting = tier.store([key], [0])
        assert not waiting.done()
        seen, callback = retry_and_wait(lambda: tier.store([key], [1]))
        waiting.add_done_callback(callback)
        os.kill(killed.proc.pid, signal.SIGKILL)  # its connection resets: the I/O thread drops it
        assert_refused_at_once(seen)
        assert seen.thread.startswith("tkvt-session"), seen.thread
        assert seen.own is not None and seen.own.failed == {key: "peer lost"}
        kept_host = hosts[kept_id]
        assert isinstance(kept_host, SharedHost)
        with tier._lock:  # the grant the retry waits for is asked now
            kept_host.refilling = False
            tier._refill(kept_host)
        assert seen.chained.result(timeout=RESULT_TIMEOUT_S).ok
        assert tier.peers() == [kept_id] and tier.lookup([key]) == 1


def test_a_done_future_returns_on_a_tier_thread_and_a_wait_elsewhere_is_a_plain_wait() -> None:
    done: TierFuture[int] = TierFuture()
    done.set_result(7)
    pending: TierFuture[int] = TierFuture()
    outcomes: list[object] = []

    def on_tier_thread() -> None:
        outcomes.append(done.result())
        outcomes.append(done.exception())
        for wait in (pending.result, pending.exception):
            try:
                wait(WAIT_S)
            except RuntimeError as exc:
                outcomes.append(type(exc))

    thread = TierThread(target=on_tier_thread, name="tkvt-test")
    thread.start()
    thread.join(RESULT_TIMEOUT_S)
    assert outcomes == [7, None, RuntimeError, RuntimeError]
    with pytest.raises(TimeoutError):  # a thread of the user's own: a plain wait
        pending.result(timeout=0.01)
