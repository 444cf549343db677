"""Which remote hosts a tier is connected to, kept in step with a host source.

A *source* (``host_sources``: a static list, DNS A/AAAA or SRV records, a file of addresses)
says which ``HOST:PORT`` hosts should be connected now. :class:`Membership` resolves it every
``interval_s`` and reconciles a tier (a ``TierManager``): it connects hosts that appeared,
disconnects hosts that disappeared, and dials again a listed host whose peer the tier dropped.
The source names are importable from here too.

Threading: sources are resolved on the calling thread (``host_sources``). After ``start``,
``Membership`` calls the tier only from its own daemon thread, but for a round's dials: those
run side by side, one thread per host (``parallel_connects``), and the round waits for them.
``hosts`` and ``stop`` may be called from any thread.

Failure model: a failed resolve (DNS timeout or SERVFAIL, missing or unreadable file, a bad
line) keeps the last known set, so a DNS blink never drops every host; an authoritative answer
(NXDOMAIN, no records, an empty file) is a real set, and empty drops every host. A failed
connect is retried every round, as is a failed disconnect of a host that left, and a round that
failed in another tier call. Each is logged once per outage, and again when it recovers. Once
the tier is closed (its calls raise ``RuntimeError``), the thread ends; an exception of an open
tier (``RuntimeError`` too) is a failed call like any other.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
from collections.abc import Mapping
from typing import Any, Protocol

from torch_kv_tier.host_sources import (
    SOURCE_FORMS,
    DnsHosts,
    HostSource,
    SourceError,
    SrvHosts,
    StaticHosts,
    WatchedFile,
    first_hosts,
    make_resolver,
    parse_source,
    source_scheme,
)
from torch_kv_tier.parallel_connects import ParallelConnects
from torch_kv_tier.remote.connect_args import check_connect_args, check_timeouts
from torch_kv_tier.remote.quantities import RECONNECT_INTERVAL, seconds
from torch_kv_tier.tier_threads import TierThread

__all__ = [
    "SOURCE_FORMS",
    "DnsHosts",
    "HostSource",
    "Membership",
    "SourceError",
    "SrvHosts",
    "StaticHosts",
    "Tier",
    "WatchedFile",
    "first_hosts",
    "make_resolver",
    "parse_source",
    "source_scheme",
]

logger = logging.getLogger(__name__)

_CLOSED_DIALS_S = 1.0  # how long a round the tier's close ended waits for its other dials


class Tier(Protocol):
    """What :class:`Membership` (and ``ParallelConnects``) needs of a ``TierManager``."""

    def connect(self, *args: Any, **kwargs: Any) -> str: ...
    def disconnect(self, peer_id: str) -> None: ...
    def dial_later(self, *args: Any, **kwargs: Any) -> None: ...
    def placing_peers(self) -> list[str]: ...
    @property
    def closed(self) -> bool: ...


def _check_connect_kwargs(tier: Tier, kwargs: dict[str, Any]) -> None:
    """``TypeError`` for ``kwargs`` that ``tier.connect`` does not take (or a timeout that is
    no number), ``ValueError`` for values no host could accept (``connect_args.check_connect_args``
    and ``check_timeouts``)."""
    try:
        inspect.signature(tier.connect).bind("host:1", **kwargs)
    except TypeError as exc:
        raise TypeError(f"connect_kwargs do not fit {type(tier).__name__}.connect: {exc}") from None
    check_connect_args(
        "host:1", kwargs.get("slots"), kwargs.get("private", False), kwargs.get("token")
    )
    check_timeouts(**{k: v for k, v in kwargs.items() if k in ("timeout_s", "heartbeat_timeout_s")})


class Membership:
    """A daemon thread that keeps ``tier`` connected to what ``source`` resolves to.

    Every ``interval_s`` (the first round right after ``start``) it resolves ``source``; each
    new address is connected with ``tier.connect(address, **connect_kwargs)``, each vanished
    one disconnected (unless another listed address reached the same peer, e.g. a dual-stack
    host's A and AAAA address), and each listed address whose peer ``tier.placing_peers()``
    no longer lists (neither joined nor joining), or that never connected, is dialled again;
    a round dials its hosts side by side, so hosts that do not answer hold it up one
    handshake timeout in all. ``known`` are addresses
    the caller already dialled: their peer ids, or ``None`` for a host that did not answer
    (already logged). The tier owns the peers; this object only calls its public methods
    (module docstring).

    ``connect_kwargs`` that ``tier.connect`` does not take raise ``TypeError``, and values no
    host could accept (``slots`` without ``private``, an empty ``token``) ``ValueError``, here;
    so does an ``interval_s`` that is no number of seconds (``TypeError``/``ValueError``) or is
    under 0.1 s (``ValueError``, ``quantities.RECONNECT_INTERVAL``: says why and what to pass).
    """

    def __init__(
        self,
        tier: Tier,
        source: HostSource,
        *,
        interval_s: float = 5.0,
        connect_kwargs: Mapping[str, Any] | None = None,
        known: Mapping[str, str | None] | None = None,
    ) -> None:
        self._interval_s = seconds("interval_s", interval_s, floor=RECONNECT_INTERVAL)
        self._tier = tier
        self._source = source
        self._connect_kwargs = dict(connect_kwargs or {})
        _check_connect_kwargs(tier, self._connect_kwargs)
        self._hosts: dict[str, str | None] = dict(known or {})
        self._lock = threading.Lock()  # guards _hosts; never held while calling the tier
        self._down = {address for address, peer in self._hosts.items() if peer is None}
        self._leaving: dict[str, str | None] = {}  # gone address -> its peer, to disconnect
        self._resolve_failing = False
        self._round_failing = False
        self._stop = threading.Event()
        self._thread = TierThread(target=self._run, name="tkvt-membership", daemon=True)

    def start(self) -> None:
        """Start the thread (once); returns at once."""
        self._thread.start()

    def stop(self, timeout: float) -> None:
        """Stop the thread; wait up to ``timeout`` s for it (a handshake in progress may take
        up to its ``timeout_s``). The tier keeps its peers. Idempotent. ``TypeError``/
        ``ValueError`` for a ``timeout`` that is no number of seconds >= 0 (``seconds``)."""
        timeout = seconds("timeout", timeout, zero=True)
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout)
            if self._thread.is_alive():
                logger.warning("membership thread did not stop within %.1fs", timeout)

    def hosts(self) -> dict[str, str | None]:
        """Each address the source listed last: its peer id, or ``None`` until connected."""
        with self._lock:
            return dict(self._hosts)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._round()
            except Exception as exc:
                if self._tier.closed:
                    logger.info("membership of %s ends: %s", self._source, exc)
                    return
                if not self._round_failing:
                    logger.warning(
                        "a membership round of %s failed; retrying every %.1fs: %r",
                        self._source,
                        self._interval_s,
                        exc,
                    )
                self._round_failing = True
            else:
                if self._round_failing:
                    logger.info("membership rounds of %s succeed again", self._source)
                self._round_failing = False
            self._stop.wait(self._interval_s)

    def _round(self) -> None:
        listed = self._resolve()
        if listed is not None:
            with self._lock:
                gone = {a: p for a, p in self._hosts.items() if a not in listed}
                for address in gone:
                    del self._hosts[address]
                for address in listed:
                    self._hosts.setdefault(address, None)
                    if self._leaving.pop(address, None):  # back before it was disconnected
                        self._down.discard(address)
                kept = set(self._hosts.values())
            for address in gone:
                self._down.discard(address)
            self._leaving.update(gone)
            for address, peer_id in sorted(self._leaving.items()):
                if peer_id is None or peer_id in kept or self._disconnect(address, peer_id):
                    del self._leaving[address]
        live = set(self._tier.placing_peers())  # (a host still joining is in hand)
        due = [a for a, peer_id in sorted(self.hosts().items()) if peer_id not in live]
        if self._stop.is_set() or not due:
            return
        dials = ParallelConnects(self._tier, due, self._connect_kwargs)  # one timeout in all
        try:
            for address, outcome in dials.outcomes():
                self._dialled(address, outcome)
        finally:  # (the rest end at once when the tier closed)
            dials.join(timeout=_CLOSED_DIALS_S)

    def _resolve(self) -> set[str] | None:
        try:
            listed = set(self._source.resolve())
        except Exception as exc:
            if not self._resolve_failing:
                logger.warning("%s; keeping the last known remote hosts", exc)
            self._resolve_failing = True
            return None
        if self._resolve_failing:
            logger.info("%s resolves again: %d remote host(s)", self._source, len(listed))
        self._resolve_failing = False
        return listed

    def _disconnect(self, address: str, peer_id: str) -> bool:
        """Disconnect the peer of ``address``, which left; ``False`` when that failed (tried
        again next round, logged once). A ``RuntimeError`` of a closed tier ends the thread."""
        try:
            with contextlib.suppress(KeyError):  # the tier had forgotten it already
                self._tier.disconnect(peer_id)
        except Exception as exc:
            self._failed(address, f"left {self._source} but cannot be disconnected", exc)
            return False
        self._down.discard(address)
        logger.info("remote host %s left %s: disconnected", address, self._source)
        return True

    def _failed(self, address: str, what: str, exc: Exception) -> None:
        """``address`` failed (``what``): logged once until it works again (the round retries
        it); a closed tier's ``RuntimeError`` is raised again, ending the thread."""
        if isinstance(exc, RuntimeError) and self._tier.closed:
            raise exc
        if address not in self._down:
            self._down.add(address)
            logger.warning(
                "remote host %s %s; retrying every %.1fs: %s", address, what, self._interval_s, exc
            )

    def _dialled(self, address: str, peer_id: str | Exception) -> None:
        """``address`` was dialled: its peer id, or what its connect raised (a ``RuntimeError``
        of a closed tier ends the thread)."""
        if isinstance(peer_id, Exception):
            self._failed(address, "cannot be connected", peer_id)
            return
        with self._lock:
            self._hosts[address] = peer_id
        self._down.discard(address)
        logger.info("connected remote host %s (peer %s)", address, peer_id)
