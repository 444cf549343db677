"""Host sources: which ``HOST:PORT`` hosts a tier should be connected to now.

A source is a static list (:class:`StaticHosts`), DNS (A/AAAA records of a name,
:class:`DnsHosts`, or SRV records, :class:`SrvHosts`) or a file of addresses
(:class:`WatchedFile`); :func:`parse_source` builds one from a spec (:data:`SOURCE_FORMS`).
``membership.Membership`` keeps a tier in step with one.

Threading: sources are plain objects resolved on the caller's thread (``resolve`` blocks for at
most the resolver's lifetime, all its queries together, or one file read).

Failure model: ``resolve`` raises :class:`SourceError` naming the source when it cannot tell
(DNS timeout or SERVFAIL, a missing, unreadable or non-regular file, a bad line); an
authoritative answer (NXDOMAIN, no records, an empty file) is a real, possibly empty, set.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import dns.exception
import dns.resolver

from torch_kv_tier.remote.client import parse_address
from torch_kv_tier.remote.quantities import DNS_LIFETIME, seconds

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
    a source (all its queries) bounded by ``lifetime_s``, with no cache. ``TypeError``/
    ``ValueError`` for a ``lifetime_s`` that is no number of seconds (``quantities.seconds``)
    or is under 0.1 s (``quantities.DNS_LIFETIME``: says why and what to pass)."""
    lifetime_s = seconds("lifetime_s", lifetime_s, floor=DNS_LIFETIME)
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
            if not name or not (port.isascii() and port.isdigit()):  # (int() takes "٥٦٠٠")
                raise ValueError("dns: needs NAME:PORT, the port in ASCII digits 0-9")
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
