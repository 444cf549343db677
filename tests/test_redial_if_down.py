"""Hosts down at their connect (``redial_if_down``): they are redialled until they join, side by
side and on a few threads, once each even when another connect or a join at another address
races the redial."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from membership_support import (
    WAIT_S,
    connected_tier,
    down_for_the_caller,
    join_wait_s,
    redial_quickly,
    redial_threads,
)
from remote_support import BLOCK_LEN, SilentHosts, fill_random, free_port, wait_until

from torch_kv_tier import connections
from torch_kv_tier.manager import TierManager
from torch_kv_tier.remote import ServerProcess
from torch_kv_tier.remote.handshake import HandshakeRejected


def test_a_host_down_at_its_connect_joins_once_it_is_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """``connect(..., redial_if_down=True)`` of a host that is not up yet raises, and dials it
    in the background with the tier's redialer until it joins (the torch loop's own dialler,
    one thread per such host, was a twin of it); its stores and loads work after, and
    ``close`` ends the redialer's thread."""
    redial_quickly(monkeypatch)
    port = free_port()  # nobody listens here yet
    address = f"127.0.0.1:{port}"
    with TierManager.create(16, BLOCK_LEN, name="down-at-connect") as tier:
        with pytest.raises(TimeoutError) as down:
            tier.connect(address, timeout_s=0.5, redial_if_down=True)
        assert any("cancel_dial" in note for note in getattr(down.value, "__notes__", []))
        assert tier.peers() == []
        with ServerProcess.start(32, BLOCK_LEN, extra_args=["--port", str(port)]):
            wait_until(lambda: tier.peers() != [], "the host joins", join_wait_s())
            data = fill_random(tier)
            assert tier.store([b"late-0", b"late-1"], [0, 1]).result(timeout=WAIT_S).ok
            tier.arena.tensor[2:4].zero_()
            assert tier.load([b"late-0", b"late-1"], [2, 3]).result(timeout=WAIT_S).ok
            assert torch.equal(tier.arena.tensor[2:4], data[0:2])
            assert not tier._pending
    assert redial_threads() == []


def test_a_refused_connect_is_not_dialled_again(tmp_path: Path) -> None:
    """A host that answers and refuses (another token here) is misconfigured, not down: the
    option does not dial it again, nor does it dial again after ``close`` a host still down."""
    token = tmp_path / "token"
    token.write_text("the-right-token\n")
    with (
        ServerProcess.start(32, BLOCK_LEN, token_file=str(token)) as server,
        TierManager.create(16, BLOCK_LEN, name="refused") as tier,
    ):
        with pytest.raises(HandshakeRejected):
            tier.connect(server.address, token="wrong", timeout_s=5.0, redial_if_down=True)
        assert not tier._pending and not tier._redialer._due and redial_threads() == []
        with pytest.raises(TimeoutError):
            tier.connect(f"127.0.0.1:{free_port()}", timeout_s=0.5, redial_if_down=True)
        assert redial_threads() != []
    assert redial_threads() == []


def test_add_peer_as_a_redial_joins_its_host_leaves_the_users_region(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``add_peer`` under the id of a lost host once the redial's handshake succeeded, before
    its join (past the check that the id is unknown): the join must not publish the host over
    the user's registration (the transport refuses a second registration of the id, so the
    join fails), nor may the redial, finding the host removed by ``add_peer``, remove the
    user's region."""
    monkeypatch.setattr(connections, "REDIAL_FIRST_S", 0.1)
    with connected_tier("replaced-mid-join") as (tier, peer, region):
        entered, go = threading.Event(), threading.Event()
        join = tier._join

        def held_join(session: Any, timeout_s: float) -> None:
            if threading.current_thread().name == connections.REDIAL_THREAD:
                entered.set()
                go.wait(timeout=WAIT_S)
            join(session, timeout_s)

        monkeypatch.setattr(tier, "_join", held_join)
        with tier._lock:  # as a failed transfer does: the host is dialled again
            tier._lose_peer(peer, "failed a transfer")
        assert entered.wait(timeout=WAIT_S), "no redial"
        added = threading.Thread(target=tier.add_peer, args=(peer, *region))
        added.start()
        time.sleep(0.2)  # add_peer runs (or waits for the join's turn)
        go.set()
        added.join(timeout=WAIT_S)
        assert not added.is_alive()
        wait_until(lambda: not tier._redialer._due, "the redialer lets go of the host")
        assert tier.peers() == [peer] and tier._peers[peer].session is None


