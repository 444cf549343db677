"""Pending dials that are cancelled, disconnected or closed under them: a cancel by address or
during a handshake leaves no peer, the last word between a connect and a cancel wins, a closing
tier warns of no next try, and a dial's owner is checked and let go."""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
import weakref
from typing import Any

import pytest
from membership_support import (
    WAIT_S,
    down_for_the_caller,
    join_wait_s,
    redial_quickly,
    redial_threads,
)
from remote_support import BLOCK_LEN, SilentHosts, free_port, wait_until

from torch_kv_tier import connections
from torch_kv_tier.manager import TierManager
from torch_kv_tier.remote import ServerProcess


def test_a_pending_dial_cancelled_by_its_address_never_connects(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The user does not know the peer id of a host that never joined: ``disconnect`` of its
    address (or ``cancel_dial``) stops dialling it; a later call says nothing is dialled."""
    monkeypatch.setattr(connections, "REDIAL_FIRST_S", 0.1)
    port = free_port()
    address = f"127.0.0.1:{port}"
    with TierManager.create(16, BLOCK_LEN, name="cancelled-dial") as tier:
        for cancel in (tier.disconnect, tier.cancel_dial):
            with pytest.raises(TimeoutError):
                tier.connect(address, timeout_s=0.5, redial_if_down=True)
            assert tier._redialer._due
            cancel(address)
            assert tier.cancel_dial(address) is False
            with pytest.raises(KeyError):
                tier.disconnect(address)
            wait_until(lambda: not tier._redialer._due, "the redialer lets go of the address")
        with ServerProcess.start(32, BLOCK_LEN, extra_args=["--port", str(port)]):
            time.sleep(1.0)  # ten times the first redial's delay
            assert tier.peers() == [], "a cancelled dial connected its host"
    assert redial_threads() == []


def _redial_handshakes_held(
    monkeypatch: pytest.MonkeyPatch, tier: TierManager
) -> tuple[threading.Event, threading.Event]:
    """``(entered, go)``: the redialer's handshakes of ``tier`` set ``entered``, then wait
    for ``go`` (bounded) before they open their session."""
    entered, go = threading.Event(), threading.Event()
    open_ = tier._open

    def held_open(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread().name == connections.REDIAL_THREAD:
            entered.set()
            go.wait(timeout=WAIT_S)
        return open_(*args, **kwargs)

    monkeypatch.setattr(tier, "_open", held_open)
    return entered, go


def test_a_dial_cancelled_while_its_handshake_is_under_way_leaves_no_peer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A dial cancelled as the redialer's handshake with the host (up by then) awaits its
    answer: the host it connects is removed at once, and is not dialled again."""
    monkeypatch.setattr(connections, "REDIAL_FIRST_S", 0.1)
    port = free_port()
    address = f"127.0.0.1:{port}"
    with (
        TierManager.create(16, BLOCK_LEN, name="cancelled-mid-dial") as tier,
        ServerProcess.start(32, BLOCK_LEN, extra_args=["--port", str(port)]),
    ):
        entered, go = _redial_handshakes_held(monkeypatch, tier)
        real_connect = tier._connect
        failed: list[str] = []

        def down_once(dial: Any) -> str:
            if not failed:  # the first connect finds the host down
                failed.append(dial.address)
                raise TimeoutError(f"nothing answered at {dial.address}")
            return real_connect(dial)

        monkeypatch.setattr(tier, "_connect", down_once)
        with pytest.raises(TimeoutError):
            tier.connect(address, timeout_s=5.0, redial_if_down=True)
        assert entered.wait(timeout=WAIT_S), "no redial"
        assert tier.cancel_dial(address)
        go.set()
        wait_until(lambda: not tier._redialer._due, "the redialer lets go of the address")
        wait_until(lambda: tier.peers() == [], "the host the cancelled dial connected is removed")
        time.sleep(1.0)  # ten times the first redial's delay
        assert tier.peers() == [] and not tier._dials and not tier._pending


def test_a_pending_dial_disconnected_while_its_host_registers_is_not_dialled_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``disconnect(address)`` of a host ``redial_if_down`` dials, while the redialer's join
    of it registers its region (a host's id is the address it listens on, by default, so the
    address is its peer id by then): the disconnect supersedes the registration, and the host
    must not be dialled again. It was: the disconnect stopped the host's dial as a lost one's
    but left the pending dial wanted, so the next try connected the host for good."""
    monkeypatch.setattr(connections, "REDIAL_FIRST_S", 0.1)
    port = free_port()
    address = f"127.0.0.1:{port}"
    with (
        TierManager.create(16, BLOCK_LEN, name="disconnected-mid-join") as tier,
        ServerProcess.start(32, BLOCK_LEN, extra_args=["--port", str(port)]),
    ):
        transport: Any = tier.transport
        entered, go = threading.Event(), threading.Event()
        register = transport.add_remote_peer_async

        def held_register(*args: Any, **kwargs: Any) -> Any:
            if not entered.is_set():  # the first registration waits behind a busy registrar
                transport._registrar.submit(lambda: go.wait(timeout=WAIT_S))
                entered.set()
            return register(*args, **kwargs)

        down_for_the_caller(monkeypatch, tier)
        monkeypatch.setattr(transport, "add_remote_peer_async", held_register)
        with pytest.raises(TimeoutError):
            tier.connect(address, timeout_s=5.0, redial_if_down=True)
        assert entered.wait(timeout=WAIT_S), "no redial"
        tier.disconnect(address)
        go.set()
        wait_until(lambda: not tier._redialer._due, "the redialer lets go of the address")
        time.sleep(1.0)  # ten times the first redial's delay
        assert tier.peers() == [] and not tier._dials and not tier._pending


@pytest.mark.parametrize("cancel_first", [False, True], ids=["connect-cancel", "cancel-connect"])
def test_a_second_connect_and_a_cancel_during_a_redials_handshake_keep_the_last_word(
    monkeypatch: pytest.MonkeyPatch, cancel_first: bool
) -> None:
    """While the redialer's handshake of a ``connect(..., redial_if_down=True)``'s dial is
    under way, a second such connect of the address and a ``cancel_dial``, in either order:
    the host that handshake connects is removed (the dial was cancelled), and a request made
    after the cancel still stands. Found by review: a second connect's dial replaced the first
    as the address's pending dial, so the cancel stopped only the second and the first's
    joined the host for good; and the cancelled dial's join forgot every pending dial of its
    address, so a request made after the cancel was dropped unseen."""
    monkeypatch.setattr(connections, "REDIAL_FIRST_S", 0.1)
    port = free_port()
    address = f"127.0.0.1:{port}"
    with (
        TierManager.create(16, BLOCK_LEN, name="second-connect") as tier,
        ServerProcess.start(32, BLOCK_LEN, extra_args=["--port", str(port)]),
    ):
        entered, go = _redial_handshakes_held(monkeypatch, tier)
        down_for_the_caller(monkeypatch, tier)
        with pytest.raises(TimeoutError):
            tier.connect(address, timeout_s=5.0, redial_if_down=True)
        assert entered.wait(timeout=WAIT_S), "no redial"
        if cancel_first:
            assert tier.cancel_dial(address)
        monkeypatch.setattr(connections, "REDIAL_FIRST_S", 30.0)  # a second dial waits
        with pytest.raises(TimeoutError):
            tier.connect(address, timeout_s=5.0, redial_if_down=True)
        if not cancel_first:
            assert tier.cancel_dial(address)
        go.set()
        wait_until(lambda: not tier._redialing, "the redial under way ends")
        wait_until(lambda: tier.peers() == [], "the host the cancelled dial connected is removed")
        assert not tier._dials
        if cancel_first:
            assert address in tier._pending, "the request made after the cancel was dropped"
        else:
            assert not tier._pending, "the cancel left a dial of the address"


def test_closing_a_tier_while_it_redials_a_host_warns_of_no_next_try(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``close`` ends the redialer's handshake under way with a host that does not answer:
    that try's end was logged as a warning that redialling it failed, with the "next try"
    that never comes, at every shutdown of a tier with a host down."""
    caplog.set_level(logging.INFO, logger="torch_kv_tier.connections")
    monkeypatch.setattr(connections, "REDIAL_FIRST_S", 0.1)
    silent = SilentHosts(1)
    with contextlib.closing(silent), TierManager.create(4, BLOCK_LEN, name="closing") as tier:
        with pytest.raises(TimeoutError):
            tier.connect(silent.addresses[0], timeout_s=0.5, redial_if_down=True)
        wait_until(lambda: bool(tier._redialer._trying), "the redialer dials the host")
        caplog.clear()
        tier.close()
    warned = [r.message for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [m for m in warned if "next try" in m], warned


def test_a_dial_cancelled_during_its_handshake_with_a_silent_host_ends_its_try_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``cancel_dial`` (or ``disconnect``) of a host the redialer was handshaking with, which
    does not answer: the try went on for the handshake's whole ``timeout_s``, a thread and its
    sockets (and one of the redialer's few tries) held for nothing. It gives up at once now."""
    monkeypatch.setattr(connections, "REDIAL_FIRST_S", 0.1)
    silent = SilentHosts(1)
    (address,) = silent.addresses
    with contextlib.closing(silent), TierManager.create(4, BLOCK_LEN, name="cancel-try") as tier:
        tier.dial_later(address, TimeoutError("down (a test)"), timeout_s=60.0)
        assert silent.dialled_side_by_side(within=1.0), "the redialer never dialled the host"
        assert tier.cancel_dial(address)
        wait_until(lambda: not tier._redialer._trying, "the try ends (its timeout is 60 s)")


def test_a_dial_cancelled_while_it_is_greeted_is_let_go_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: ``cancel_dial`` of hosts the redialer was greeting (more were due than
    it may try at once) left them greeted until their ``timeout_s`` (up to 1e6 s), each with
    its socket, and the greeter's thread running for them. They are let go at once, and the
    greeter ends with nobody left to greet."""
    monkeypatch.setattr(connections, "MAX_CONNECTS", 0)  # no try free: each host greeted
    monkeypatch.setattr(connections, "REDIAL_FIRST_S", 0.0)
    down = [f"127.0.0.1:{free_port()}" for _ in range(2)]  # nothing listens: never answer
    with TierManager.create(4, BLOCK_LEN, name="cancel-greeted") as tier:
        redialer = tier._redialer
        for address in down:
            tier.dial_later(address, TimeoutError("down (a test)"), timeout_s=600.0)
        wait_until(lambda: len(redialer._greeting) == 2, "both hosts are greeted")
        for address in down:
            assert tier.cancel_dial(address)
        wait_until(lambda: not redialer._greeting and not redialer._due, "the hosts let go")
        wait_until(lambda: redialer._greeter is None, "the greeter ends")


def test_an_unhashable_dial_owner_is_refused_before_anything_is_dialled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: ``connect(..., redial_if_down=True, dial_owner={...})`` waited out
    its handshake, then raised ``TypeError: unhashable type`` and left the address pending with
    nobody to dial it or to cancel it by owner. A ``dial_owner`` a dial cannot keep is refused
    first, saying what to pass, by ``connect``, ``dial_later`` and ``cancel_dial``."""
    with TierManager.create(4, BLOCK_LEN, name="unhashable-owner") as tier:
        opened: list[object] = []

        def down(dial: Any, *_args: Any, **_kwargs: Any) -> None:
            opened.append(dial)
            raise TimeoutError("down (a test)")

        monkeypatch.setattr(tier, "_open", down)
        address = "127.0.0.1:1"
        with pytest.raises(TypeError, match=r"dial_owner must be hashable.*object\(\)"):
            tier.connect(address, redial_if_down=True, dial_owner={"library": 1})
        with pytest.raises(TypeError, match="dial_owner must be hashable"):
            tier.dial_later(address, TimeoutError("down (a test)"), dial_owner=[])
        with pytest.raises(TypeError, match="dial_owner must be hashable"):
            tier.cancel_dial(address, [])
        assert opened == [] and not tier._pending


def test_a_dial_owner_is_let_go_once_its_host_joined(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review: the dial of a host down at its connect kept its ``dial_owner`` (a
    library's own object, say) for as long as the host stayed connected, long after nobody
    could withdraw the request. A dial lets its owners go once its host joined."""
    redial_quickly(monkeypatch)
    port = free_port()
    address = f"127.0.0.1:{port}"
    owner = type("Library", (), {})()
    owner_gone = weakref.ref(owner)
    with TierManager.create(16, BLOCK_LEN, name="owner-let-go") as tier:
        with pytest.raises(TimeoutError):
            tier.connect(address, timeout_s=0.3, redial_if_down=True, dial_owner=owner)
        with ServerProcess.start(32, BLOCK_LEN, extra_args=["--port", str(port)]):
            wait_until(lambda: tier.peers() == [address], "the host joins", join_wait_s())
            del owner

            def let_go() -> bool:  # (the connect publishes the host, then lets the owners go)
                gc.collect()
                return owner_gone() is None

            wait_until(let_go, "the joined host's dial lets its owner go")
