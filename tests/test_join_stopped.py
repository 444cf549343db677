"""A host removed (``disconnect``) or its dial cancelled (``cancel_dial``) while its join
registers its region, before the host is published: the join went on and published it, so a
host the user removed stayed in ``peers()`` (a first connect), or was published and then
removed again (a redial). The join now checks its dial under the lock that publishes: it never
publishes, its connect fails saying the host was removed (and, ``redial_if_down``, it is
not dialled again), the host holds no session of it, and a later connect of the host joins it
at once."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest
from join_support import STUCK_S, connect_on_a_thread, registrations_held, withhold_index
from membership_support import WAIT_S, down_for_the_caller
from release_support import assert_nothing_held
from remote_support import BLOCK_LEN, fake_session, wait_until

from torch_kv_tier import connected_hosts, connections
from torch_kv_tier.connections import Dial, Joining
from torch_kv_tier.manager import TierManager
from torch_kv_tier.remote import ServerProcess


def _noted(monkeypatch: pytest.MonkeyPatch, tier: TierManager, method: str) -> threading.Event:
    """An event set once ``tier``'s ``method`` is called (it then runs as ever)."""
    called = threading.Event()
    real = getattr(tier, method)

    def noted(*args: Any) -> Any:
        called.set()
        return real(*args)

    monkeypatch.setattr(tier, method, noted)
    return called


def _removed_as_it_registers(
    tier: TierManager, peer_id: str, stopped: threading.Event, go: threading.Event
) -> None:
    """``disconnect`` ``peer_id`` on a thread of its own; once it stopped the join
    (``stopped``), the registration held goes on (``go``); returns once ``disconnect`` did."""
    removing = threading.Thread(target=tier.disconnect, args=(peer_id,))
    removing.start()
    assert stopped.wait(WAIT_S), "disconnect did not stop the host's join"
    go.set()  # the registration goes on after the removal
    removing.join(WAIT_S)
    assert not removing.is_alive(), "disconnect never returned"


def _on_a_redial_thread() -> bool:
    return threading.current_thread().name == connections.REDIAL_THREAD


def _assert_no_session_left(address: str) -> None:
    """The host at ``address`` lists no session but an observer's own, and holds none."""
    assert_nothing_held(address)
    with fake_session(address, private=False) as observer:
        assert len(observer.stats()["sessions"]) == 1, observer.stats()["sessions"]


@pytest.mark.parametrize("second", [False, True], ids=["one-connect", "and-one-waiting"])
@pytest.mark.parametrize("private", [False, True], ids=["shared", "private"])
def test_a_host_removed_before_its_first_join_publishes_it_is_never_connected(
    monkeypatch: pytest.MonkeyPatch, private: bool, second: bool
) -> None:
    """``second``: another ``redial_if_down`` connect of the host waits for that join (it
    answered as the host being joined): it fails too, and does not dial the host again."""
    kwargs: dict[str, Any] = {"private": private, "slots": 8} if private else {}
    with (
        ServerProcess.start(32, BLOCK_LEN) as server,
        TierManager.create(16, BLOCK_LEN, name="removed-before-publish") as tier,
    ):
        entered, go = registrations_held(monkeypatch, tier, lambda: not go.is_set())
        awaiting = _noted(monkeypatch, tier, "_await_join")
        outcome: list[object] = []
        connecting = [connect_on_a_thread(tier, server.address, outcome, **kwargs)]
        assert entered.wait(WAIT_S), "the join never registered the host"
        [peer_id] = tier._joining
        dial, joining = tier._dials[peer_id], tier._joining[peer_id]
        if second:
            connecting.append(connect_on_a_thread(tier, server.address, outcome, **kwargs))
            assert awaiting.wait(WAIT_S), "the second connect never waited for the join"
        _removed_as_it_registers(tier, peer_id, dial.stopped, go)
        assert joining.is_set(), "disconnect returned while the host's join went on"
        assert tier.placing_peers() == [] and tier.peers() == [], "the removed host joined"
        for thread in connecting:
            thread.join(WAIT_S)
            assert not thread.is_alive()
        assert len(outcome) == len(connecting), outcome
        for failed in outcome:
            assert isinstance(failed, ConnectionError) and "removed" in str(failed), outcome
        assert not tier.cancel_dial(server.address), "the removed host is dialled again"
        assert tier.stats().peers_dropped == 0  # never published, so never dropped
        registered = tier.transport._peers.get(peer_id)  # type: ignore[attr-defined]
        assert registered is None, "its region is left registered"
        _assert_no_session_left(server.address)
        assert tier.connect(server.address, timeout_s=WAIT_S, **kwargs) == peer_id
        assert tier.peers() == [peer_id]


