"""A host given by name: one that does not resolve fails its connect at once, saying so (it
waited out the whole timeout and said the host did not answer), a lookup that hangs ends with
the connect's timeout, a name that resolves connects, an IP address is not looked up, and a
host whose name does not resolve is redialled as a host that is down, past the connect cap
too."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from membership_support import WAIT_S, FakeTier, join_wait_s, redial_quickly
from remote_support import BLOCK_LEN, free_port, wait_until

from torch_kv_tier import connections, parallel_connects
from torch_kv_tier.connections import Dial, Redialer
from torch_kv_tier.host_sources import WatchedFile
from torch_kv_tier.manager import TierManager
from torch_kv_tier.membership import Membership
from torch_kv_tier.parallel_connects import ParallelConnects
from torch_kv_tier.remote import ServerProcess, UnresolvedHost, host_names

_getaddrinfo = socket.getaddrinfo


def _unknown(name: str) -> Any:
    """A ``getaddrinfo`` for which ``name`` does not exist (others resolve as ever)."""

    def getaddrinfo(host: str, *args: Any, **kwargs: Any) -> Any:
        if host == name:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return _getaddrinfo(host, *args, **kwargs)

    return getaddrinfo


@pytest.fixture
def hung_dns(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """A name server that does not answer until the event is set (at the test's end at the
    latest); each lookup then fails (``EAI_AGAIN``)."""
    release = threading.Event()

    def hung(*args: Any, **kwargs: Any) -> Any:
        release.wait(WAIT_S)
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    monkeypatch.setattr(host_names.socket, "getaddrinfo", hung)
    yield release
    release.set()


def test_a_name_that_does_not_resolve_fails_at_once_naming_it() -> None:
    """``.invalid`` never resolves (RFC 6761): the connect raises ``UnresolvedHost``, naming
    the name and what to check, rather than ``TimeoutError`` ("no answer") after
    ``timeout_s``."""
    with TierManager.create(16, BLOCK_LEN, name="unresolved") as tier:
        with pytest.raises(UnresolvedHost, match="'nosuchhost.invalid'.*check") as failed:
            tier.connect("nosuchhost.invalid:5555", timeout_s=WAIT_S)
        assert failed.value.name == "nosuchhost.invalid"
        assert tier.peers() == []


def test_a_lookup_that_hangs_ends_with_the_connects_timeout(hung_dns: threading.Event) -> None:
    """A name server that does not answer holds the connect for its ``timeout_s`` alone, and
    the error says the lookup is what did not answer."""
    with (
        TierManager.create(16, BLOCK_LEN, name="hung-dns") as tier,
        pytest.raises(UnresolvedHost, match="no answer within the connect's timeout"),
    ):
        tier.connect("slow.example:5555", timeout_s=0.2)


def test_redials_of_a_name_whose_lookup_hangs_share_one_thread(hung_dns: threading.Event) -> None:
    """A name server that does not answer: each connect of each redial round gave up at its
    timeout and left its lookup's thread behind (1,000 hosts: 1,000 more threads a round);
    connects asking for a name whose lookup is under way wait for that one."""
    for _ in range(20):
        with pytest.raises(UnresolvedHost, match="no answer within the connect's timeout"):
            host_names.check_resolves("hung.example:5555", "hung.example", 0.0)
    lookups = [t for t in threading.enumerate() if t.name == "tkvt-resolve-hung.example"]
    assert len(lookups) == 1
    hung_dns.set()
    lookups[0].join(WAIT_S)
    with pytest.raises(UnresolvedHost, match="could not answer now"):
        host_names.check_resolves("hung.example:5555", "hung.example", time.monotonic() + WAIT_S)


def test_a_name_with_ipv6_addresses_only_is_refused_naming_the_address_to_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ZeroMQ dials a host name over IPv4 alone: a name with only IPv6 addresses resolved, then
    the connect waited out its timeout ("no answer") though the host listened."""

    def ipv6_only(host: str, *args: Any, **kwargs: Any) -> Any:
        return [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("fd00::7", 0, 0, 0))]

    monkeypatch.setattr(host_names.socket, "getaddrinfo", ipv6_only)
    with pytest.raises(UnresolvedHost, match=r"IPv6 addresses only .* e\.g\. \[fd00::7\]:5555"):
        host_names.check_resolves("six.example:5555", "six.example", time.monotonic() + WAIT_S)


