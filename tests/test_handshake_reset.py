"""A control connection reset while a handshake awaited its ``Accept``, the host still running:
the host opened a session for the lost ``Handshake`` and holds it, so the greeting again must
name it for the host to free before it weighs the new one."""

from __future__ import annotations

import threading

import pytest
import zmq
from remote_support import BLOCK_LEN, fake_session, free_port

from torch_kv_tier.remote import ServerProcess
from torch_kv_tier.remote import protocol as p

RESULT_TIMEOUT_S = 10.0
POOL = 32


class _ResetAtAccept:
    """A relay at ``127.0.0.1:port`` in front of the host at ``upstream`` that swallows the
    first ``Accept`` and drops the client's connection (its socket closed, a new one bound on
    the same port, relaying everything over a connection of its own to the host): what a client
    sees when its connection resets while the ``Accept`` is on its way. ``dropped`` is set
    then."""

    def __init__(self, upstream: str) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self._upstream = upstream
        self.dropped = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self._relay(drop_accept=True):
            self._relay(drop_accept=False)

    def _relay(self, *, drop_accept: bool) -> bool:
        """Relay until stopped (``False``), or until it swallowed an ``Accept`` (``True``)."""
        context = zmq.Context()  # its own: terminating it frees the port before the next bind
        front, back = context.socket(zmq.ROUTER), context.socket(zmq.DEALER)
        try:
            front.setsockopt(zmq.LINGER, 0)
            back.setsockopt(zmq.LINGER, 0)
            front.bind(f"tcp://{self.address}")
            back.connect(f"tcp://{self._upstream}")
            poller = zmq.Poller()
            poller.register(front, zmq.POLLIN)
            poller.register(back, zmq.POLLIN)
            identity = b""
            while not self._stop.is_set():
                ready = dict(poller.poll(50))
                if front in ready:
                    identity, frame = front.recv_multipart()
                    back.send(frame)
                if back in ready:
                    frame = back.recv()
                    if drop_accept and isinstance(p.decode_server(frame), p.Accept):
                        self.dropped.set()
                        return True
                    front.send_multipart([identity, frame])
            return False
        finally:
            front.close()
            back.close()
            context.term()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=RESULT_TIMEOUT_S)


@pytest.mark.parametrize(
    ("extra", "slots"), [(["--max-sessions", "1"], 4), ([], POOL)], ids=["sessions", "slots"]
)
def test_a_greeting_again_frees_the_session_the_lost_accept_opened(
    extra: list[str], slots: int
) -> None:
    """Found by review: a host at its ``--max-sessions`` (or with every slot leased) once the
    lost ``Handshake``'s session opened refused the greeting again (``too many sessions``,
    ``no free slots``): that session was to be released only over the new one, which the host
    would not open. The connect now succeeds, and the host holds that one session alone."""
    with ServerProcess.start(POOL, BLOCK_LEN, extra_args=extra) as server:
        relay = _ResetAtAccept(server.address)
        try:
            session = fake_session(relay.address, slots=slots, timeout_s=RESULT_TIMEOUT_S)
            try:
                assert relay.dropped.is_set(), "no Accept was lost: nothing was tested"
                held = session.stats()["sessions"]
                assert [s["public_id"] for s in held] == [session.public_id], held
            finally:
                session.close()
        finally:
            relay.close()