def test_a_lost_host_down_at_another_connect_is_dialled_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``connect(..., redial_if_down=True)`` of the address of a lost host, which the tier
    dials already, adds no second dial of it (each would open its own session with the host
    once it is back)."""
    monkeypatch.setattr(connections, "REDIAL_FIRST_S", 30.0)  # due, not dialled meanwhile
    with connected_tier("lost-and-down") as (tier, peer, _):
        address = tier._dials[peer].address
        with tier._lock:  # as a failed transfer does: the host is dialled again
            tier._lose_peer(peer, "failed a transfer")
        wait_until(lambda: bool(tier._redialer._due), "the host is due for a redial")

        def down(dial: Any) -> str:
            raise TimeoutError(f"nothing answered at {dial.address}")

        monkeypatch.setattr(tier, "_connect", down)
        with pytest.raises(TimeoutError):
            tier.connect(address, timeout_s=5.0, redial_if_down=True)
        assert not tier._pending and len(tier._redialer._due) == 1


def test_hosts_down_at_their_connect_are_redialled_side_by_side(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: the redialer dialled its hosts one after another, each try of a host
    that does not answer holding it for the handshake's ``timeout_s``: with hosts down at
    their connect (``redial_if_down``) or lost, a host that was back joined only once every
    other one's try gave up (the torch loop's own dialler had one thread per host). They are
    dialled side by side now, and ``close`` still ends every dial."""
    monkeypatch.setattr(connections, "REDIAL_FIRST_S", 0.1)
    silent = SilentHosts(3)
    with contextlib.closing(silent), TierManager.create(16, BLOCK_LEN, name="side-by-side") as tier:
        down_for_the_caller(monkeypatch, tier)
        for address in silent.addresses:
            with pytest.raises(TimeoutError):
                tier.connect(address, timeout_s=3.0, redial_if_down=True)
        assert silent.dialled_side_by_side(within=1.5), "each host waited for the one before"
    assert redial_threads() == []


def test_a_host_disconnected_while_due_then_connected_again_is_dialled_when_lost_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A lost host the user disconnects while it is due for a redial, then connects again with
    the same arguments (a membership source that drops and re-lists it), then loses again: it
    must be dialled again. The redialer keyed its hosts by equal ``Dial`` values, so the new
    loss found the old, unwanted dial still due, added nothing, and that one was dropped at its
    try: the host was never dialled again."""
    monkeypatch.setattr(connections, "REDIAL_FIRST_S", 30.0)  # the old dial stays due meanwhile
    with connected_tier("reconnected") as (tier, peer, _):
        address = tier._dials[peer].address
        with tier._lock:  # as a failed transfer does: the host is dialled again
            tier._lose_peer(peer, "failed a transfer")
        wait_until(lambda: bool(tier._redialer._due), "the host is due for a redial")
        tier.disconnect(peer)
        assert tier.connect(address, timeout_s=5.0) == peer  # the arguments of its first connect
        monkeypatch.setattr(connections, "REDIAL_FIRST_S", 0.1)
        with tier._lock:
            tier._lose_peer(peer, "failed a transfer")
        wait_until(lambda: tier.peers() == [peer], "the host lost again is dialled again")


def test_a_dial_at_another_address_of_a_host_joining_meanwhile_ends_once_it_joined(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host down at a ``connect(..., redial_if_down=True)`` of one of its addresses (a name)
    answers the redial while a connect of another of its addresses joins it: once that join
    succeeded, the host is connected and the dial is done. It stayed pending: the redial was
    called failed ("the new session was lost at once", a warning) and dialled the host again."""
    caplog.set_level(logging.INFO, logger="torch_kv_tier.connections")
    monkeypatch.setattr(connections, "REDIAL_FIRST_S", 0.1)
    with (
        ServerProcess.start(64, BLOCK_LEN) as server,
        TierManager.create(16, BLOCK_LEN, name="two-addresses") as tier,
    ):
        port = server.address.rsplit(":", 1)[1]
        name, ip = f"localhost:{port}", f"127.0.0.1:{port}"
        joining, go_redial, awaiting, go_join = (threading.Event() for _ in range(4))
        open_, join, await_join = tier._open, tier._join, tier._await_join

        def held_open(*args: Any, **kwargs: Any) -> Any:
            if threading.current_thread().name == connections.REDIAL_THREAD:
                go_redial.wait(timeout=WAIT_S)
            return open_(*args, **kwargs)

        def held_join(session: Any, timeout_s: float) -> None:
            if threading.current_thread().name == "joiner":
                joining.set()
                go_join.wait(timeout=WAIT_S)
            join(session, timeout_s)

        def noted_await_join(*args: Any) -> None:
            awaiting.set()
            await_join(*args)

        down_for_the_caller(monkeypatch, tier)
        monkeypatch.setattr(tier, "_join", held_join)
        monkeypatch.setattr(tier, "_await_join", noted_await_join)
        with pytest.raises(TimeoutError):
            tier.connect(name, timeout_s=5.0, redial_if_down=True)
        joiner = threading.Thread(target=tier.connect, args=(ip,), name="joiner", daemon=True)
        joiner.start()
        assert joining.wait(timeout=WAIT_S), "the other address never joined"
        go_redial.set()
        assert awaiting.wait(timeout=WAIT_S), "the redial never waited for the join"
        go_join.set()
        joiner.join(timeout=WAIT_S)
        wait_until(lambda: not tier._redialing and not tier._redialer._trying, "the redial ends")
        assert tier.peers() == [server.address] and not tier._pending
        assert "lost at once" not in caplog.text, caplog.text