@pytest.mark.parametrize("host", ["127.0.0.1", "[::1]"])
def test_an_ip_address_is_not_looked_up(monkeypatch: pytest.MonkeyPatch, host: str) -> None:
    """An IP literal goes to the handshake as before (nobody listens: it does not answer)."""

    def no_lookup(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"looked up {args[0]!r}")

    monkeypatch.setattr(host_names.socket, "getaddrinfo", no_lookup)
    with (
        TierManager.create(16, BLOCK_LEN, name="ip-literal") as tier,
        pytest.raises(TimeoutError, match="no answer"),
    ):
        tier.connect(f"{host}:{free_port()}", timeout_s=0.2)


def test_a_name_that_resolves_connects_and_one_that_stops_is_redialled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``localhost:PORT`` joins; a host whose name does not resolve at its connect with
    ``redial_if_down`` is dialled again in the background (down, not misconfigured) and joins
    once its name resolves."""
    redial_quickly(monkeypatch)  # (its backoff grows until the name resolves)
    with (
        ServerProcess.start(32, BLOCK_LEN) as server,
        TierManager.create(16, BLOCK_LEN, name="by-name") as tier,
    ):
        address = f"localhost:{server.address.rpartition(':')[2]}"
        monkeypatch.setattr(host_names.socket, "getaddrinfo", _unknown("localhost"))
        with pytest.raises(UnresolvedHost, match="'localhost'"):
            tier.connect(address, timeout_s=WAIT_S, redial_if_down=True)
        assert tier.peers() == [] and tier._pending
        monkeypatch.setattr(host_names.socket, "getaddrinfo", _getaddrinfo)
        # peers() lists a host once joined (its index in), never mid-join: the disconnect below
        # met a join still waiting for the index, which then held the next connect (review)
        wait_until(
            lambda: tier.peers() != [], "the host joins once its name resolves", join_wait_s()
        )
        tier.disconnect(tier.peers()[0])
        assert tier.connect(address, timeout_s=WAIT_S) in tier.peers()


def test_a_hosts_file_name_that_does_not_resolve_is_retried_until_it_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A hosts file listing a name that does not resolve: membership logs that it cannot
    resolve (not that the host did not answer) and dials it every round until it resolves."""
    monkeypatch.setattr(host_names.socket, "getaddrinfo", _unknown("localhost"))
    hosts = tmp_path / "hosts"
    with (
        ServerProcess.start(32, BLOCK_LEN) as server,
        TierManager.create(16, BLOCK_LEN, name="file-by-name") as tier,
        caplog.at_level(logging.WARNING, logger="torch_kv_tier.membership"),
    ):
        address = f"localhost:{server.address.rpartition(':')[2]}"
        hosts.write_text(f"{address}\n")
        members = Membership(tier, WatchedFile(hosts), interval_s=0.1)
        members.start()
        try:
            wait_until(lambda: "cannot resolve host name 'localhost'" in caplog.text, "the log")
            assert members.hosts() == {address: None}
            monkeypatch.setattr(host_names.socket, "getaddrinfo", _getaddrinfo)
            wait_until(lambda: members.hosts()[address] is not None, "the join", WAIT_S)
        finally:
            members.stop(WAIT_S)


