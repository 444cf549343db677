"""A handshake greeting a host again (``handshake``) against answers that arrive out of step with
it: an earlier greeting's answer, and an answer that arrived just before its connection closed.
The hosts are ZeroMQ ROUTERs in this process, scripted message by message."""

from __future__ import annotations

import secrets
import threading
import time
from typing import Any

import pytest
import zmq
from remote_support import BLOCK_LEN

from torch_kv_tier.remote import handshake as hs
from torch_kv_tier.remote import protocol as p

RESULT_TIMEOUT_S = 10.0
REGION = p.Region(0x10000, 8, BLOCK_LEN)


def _router(port: int | None = None) -> tuple[zmq.Context[Any], zmq.Socket[bytes], int]:
    """A ROUTER on 127.0.0.1 (``port``, or a random one) in a context of its own: terminating
    it frees the port at once, for a host started again there."""
    context: zmq.Context[Any] = zmq.Context()
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    if port is None:
        port = sock.bind_to_random_port("tcp://127.0.0.1")
    else:
        sock.bind(f"tcp://127.0.0.1:{port}")
    return context, sock, port


def _receive(sock: zmq.Socket[bytes]) -> tuple[bytes, p.ClientMessage]:
    if not sock.poll(int(RESULT_TIMEOUT_S * 1e3), zmq.POLLIN):
        raise TimeoutError("the client sent nothing")
    identity, frame = sock.recv_multipart()
    return identity, p.decode_client(frame)


class _RestartedWithHelloQueued:
    """A host that dies before it answers the first ``Hello``, and is started again on its
    port, where that ``Hello`` (still queued on the client's side) arrives with the next one:
    it answers both, in order. It accepts a ``Handshake`` that answers the nonce given for
    that ``Handshake``'s own ``Hello`` (as a real host's MAC checks), and refuses any other
    as stale. ``hellos`` counts the ``Hello``s it got."""

    def __init__(self) -> None:
        self._context, self._sock, self.port = _router()
        self.address = f"127.0.0.1:{self.port}"
        self.hellos = 0
        self.failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            _, first = _receive(self._sock)
            assert isinstance(first, p.Hello), first
            self.hellos += 1
            self._sock.close()
            self._context.term()
            self._context, self._sock, _ = _router(self.port)
            issued: dict[bytes, bytes] = {}
            pending = [first]  # (delivered again to the host started anew)
            while True:
                identity, message = _receive(self._sock)
                if isinstance(message, p.Hello):
                    self.hellos += 1
                    for hello in [*pending, message]:
                        nonce = issued[hello.client_nonce] = secrets.token_bytes(p.NONCE_BYTES)
                        answer = p.Challenge(p.PROTOCOL_VERSION, hello.seq, nonce, b"")
                        self._sock.send_multipart([identity, p.encode(answer)])
                    pending = []
                elif isinstance(message, p.Handshake):
                    if issued.get(message.client_nonce) != message.nonce:
                        refusal = p.Reject(message.seq, p.STALE_NONCE)
                        self._sock.send_multipart([identity, p.encode(refusal)])
                        continue
                    self._sock.send_multipart([identity, p.encode(_accept(message))])
                    return
        except BaseException as exc:  # (reported by ``close``)
            self.failure = exc

    def close(self) -> None:
        self._thread.join(timeout=RESULT_TIMEOUT_S)
        self._sock.close()
        self._context.term()
        if self.failure is not None:
            raise self.failure


def _accept(request: p.Handshake) -> p.Accept:
    return p.Accept(
        seq=request.seq,
        session_id=request.nonce.hex(),
        public_id="s1",
        server_name="fake",
        agent_metadata=b"meta",
        region=REGION,
        lease_start=0,
        lease_stop=REGION.num_blocks,
        lease_timeout_s=10.0,
    )


def _request() -> p.Handshake:
    return p.Handshake(
        version=p.PROTOCOL_VERSION,
        seq=2,
        nonce=b"",
        proof=b"",
        agent_metadata=b"not a nixl agent",
        region=REGION,
        config_fingerprint="",
        slots=None,
    )


def test_an_earlier_greetings_challenge_is_not_taken_for_the_greeting_again() -> None:
    """Found by review: a host restarted with the first ``Hello`` still queued got it along
    with the second, and its ``Challenge`` to the first (the same seq) was taken for the
    second's: that ``Handshake`` was refused as stale, one of the ``GREETINGS`` wasted (the
    last, unwatched, is left for a host that restarts once more). Each greeting's messages
    are now numbered apart: the second greeting is accepted."""
    host = _RestartedWithHelloQueued()
    sock, monitor = hs.connect(host.address)
    try:
        deadline = time.monotonic() + RESULT_TIMEOUT_S
        accept = hs.handshake(sock, host.address, deadline, None, _request(), monitor=monitor)
    finally:
        hs.close_sockets(sock, monitor)
        host.close()
    assert host.hellos == 2
    assert accept.seq == 4  # the second greeting's Handshake


class _MonitorSeenFirst:
    """A ``zmq.Poller`` whose first poll that finds the monitor ready leaves the control
    socket out, as ``zmq_poll`` does when a frame lands between its look at the socket and
    its look at the monitor: the frame that arrived just before the connection closed."""

    def __init__(self, control: zmq.Socket[bytes], real: type[zmq.Poller]) -> None:
        self._control = control
        self._poller = real()
        self._hidden = False

    def register(self, sock: Any, flags: int) -> None:
        self._poller.register(sock, flags)

    def poll(self, timeout: int) -> list[tuple[Any, int]]:
        ready = self._poller.poll(timeout)
        if self._hidden or len(ready) < 2:
            return ready
        self._hidden = True
        return [(sock, event) for sock, event in ready if sock is not self._control]


def test_an_answer_that_arrived_before_the_connection_closed_is_taken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: one poll that saw the monitor's disconnect but not the answer that had
    arrived just before it greeted again (``Closed``), the answer still waiting: its session,
    opened, was named for release and a greeting wasted. The answer is now taken."""
    context, host, port = _router()
    sock, monitor = hs.connect(f"127.0.0.1:{port}")
    try:
        hs.say_hello(sock)
        identity, hello = _receive(host)
        assert isinstance(hello, p.Hello), hello
        answer = p.Challenge(p.PROTOCOL_VERSION, 1, secrets.token_bytes(p.NONCE_BYTES), b"")
        host.send_multipart([identity, p.encode(answer)])
        assert sock.poll(int(RESULT_TIMEOUT_S * 1e3), zmq.POLLIN)  # arrived (not read)
        host.close()
        context.term()  # the connection closes: the monitor reports it
        assert monitor.poll(int(RESULT_TIMEOUT_S * 1e3), zmq.POLLIN)
        real = zmq.Poller
        monkeypatch.setattr(hs.zmq, "Poller", lambda: _MonitorSeenFirst(sock, real))
        deadline = time.monotonic() + RESULT_TIMEOUT_S
        got = hs._await_reply(sock, 1, deadline, None, monitor)
    finally:
        hs.close_sockets(sock, monitor)
    assert got == answer
