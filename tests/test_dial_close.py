"""Dials that must not outlive ``TierManager.close``, nor a host no longer wanted: handshakes,
greetings and their threads and sockets, against hosts in this process that answer part of a
handshake and then go silent."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import zmq
from late_write_support import LateWriteTransport
from remote_support import BLOCK_LEN, SilentHosts, wait_for
from tier_races_support import PrivateSession

from torch_kv_tier import connections
from torch_kv_tier.arena import BlockArena
from torch_kv_tier.connections import REDIAL_THREAD, Dial
from torch_kv_tier.manager import TierManager
from torch_kv_tier.remote import protocol as p
from torch_kv_tier.remote.handshake import AcceptAbandoned
from torch_kv_tier.remote.launch import ServerProcess

RESULT_TIMEOUT_S = 10.0
DIAL_TIMEOUT_S = 60.0  # a handshake's own wait: far past every wait of these tests


class _MuteAtAccept:
    """A ZeroMQ ROUTER on 127.0.0.1 that answers each ``Hello`` with a ``Challenge`` and then
    says nothing: a host that froze (or died) after it got the ``Handshake``. ``heard`` lists
    the client messages it got; ``handshaken`` is set at the first ``Handshake``."""

    def __init__(self, port: int | None = None) -> None:
        self._context = zmq.Context()  # its own: ``close`` frees the port before it returns
        self._sock = self._context.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if port is None:
            port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        else:  # (a host started again on the port of one closed)
            self._sock.bind(f"tcp://127.0.0.1:{port}")
        self.port = port
        self.address = f"127.0.0.1:{port}"
        self.heard: list[p.ClientMessage] = []
        self.handshaken = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(10, zmq.POLLIN):
                continue
            identity, frame = self._sock.recv_multipart()
            message = p.decode_client(frame)
            self.heard.append(message)
            if isinstance(message, p.Hello):
                nonce = secrets.token_bytes(p.NONCE_BYTES)
                challenge = p.Challenge(p.PROTOCOL_VERSION, message.seq, nonce, b"")
                self._sock.send_multipart([identity, p.encode(challenge)])
            elif isinstance(message, p.Handshake):
                self.handshaken.set()

    def disconnected(self) -> list[str]:
        """The ids of the sessions the client ended with a clean ``Disconnect``."""
        return [m.session_id for m in self.heard if isinstance(m, p.Disconnect) and m.clean]

    def handshakes(self) -> list[str]:
        """The ids of the sessions the handshakes it got would have opened."""
        return [m.nonce.hex() for m in self.heard if isinstance(m, p.Handshake)]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=RESULT_TIMEOUT_S)
        self._sock.close()
        self._context.term()  # (once its sockets' descriptors are closed)


@contextmanager
def _tier_and_host() -> Iterator[tuple[TierManager, _MuteAtAccept]]:
    """A tier (its transport in this process) and a host mute at the accept, closed on exit."""
    arena = BlockArena(4, BLOCK_LEN)
    tier = TierManager(arena, LateWriteTransport(arena.tensor))
    host = _MuteAtAccept()
    try:
        yield tier, host
    finally:
        tier.close(timeout=1.0)
        host.close()


def _redialling(before: set[threading.Thread]) -> list[threading.Thread]:
    """The redial threads running that were not running ``before``."""
    return [t for t in set(threading.enumerate()) - before if t.name == REDIAL_THREAD]


@pytest.mark.parametrize("dialled_by", ["the redialer", "a connect on another thread"])
def test_close_abandons_a_handshake_awaiting_its_accept(
    dialled_by: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: a handshake awaiting the host's ``Accept`` (the ``Handshake`` sent)
    ignored the tier's close and waited out its whole ``timeout_s``: ``close`` returned with a
    redial thread still running, which could then register what it learnt on a closed tier.
    ``close`` abandons it: its thread ends within ``close``, and the host is told to end the
    session it may have opened (a clean ``Disconnect``)."""
    monkeypatch.setattr(connections, "REDIAL_FIRST_S", 0.0)
    before = set(threading.enumerate())
    with _tier_and_host() as (tier, host):
        dial = Dial(host.address, None, True, None, DIAL_TIMEOUT_S, 10.0)
        raised: list[BaseException] = []
        if dialled_by == "the redialer":
            with tier._lock:  # the host was connected, then lost
                tier._dials["h"] = dial
                tier._redialer.start(dial)
            dialling = None
        else:

            def connect() -> None:
                try:
                    tier.connect(host.address, private=True, timeout_s=DIAL_TIMEOUT_S)
                except BaseException as exc:
                    raised.append(exc)

            dialling = threading.Thread(target=connect, daemon=True)
            dialling.start()
        assert host.handshaken.wait(RESULT_TIMEOUT_S), "the handshake never went out"
        tier.close(timeout=2.0)
        assert _redialling(before) == [], "a redial outlived close"
        if dialling is not None:
            dialling.join(timeout=2.0)
            assert not dialling.is_alive(), "a connect outlived close by its timeout_s"
            assert isinstance(raised[0], ConnectionError), raised
        assert tier.peers() == []
        abandoned = host.handshakes()[0]  # (close's last word to the host is another one)
        assert wait_for(lambda: abandoned in host.disconnected(), RESULT_TIMEOUT_S), host.heard


