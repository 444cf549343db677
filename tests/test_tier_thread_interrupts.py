"""A done-callback's ``KeyboardInterrupt`` on one of the tier's own threads other than the
poller (a host session's I/O thread as it applies a grant's answer or the session's loss,
membership's as it removes a host): logged, and that thread goes on; raised there, it ended
the thread (a session's I/O thread left its session silent, never reported lost)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from release_support import RESULT_TIMEOUT_S
from tier_races_support import SharedSession, add_shared_host, in_process_tier

from torch_kv_tier.manager import TierManager
from torch_kv_tier.tier_threads import TierThread


def _answered_with_no_slots(tier: TierManager, session: SharedSession) -> None:
    session.answer([])  # nothing this tier does could free its share: "capacity"


def _session_lost(tier: TierManager, session: SharedSession) -> None:
    session.lost = "the control connection was closed or reset"
    tier._on_session_lost("h")  # (its ``on_lost``): "peer lost"


def _removed(tier: TierManager, session: SharedSession) -> None:
    tier.remove_peer("h")  # (a host its source no longer lists): "peer lost"


def _on_a_tier_thread(name: str, call: Callable[[], None]) -> list[BaseException]:
    """Run ``call`` on a ``TierThread`` named ``name``; what it raised, if anything."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:
            raised.append(exc)

    thread = TierThread(target=run, name=name, daemon=True)
    thread.start()
    thread.join(RESULT_TIMEOUT_S)
    assert not thread.is_alive(), f"{name} hung"
    return raised


@pytest.mark.parametrize(
    ("thread", "settle"),
    [
        ("tkvt-session-h", _answered_with_no_slots),
        ("tkvt-session-h", _session_lost),
        ("tkvt-membership", _removed),
    ],
    ids=["grant-answer", "session-lost", "membership-removes"],
)
def test_a_callback_s_keyboard_interrupt_on_a_tier_thread_is_logged_and_it_goes_on(
    caplog: pytest.LogCaptureFixture,
    thread: str,
    settle: Callable[[TierManager, SharedSession], None],
) -> None:
    """Found by review: the poller survived a done-callback's ``KeyboardInterrupt``, the
    other tier threads that resolve futures did not: it ended them."""
    with in_process_tier() as (tier, _):
        _, session = add_shared_host(tier, 8)
        first = tier.store([b"a"], [0])  # no slot granted: both wait, and the host is asked
        second = tier.store([b"b"], [1])

        def interrupt(_: Any) -> None:
            raise KeyboardInterrupt

        first.add_done_callback(interrupt)
        raised = _on_a_tier_thread(thread, lambda: settle(tier, session))
        assert raised == [], f"the callback's interrupt ended {thread}"
        assert first.done() and second.done()
        assert "raised KeyboardInterrupt on the tier's thread" in caplog.text
