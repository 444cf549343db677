"""A ``KeyboardInterrupt`` as the tier resolves the futures it settled (``Transfers._flush``):
on the poller (a done-callback's), the poller goes on and later transfers still complete; on
any thread (in ``_flush``, ``store``, ``load``, a grant's answer), the futures it took and did
not resolve yet are resolved by the next flush."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from late_write_support import BLOCK, late_write_tier
from release_support import RESULT_TIMEOUT_S
from tier_races_support import add_shared_host, in_process_tier

from torch_kv_tier.arena import BlockArena
from torch_kv_tier.records import Request


def test_a_callback_s_keyboard_interrupt_on_the_poller_leaves_it_polling(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Found by review: a done-callback that raised ``KeyboardInterrupt`` on the poller
    thread (``Future`` logs only an ``Exception``) ended the poller: no later transfer ever
    completed, its future hung until ``close``."""
    with late_write_tier(BlockArena(8, BLOCK), {"p": 4}) as (tier, transport):
        transport.hold = True  # writes stay in flight until landed: the poller completes them
        first = tier.store(["a"], [0])
        ran = threading.Event()

        def interrupt(_: object) -> None:
            ran.set()
            raise KeyboardInterrupt

        first.add_done_callback(interrupt)
        (tid,) = transport.in_flight()
        transport.land(tid)
        assert first.result(timeout=RESULT_TIMEOUT_S).ok
        assert ran.wait(RESULT_TIMEOUT_S)
        second = tier.store(["b"], [1])
        (tid,) = transport.in_flight()
        transport.land(tid)
        assert second.result(timeout=RESULT_TIMEOUT_S).ok, "the poller died with the callback"
        assert "raised KeyboardInterrupt on the tier's thread 'tkvt-poller'" in caplog.text


def test_an_interrupt_as_the_flush_releases_the_lock_loses_no_future(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: ``_flush`` took the settled requests under the lock, and a
    ``KeyboardInterrupt`` raised as that lock was released (work deferred to its holder,
    ``DeferringLock``: a Ctrl-C there is raised on) lost them: no later flush resolved them."""
    with late_write_tier(BlockArena(8, BLOCK), {"p": 4}) as (tier, _):
        request = Request([b"k"])
        request.settle(request.keys, None)
        cleared, caller = tier._withheld.cleared, threading.current_thread()
        interrupts = [KeyboardInterrupt()]

        def interrupt() -> None:
            raise interrupts.pop()

        def cleared_then_interrupted() -> list[Any]:
            if threading.current_thread() is not caller or not interrupts:
                return cleared()
            tier._lock._deferred.append(interrupt)  # raised as the flush releases the lock
            return [request, *cleared()]

        monkeypatch.setattr(tier._withheld, "cleared", cleared_then_interrupted)
        with pytest.raises(KeyboardInterrupt):
            tier._flush()
        assert not interrupts, "the interrupt was never injected"
        tier._flush()  # the next flush (close's retry, the poller's next turn)
        assert request.future.result(timeout=RESULT_TIMEOUT_S).ok  # (or the poller, as it wakes)


@pytest.mark.parametrize("call", ["store", "load"])
def test_an_interrupt_as_a_store_or_load_releases_the_lock_loses_no_other_future(
    monkeypatch: pytest.MonkeyPatch, call: str
) -> None:
    """Found by review: ``store`` and ``load`` took every settled request out of the tier
    (another caller's too, completed by their poll) under the lock, then resolved them; a
    ``KeyboardInterrupt`` between (as the lock was released, or a Ctrl-C on the lines after)
    lost them: that other caller's future never resolved."""
    with late_write_tier(BlockArena(8, BLOCK), {"p": 4}) as (tier, _):
        assert tier.store(["b"], [1]).result(timeout=RESULT_TIMEOUT_S).ok
        other = Request([b"k"])  # another caller's, settled as this call polled
        other.settle(other.keys, None)
        refuse, interrupts = tier._withheld.refuse, [KeyboardInterrupt()]

        def interrupt() -> None:
            raise interrupts.pop()

        def refuse_then_interrupted(*args: Any) -> None:
            refuse(*args)
            if interrupts:
                tier._ready.append(other)  # (under the call's lock: the poller cannot take it)
                tier._lock._deferred.append(interrupt)  # raised as the call releases the lock

        monkeypatch.setattr(tier._withheld, "refuse", refuse_then_interrupted)
        with pytest.raises(KeyboardInterrupt):
            if call == "store":
                tier.store(["a"], [0])
            else:
                tier.load(["b"], [2])
        assert not interrupts, "the interrupt was never injected"
        tier._flush()  # the next flush (the next call, the poller's next turn)
        assert other.future.result(timeout=RESULT_TIMEOUT_S).ok  # (or the poller, as it wakes)


def test_an_interrupt_as_a_grant_answer_releases_the_lock_loses_no_other_future(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: a shared host's grant answer (``_on_granted``, on its session's I/O
    thread) took every settled request out of the tier (another caller's too) under the lock,
    then resolved them; a ``KeyboardInterrupt`` between (as the lock was released, or a
    done-callback's) lost them, as in ``store``/``load``: that caller's future never
    resolved."""
    with in_process_tier() as (tier, _):
        host, session = add_shared_host(tier, 8)
        with tier._lock:
            tier._refill(host)  # asks the host for slots: answered below
        other = Request([b"k"])  # another caller's, settled as the answer was applied
        other.settle(other.keys, None)
        launch, interrupts = tier._launch_awaiting, [KeyboardInterrupt()]

        def interrupt() -> None:
            raise interrupts.pop()

        def launched_then_interrupted(*args: Any) -> bool:
            tier._ready.append(other)  # (under the answer's lock: the poller cannot take it)
            tier._lock._deferred.append(interrupt)  # raised as the answer releases the lock
            return launch(*args)

        monkeypatch.setattr(tier, "_launch_awaiting", launched_then_interrupted)
        with pytest.raises(KeyboardInterrupt):
            session.answer([0, 1])
        assert not interrupts, "the interrupt was never injected"
        tier._flush()  # the next flush (the next call, the poller's next turn)
        assert other.future.result(timeout=RESULT_TIMEOUT_S).ok