def test_a_redial_if_down_connect_that_waited_out_another_join_of_its_host_dials_it_once_failed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``connect(..., redial_if_down=True)`` of a host another thread is joining meanwhile
    times out waiting for that join, and is told the host is dialled in the background. It was
    not: the other join's dial of the address stood for it, and that join's failure forgot it,
    so once it failed nobody dialled the host. Now the address is dialled until it joins."""
    monkeypatch.setattr(connections, "REDIAL_FIRST_S", 0.1)
    with (
        ServerProcess.start(64, BLOCK_LEN) as server,
        TierManager.create(16, BLOCK_LEN, name="waited-out-join") as tier,
    ):
        joining, go = threading.Event(), threading.Event()
        join = tier._join

        def failing_join(session: Any, timeout_s: float) -> None:
            if threading.current_thread().name == "joiner":
                joining.set()
                go.wait(timeout=WAIT_S)
                tier._end_keeping_releases(session, True)
                raise RuntimeError("registration failed (a test)")
            join(session, timeout_s)

        monkeypatch.setattr(tier, "_join", failing_join)
        joiner = threading.Thread(
            target=lambda: pytest.raises(RuntimeError, tier.connect, server.address),
            name="joiner",
            daemon=True,
        )
        joiner.start()
        assert joining.wait(timeout=WAIT_S), "the other connect never joined"
        with pytest.raises(TimeoutError) as waited:
            tier.connect(server.address, timeout_s=0.3, redial_if_down=True)
        assert any("cancel_dial" in n for n in getattr(waited.value, "__notes__", []))
        go.set()
        joiner.join(timeout=WAIT_S)
        assert tier.peers() == [], "the other connect's join did not fail"
        wait_until(lambda: tier.peers() == [server.address], "the host is dialled and joins")


def test_many_lost_hosts_are_redialled_on_a_few_threads_and_one_back_joins_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: each host due for a redial got a try thread of its own, so hosts lost
    at once (200 in a rack's power cut) made as many threads, each handshaking. Past
    ``MAX_CONNECTS`` due hosts, the redialer greets them all on one thread and tries those
    that answer: threads stay few, and a host that is back waits for no silent host's
    timeout (queued behind 60 silent hosts, 4 at a time, it would wait 15 s a round)."""
    monkeypatch.setattr(connections, "MAX_CONNECTS", 4)
    monkeypatch.setattr(connections, "REDIAL_FIRST_S", 0.1)
    monkeypatch.setattr(connections, "REDIAL_MAX_S", 0.5)
    port = free_port()
    back = f"127.0.0.1:{port}"
    closed = [f"127.0.0.1:{free_port()}" for _ in range(60)]  # nothing listens: never answer
    peak = [0]
    done = threading.Event()

    def count_threads() -> None:
        while not done.wait(0.01):
            peak[0] = max(peak[0], len(redial_threads()))

    counter = threading.Thread(target=count_threads, daemon=True)
    counter.start()
    try:
        with TierManager.create(16, BLOCK_LEN, name="many-lost") as tier:
            for address in [*closed, back]:
                tier.dial_later(address, TimeoutError("down (a test)"), timeout_s=1.0)
            with ServerProcess.start(32, BLOCK_LEN, extra_args=["--port", str(port)]):
                wait_until(lambda: tier.peers() != [], "the host back joins", timeout=8.0)
                assert tier.peers() == [back]
    finally:
        done.set()
        counter.join(timeout=WAIT_S)
    assert peak[0] <= 4 + 2, f"{peak[0]} redial threads at once (4 tries, greeter, its loop)"
    assert redial_threads() == []
