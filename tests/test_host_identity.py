"""A host's identity across restarts and replacements: a host restarted under another id at the
same address replaces the old one, one id at two addresses is an error, hosts that left are
forgotten, and ``add_peer`` replacing a connected or redialled host leaves it dialled once."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest
import torch
from membership_support import WAIT_S, connected_tier, session_threads
from remote_support import BLOCK_LEN, free_port, wait_until

from torch_kv_tier import connections
from torch_kv_tier.manager import TierManager
from torch_kv_tier.remote import RemoteSession, ServerProcess, session_io


def test_a_host_restarted_under_another_id_at_the_same_address_replaces_the_old_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A new pod on a reused IP (or a host restarted with another ``--host-id``) answers at the
    address the tier dialled: the tier follows it, and stops dialling the old id (found by
    review: the old id stayed due for a redial for good, and every redial, up to every 10 s,
    opened a session with the new host and called itself failed)."""
    caplog.set_level(logging.INFO, logger="torch_kv_tier.connections")
    port = free_port()
    args = ["--port", str(port), "--host-id"]
    with TierManager.create(16, BLOCK_LEN, name="restarted") as tier:
        first = ServerProcess.start(32, BLOCK_LEN, extra_args=[*args, "pod-a"])
        try:
            assert tier.connect(first.address, timeout_s=5.0) == "pod-a"
        finally:
            first.kill()
        with ServerProcess.start(32, BLOCK_LEN, extra_args=[*args, "pod-b"]):
            wait_until(lambda: tier.peers() == ["pod-b"], "the tier follows the new host")
            # (redials while the new host was starting, slow on a loaded machine, fail: fine)
            caplog.clear()
            time.sleep(2.0)  # redials of pod-a at 0.5, 1 and 2 s would have gone on
            assert "re-dialling" not in caplog.text, caplog.text
            assert list(tier._dials) == ["pod-b"]
            assert "pod-a" not in tier.transport._peers._parked  # type: ignore[attr-defined]
            tier.arena.tensor[:1].random_(0, 256)
            assert tier.store(["k"], [0]).result(timeout=WAIT_S).ok
            assert tier.load(["k"], [1]).result(timeout=WAIT_S).ok
            assert torch.equal(tier.arena.tensor[1], tier.arena.tensor[0])


def test_a_lost_host_that_leaves_keeps_no_nixl_agent_loaded() -> None:
    """A host that died (its peer dropped as lost: its NIXL agent stays parked for the redial)
    and then left the fleet (Membership disconnects it) keeps nothing loaded (found by review:
    its agent, and the sockets NIXL keeps for it, stayed until the tier closed, one per host
    that ever left that way)."""
    with TierManager.create(16, BLOCK_LEN, name="left-lost") as tier:
        server = ServerProcess.start(32, BLOCK_LEN)
        try:
            peer = tier.connect(server.address, timeout_s=5.0)
        finally:
            server.kill()
        wait_until(lambda: tier.peers() == [], "the tier drops the dead host")
        parked = tier.transport._peers._parked  # type: ignore[attr-defined]
        assert list(parked) == [peer]  # kept for the redial
        tier.disconnect(peer)
        assert list(parked) == []


def test_hosts_that_left_are_forgotten_once_their_sessions_are_released() -> None:
    """A tier following a churning fleet (a new pod, a new address, each time) keeps nothing of
    the hosts that left once each was told its sessions ended (found by review: how each was
    dialled stayed in ``_removed`` until the tier closed, one entry per host that ever left)."""
    with TierManager.create(16, BLOCK_LEN, name="churn") as tier:
        for _ in range(2):
            with ServerProcess.start(32, BLOCK_LEN) as server:
                peer = tier.connect(server.address, timeout_s=5.0)
                tier.arena.tensor[:1].random_(0, 256)
                assert tier.store(["k"], [0]).result(timeout=WAIT_S).ok
                tier.disconnect(peer)
                wait_until(lambda: not tier._removed, f"the tier forgets {server.address}")
        assert tier.peers() == [] and not tier._ended.resolved


def test_two_hosts_with_one_id_are_a_clear_error() -> None:
    """Two host processes that call themselves the same (pods left at the default
    ``--host-id``, the address they listen on: ``0.0.0.0:5600`` in every pod): connecting the
    second names the mistake (found by review: it returned the first host's peer id, so a fleet
    of N such hosts was silently one host)."""
    args = ["--host-id", "0.0.0.0:5600"]
    with (
        ServerProcess.start(32, BLOCK_LEN, extra_args=args) as first,
        ServerProcess.start(32, BLOCK_LEN, extra_args=args) as second,
        TierManager.create(16, BLOCK_LEN, name="one-id") as tier,
    ):
        assert tier.connect(first.address, timeout_s=5.0) == "0.0.0.0:5600"
        port = first.address.rsplit(":", 1)[1]
        assert tier.connect(f"localhost:{port}", timeout_s=5.0) == "0.0.0.0:5600"  # same host
        with pytest.raises(ValueError, match=r"another process.*--host-id"):
            tier.connect(second.address, timeout_s=5.0)
        assert tier.peers() == ["0.0.0.0:5600"]
        wait_until(lambda: len(session_threads()) == 1, f"one session left: {session_threads()}")
        tier.arena.tensor[:1].random_(0, 256)
        assert tier.store(["k"], [0]).result(timeout=WAIT_S).ok
        assert tier.load(["k"], [1]).result(timeout=WAIT_S).ok


