"""A dropped host's session ends before anything else speaks to its host about it: nobody
names it as resolved while its end is due or under way (the host would end it first, and its
own disconnect would go unanswered). How the end itself is started is
``test_lost_session_end``."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from release_support import RESULT_TIMEOUT_S
from remote_support import BLOCK_LEN, wait_for

from torch_kv_tier import session_releases
from torch_kv_tier.manager import TierManager
from torch_kv_tier.remote import ServerProcess


@pytest.fixture
def gated_end(monkeypatch: pytest.MonkeyPatch) -> tuple[list[threading.Event], threading.Event]:
    """Each dropped session's end (``_end_dropped``) waits until ``gate[0]`` is set, or 2 s
    passed (a host slow to answer its disconnect); ``ended`` is set once one is over."""
    gate, ended, end_dropped = [threading.Event()], threading.Event(), TierManager._end_dropped

    def end_at_gate(tier: TierManager, session: Any, clean: bool) -> None:
        gate[0].wait(timeout=2.0)
        try:
            end_dropped(tier, session, clean)
        finally:
            ended.set()

    monkeypatch.setattr(TierManager, "_end_dropped", end_at_gate)
    return gate, ended


@pytest.fixture
def host() -> Iterator[ServerProcess]:
    with ServerProcess.start(64, BLOCK_LEN) as server:
        yield server


def test_a_host_removed_before_its_dropped_session_ended_is_not_told_to_release_it(
    gated_end: tuple[list[threading.Event], threading.Event],
    host: ServerProcess,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Found by review: ``remove_peer`` of a host dropped (a failed transfer) whose session's
    end had not run yet (a busy machine) named that session to the host as resolved, over a
    session of its own: the host ended it, then the session's own clean disconnect was
    refused, logged as a warning ("disconnect ... got no answer: ... no longer knows this
    session") though nothing was lost. It is named only once it ended, unless it ended clean."""
    gate, ended = gated_end
    with TierManager.create(16, BLOCK_LEN, name="removed-before-end") as tier:
        peer = tier.connect(host.address)
        session = tier._peers[peer].session
        assert session is not None
        with tier._lock:  # as a failed transfer does: the session ends on a thread of its own
            tier._lose_peer(peer, "failed a transfer")
        tier.remove_peer(peer)
        assert wait_for(  # what the removal carries over a session of its own is told
            lambda: (
                not [t for t in threading.enumerate() if t.name == session_releases.RELEASE_THREAD]
            ),
            RESULT_TIMEOUT_S,
        )
        with caplog.at_level(logging.WARNING):
            gate[0].set()
            assert ended.wait(timeout=RESULT_TIMEOUT_S)
        assert session.ended_clean, "the host had ended the session before its disconnect"
        assert [r.getMessage() for r in caplog.records if "disconnect" in r.getMessage()] == []
