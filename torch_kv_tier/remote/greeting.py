"""Greeting hosts before handshaking with them: a ``Hello`` to each, to learn which answer.

A tier that has more hosts to dial than handshakes it runs at once (``connections.MAX_CONNECTS``)
greets them first: one thread, one socket each, no handshake threads held by hosts that do not
answer. ``Greeting`` takes hosts as they come, each with its own timeout, so a host added while
others are awaited is answered (and handed on) at once, whatever their timeouts;
``answering`` greets a fixed list.

Threading and ownership: a ``Greeting`` belongs to one thread (ZeroMQ sockets are not
thread-safe), which must ``close`` it: that closes every socket still open.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Generic, TypeVar

import zmq

from torch_kv_tier.remote.handshake import CANCEL_POLL_S, dealer, say_hello

K = TypeVar("K")


class Greeting(Generic[K]):
    """Hosts greeted, each under a key of the caller's, until it answers or its timeout ends."""

    def __init__(self) -> None:
        self._greeted: dict[zmq.Socket[bytes], tuple[K, float]] = {}  # -> (key, deadline)
        self._poller = zmq.Poller()

    def __len__(self) -> int:
        """How many hosts are awaited."""
        return len(self._greeted)

    def keys(self) -> list[K]:
        """The keys of the hosts awaited."""
        return [key for key, _ in self._greeted.values()]

    def add(self, key: K, address: str, timeout_s: float) -> bool:
        """Send a ``Hello`` to the host at ``address``, awaited for ``timeout_s`` from now;
        ``False`` when it cannot be greeted (a bad address, no socket left: its handshake
        says why), never raises."""
        try:
            sock, endpoint = dealer(address)
        except (ValueError, zmq.ZMQError):
            return False
        try:
            sock.connect(endpoint)
            say_hello(sock, zmq.NOBLOCK)
        except zmq.ZMQError:
            sock.close(linger=0)
            return False
        self._greeted[sock] = (key, time.monotonic() + timeout_s)
        self._poller.register(sock, zmq.POLLIN)
        return True

    def wait(self, timeout_s: float) -> tuple[list[K], list[K]]:
        """Wait up to ``timeout_s`` (less once a host's timeout ends) for answers; return the
        keys of the hosts that answered (any answer: a refusal is its handshake's to report;
        every host when the poll fails) and of those whose timeout ended first. Neither is
        awaited any more."""
        if not self._greeted:
            return [], []
        now = time.monotonic()
        soonest = min(deadline for _, deadline in self._greeted.values())
        wait_ms = math.ceil(max(min(timeout_s, soonest - now), 0.0) * 1e3)
        try:
            heard = [sock for sock, _ in self._poller.poll(wait_ms)]
        except zmq.ZMQError:  # (the context was terminated, say): each handshake says why
            heard = list(self._greeted)
        answered = [self._let_go(sock) for sock in heard]
        now = time.monotonic()
        late = [sock for sock, (_, deadline) in self._greeted.items() if deadline <= now]
        return answered, [self._let_go(sock) for sock in late]

    def drop(self, gone: Callable[[K], bool]) -> list[K]:
        """Stop awaiting the hosts whose key is ``gone``; returns their keys."""
        return [self._let_go(s) for s, (key, _) in list(self._greeted.items()) if gone(key)]

    def close(self) -> None:
        """Close the sockets of the hosts still awaited (idempotent)."""
        for sock in self._greeted:
            sock.close(linger=0)
        self._greeted.clear()

    def _let_go(self, sock: zmq.Socket[bytes]) -> K:
        self._poller.unregister(sock)
        sock.close(linger=0)
        return self._greeted.pop(sock)[0]


def answering(
    addresses: Sequence[str], timeout_s: float, closed: Callable[[], bool]
) -> Iterator[int]:
    """The index of each of ``addresses`` whose host answers a ``Hello`` within ``timeout_s``
    (any answer: a refusal is its handshake's to report), as it answers, or that could not be
    greeted (its handshake says why); stops early once ``closed()``. Every socket it made is
    closed when it returns."""
    greeting: Greeting[int] = Greeting()
    try:
        for i, address in enumerate(addresses):
            if not greeting.add(i, address, timeout_s):
                yield i
        while greeting and not closed():
            yield from greeting.wait(CANCEL_POLL_S)[0]
    finally:
        greeting.close()
