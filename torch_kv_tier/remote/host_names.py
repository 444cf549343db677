"""Resolving a host's name before dialling it (``check_resolves``): ZeroMQ resolves a name
itself, in the background, and retries one that does not resolve without a word, so a connect
to a misspelt or vanished name waited out its whole timeout and then said the host did not
answer. An IP literal is not looked up. The name still goes to ZeroMQ as given (it resolves it
again on each reconnect, as before), which dials a name over IPv4 alone (``handshake.dealer``
turns IPv6 on for an IPv6 literal only): a name with IPv6 addresses and no IPv4 one is refused
here too, naming its address to pass instead (it waited out the timeout, "no answer").

Threading: ``check_resolves`` blocks its caller until the lookup ends, its deadline passes or
its ``cancel`` is set (``resolving`` starts a lookup and never waits); the lookup
(``socket.getaddrinfo``, which no timeout bounds) runs on a daemon thread, which a lookup that
hangs leaves behind until the system's resolver gives up (its own timeout, ``/etc/resolv.conf``).
Callers asking for a name while its lookup is still under way wait for that one: one thread per
name, however many connects and redials ask for it (each made a thread of its own, so a hung
name server left one behind per redial of each host).
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from collections.abc import Callable

from torch_kv_tier.remote.connect_args import parse_address
from torch_kv_tier.remote.handshake import CANCEL_POLL_S, Cancel
from torch_kv_tier.remote.handshake_errors import Cancelled

_NO_SUCH_NAME = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


class UnresolvedHost(ConnectionError):
    """The host name of ``address`` did not resolve (``name``): no such name, no answer from
    the name server, or none by the connect's deadline. A ``ConnectionError``, so that a host
    whose name does not resolve (yet, or any more) counts as down: ``redial_if_down`` and a
    lost host's redial dial it again until it resolves."""

    def __init__(self, address: str, name: str, why: str) -> None:
        super().__init__(f"cannot resolve host name {name!r} of {address}: {why}")
        self.address = address
        self.name = name


def is_ip(host: str) -> bool:
    """Whether ``host`` is an IPv4 or IPv6 address (with its zone), which needs no lookup."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class _Lookup:
    """One ``getaddrinfo`` of ``host`` on a daemon thread; ``done`` is set once it ended, with
    ``failure`` set if it failed, else ``ipv6_only`` (an IPv6 address of the name, when it has
    no IPv4 one). Its entry in ``_IN_FLIGHT`` goes before ``done`` is set."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.done = threading.Event()
        self.failure: socket.gaierror | None = None
        self.ipv6_only: str | None = None

    def run(self) -> None:
        try:
            found = socket.getaddrinfo(self.host, None, type=socket.SOCK_STREAM)
            if all(info[0] != socket.AF_INET for info in found):
                self.ipv6_only = str(found[0][4][0])
        except socket.gaierror as exc:
            self.failure = exc
        except Exception as exc:  # (a name too long for the resolver: UnicodeError)
            self.failure = socket.gaierror(socket.EAI_NONAME, str(exc))
        finally:
            with _LOCK:
                del _IN_FLIGHT[self.host]
            self.done.set()


_LOCK = threading.Lock()
_IN_FLIGHT: dict[str, _Lookup] = {}  # the lookup under way of each name (guarded by _LOCK)


def _look_up(host: str) -> _Lookup:
    """The lookup of ``host`` under way, or a new one started (``RuntimeError`` when no thread
    can be started for it)."""
    with _LOCK:
        lookup = _IN_FLIGHT.get(host)
        if lookup is None:
            lookup = _IN_FLIGHT[host] = _Lookup(host)
            try:
                threading.Thread(
                    target=lookup.run, name=f"tkvt-resolve-{host}", daemon=True
                ).start()
            except BaseException:
                del _IN_FLIGHT[host]
                raise
    return lookup


def check_resolves(address: str, host: str, deadline: float, cancel: Cancel | None = None) -> None:
    """Return once ``host`` (``address``'s, an IP literal or a name) resolves; raise
    ``UnresolvedHost`` naming it and what to check when it does not, or not before
    ``deadline`` (``time.monotonic()``), and ``Cancelled`` once ``cancel`` (anything with an
    ``is_set``) is set. ``RuntimeError`` when no thread can be started for the lookup. Any
    thread; callers asking for a name whose lookup is under way share it."""
    if not is_ip(host):
        _check(address, _look_up(host), deadline, cancel)


def resolving(address: str) -> Callable[[], UnresolvedHost | None]:
    """Start looking up the host name of ``address`` (``HOST:PORT``) now, without waiting
    (shared with ``check_resolves`` asking for the same name meanwhile), for a caller that
    greets the host meanwhile (``parallel_connects``: past its cap a host that does not answer
    the greeting gets no connect, and an unresolvable name was reported as "no answer").
    Returns a check that never waits, to call once the host did not answer (any thread): the
    ``UnresolvedHost`` that ``check_resolves`` would raise (the lookup failed, found IPv6
    addresses only, or has not ended by then), or ``None`` when the name resolved, or when
    there is nothing to look up (an IP address) or no lookup could be started (a bad address,
    no thread left: the connect says why). Never raises."""
    try:
        host = parse_address(address)[0]
        if is_ip(host):
            return lambda: None
        lookup = _look_up(host)
    except (ValueError, RuntimeError):
        return lambda: None

    def failure() -> UnresolvedHost | None:
        try:
            _check(address, lookup, time.monotonic())
        except UnresolvedHost as exc:
            return exc
        return None

    return failure


def _check(address: str, lookup: _Lookup, deadline: float, cancel: Cancel | None = None) -> None:
    """``check_resolves`` of ``lookup`` under way (of ``address``'s host)."""
    host = lookup.host
    while not lookup.done.wait(max(min(deadline - time.monotonic(), CANCEL_POLL_S), 0.0)):
        if cancel is not None and cancel.is_set():
            raise Cancelled(
                f"resolving {host!r} cancelled: the tier is closing, or no longer dials it"
            )
        if time.monotonic() >= deadline:
            raise UnresolvedHost(
                address,
                host,
                "the name server gave no answer within the connect's timeout: check the name "
                "servers of /etc/resolv.conf (reachable? slow?), or pass the host's IP address",
            )
    exc = lookup.failure
    if exc is None and lookup.ipv6_only is not None:
        raise UnresolvedHost(
            address,
            host,
            f"it has IPv6 addresses only ({lookup.ipv6_only}, ...) and host names are dialled "
            f"over IPv4: pass the host's IPv6 address in brackets, e.g. "
            f"[{lookup.ipv6_only}]:{address.rpartition(':')[2]}",
        )
    if exc is None:
        return
    if exc.errno in _NO_SUCH_NAME:
        why = (
            f"{exc.strerror}: check its spelling, and that DNS or /etc/hosts on this machine "
            "lists it (or pass the host's IP address)"
        )
    else:
        why = (
            f"{exc.strerror}: the name server could not answer now; check the network and "
            "the name servers of /etc/resolv.conf"
        )
    raise UnresolvedHost(address, host, why)
