"""The arguments of a connection to a host, checked before any network traffic: its address
(``parse_address``), the session's region, token, slots and timeouts (``check_session_args``,
``check_connect_args``, ``check_timeouts``). Each raises ``TypeError``/``ValueError`` naming the
bad argument and what to pass. Pure functions: any thread.
"""

from __future__ import annotations

import re

from torch_kv_tier.remote import protocol as p
from torch_kv_tier.remote.quantities import (
    CONNECT_TIMEOUT,
    HEARTBEAT_INTERVAL,
    HEARTBEAT_TIMEOUT,
    Floor,
    count,
    flag,
    seconds,
)

# the floor of each timeout a connection takes (``check_timeouts``)
FLOORS: dict[str, Floor] = {
    "timeout_s": CONNECT_TIMEOUT,
    "heartbeat_timeout_s": HEARTBEAT_TIMEOUT,
    "heartbeat_interval_s": HEARTBEAT_INTERVAL,
}
# a host name, IPv4 or IPv6 address (with its zone); ZeroMQ refuses one that starts otherwise
_HOST = re.compile(r"[A-Za-z0-9:][A-Za-z0-9._%:-]*")


def parse_address(address: str) -> tuple[str, int]:
    """Split ``HOST:PORT`` (IPv6: ``[HOST]:PORT``); ``ValueError`` when it is not one, or when
    its host has characters no host name or IP address has (ZeroMQ would refuse it)."""
    host, sep, port_text = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    digits = port_text.isascii() and port_text.isdigit()  # (int() takes "٥٦٠٠"; "²" raised)
    if not sep or not host or not digits or not 0 < int(port_text) < 65536:
        raise ValueError(f"server address must be HOST:PORT (as `ready` printed), got {address!r}")
    if not _HOST.fullmatch(host):
        raise ValueError(
            f"server address must be HOST:PORT, got {address!r}: a host has only letters, "
            "digits and '.-_' (an IPv6 address ':' and '%' too, in brackets), no spaces, and "
            "starts with a letter or a digit"
        )
    return host, int(port_text)


def check_session_args(
    address: str,
    region: p.Region,
    agent_metadata: bytes,
    slots: int | None,
    private: bool,
    token: str | None,
    **timeouts_s: float,
) -> int | None:
    """``RemoteSession.open``'s checks, before any network traffic: ``TypeError``/
    ``ValueError`` naming the bad argument (a timeout must be finite, at most
    ``quantities.MAX_WAIT_S``, and at least its floor: ``check_timeouts``). Returns ``slots``
    as the ``int`` to send (``check_connect_args``)."""
    problem = region.problem()
    if problem is not None:
        raise ValueError(problem)
    slots = check_connect_args(address, slots, private, token)
    if not agent_metadata:
        raise ValueError("agent_metadata is empty: pass transport.get_agent_metadata()")
    check_timeouts(**timeouts_s)
    return slots


def check_timeouts(**timeouts_s: float) -> dict[str, float]:
    """``seconds`` of each of ``timeouts_s`` (each > 0, and at least its ``FLOORS`` entry's
    ``least_s``: the ``ValueError`` says why and what to pass): raises for the first that is
    none. Returns them as the floats every wait takes."""
    return {
        name: seconds(name, value, floor=FLOORS.get(name)) for name, value in timeouts_s.items()
    }


def check_connect_args(
    address: str, slots: int | None, private: bool, token: str | None
) -> int | None:
    """Connection arguments no host could accept (what a tier's ``connect`` checks before it
    dials): ``TypeError``/``ValueError`` naming the bad one. Returns ``slots`` as an ``int``
    (``count``), the value to send."""
    parse_address(address)
    flag("private", private)
    if slots is not None:
        slots = count("slots", slots)
        if not private:
            raise ValueError("slots= sizes a private lease: pass private=True with it")
    if token is not None and not isinstance(token, str):
        raise TypeError(
            f"token must be a str (the host's token, stripped), got a {type(token).__name__}: "
            "pass e.g. Path(token_file).read_text().strip()"
        )
    if token == "":
        raise ValueError("token is empty: pass None for a server without a token")
    if token is not None and token != token.strip():
        raise ValueError(
            "token has surrounding whitespace (a token file's newline?), which no host's "
            "token has (it strips its --token-file): pass token.strip()"
        )
    return slots
