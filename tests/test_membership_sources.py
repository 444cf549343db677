"""Membership's host sources (issue 20, item 4): a static list, DNS (A/AAAA and SRV, through a
real stub DNS server on 127.0.0.1) or a watched file, each resolving to the hosts a tier should
have, and every malformed source refused with the forms it accepts."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dns.flags
import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset
import pytest
from membership_support import WAIT_S, write_hosts

from torch_kv_tier.membership import (
    DnsHosts,
    SourceError,
    SrvHosts,
    StaticHosts,
    WatchedFile,
    first_hosts,
    make_resolver,
    parse_source,
)

# -- parse_source ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "kind", "text"),
    [
        ("10.0.0.2:5600, 10.0.0.1:5600,10.0.0.2:5600", StaticHosts, "10.0.0.1:5600,10.0.0.2:5600"),
        (["h2:1", "[::1]:2"], StaticHosts, "[::1]:2,h2:1"),
        ("dns:5600", StaticHosts, "dns:5600"),  # a host named "dns"
        ("dns:kv.ns.svc.cluster.local:5600", DnsHosts, "dns:kv.ns.svc.cluster.local:5600"),
        ("srv:_kv._tcp.kv.ns.svc.cluster.local", SrvHosts, "srv:_kv._tcp.kv.ns.svc.cluster.local"),
        ("file:/etc/kv-hosts", WatchedFile, "file:/etc/kv-hosts"),
    ],
)
def test_parse_source_forms(spec: Any, kind: type, text: str) -> None:
    source = parse_source(spec)
    assert isinstance(source, kind)
    assert str(source) == text


def test_a_static_source_resolves_sorted_and_deduplicated() -> None:
    source = parse_source("b:2,a:1,b:2")
    assert source.resolve() == ["a:1", "b:2"]


@pytest.mark.parametrize(
    "spec",
    [
        "",
        "not-an-address",
        "host:99999",
        ["a:1", 5],
        [],
        "dns:kv.example",
        "dns:kv.example:port",
        "dns::5600",
        "srv:kv.example",
        "srv:_kv.example",
        "srv:_kv._tcp",
        "file:",
        # found by review: a DNS name holding a ':' (a port after an SRV name, an IPv6
        # address) resolved to no host at all, which drops every host with no error
        "srv:_kv._tcp.kv.example:5600",
        "dns:kv.example:5600:5600",
        "dns:fd00::1:5600",
    ],
)
def test_parse_source_errors_name_the_accepted_forms(spec: Any) -> None:
    with pytest.raises(ValueError, match="accepted: .*dns:NAME:PORT.*srv:.*file:"):
        parse_source(spec)


@pytest.mark.parametrize("port", ["\u0665\u0666\u0660\u0660", "\uff15\uff16\uff10\uff10", "\u00b2"])
def test_a_dns_source_whose_port_is_not_ascii_digits_is_refused(port: str) -> None:
    """Found by review: ``dns:kv.example:٥٦٠٠`` resolved to port 5600 (``isdigit()`` and
    ``int()`` take digits of any script), as no ``HOST:PORT`` does; ``dns:kv.example:²`` said
    int()'s "invalid literal"."""
    with pytest.raises(ValueError, match="dns: needs NAME:PORT, the port in ASCII digits 0-9"):
        parse_source(f"dns:kv.example:{port}")


# -- DNS, through a stub server ----------------------------------------------------------------


