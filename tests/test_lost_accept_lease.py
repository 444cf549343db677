"""A connect that gave up waiting for its ``Accept`` (``AcceptLost``) may have opened a private
lease the tier never learned of: the tier knows the session's id, and the host holds the lease
(unreleased, it expires into held slots) until that id is named in a release. Nobody
connecting to that host again, the failed connect names it at once over a session of its own:
before, the host held the lease for good (without ``--hold-timeout``) though nothing of it was
ever written, and ``close`` only warned that the host was no longer dialled."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from remote_support import BLOCK_LEN, fake_session, wait_for

from torch_kv_tier.manager import TierManager
from torch_kv_tier.remote import ServerProcess, handshake
from torch_kv_tier.remote import protocol as p
from torch_kv_tier.remote.handshake_errors import AcceptLost
from torch_kv_tier.session_releases import RELEASE_THREAD

POOL = 64


@pytest.mark.timeout(60)
def test_a_lease_opened_by_a_connect_that_gave_up_is_released_when_the_tier_closes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _lose_accepts_of(monkeypatch, threading.current_thread())
    extra = ["--lease-timeout", "1"]
    with ServerProcess.start(POOL, BLOCK_LEN, extra_args=extra) as server:
        with (
            TierManager.create(16, BLOCK_LEN, name="gave-up") as tier,
            pytest.raises(AcceptLost),
        ):
            tier.connect(server.address, private=True, slots=POOL - 16)
        monkeypatch.undo()  # the observer's own handshake is a plain one
        with fake_session(server.address, private=False) as observer:
            freed = wait_for(lambda: observer.stats()["free_blocks"] == POOL, 10.0)
            stats = observer.stats()
            assert freed, {k: stats[k] for k in ("free_blocks", "leased_blocks", "held_blocks")}


def _lose_accepts_of(monkeypatch: pytest.MonkeyPatch, thread: threading.Thread) -> None:
    """The ``Accept``s ``thread``'s handshakes await come (the host opened the session), as if
    too late: ``AcceptLost``. Other threads' handshakes (a release's) are plain ones."""
    real = handshake._expect

    def lost(sock: Any, address: str, seq: int, deadline: float, kind: type, *args: Any) -> Any:
        reply = real(sock, address, seq, deadline, kind, *args)
        if kind is p.Accept and threading.current_thread() is thread:
            raise TimeoutError(f"no Accept from {address} by the deadline")
        return reply

    monkeypatch.setattr(handshake, "_expect", lost)


def _nothing_held(address: str) -> dict[str, int] | None:
    """``None`` once the host at ``address`` leases and holds no slot (within 10 s: a lease
    nobody names expires into held slots after ``--lease-timeout``), else what it does."""
    with fake_session(address, private=False) as observer:
        quantities = ("leased_blocks", "held_blocks")
        if wait_for(lambda: not any(observer.stats()[q] for q in quantities), 10.0):
            return None
        stats = observer.stats()
        return {q: stats[q] for q in quantities}


@pytest.mark.timeout(60)
def test_a_connect_that_gave_up_as_an_earlier_ones_release_ended_is_released_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: a second connect of the address that gave up just as the release of
    the first one's lease ended (its list taken, its thread not over) found the address
    remembered as removed and sent nothing: its lease stayed held until ``close``."""
    with (
        ServerProcess.start(POOL, BLOCK_LEN, extra_args=["--lease-timeout", "1"]) as server,
        TierManager.create(16, BLOCK_LEN, name="gave-up-twice") as tier,
    ):
        _lose_accepts_of(monkeypatch, threading.current_thread())
        ended, go = threading.Event(), threading.Event()
        end = tier._end_keeping_releases

        def first_release_held_once_ended(session: Any, clean: bool) -> None:
            end(session, clean)
            if threading.current_thread().name == RELEASE_THREAD and not ended.is_set():
                ended.set()
                go.wait(timeout=20.0)

        monkeypatch.setattr(tier, "_end_keeping_releases", first_release_held_once_ended)
        with pytest.raises(AcceptLost):
            tier.connect(server.address, private=True, slots=16)
        assert ended.wait(10.0), "the first lease's release never ended"
        with pytest.raises(AcceptLost):
            tier.connect(server.address, private=True, slots=16)
        go.set()
        monkeypatch.undo()
        held = _nothing_held(server.address)
        assert held is None, held


@pytest.mark.timeout(60)
@pytest.mark.parametrize("redial_if_down", [False, True])
def test_a_connect_that_gave_up_on_a_connected_host_is_released_over_its_session(
    monkeypatch: pytest.MonkeyPatch, redial_if_down: bool
) -> None:
    """Found by review: a private connect of a host connected already (shared) that gave up on
    its ``Accept`` sent nothing (the host dialled, nor dialled again with ``redial_if_down``):
    its lease stayed held until ``close``. It goes over the live session now."""
    with (
        ServerProcess.start(POOL, BLOCK_LEN, extra_args=["--lease-timeout", "1"]) as server,
        TierManager.create(16, BLOCK_LEN, name="gave-up-connected") as tier,
    ):
        tier.connect(server.address)
        _lose_accepts_of(monkeypatch, threading.current_thread())
        with pytest.raises(AcceptLost):
            tier.connect(server.address, private=True, slots=16, redial_if_down=redial_if_down)
        monkeypatch.undo()
        held = _nothing_held(server.address)
        assert held is None, held


@pytest.mark.timeout(60)
def test_a_connect_that_gave_up_as_the_tier_closed_is_released_by_its_own_last_word(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: a connect whose wait for the ``Accept`` ran out as ``close`` ran (the
    thread descheduled between its timeout and handing the session back, on a busy machine)
    handed it back once ``close`` had said its last words: nobody named it, its lease stayed
    held for good (without ``--hold-timeout``), and nothing was logged. It names it itself."""
    real = handshake._expect
    tier = TierManager.create(16, BLOCK_LEN, name="gave-up-closing")

    def accept_lost_after_the_close(
        sock: Any, address: str, seq: int, deadline: float, kind: type, *args: Any
    ) -> Any:
        reply = real(sock, address, seq, deadline, kind, *args)
        if kind is p.Accept and threading.current_thread() is threading.main_thread():
            closer = threading.Thread(target=tier.close)  # (awaits no handshake of this thread)
            closer.start()
            closer.join(timeout=30.0)
            raise TimeoutError(f"no Accept from {address} by the deadline")
        return reply

    monkeypatch.setattr(handshake, "_expect", accept_lost_after_the_close)
    with ServerProcess.start(POOL, BLOCK_LEN, extra_args=["--lease-timeout", "1"]) as server:
        with tier, pytest.raises(AcceptLost):
            tier.connect(server.address, private=True, slots=16)
        assert tier.closed
        monkeypatch.undo()
        held = _nothing_held(server.address)
        assert held is None, held
