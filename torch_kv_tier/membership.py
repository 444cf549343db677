"""Which remote hosts a tier is connected to, kept in step with a host source.

A *source* says which ``HOST:PORT`` hosts should be connected now: a static list, DNS (A/AAAA
records of a name, or SRV records), or a file of addresses. :class:`Membership` resolves it
every ``interval_s`` and reconciles a tier (a ``TierManager``): it connects hosts that appeared,
disconnects hosts that disappeared, and dials again a listed host whose peer the tier dropped.

Threading: sources are plain objects resolved on the caller's thread (``resolve`` blocks for at
most the resolver's lifetime, all its queries together, or one file read). After ``start``,
``Membership`` calls the tier only from its own daemon thread; ``hosts`` and ``stop`` may be
called from any thread.

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
import math
import os
import stat
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import dns.exception
import dns.resolver

from torch_kv_tier.remote.client import parse_address
from torch_kv_tier.remote.handshake import check_connect_args

logger = logging.getLogger(__name__)

SOURCE_FORMS = (
    '"HOST:PORT,HOST:PORT" or a list of HOST:PORT, "dns:NAME:PORT" (A/AAAA records), '
    '"srv:_SERVICE._PROTO.NAME" (SRV records), "file:/PATH" (one HOST:PORT per line)'
)


class SourceError(Exception):
    """A source could not be resolved; the message names the source and the reason."""


class HostSource(Protocol):
    def resolve(self) -> list[str]:
        """The hosts to connect now: sorted, de-duplicated ``HOST:PORT``. Raises
        :class:`SourceError` naming the source when it cannot tell."""
        ...


class Tier(Protocol):
    """What :class:`Membership` needs of a ``TierManager``."""

    def connect(self, *args: Any, **kwargs: Any) -> str: ...
    def disconnect(self, peer_id: str) -> None: ...
    def peers(self) -> list[str]: ...
    @property
    def closed(self) -> bool: ...


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class StaticHosts:
    """A fixed list of ``HOST:PORT`` (validated here; ``ValueError`` for a bad or empty one)."""

    def __init__(self, addresses: Sequence[str]) -> None:
        for address in addresses:
            parse_address(address)
        if not addresses:
            raise ValueError("a static host list needs at least one HOST:PORT")
        self._addresses = sorted(set(addresses))

    def resolve(self) -> list[str]:
        return list(self._addresses)

    def __str__(self) -> str:
        return ",".join(self._addresses)


def make_resolver(
    nameserver: str, port: int = 53, lifetime_s: float = 5.0
) -> dns.resolver.Resolver:
    """A resolver that asks only ``nameserver`` (an IP address) on ``port``, each resolve of
    a source (all its queries) bounded by ``lifetime_s``, with no cache."""
    resolver = dns.resolver.Resolver(configure=False)
    resolver.nameservers = [nameserver]
    resolver.port = port
    resolver.lifetime = lifetime_s
    return resolver


def _check_dns_name(name: str) -> None:
    """``ValueError`` for a name no DNS record could have: one with a ``:`` (a port, or an IP
    address) would resolve to no host at all, and so drop every host."""
    if ":" in name:
        raise ValueError(
            f"{name!r} is not a DNS name (no ':'; an SRV record carries the port, and addresses "
            "are listed as HOST:PORT)"
        )


def _query(
    resolver: dns.resolver.Resolver, name: str, rdtype: str, deadline: float
) -> dns.resolver.Answer | None:
    """``rdtype`` records of ``name``, within what is left until ``deadline`` (one resolve's
    queries share the resolver's lifetime); ``None`` when DNS answers there are none."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise dns.exception.Timeout(timeout=resolver.lifetime)
    try:
        return resolver.resolve(name, rdtype, lifetime=left)
    except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
        return None


def _addresses(resolver: dns.resolver.Resolver, name: str, deadline: float) -> list[str]:
    """The A and AAAA addresses of ``name``; ``[]`` when DNS answers it has none."""
    found: list[str] = []
    for rdtype in ("A", "AAAA"):
        answer = _query(resolver, name, rdtype, deadline)
        if answer is not None:
            found.extend(rdata.to_text() for rdata in answer)
    return found


class DnsHosts:
    """Every A and AAAA record of ``name``, each with ``port``. Uses the system's resolver
    unless one is given (see :func:`make_resolver`); ``name`` is taken as fully qualified."""

    def __init__(self, name: str, port: int, resolver: dns.resolver.Resolver | None = None) -> None:
        _check_dns_name(name)
        parse_address(_host_port(name, port))
        self._name, self._port = name, port
        self._resolver = resolver or dns.resolver.Resolver()

    def resolve(self) -> list[str]:
        deadline = time.monotonic() + self._resolver.lifetime
        try:
            found = _addresses(self._resolver, self._name, deadline)
        except dns.exception.DNSException as exc:
            raise SourceError(f"{self}: {exc}") from exc
        return sorted({_host_port(ip, self._port) for ip in found})

    def __str__(self) -> str:
        return f"dns:{self._name}:{self._port}"


class SrvHosts:
    """The SRV records of ``name`` (``_service._proto.domain``): each record's port at every
    A/AAAA address of its target, resolved by the same resolver (so the tier dials exactly what
    this DNS server says, and a target that moved to a new address is a membership change). A
    target without addresses is left out."""

    def __init__(self, name: str, resolver: dns.resolver.Resolver | None = None) -> None:
        labels = name.split(".")
        if len(labels) < 3 or not all(label[1:] and label[0] == "_" for label in labels[:2]):
            raise ValueError(f"SRV name must be _SERVICE._PROTO.DOMAIN, got {name!r}")
        _check_dns_name(name)
        self._name = name
        self._resolver = resolver or dns.resolver.Resolver()

    def resolve(self) -> list[str]:
        found: set[str] = set()
        deadline = time.monotonic() + self._resolver.lifetime
        try:
            records = list(_query(self._resolver, self._name, "SRV", deadline) or ())
            for record in records:
                target = record.target.to_text()
                found.update(
                    _host_port(ip, record.port)
                    for ip in _addresses(self._resolver, target, deadline)
                )
        except dns.exception.DNSException as exc:
            raise SourceError(f"{self}: {exc}") from exc
        return sorted(found)

    def __str__(self) -> str:
        return f"srv:{self._name}"


class WatchedFile:
    """``HOST:PORT`` per line of a file (``#`` comments and blank lines ignored), re-read when
    its inode, size or mtime changed. Replace it atomically (write a copy, rename it over), or a
    resolve may read it half written. Not thread-safe: one resolving thread.

    Only a regular file is read: anything else (a FIFO, whose read waits for a writer, a device
    that never ends) fails the resolve with :class:`SourceError` at once."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._path = Path(path).expanduser()
        self._seen: tuple[int, int, int] | None = None
        self._hosts: list[str] = []

    def resolve(self) -> list[str]:
        try:
            # Non-blocking open: opening a FIFO to read would wait for a writer.
            with open(os.open(self._path, os.O_RDONLY | os.O_NONBLOCK), "rb") as file:
                st = os.fstat(file.fileno())
                if not stat.S_ISREG(st.st_mode):
                    raise SourceError(
                        f"{self}: not a regular file (a FIFO or a device is never read): "
                        "name a file of HOST:PORT lines"
                    )
                stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
                if stamp != self._seen:
                    self._hosts = self._parse(file.read().decode())
                    self._seen = stamp
        except (OSError, UnicodeDecodeError) as exc:
            raise SourceError(f"{self}: cannot read it: {exc}") from exc
        return list(self._hosts)

    def _parse(self, text: str) -> list[str]:
        hosts = set()
        for number, line in enumerate(text.splitlines(), 1):
            address = line.split("#", 1)[0].strip()
            if not address:
                continue
            try:
                parse_address(address)
            except ValueError:
                raise SourceError(
                    f"{self}: line {number} {address!r} is not HOST:PORT (e.g. 10.0.0.5:5600)"
                ) from None
            hosts.add(address)
        return sorted(hosts)

    def __str__(self) -> str:
        return f"file:{self._path}"


def source_scheme(spec: str) -> str | None:
    """``"dns"``, ``"srv"`` or ``"file"`` for such a spec; ``None`` for ``HOST:PORT`` (a host
    named like a scheme, ``dns:5600``, is an address)."""
    scheme, _, rest = spec.partition(":")
    return scheme if scheme in ("dns", "srv", "file") and not rest.isdigit() else None


def parse_source(
    spec: str | Sequence[str], *, resolver: dns.resolver.Resolver | None = None
) -> HostSource:
    """The source ``spec`` names (forms: :data:`SOURCE_FORMS`); DNS sources use ``resolver``
    (default: the system's). Raises ``ValueError`` naming the accepted forms."""
    try:
        if not isinstance(spec, str):
            if not all(isinstance(item, str) for item in spec):
                raise ValueError("a list of hosts must hold HOST:PORT strings")
            return StaticHosts([item.strip() for item in spec])
        scheme, rest = source_scheme(spec), spec.partition(":")[2]
        if scheme == "dns":
            name, _, port = rest.rpartition(":")
            if not name or not port.isdigit():
                raise ValueError("dns: needs NAME:PORT")
            return DnsHosts(name, int(port), resolver)
        if scheme == "srv":
            return SrvHosts(rest, resolver)
        if scheme == "file":
            if not rest:
                raise ValueError("file: needs a path")
            return WatchedFile(rest)
        return StaticHosts([part.strip() for part in spec.split(",") if part.strip()])
    except ValueError as exc:
        raise ValueError(f"bad host source {spec!r} ({exc}); accepted: {SOURCE_FORMS}") from None


def first_hosts(source: HostSource) -> list[str]:
    """Resolve ``source`` once for a tier's startup: a failure or an empty answer logs a
    warning and gives ``[]`` (the tier starts without hosts; :class:`Membership` adds them)."""
    try:
        hosts = source.resolve()
    except SourceError as exc:
        logger.warning("%s; starting without remote hosts", exc)
        return []
    if not hosts:
        logger.warning("%s lists no remote host; starting without remote hosts", source)
    return hosts


def _check_connect_kwargs(tier: Tier, kwargs: dict[str, Any]) -> None:
    """``TypeError`` for ``kwargs`` that ``tier.connect`` does not take, ``ValueError`` for
    values no host could accept (``handshake.check_connect_args``)."""
    try:
        inspect.signature(tier.connect).bind("host:1", **kwargs)
    except TypeError as exc:
        raise TypeError(f"connect_kwargs do not fit {type(tier).__name__}.connect: {exc}") from None
    check_connect_args(
        "host:1", kwargs.get("slots"), bool(kwargs.get("private", False)), kwargs.get("token")
    )


class Membership:
    """A daemon thread that keeps ``tier`` connected to what ``source`` resolves to.

    Every ``interval_s`` (the first round right after ``start``) it resolves ``source``; each
    new address is connected with ``tier.connect(address, **connect_kwargs)``, each vanished
    one disconnected (unless another listed address reached the same peer, e.g. a dual-stack
    host's A and AAAA address), and each listed address whose peer ``tier.peers()`` no longer
    lists, or that never connected, is dialled again. ``known`` are addresses the caller already
    dialled: their peer ids, or ``None`` for a host that did not answer (already logged).
    The tier owns the peers; this object only calls its public methods (module docstring).

    ``connect_kwargs`` that ``tier.connect`` does not take raise ``TypeError``, and values no
    host could accept (``slots`` without ``private``, an empty ``token``) ``ValueError``, here.
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
        if not 0 < interval_s < math.inf:
            raise ValueError(
                f"interval_s must be a finite positive number of seconds, got {interval_s}"
            )
        self._tier = tier
        self._source = source
        self._interval_s = interval_s
        self._connect_kwargs = dict(connect_kwargs or {})
        _check_connect_kwargs(tier, self._connect_kwargs)
        self._hosts: dict[str, str | None] = dict(known or {})
        self._lock = threading.Lock()  # guards _hosts; never held while calling the tier
        self._down = {address for address, peer in self._hosts.items() if peer is None}
        self._leaving: dict[str, str | None] = {}  # gone address -> its peer, to disconnect
        self._resolve_failing = False
        self._round_failing = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tkvt-membership", daemon=True)

    def start(self) -> None:
        """Start the thread (once); returns at once."""
        self._thread.start()

    def stop(self, timeout: float) -> None:
        """Stop the thread; wait up to ``timeout`` s for it (a handshake in progress may take
        up to its ``timeout_s``). The tier keeps its peers. Idempotent."""
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
        live = set(self._tier.peers())
        for address, peer_id in sorted(self.hosts().items()):
            if self._stop.is_set():
                return
            if peer_id is None or peer_id not in live:
                self._dial(address)

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
            if isinstance(exc, RuntimeError) and self._tier.closed:
                raise
            if address not in self._down:
                self._down.add(address)
                logger.warning(
                    "remote host %s left %s but cannot be disconnected; retrying every %.1fs: %s",
                    address,
                    self._source,
                    self._interval_s,
                    exc,
                )
            return False
        self._down.discard(address)
        logger.info("remote host %s left %s: disconnected", address, self._source)
        return True

    def _dial(self, address: str) -> None:
        """Connect ``address``; a ``RuntimeError`` of a closed tier ends the thread."""
        try:
            peer_id = self._tier.connect(address, **self._connect_kwargs)
        except Exception as exc:
            if isinstance(exc, RuntimeError) and self._tier.closed:
                raise
            if address not in self._down:
                self._down.add(address)
                logger.warning(
                    "remote host %s cannot be connected; retrying every %.1fs: %s",
                    address,
                    self._interval_s,
                    exc,
                )
            return
        with self._lock:
            self._hosts[address] = peer_id
        self._down.discard(address)
        logger.info("connected remote host %s (peer %s)", address, peer_id)