class StubDns:
    """A UDP DNS server on 127.0.0.1 answering from ``records``: (name, type) -> rdata texts.
    A name with no record of any type is NXDOMAIN; ``servfail`` answers every query SERVFAIL."""

    def __init__(self) -> None:
        self.records: dict[tuple[str, str], list[str]] = {}
        self.servfail = False
        self.delay_s = 0.0  # before each answer
        self.queries = 0
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.settimeout(0.05)
        self.port = self._sock.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                wire, peer = self._sock.recvfrom(4096)
            except TimeoutError:
                continue
            query = dns.message.from_wire(wire)
            response = dns.message.make_response(query)
            response.flags |= dns.flags.AA
            question = query.question[0]
            name, rdtype = question.name.to_text(), dns.rdatatype.to_text(question.rdtype)
            self.queries += 1
            time.sleep(self.delay_s)
            if self.servfail:
                response.set_rcode(dns.rcode.SERVFAIL)
            elif (name, rdtype) in self.records:
                texts = self.records[(name, rdtype)]
                response.answer.append(dns.rrset.from_text_list(name, 5, "IN", rdtype, texts))
            elif not any(known == name for known, _ in self.records):
                response.set_rcode(dns.rcode.NXDOMAIN)
            self._sock.sendto(response.to_wire(), peer)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()


@pytest.fixture
def stub_dns() -> Iterator[StubDns]:
    server = StubDns()
    try:
        yield server
    finally:
        server.close()


def test_dns_a_and_aaaa_records_follow_the_server(stub_dns: StubDns) -> None:
    resolver = make_resolver("127.0.0.1", stub_dns.port, lifetime_s=2.0)
    source = parse_source("dns:kv.test:5600", resolver=resolver)
    stub_dns.records = {
        ("kv.test.", "A"): ["127.0.0.3", "127.0.0.2"],
        ("kv.test.", "AAAA"): ["::1"],
    }
    assert source.resolve() == ["127.0.0.2:5600", "127.0.0.3:5600", "[::1]:5600"]
    stub_dns.records = {("kv.test.", "A"): ["127.0.0.4"]}  # AAAA: no data
    assert source.resolve() == ["127.0.0.4:5600"]
    stub_dns.records = {("other.test.", "A"): ["127.0.0.9"]}  # kv.test: NXDOMAIN, no hosts
    assert source.resolve() == []
    stub_dns.servfail = True
    with pytest.raises(SourceError, match="dns:kv.test:5600"):
        source.resolve()


def test_srv_records_give_each_targets_addresses_and_port(stub_dns: StubDns) -> None:
    resolver = make_resolver("127.0.0.1", stub_dns.port, lifetime_s=2.0)
    source = parse_source("srv:_kv._tcp.kv.test", resolver=resolver)
    stub_dns.records = {
        ("_kv._tcp.kv.test.", "SRV"): ["0 0 5601 pod-a.kv.test.", "0 0 5602 pod-b.kv.test."],
        ("pod-a.kv.test.", "A"): ["10.0.0.1"],
        ("pod-b.kv.test.", "A"): ["10.0.0.2"],
        ("pod-b.kv.test.", "AAAA"): ["fd00::2"],
    }
    assert source.resolve() == ["10.0.0.1:5601", "10.0.0.2:5602", "[fd00::2]:5602"]
    stub_dns.records = {  # pod-b left; pod-a came back on another address; pod-c has none yet
        ("_kv._tcp.kv.test.", "SRV"): ["0 0 5601 pod-a.kv.test.", "0 0 5603 pod-c.kv.test."],
        ("pod-a.kv.test.", "A"): ["10.0.0.7"],
    }
    assert source.resolve() == ["10.0.0.7:5601"]
    stub_dns.servfail = True
    with pytest.raises(SourceError, match="srv:_kv._tcp.kv.test"):
        source.resolve()


def test_a_dns_server_that_does_not_answer_fails_within_the_lifetime() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as silent:  # bound, never answers
        silent.bind(("127.0.0.1", 0))
        resolver = make_resolver("127.0.0.1", silent.getsockname()[1], lifetime_s=0.3)
        start = time.monotonic()
        with pytest.raises(SourceError, match="dns:kv.test:5600"):
            parse_source("dns:kv.test:5600", resolver=resolver).resolve()
        assert time.monotonic() - start < 3.0