def test_past_the_connect_cap_each_silent_hosts_failure_says_what_it_was(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: past ``MAX_CONNECTS`` hosts (16), those that do not answer the greeting
    get no connect, and each was reported "no answer" (``TimeoutError``), a name that does not
    resolve too. Each now fails as its connect would have: the name that does not resolve
    saying so, a name whose lookup has not ended saying the name server did not answer, and a
    host that resolves (or an IP address) but is silent saying it did not answer."""
    monkeypatch.setattr(parallel_connects, "MAX_CONNECTS", 1)
    release = threading.Event()

    def getaddrinfo(host: str, *args: Any, **kwargs: Any) -> Any:
        if host == "hung.example":
            release.wait(WAIT_S)
        if host in ("nosuchhost.example", "hung.example"):
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return _getaddrinfo(host, *args, **kwargs)

    greet = parallel_connects.answering

    def answering(*args: Any) -> Iterator[int]:
        """The greeting, ended once every lookup but the hung one has (a loaded machine may
        run them late: the greeting's timeout is no bound on that)."""
        yield from greet(*args)
        for thread in threading.enumerate():
            if thread.name.startswith("tkvt-resolve-") and "hung" not in thread.name:
                thread.join(WAIT_S)

    monkeypatch.setattr(host_names.socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(parallel_connects, "answering", answering)
    port = free_port()  # nobody listens there
    addresses = [f"{host}:{port}" for host in ("nosuchhost.example", "hung.example", "localhost")]
    tier = FakeTier()
    connects = ParallelConnects(tier, [*addresses, f"127.0.0.1:{port}"], {"timeout_s": 0.5})
    try:
        outcomes = [outcome for _, outcome in connects.outcomes()]
    finally:
        release.set()
        connects.join(timeout=WAIT_S)
    unknown, hung, silent_name, silent_ip = outcomes
    assert isinstance(unknown, UnresolvedHost) and "Name or service not known" in str(unknown)
    assert isinstance(hung, UnresolvedHost) and "no answer within the connect's" in str(hung)
    assert unknown.name == "nosuchhost.example" and hung.name == "hung.example"
    for silent in (silent_name, silent_ip):
        assert isinstance(silent, TimeoutError) and "no answer from" in str(silent)
    assert tier.calls == [], "hosts that did not answer the greeting were connected"


def test_past_the_redial_cap_a_lost_hosts_name_that_does_not_resolve_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by review: past ``MAX_CONNECTS`` lost hosts due at once the redialer greets them
    first, and each that did not answer failed its round as "no answer" (``TimeoutError``), a
    name that does not resolve too. Its round now fails as its try would have: saying the name
    does not resolve (``UnresolvedHost``), a silent IP address still saying it did not
    answer."""
    caplog.set_level(logging.INFO, logger=connections.__name__)
    redial_quickly(monkeypatch)
    monkeypatch.setattr(connections, "MAX_CONNECTS", 1)  # 2 hosts due: greeted first
    monkeypatch.setattr(host_names.socket, "getaddrinfo", _unknown("nosuchhost.invalid"))
    port = free_port()  # nobody listens there
    hosts = ("nosuchhost.invalid", "127.0.0.1")  # a name that does not resolve, an IP address
    unknown, silent = (Dial(f"{host}:{port}", None, False, None, 0.5, 1.0) for host in hosts)
    dialled: list[Dial] = []

    class _Tier:  # the redialer holds its tier's methods weakly
        def dial(self, dial: Dial) -> None:
            dialled.append(dial)

        def wanted(self, dial: Dial) -> bool:
            return True

    def failures(dial: Dial) -> list[str]:
        start = f"re-dialling {dial.address} failed"
        return [r.getMessage() for r in caplog.records if r.getMessage().startswith(start)]

    tier = _Tier()
    redialer = Redialer(tier.dial, tier.wanted)
    try:
        with redialer._lock:  # both due at once, one try at a time: greeted
            redialer.start(unknown)
            redialer.start(silent)
        wait_until(lambda: bool(failures(unknown) and failures(silent)), "both failed", WAIT_S)
    finally:
        redialer.stop(timeout=WAIT_S)
    unresolved = f"cannot resolve host name 'nosuchhost.invalid' of {unknown.address}"
    assert unresolved in failures(unknown)[0]
    assert "no answer from" in failures(silent)[0]
    assert dialled == [], "hosts that did not answer the greeting were tried"