def test_a_dial_cancelled_as_its_redial_registers_the_host_never_publishes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(connections, "REDIAL_FIRST_S", 0.1)
    with (
        ServerProcess.start(32, BLOCK_LEN) as server,
        TierManager.create(16, BLOCK_LEN, name="cancelled-before-publish") as tier,
    ):
        address = server.address
        entered, go = registrations_held(monkeypatch, tier, _on_a_redial_thread)
        down_for_the_caller(monkeypatch, tier)
        with pytest.raises(TimeoutError):
            tier.connect(address, timeout_s=WAIT_S, redial_if_down=True)
        assert entered.wait(WAIT_S), "no redial"
        assert tier.cancel_dial(address)
        go.set()
        wait_until(lambda: not tier._redialing, "the redial under way ends")
        assert tier.stats().peers_dropped == 0, "the cancelled dial's host was published"
        assert tier.peers() == [] and not tier._dials and not tier._pending
        assert tier.transport._peers.get(address) is None  # type: ignore[attr-defined]
        _assert_no_session_left(address)


def test_a_dial_cancelled_as_its_redial_awaits_the_hosts_index_ends_that_join_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Published (placed) but not joined, its index awaited: the join waited out its whole
    ``timeout_s`` for the cancelled dial (or, the index in, joined the host, then removed it)."""
    monkeypatch.setattr(connections, "REDIAL_FIRST_S", 0.1)
    _, following = withhold_index(monkeypatch, lambda n: True)
    with (
        ServerProcess.start(32, BLOCK_LEN) as server,
        TierManager.create(16, BLOCK_LEN, name="cancelled-awaiting-index") as tier,
    ):
        down_for_the_caller(monkeypatch, tier)
        with pytest.raises(TimeoutError):
            tier.connect(server.address, timeout_s=STUCK_S, redial_if_down=True)
        assert following.wait(WAIT_S), "no redial"
        [joining] = tier._joining.values()
        assert tier.cancel_dial(server.address)
        assert joining.wait(WAIT_S), "the cancelled dial's join waited on for the host's index"
        assert isinstance(joining.failure, ConnectionError), joining.failure
        wait_until(lambda: not tier._redialing, "the redial under way ends")
        assert tier.peers() == [] and not tier._dials and not tier._pending
        _assert_no_session_left(server.address)


def test_a_host_removed_as_its_join_awaits_its_turn_ends_that_join_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Joins take turns: a host removed while its join waited behind another host's waited on
    for its turn, up to its ``timeout_s`` (``disconnect`` with it)."""
    with (
        ServerProcess.start(32, BLOCK_LEN) as server,
        TierManager.create(16, BLOCK_LEN, name="removed-awaiting-turn") as tier,
    ):
        joining = _noted(monkeypatch, tier, "_join")
        outcome: list[object] = []
        with tier._join_turn:  # another host's join holds the turn
            connecting = connect_on_a_thread(tier, server.address, outcome)
            assert joining.wait(WAIT_S), "the connect never joined the host"
            [peer_id] = tier._joining
            join = tier._joining[peer_id]
            tier.disconnect(peer_id)
            assert join.is_set(), "disconnect returned while the join awaited its turn"
        connecting.join(WAIT_S)
        [failed] = outcome
        assert isinstance(failed, ConnectionError) and "removed" in str(failed), failed
        assert tier.peers() == [] and not tier.cancel_dial(server.address)
        _assert_no_session_left(server.address)


@pytest.mark.parametrize("private", [False, True], ids=["shared", "private"])
def test_a_lost_host_removed_as_a_connect_of_it_registers_it_is_never_connected(
    monkeypatch: pytest.MonkeyPatch, private: bool
) -> None:
    """A user's connect of a lost host (dialled again) joins it with a dial of its own, not
    the one ``disconnect`` stops: the join published the host all the same, and it stayed
    connected (in ``peers()``, not dialled again) after ``disconnect`` returned."""
    monkeypatch.setattr(connections, "REDIAL_FIRST_S", STUCK_S)  # the user's connect joins it
    kwargs: dict[str, Any] = {"private": private, "slots": 8} if private else {}
    with (
        ServerProcess.start(32, BLOCK_LEN) as server,
        TierManager.create(16, BLOCK_LEN, name="lost-removed-as-connected") as tier,
    ):
        peer_id = tier.connect(server.address, timeout_s=WAIT_S, **kwargs)
        with tier._lock:  # as a failed transfer does: the host is dialled again
            tier._lose_peer(peer_id, "failed a transfer")
        lost_dial = tier._dials[peer_id]
        entered, go = registrations_held(monkeypatch, tier, lambda: not go.is_set())
        outcome: list[object] = []
        connecting = connect_on_a_thread(tier, server.address, outcome, **kwargs)
        assert entered.wait(WAIT_S), "the connect never registered the host"
        _removed_as_it_registers(tier, peer_id, lost_dial.stopped, go)
        connecting.join(WAIT_S)
        assert not connecting.is_alive()
        [failed] = outcome
        assert isinstance(failed, ConnectionError) and "removed" in str(failed), failed
        assert tier.peers() == [] and not tier._dials, "the removed host joined"
        _assert_no_session_left(server.address)