def test_a_host_restarted_before_the_tier_noticed_is_not_called_a_host_id_mistake(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A host that restarted at its address (same ``--host-id``) before the tier noticed (its
    machine died without a reset reaching the tier, which learns it at the next heartbeat):
    a connect there was refused telling the user to give each host its own ``--host-id``, a
    configuration that is right. The error says what happened: the tier drops the old session
    within its heartbeat timeout and dials the host again by itself."""
    open_ = RemoteSession.open.__func__  # type: ignore[attr-defined]

    def quiet_open(cls: type[RemoteSession], *args: Any, **kwargs: Any) -> RemoteSession:
        quiet = {"heartbeat_interval_s": 600.0, "heartbeat_timeout_s": 1800.0}
        return open_(cls, *args, **{**kwargs, **quiet})

    # the old connection's end is not seen, and no heartbeat asks the new host meanwhile (found
    # under load: a heartbeat is sent at least every third of the heartbeat and lease timeouts,
    # 3.3 s by default, and one that reached the new host before the connect ended the session)
    monkeypatch.setattr(RemoteSession, "open", classmethod(quiet_open))
    monkeypatch.setattr(session_io, "disconnected", lambda _monitor: False)
    args = ["--port", str(free_port()), "--host-id", "pod-0", "--lease-timeout", "1800"]
    with TierManager.create(16, BLOCK_LEN, name="unnoticed") as tier:
        first = ServerProcess.start(32, BLOCK_LEN, extra_args=args)
        try:
            assert tier.connect(first.address, timeout_s=5.0) == "pod-0"
        finally:
            first.kill()
        with ServerProcess.start(32, BLOCK_LEN, extra_args=args) as second:
            with pytest.raises(ValueError, match="restarted") as refused:
                tier.connect(second.address, timeout_s=5.0)
            assert "--host-id" not in str(refused.value), refused.value
            assert "heartbeat timeout" in str(refused.value), refused.value


def test_a_connected_host_add_peer_replaced_is_not_dialled_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``add_peer`` under the id of a connected host (lost and due for a redial) replaced its
    registration but left how it was dialled: once the user's registration failed in turn, the
    redial connected the old host again in its place, and the entry stayed for good."""
    # due all along, its try only once the user's registration failed (with a try due in 2 s,
    # a test held 2 s on a loaded machine saw the host joined again before its add_peer)
    monkeypatch.setattr(connections, "REDIAL_FIRST_S", 30.0)
    with connected_tier("replaced") as (tier, peer, region):
        redialer = tier._redialer
        with tier._lock:  # as a failed transfer does: the host is dialled again
            tier._lose_peer(peer, "failed a transfer")
        wait_until(lambda: bool(redialer._due), "the host is due for a redial")
        tier.add_peer(peer, *region)
        assert peer not in tier._dials
        with tier._lock:  # the user's registration fails in turn
            tier._lose_peer(peer, "failed a transfer")
        with redialer._lock:  # the old host's try falls due now
            for dial, (_, backoff) in list(redialer._due.items()):
                redialer._due[dial] = (0.0, backoff)
            redialer._lock.notify()
        wait_until(lambda: not redialer._due, "the redialer lets go of the host")
        assert tier.peers() == [], "the old host was dialled again in the user's place"


def test_a_redial_under_way_as_add_peer_replaces_its_host_leaves_the_users_region(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The other order: ``add_peer`` replaced the host while a redial of it awaited the host's
    answer. The redial must end its own session, not remove the user's registration."""
    monkeypatch.setattr(connections, "REDIAL_FIRST_S", 0.1)
    with connected_tier("replaced-mid-redial") as (tier, peer, region):
        entered, go = threading.Event(), threading.Event()
        open_ = tier._open

        def held_open(*args: Any, **kwargs: Any) -> Any:
            if threading.current_thread().name == "tkvt-redial":
                entered.set()
                go.wait(timeout=WAIT_S)
            return open_(*args, **kwargs)

        tier._open = held_open  # type: ignore[method-assign]
        with tier._lock:  # as a failed transfer does: the host is dialled again
            tier._lose_peer(peer, "failed a transfer")
        assert entered.wait(timeout=WAIT_S), "no redial"
        tier.add_peer(peer, *region)
        go.set()
        wait_until(lambda: not tier._redialer._due, "the redialer lets go of the host")
        assert tier.peers() == [peer] and tier._peers[peer].session is None


def test_a_host_disconnected_as_its_connect_ends_is_not_dialled_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: a connect registered how its host was dialled again once the join
    was over, after the host was published: a ``disconnect`` on another thread in between
    (the host in ``peers()`` already) was undone, and the redialer connected the host again
    in the background (seen with the torch-loop offloader's dialler and a user's disconnect)."""
    monkeypatch.setattr(connections, "REDIAL_FIRST_S", 0.1)
    with (
        ServerProcess.start(32, BLOCK_LEN) as server,
        TierManager.create(16, BLOCK_LEN, name="disconnected-as-joined") as tier,
    ):
        join = tier._join_shared

        def join_then_disconnect(session: Any, timeout_s: float) -> None:
            join(session, timeout_s)
            tier.disconnect(session.peer_id)  # as another thread does once it sees the host

        monkeypatch.setattr(tier, "_join_shared", join_then_disconnect)
        peer = tier.connect(server.address, timeout_s=5.0)
        assert peer not in tier._dials
        time.sleep(1.0)  # ten times the first redial's delay
        assert tier.peers() == [], "the disconnected host was dialled again"
