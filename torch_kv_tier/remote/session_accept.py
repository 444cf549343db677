"""How ``RemoteSession.open`` gets a server's usable accept: look the host's name up, connect,
run the handshake (``handshake``), and check the accept before any session starts on it.

Threading: ``connect_accepted`` runs in the caller's thread, before the session's I/O thread
exists; it blocks for up to ``timeout_s`` (the name's lookup and the handshake together), or
until ``cancel`` is set.

Ownership: the sockets it returns, with the server's ``Accept`` received on them, are the
caller's: it hands them to the session's I/O thread, or ends them with
``handshake.end_unstarted`` (the server then ends the session it accepted). On failure nothing
is left open: the sockets are closed (lingering after ``AcceptAbandoned``, so that its
``Disconnect`` still goes out), and an accept no session can use is ended at the server first.

Errors: what ``RemoteSession.open`` documents past its argument checks (``UnresolvedHost``,
``HandshakeRejected``, ``TimeoutError``/``AcceptLost``, ``ConnectionError``/``AcceptAbandoned``);
the sessions the server may have opened meanwhile are ``handshake_errors.opened_by`` the error.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import zmq

from torch_kv_tier.remote import protocol as p
from torch_kv_tier.remote.connect_args import parse_address
from torch_kv_tier.remote.handshake import (
    AcceptAbandoned,
    Cancel,
    accept_problem,
    close_sockets,
    connect,
    end_unstarted,
    handshake,
)
from torch_kv_tier.remote.host_names import check_resolves


class Accepted(NamedTuple):
    """A server's usable accept and the control sockets it came on (owned by the caller)."""

    sock: zmq.Socket[bytes]
    monitor: zmq.Socket[bytes]
    accept: p.Accept
    opened: list[str]  # sessions of greetings whose connection closed (``handshake``)


def connect_accepted(
    address: str, hello: p.Handshake, token: str | None, timeout_s: float, cancel: Cancel | None
) -> Accepted:
    """Say ``hello`` to the server at ``address`` (proving ``token``) and return its accept,
    within ``timeout_s`` (module docstring)."""
    opened: list[str] = []
    deadline = time.monotonic() + timeout_s  # the name's lookup and the handshake's
    check_resolves(address, parse_address(address)[0], deadline, cancel)
    sock, monitor = connect(address)
    try:
        accept = handshake(sock, address, deadline, token, hello, cancel, monitor, opened)
    except BaseException as exc:  # an abandoned accept's ``Disconnect`` still goes out
        close_sockets(sock, monitor, linger=isinstance(exc, AcceptAbandoned))
        raise
    problem = accept_problem(accept)
    if problem is not None:
        end_unstarted(sock, monitor, accept.session_id)
        raise ConnectionError(
            f"the server at {address} sent an unusable accept ({problem}): is it a "
            "`torch-kv-tier serve` of this version?"
        )
    return Accepted(sock, monitor, accept, opened)