@pytest.mark.parametrize("private", [False, True], ids=["shared", "private"])
def test_a_host_removed_as_nixl_registers_it_fails_its_connect_saying_so(
    monkeypatch: pytest.MonkeyPatch, private: bool
) -> None:
    """The removal supersedes the registration NIXL is building: the connect raised that
    registration's ``RuntimeError`` ("superseded ... or the transport closed"), not the
    ``ConnectionError`` saying the host was removed."""
    kwargs: dict[str, Any] = {"private": private, "slots": 8} if private else {}
    with (
        ServerProcess.start(32, BLOCK_LEN) as server,
        TierManager.create(16, BLOCK_LEN, name="removed-in-nixl") as tier,
    ):
        entered, go = threading.Event(), threading.Event()
        nixl_peers = tier.transport._peers  # type: ignore[attr-defined]
        build = nixl_peers.build

        def held_build(*args: Any) -> Any:  # on the transport's registration thread
            entered.set()
            go.wait(timeout=WAIT_S)
            return build(*args)

        monkeypatch.setattr(nixl_peers, "build", held_build)
        outcome: list[object] = []
        connecting = connect_on_a_thread(tier, server.address, outcome, **kwargs)
        assert entered.wait(WAIT_S), "NIXL never registered the host"
        [peer_id] = tier._joining
        _removed_as_it_registers(tier, peer_id, tier._joining[peer_id].stopped, go)
        connecting.join(WAIT_S)
        assert not connecting.is_alive()
        [failed] = outcome
        assert isinstance(failed, ConnectionError) and "removed" in str(failed), failed
        assert tier.peers() == [] and not tier.cancel_dial(server.address)
        _assert_no_session_left(server.address)


def test_a_connect_after_a_disconnect_that_gave_up_on_the_join_joins_the_host_anew(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``disconnect`` waits up to 10 s for the join it ended (NIXL may register longer): a
    connect of the host after it returned waited for that removed join and failed with it
    ("removed"; with ``redial_if_down`` not dialled again), though it asked after the
    removal. It waits for that join to end, then joins the host."""
    monkeypatch.setattr(connected_hosts, "CONNECT_TIMEOUT_S", 0.1)  # disconnect's wait
    with (
        ServerProcess.start(32, BLOCK_LEN) as server,
        TierManager.create(16, BLOCK_LEN, name="connected-after-removal") as tier,
    ):
        entered, go = registrations_held(monkeypatch, tier, lambda: not go.is_set())
        first: list[object] = []
        connecting = connect_on_a_thread(tier, server.address, first)
        assert entered.wait(WAIT_S), "the join never registered the host"
        [peer_id] = tier._joining
        removed = tier._joining[peer_id]
        tier.disconnect(peer_id)  # (its wait for the join runs out: a warning)
        assert not removed.is_set()
        looked = threading.Event()  # the next connect waits for the removed join
        wait = removed.wait

        def noted_wait(timeout: float | None = None) -> bool:
            if threading.current_thread() is not connecting:
                looked.set()
            return wait(timeout)

        monkeypatch.setattr(removed, "wait", noted_wait)
        again: list[object] = []
        reconnecting = connect_on_a_thread(tier, server.address, again)
        assert looked.wait(WAIT_S), "the next connect never saw the removed join"
        go.set()
        for thread in (connecting, reconnecting):
            thread.join(WAIT_S)
            assert not thread.is_alive()
        [failed] = first
        assert isinstance(failed, ConnectionError) and "removed" in str(failed), failed
        assert again == [peer_id] and tier.peers() == [peer_id]


def test_a_removed_join_that_ends_once_the_tier_closed_logs_no_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A join awaiting its turn ends at its next look once its host is removed: after a
    ``close`` meanwhile (``disconnect`` then ``close``, as an app shuts down), it let go of
    its region in the closed transport, logging an error and its traceback."""
    with TierManager.create(16, BLOCK_LEN, name="removed-then-closed") as tier:
        dial = Dial("127.0.0.1:1", None, False, None, WAIT_S, WAIT_S)
        tier._joining["host"] = Joining(dial, True)  # a join of "host" awaiting its turn
        dial.stopped.set()  # disconnect("host")
    with tier._lock:  # its next look, the tier closed
        removed = tier._stopped_join("host")
    assert isinstance(removed, ConnectionError) and "removed" in str(removed), removed
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