@pytest.mark.parametrize("replaced_by", ["another id at its address", "a connect of its id"])
def test_a_lost_host_greeted_as_another_dial_joins_in_its_place_is_let_go_at_once(
    replaced_by: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: a lost host the redialer greeted (a host frozen, or killed, since) that
    the tier stopped dialling for another reason than a cancel (its address answered under
    another id, or a connect of its id joined with a dial of its own) stayed greeted, its
    socket open, until its ``timeout_s``. It is let go at once, as a cancelled one is."""
    monkeypatch.setattr(connections, "MAX_CONNECTS", 0)  # every host due is greeted
    monkeypatch.setattr(connections, "REDIAL_FIRST_S", 0.0)
    silent = SilentHosts(1)
    with _tier_and_host() as (tier, _):
        redialer = tier._redialer
        old = Dial(silent.addresses[0], None, True, None, DIAL_TIMEOUT_S, 10.0)
        with tier._lock:  # connected, then lost
            tier._dials["host-1"] = old
            redialer.start(old)
        assert wait_for(lambda: old in redialer._greeting, RESULT_TIMEOUT_S), "never greeted"
        new = Dial(old.address, None, True, None, DIAL_TIMEOUT_S, 10.0)
        if replaced_by == "another id at its address":
            with tier._lock:
                tier._dials["host-2"] = new
                tier._forget_replaced("host-2", new)
        else:
            assert isinstance(tier.transport, LateWriteTransport)
            tier.transport.remotes[b""] = torch.zeros(8, BLOCK_LEN, dtype=torch.uint8)
            monkeypatch.setattr(TierManager, "_open", lambda *_a, **_k: PrivateSession())
            assert tier._connect(new) == "host-1"
        assert wait_for(lambda: old not in redialer._greeting, RESULT_TIMEOUT_S), (
            f"greeted on, up to its timeout_s ({DIAL_TIMEOUT_S} s)"
        )
        assert not new.stopped.is_set()
    silent.close()


@pytest.mark.parametrize("shared", [True, False])
def test_a_join_whose_handshake_ends_after_close_registers_nothing(shared: bool) -> None:
    """Found by review: a redial whose handshake returned once ``close`` began registered a
    shared host's region with the transport (a NIXL registration, seconds for a big pool)
    before it found the tier closed. Nothing it learnt after close is registered now: it
    ends the session, clean, and raises ``RuntimeError``."""
    with _tier_and_host() as (tier, _):
        assert isinstance(tier.transport, LateWriteTransport)
        tier.transport.remotes[b""] = torch.zeros(8, BLOCK_LEN, dtype=torch.uint8)
        session = PrivateSession()
        session.shared = shared
        tier.close()
        with pytest.raises(RuntimeError, match="closed"):
            tier._join(session, 1.0)
        assert tier.transport._peers == {}, "registered after close"
        assert session.closed == [True]


def _connect_on_a_thread(tier: TierManager, address: str) -> tuple[threading.Thread, list[object]]:
    """``tier.connect(address, private=True)`` on a thread of its own, with a timeout far past
    every wait of these tests; the list gets its peer id or its error."""
    outcome: list[object] = []

    def connect() -> None:
        try:
            outcome.append(tier.connect(address, private=True, timeout_s=DIAL_TIMEOUT_S))
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    return thread, outcome


def test_a_host_restarted_while_its_accept_is_awaited_is_greeted_again_at_once() -> None:
    """Found by review: a host killed while a tier awaited its ``Accept`` and started again on
    its port cost the connect its whole ``timeout_s`` (its answer could never come), then an
    ``AcceptLost``. The closed connection is seen at once: the tier greets the new host, joins
    it, and releases over the new session what the lost ``Handshake`` may have opened."""
    with TierManager.create(4, BLOCK_LEN, name="restarted") as tier:  # (a real NIXL agent)
        old = _MuteAtAccept()
        thread, outcome = _connect_on_a_thread(tier, old.address)
        assert old.handshaken.wait(RESULT_TIMEOUT_S), "the handshake never went out"
        old.close()  # killed: its connections close
        with ServerProcess.start(32, BLOCK_LEN, extra_args=["--port", str(old.port)]):
            thread.join(timeout=RESULT_TIMEOUT_S)
            assert not thread.is_alive(), "the connect waited out its timeout_s"
            assert outcome == [old.address], outcome
            session = tier._peers[old.address].session
            assert session is not None
            # named in the release of the Handshake the new host accepted, not again after it
            assert old.handshakes()[0] not in session.unreleased()


def test_a_handshake_whose_connections_closed_twice_names_every_session_it_may_have_opened() -> (
    None
):
    """A host killed while the ``Accept`` is awaited, started again and killed again before it
    answers: both ``Handshake``s may have opened a session (on a host still running, the
    connection only reset). The connect fails once the second host's answer is not coming,
    naming both, and the tier's next handshake there releases them."""
    arena = BlockArena(4, BLOCK_LEN)
    with TierManager(arena, LateWriteTransport(arena.tensor)) as tier:
        first = _MuteAtAccept()
        thread, outcome = _connect_on_a_thread(tier, first.address)
        assert first.handshaken.wait(RESULT_TIMEOUT_S), "the handshake never went out"
        first.close()
        second = _MuteAtAccept(first.port)
        assert second.handshaken.wait(RESULT_TIMEOUT_S), "the host was not greeted again"
        second.close()
        third = _MuteAtAccept(first.port)  # its greeting is the last a handshake says
        try:
            assert third.handshaken.wait(RESULT_TIMEOUT_S), "the host was not greeted again"
            opened = [*first.handshakes(), *second.handshakes(), *third.handshakes()]
            tier.close(timeout=2.0)  # (the third is awaited to its timeout: abandoned)
            thread.join(timeout=RESULT_TIMEOUT_S)
            assert not thread.is_alive()
        finally:
            third.close()
    assert len(outcome) == 1 and isinstance(outcome[0], AcceptAbandoned), outcome
    assert outcome[0].session_ids == opened
    # each greeting again named what the ones before may have opened, for the host to free first
    assert _released(second) == opened[:1] and _released(third) == opened[:2]


def _released(host: _MuteAtAccept) -> list[str]:
    """The sessions the ``Handshake`` ``host`` got named in its ``release``."""
    (handshake,) = [m for m in host.heard if isinstance(m, p.Handshake)]
    return list(handshake.release)
