"""``PagedKVOffloader``'s calls that would wait (``flush`` and ``close`` with offloads pending,
an ``offload`` waiting for free arena slots, a ``restore`` waiting for its reads) raise
``RuntimeError`` at once in a done-callback on the tier's poller, as ``TierFuture.result()``
does there: such a wait held the poller for the offloader's whole timeout, as only the poller
could end it (a flush returned ``False`` though the write had landed, an offload failed "host
overdue"). Those that need not wait run there as anywhere."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest
import torch
from late_write_support import LateWriteTransport, late_write_tier
from remote_support import wait_until

from torch_kv_tier.arena import BlockArena
from torch_kv_tier.integrations.torch_loop import OffloadError, PagedKVOffloader

TIMEOUT_S = 10.0  # the offloader's: a wait on the poller lasted all of it
RESULT_TIMEOUT_S = 30.0
PAGES = 8
TRIGGERS = itertools.count()  # each trigger a key of its own: a new write to land


@dataclass
class Outcome:
    """What a call made in a done-callback on the poller returned or raised, and how long."""

    thread: str = ""
    value: object = None
    error: BaseException | None = None
    took: float = -1.0
    ran: threading.Event = field(default_factory=threading.Event)

    def refused(self) -> str:
        """The refusal's message, once the callback ran; fails the test unless it was one
        (raised as it is, or as the cause of an offload's ``OffloadError`` once it had sent
        some pages: then the message is that error's)."""
        assert self.ran.wait(RESULT_TIMEOUT_S), "the callback never ran"
        assert self.thread == "tkvt-poller"
        refusal = self.error.__cause__ if isinstance(self.error, OffloadError) else self.error
        assert type(refusal) is RuntimeError, (self.error, self.value)
        message = str(self.error)
        assert "add_done_callback" in message and "tkvt-poller" in message
        assert self.took < TIMEOUT_S / 2  # at once, not after the offloader's timeout
        return message


@contextmanager
def offloader(
    slots: int = 8, owns: bool = False
) -> Iterator[tuple[PagedKVOffloader, LateWriteTransport]]:
    """An offloader over an in-process tier of ``slots`` arena slots and one host, whose
    writes stay in flight until the test lands them (``transport.land``); ``owns``: it owns
    the tier (its ``close`` closes it)."""
    keys_c = [torch.randn(PAGES, 2, 1, 8) for _ in range(2)]
    values_c = [torch.randn(PAGES, 2, 1, 8) for _ in range(2)]
    arena = BlockArena(slots, PagedKVOffloader.block_len_for(keys_c, values_c))
    with late_write_tier(arena, {"a": 64}) as (tier, transport):
        off = PagedKVOffloader(keys_c, values_c, tier, timeout=TIMEOUT_S, owns_manager=owns)
        transport.hold = True
        yield off, transport


def on_poller(
    off: PagedKVOffloader, transport: LateWriteTransport, call: Callable[[], object]
) -> Outcome:
    """Run ``call`` in the done-callback of an offload whose write the poller completes."""
    outcome = Outcome()

    def callback(_: Future[object]) -> None:
        outcome.thread = threading.current_thread().name
        started = time.monotonic()
        try:
            outcome.value = call()
        except BaseException as exc:
            outcome.error = exc
        outcome.took = time.monotonic() - started
        outcome.ran.set()

    in_flight = set(transport.in_flight())
    trigger = off.offload([PAGES - 1], [f"trigger{next(TRIGGERS)}"])
    (tid,) = set(transport.in_flight()) - in_flight
    trigger.add_done_callback(callback)
    transport.land(tid)
    return outcome


def hold_reads(transport: LateWriteTransport) -> list[Callable[[], None]]:
    """Keep ``transport``'s reads from now on in flight (they end at once otherwise, reported
    to the caller's own poll); returns, for each read begun, what lands it."""
    landings: list[Callable[[], None]] = []

    def read_blocks(peer_id: str, local: Sequence[int], remote: Sequence[int]) -> int:
        with transport._lock:
            tid = next(transport._ids)

        def land() -> None:
            with transport._lock:
                transport.region.owner[list(local)] = transport._peers[peer_id][list(remote)]
                transport._done[tid] = peer_id

        landings.append(land)
        return tid

    transport.read_blocks = read_blocks  # type: ignore[method-assign]
    return landings


def land_all(transport: LateWriteTransport) -> None:
    for tid in transport.in_flight():
        transport.land(tid)


def test_flush_and_close_with_offloads_pending_refuse_on_the_poller_leaving_it_open() -> None:
    with offloader() as (off, transport):
        pending = off.offload([0], ["p0"])
        flushed = on_poller(off, transport, lambda: off.flush(TIMEOUT_S))
        assert "flush() with" in flushed.refused()
        closed = on_poller(off, transport, lambda: off.close(TIMEOUT_S))
        assert "close() with" in closed.refused()
        land_all(transport)
        assert pending.result(timeout=RESULT_TIMEOUT_S).ok
        assert off.flush()
        assert off.offload([1], ["p1"]) is not None  # still open: the close was refused
        land_all(transport)
        assert off.flush() and off.lookup(["p0", "p1"]) == 2


def test_a_close_with_nothing_pending_closes_its_tier_on_the_poller_at_once() -> None:
    # Reviewed: a close with nothing pending closes the tier it owns there (the tier's close
    # does not join the poller it runs on), neither held for its timeout nor refused.
    with offloader(owns=True) as (off, transport):
        closed = on_poller(off, transport, lambda: off.close(TIMEOUT_S))
        assert closed.ran.wait(RESULT_TIMEOUT_S) and closed.thread == "tkvt-poller"
        assert closed.error is None and closed.took < TIMEOUT_S / 2
        assert off.manager.closed
        off.manager._thread.join(RESULT_TIMEOUT_S)  # the poller ends: it ran the close
        assert not off.manager._thread.is_alive()


def test_a_flush_with_nothing_pending_returns_true_on_the_poller() -> None:
    with offloader() as (off, transport):
        flushed = on_poller(off, transport, lambda: off.flush(TIMEOUT_S))
        assert flushed.ran.wait(RESULT_TIMEOUT_S) and flushed.thread == "tkvt-poller"
        assert flushed.error is None and flushed.value is True


def test_an_offload_that_would_wait_for_slots_refuses_on_the_poller_one_with_free_slots_runs() -> (
    None
):
    with offloader(slots=2) as (off, transport):
        off.offload([0], ["p0"])  # holds one slot; the trigger the other, until it lands
        waiting = on_poller(off, transport, lambda: off.offload([1, 2], ["p1", "p2"]))
        assert "free arena slots" in waiting.refused()
        # Found by review: the refusal said nothing of page 1, sent before it would have
        # waited (stored once it landed): the caller could not tell which pages to offload
        # again. It names the pages sent and those not now.
        assert isinstance(waiting.error, OffloadError)
        assert "handed 1 pages (page_ids [1])" in str(waiting.error)
        assert "1 pages (page_ids [2]) were not sent" in str(waiting.error)
        land_all(transport)  # (what it sent before it would have waited)
        assert off.flush() and off.lookup(["p1"]) == 1 and off.lookup(["p2"]) == 0
        fitting = on_poller(off, transport, lambda: off.offload([3], ["p3"]))
        assert fitting.ran.wait(RESULT_TIMEOUT_S) and fitting.error is None
        land_all(transport)
        assert isinstance(fitting.value, Future)
        assert fitting.value.result(timeout=RESULT_TIMEOUT_S).ok
        assert off.flush() and off.lookup(["p0", "p3"]) == 2
        wait_until(lambda: off.manager.arena.num_free == 2, "every slot is back")


def test_a_restore_with_its_reads_under_way_refuses_on_the_poller_and_its_slots_come_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Found by review: the refusal came wrapped in an OffloadError saying the restore "failed
    # copying into page_ids[0:1], which may be partly written" (nothing was copied), and the
    # log said the restore "was interrupted", as if by a Ctrl-C. The refusal is raised as it
    # is now, and the log line names it.
    with offloader(slots=4) as (off, transport):
        stored = off.offload([0], ["p0"])
        land_all(transport)
        assert stored.result(timeout=RESULT_TIMEOUT_S).ok
        reads = hold_reads(transport)
        reading = on_poller(off, transport, lambda: off.restore(["p0"], [1]))
        assert "restore() with its reads under way" in reading.refused()
        assert type(reading.error) is RuntimeError  # as it is: it copied nothing
        assert "interrupted" not in caplog.text
        assert (
            "restore from a ended early by RuntimeError (PagedKVOffloader.restore()" in caplog.text
        )
        del transport.read_blocks  # (later reads end at once again)
        for land in reads:
            land()
        assert off.flush()
        wait_until(lambda: off.manager.arena.num_free == 4, "the read's slot is back")
        assert off.restore(["p0"], [2]) == 1