@pytest.mark.parametrize("spec", ["dns:kv.test:5600", "srv:_kv._tcp.kv.test"])
def test_a_slow_dns_server_fails_a_resolve_within_the_lifetime(
    stub_dns: StubDns, spec: str
) -> None:
    """A resolve takes at most the resolver's lifetime, however many queries it makes (found
    by review: each query had the whole lifetime, so an SRV source of 4 targets on a server
    answering each query just within it held Membership's round for 9 lifetimes). Each query
    answers within the lifetime, not all of them: the resolve fails only where they share it
    (no wall-clock bound, which a loaded machine stretches past the lifetime)."""
    targets = [f"pod-{i}.kv.test." for i in range(4)]
    stub_dns.records = {
        ("_kv._tcp.kv.test.", "SRV"): [f"0 0 5600 {t}" for t in targets],
        ("kv.test.", "A"): ["10.0.0.1"],
        ("kv.test.", "AAAA"): ["fd00::1"],
        **{(t, "A"): ["10.0.0.2"] for t in targets},
        **{(t, "AAAA"): ["fd00::2"] for t in targets},
    }
    resolver = make_resolver("127.0.0.1", stub_dns.port, lifetime_s=1.0)
    source = parse_source(spec, resolver=resolver)
    assert source.resolve()  # answers at once: fine
    stub_dns.delay_s = 0.6  # each query answers within the lifetime, not all of them
    with pytest.raises(SourceError, match=spec):
        source.resolve()


def test_a_watched_file_is_re_read_when_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "hosts"
    write_hosts(path, "# kv hosts\n10.0.0.2:5600\n\n  10.0.0.1:5600  # rack 1\n10.0.0.2:5600\n")
    source = parse_source(f"file:{path}")
    assert source.resolve() == ["10.0.0.1:5600", "10.0.0.2:5600"]
    with path.open("a") as f:  # appended in place: size and mtime change
        f.write("10.0.0.3:5600\n")
    assert source.resolve() == ["10.0.0.1:5600", "10.0.0.2:5600", "10.0.0.3:5600"]
    write_hosts(path, "# 10.0.0.1:5600\n10.0.0.3:5600\n")
    assert source.resolve() == ["10.0.0.3:5600"]
    write_hosts(path, "10.0.0.3:5600\nnot an address\n")
    with pytest.raises(SourceError, match=r"line 2 'not an address' is not HOST:PORT"):
        source.resolve()
    write_hosts(path, "")
    assert source.resolve() == []
    path.unlink()
    with pytest.raises(SourceError, match=f"file:{path}"):
        source.resolve()


def test_a_watched_file_that_is_not_a_regular_file_is_refused_at_once(tmp_path: Path) -> None:
    """Found by review: a ``file:`` source naming a FIFO blocked its resolve (Membership's
    thread, or a tier's startup) until some process opened the FIFO for writing, for good if
    none ever did; a device such as ``/dev/zero`` was read without end."""
    fifo = tmp_path / "hosts"
    os.mkfifo(fifo)
    source = parse_source(f"file:{fifo}")
    outcome: list[BaseException | list[str]] = []

    def resolve() -> None:
        try:
            outcome.append(source.resolve())
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=resolve, daemon=True)
    thread.start()
    thread.join(timeout=WAIT_S)
    if thread.is_alive():  # unblock the reader: a writer that opens and closes at once
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(timeout=WAIT_S)
    assert len(outcome) == 1 and isinstance(outcome[0], SourceError), outcome
    assert "not a regular file" in str(outcome[0]) and f"file:{fifo}" in str(outcome[0])
    with pytest.raises(SourceError, match="not a regular file"):
        parse_source("file:/dev/zero").resolve()


def test_first_hosts_warns_and_starts_empty(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "hosts"
    assert first_hosts(parse_source(f"file:{path}")) == []
    assert "cannot read it" in caplog.text and "starting without remote hosts" in caplog.text
    path.write_text("# nothing yet\n")
    caplog.clear()
    assert first_hosts(parse_source(f"file:{path}")) == []
    assert "lists no remote host" in caplog.text
    path.write_text("10.0.0.1:5600\n")
    assert first_hosts(parse_source(f"file:{path}")) == ["10.0.0.1:5600"]
