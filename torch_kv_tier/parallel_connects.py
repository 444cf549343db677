"""A tier's connects to several remote hosts, made side by side: hosts that do not answer cost
one handshake timeout in all, not one each (a tier's startup with 4 hosts down waited
4 x ``connect_timeout``; so did each membership round). Only the handshakes overlap: the
tier's joins after them go one at a time (``ConnectedHosts._join``).

At most ``MAX_CONNECTS`` connects run at once, each on a thread of its own (200 hosts made 200
threads, each with its handshake's sockets, at every startup or membership round). Why 16:
joins take turns anyway, so more connects at once only overlap handshakes, which take
milliseconds for a host that answers; the threads that matter are those waiting out a host that
does not answer. So with more hosts than that, one more thread first greets them all at once
(a ``Hello`` on a socket of its own to each, up to the handshake's ``timeout_s``, while each
host name is looked up, as a connect does first): only the hosts that answer get a connect,
and those that do not fail without one, as their connect would have, with
``remote.UnresolvedHost`` for a name that did not resolve (in time) and ``TimeoutError``
otherwise (with the connects' ``redial_if_down``, the tier dials them in the background all
the same).
Hosts that do not answer still cost one timeout in all; the trade-off is one more round trip
for each host that does, and a host that freezes between its answer and its handshake holds a
connect's thread for its timeout (one of 16).

Threading: :class:`ParallelConnects` starts its threads (at most ``MAX_CONNECTS`` connects, and
the greeter), each ``tier.connect`` call is made once (``TierManager.connect`` is thread-safe);
``outcomes`` and ``join`` run on the caller's thread. Ownership: the tier is the caller's; this
object owns only its threads and the greeter's sockets. A caller that gives up before every
connect ended closes the tier (which ends the handshakes still awaiting an answer, and the
greeting), then calls ``join``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from torch_kv_tier.connected_hosts import REGISTER_TIMEOUT_S
from torch_kv_tier.connections import CONNECT_TIMEOUT_S, MAX_CONNECTS
from torch_kv_tier.remote.connect_args import check_timeouts
from torch_kv_tier.remote.greeting import answering
from torch_kv_tier.remote.handshake import no_answer
from torch_kv_tier.remote.host_names import resolving
from torch_kv_tier.tier_threads import TierThread

if TYPE_CHECKING:
    from torch_kv_tier.membership import Tier

logger = logging.getLogger(__name__)

_LOOK_S = 0.5  # how often ``outcomes`` looks whether a connect under way is past its bound
_MARGIN_S = 30.0  # on top of a connect's own timeouts, before it is called stuck


def longest_connect_s(timeout_s: Any) -> float:
    """How long one ``tier.connect`` may last by its own timeouts: its handshake, its wait for
    its join's turn and a shared host's snapshot (``timeout_s`` each), a private host's NIXL
    registration (``REGISTER_TIMEOUT_S``), and a margin. Past that its thread is stuck (a NIXL
    call that never returns)."""
    if not _is_timeout(timeout_s):
        timeout_s = CONNECT_TIMEOUT_S  # (such a connect raises at once)
    return 3 * float(timeout_s) + REGISTER_TIMEOUT_S + _MARGIN_S


class ParallelConnects:
    """``tier.connect(address, **connect_kwargs)`` for each of ``addresses``, side by side."""

    def __init__(
        self, tier: Tier, addresses: Sequence[str], connect_kwargs: Mapping[str, Any]
    ) -> None:
        self._tier = tier
        self._kwargs = connect_kwargs
        self._addresses = list(addresses)
        self._outcomes: dict[int, str | BaseException] = {}
        self._ended = [threading.Event() for _ in self._addresses]
        self._started: dict[int, float] = {}  # when each connect under way began
        self._longest_s = longest_connect_s(connect_kwargs.get("timeout_s", CONNECT_TIMEOUT_S))
        self._todo: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        workers = self._workers = min(MAX_CONNECTS, len(self._addresses))
        self._threads = [
            TierThread(target=self._work, name=f"tkvt-connect-{i}", daemon=True)
            for i in range(workers)
        ]
        if len(self._addresses) > workers:
            greeter = TierThread(
                target=self._greet, args=(workers,), name="tkvt-connect-greet", daemon=True
            )
            self._threads.append(greeter)
        else:
            self._hand_out(range(len(self._addresses)), workers)
        for thread in self._threads:
            thread.start()

    def _hand_out(self, indices: Iterable[int], workers: int) -> None:
        """Queue the connects of ``indices``, then one end for each of ``workers``."""
        for i in indices:
            self._todo.put(i)
        for _ in range(workers):
            self._todo.put(None)

    def _work(self) -> None:
        """A connect's thread: the connects queued, one after another, until its end."""
        while (i := self._todo.get()) is not None:
            threading.current_thread().name = f"tkvt-connect-{self._addresses[i]}"
            self._started[i] = time.monotonic()
            try:
                self._outcomes[i] = self._tier.connect(self._addresses[i], **self._kwargs)
            except BaseException as exc:
                self._outcomes[i] = exc
            self._ended[i].set()

    def _greet(self, workers: int) -> None:
        """The greeter's thread: a connect for each host that answers a ``Hello`` (as it
        answers), ``TimeoutError`` for each that does not within the handshake's timeout. One
        it could not greet (a bad address, no socket left) gets its connect all the same, as
        does every host when ``timeout_s`` is no timeout (each connect says why)."""
        timeout_s = self._kwargs.get("timeout_s", CONNECT_TIMEOUT_S)
        waiting = set(range(len(self._addresses)))
        try:
            if not _is_timeout(timeout_s):
                return
            lookups = [resolving(address) for address in self._addresses]
            for i in answering(self._addresses, timeout_s, lambda: self._tier.closed):
                waiting.discard(i)
                self._todo.put(i)
            if not self._tier.closed:  # (closed: each connect fails at once, saying so)
                for i in sorted(waiting):
                    exc = lookups[i]() or no_answer(self._addresses[i], timeout_s)
                    self._outcomes[i] = self._silent(self._addresses[i], exc)
                    self._ended[i].set()
                waiting.clear()
        finally:
            self._hand_out(sorted(waiting), workers)

    def _silent(self, address: str, exc: Exception) -> Exception:
        """What the connect of ``address``, which did not answer the greeting, fails with:
        ``exc``, what its connect would have raised (``UnresolvedHost`` for a name that did not
        resolve, else ``TimeoutError``); with ``redial_if_down``, the tier dials it in the
        background all the same (``dial_later``), as that connect would have."""
        if self._kwargs.get("redial_if_down"):
            kwargs = {k: v for k, v in self._kwargs.items() if k != "redial_if_down"}
            try:
                self._tier.dial_later(address, exc, **kwargs)
            except Exception as refused:  # (the tier closed meanwhile)
                return refused
        return exc

    def outcomes(self) -> Iterator[tuple[str, str | Exception]]:
        """Each address, in the order given, with its peer id or the exception its connect
        raised; each waits for its connect to end, as long as the connect's own timeouts let it
        (``longest_connect_s``): one still under way after that is stuck (a NIXL call that never
        returned) and yields ``TimeoutError``, its thread left to end on its own (``join`` logs
        it). An exception that is not an ``Exception`` is raised."""
        for i, address in enumerate(self._addresses):
            outcome = self._wait(i)
            if outcome is None:
                yield (
                    address,
                    TimeoutError(
                        f"the connect of {address} did not end within {self._longest_s:g} s, past "
                        "its own timeouts: its thread is stuck (a NIXL call that never returned?); "
                        "the tier goes on without it: restart the process if it never joins"
                    ),
                )
                continue
            if not isinstance(outcome, str | Exception):
                raise outcome
            yield address, outcome

    def _wait(self, i: int) -> str | BaseException | None:
        """Connect ``i``'s outcome once it ended; ``None`` once it has been under way for longer
        than its own timeouts allow, or, not begun, once every connect thread is stuck so."""
        while not self._ended[i].wait(_LOOK_S):
            late = time.monotonic() - self._longest_s
            started = self._started.get(i)
            if started is not None:
                if started < late:
                    return None
            elif self._workers <= sum(
                1
                for j, t in list(self._started.items())
                if t < late and not self._ended[j].is_set()
            ):
                return None
        return self._outcomes[i]

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` s in all for every connect to end; one still running then is
        logged and left to end on its own (its daemon thread)."""
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(deadline - time.monotonic(), 0.0))
        for address, ended in zip(self._addresses, self._ended, strict=True):
            if not ended.is_set():
                logger.warning("a connect of %s did not end within %.1fs", address, timeout)


def _is_timeout(timeout_s: Any) -> bool:
    """Whether the connects take ``timeout_s`` (``connect_args.check_timeouts``)."""
    try:
        check_timeouts(timeout_s=timeout_s)
    except (TypeError, ValueError):
        return False
    return True


__all__ = ["ParallelConnects"]
