"""The tier's durations have floors (``quantities.CONNECT_TIMEOUT``, ``HEARTBEAT_TIMEOUT``,
``HEARTBEAT_INTERVAL``, ``RECONNECT_INTERVAL``): below one the tier fails with no fault (a host
that never joins, a session lost at once) or only loads its hosts. Each is refused with a
``ValueError`` naming the parameter, why, and what to pass, before anything is dialled."""

from __future__ import annotations

import argparse
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from late_write_support import LateWriteTransport

from torch_kv_tier.arena import BlockArena
from torch_kv_tier.benchmarks import frozen_writer_client, shared_stress, soak
from torch_kv_tier.host_sources import make_resolver
from torch_kv_tier.integrations.torch_loop import PagedKVOffloader
from torch_kv_tier.integrations.vllm.tier_config import RemoteHostTierConfig
from torch_kv_tier.manager import TierManager
from torch_kv_tier.membership import Membership, StaticHosts
from torch_kv_tier.remote import protocol as p
from torch_kv_tier.remote.client import RemoteSession

BLOCK_LEN = 4096


@pytest.fixture
def tier(monkeypatch: pytest.MonkeyPatch) -> Iterator[TierManager]:
    """A tier whose dials are recorded in ``tier.opened`` instead of made."""
    arena = BlockArena(4, BLOCK_LEN)
    with TierManager(arena, LateWriteTransport(arena.tensor)) as tier:
        opened: list[object] = []
        monkeypatch.setattr(tier, "_open", lambda dial, *_args, **_kw: opened.append(dial))
        tier.opened = opened  # type: ignore[attr-defined]
        yield tier


@pytest.fixture
def address() -> Iterator[str]:
    """An address bound and never listening: no handshake there is ever answered."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{s.getsockname()[1]}"


def _open(address: str, **kwargs: Any) -> RemoteSession:
    return RemoteSession.open(address, agent_metadata=b"m", region=p.Region(4096, 8, 64), **kwargs)


@pytest.mark.parametrize("value", [0.001, 0.05])
def test_a_connect_timeout_too_short_for_a_handshake_is_refused(
    tier: TierManager, address: str, value: float
) -> None:
    """Found by review: ``connect(timeout_s=0.001)`` (milliseconds meant, say) took it, and
    0 of 10 handshakes on loopback finished in time: the host was reported not ready and never
    joined. Every way to set the handshake's timeout now refuses less than 0.1 s, naming it,
    before anything is dialled (a session's ``open`` no longer waits and times out)."""
    why = r"must be at least 0\.1 s and at most 1e\+06 s, got .*: a handshake .* pass 10"
    with pytest.raises(ValueError, match=rf"^timeout_s {why}"):
        tier.connect(address, timeout_s=value, redial_if_down=True)
    with pytest.raises(ValueError, match=rf"^timeout_s {why}"):
        tier.dial_later(address, TimeoutError("down (a test)"), timeout_s=value)
    assert tier.opened == [] and not tier._pending  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=rf"^timeout_s {why}"):
        _open(address, timeout_s=value)
    with pytest.raises(ValueError, match=rf'^"connect_timeout_s" {why}'):
        RemoteHostTierConfig.from_options({"remote": address, "connect_timeout_s": value})
    caches = [torch.zeros(4, 4, 2, 64)], [torch.zeros(4, 4, 2, 64)]
    threads = threading.active_count()
    with pytest.raises(ValueError, match=rf"^connect_timeout {why}"):
        PagedKVOffloader.create(*caches, remote=address, connect_timeout=value, strict=True)
    assert threading.active_count() == threads, "refused, yet a tier started"


def test_an_offloader_timeout_shorter_than_a_handshake_still_connects_within_the_floor() -> None:
    """An offloader's own ``timeout`` has no floor (it bounds the user's calls); a connect
    without ``connect_timeout`` takes it as the handshake's, raised to the floor."""
    caches = [torch.zeros(4, 4, 2, 64)], [torch.zeros(4, 4, 2, 64)]
    arena = BlockArena(4, PagedKVOffloader.block_len_for(*caches))
    with TierManager(arena, LateWriteTransport(arena.tensor)) as own:
        dials: list[Any] = []
        own._open = lambda dial, *_a, **_k: dials.append(dial)  # type: ignore[method-assign]
        off = PagedKVOffloader(*caches, own, timeout=0.01)
        off.connect("127.0.0.1:1")
        assert [dial.timeout_s for dial in dials] == [0.1]


def test_an_offloader_created_with_a_long_timeout_waits_at_most_10_s_for_a_handshake(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: ``create``'s docstring said ``timeout`` bounds each connect, yet a
    handshake waits at most the tier's default, 10 s (what the README says). ``create(timeout=
    30)`` without ``connect_timeout`` dials with 10 s."""
    caches = [torch.zeros(4, 4, 2, 64)], [torch.zeros(4, 4, 2, 64)]
    dialled: list[float] = []

    def connect(_tier: TierManager, _address: str, **kwargs: Any) -> str:
        dialled.append(kwargs["timeout_s"])
        raise ConnectionRefusedError("not dialled (a test)")

    monkeypatch.setattr(TierManager, "connect", connect)
    PagedKVOffloader.create(*caches, remote="127.0.0.1:1", timeout=30).close()
    assert dialled == [10.0]


@pytest.mark.parametrize("value", [0.001, 0.01, 0.5])
def test_a_heartbeat_timeout_that_loses_the_session_at_once_is_refused(
    tier: TierManager, address: str, value: float
) -> None:
    """Found by review: ``heartbeat_timeout_s=0.01`` (or 0.001) opened a session that was lost
    at once ("no heartbeat answer for 0.0 s"), and a tier paused for a collection loses one
    of 0.5 s. Less than 1 s is refused by ``connect``, ``dial_later`` and ``open``."""
    why = r"^heartbeat_timeout_s must be at least 1 s and at most 1e\+06 s, got .*: a session .* 10"
    with pytest.raises(ValueError, match=why):
        tier.connect(address, heartbeat_timeout_s=value, redial_if_down=True)
    with pytest.raises(ValueError, match=why):
        tier.dial_later(address, TimeoutError("down (a test)"), heartbeat_timeout_s=value)
    assert tier.opened == [] and not tier._pending  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=why):
        _open(address, heartbeat_timeout_s=value)


def test_a_heartbeat_interval_that_only_loads_the_host_is_refused(address: str) -> None:
    """Found by review: ``open(heartbeat_interval_s=0.0001)`` beat 10000 times a second, each
    a message the host's one loop answers, and found no loss any sooner. Less than 0.01 s is
    refused before the handshake."""
    with pytest.raises(ValueError, match=r"^heartbeat_interval_s must be at least 0\.01 s"):
        _open(address, heartbeat_interval_s=0.0001)


def test_a_reconnect_interval_that_resolves_the_hosts_back_to_back_is_refused() -> None:
    """Found by review: ``"reconnect_interval_s": 0.001`` resolved the host list (a DNS or SRV
    query, or a file read) and dialled the hosts that are down back to back, with no pause.
    Less than 0.1 s is refused, naming the option; 0 (never) and 0.1 s are taken."""

    def interval(value: float) -> float:
        options = {"remote": "127.0.0.1:5600", "reconnect_interval_s": value}
        return RemoteHostTierConfig.from_options(options).reconnect_interval_s

    match = (
        r'^"reconnect_interval_s" must be at least 0\.1 s \(or 0: off\) and at most 1e\+06 s, '
        r"got 0\.001: each"
    )
    with pytest.raises(ValueError, match=match):
        interval(0.001)
    assert (interval(0), interval(0.1)) == (0.0, 0.1)


def test_a_membership_interval_that_resolves_the_hosts_back_to_back_is_refused(
    tier: TierManager,
) -> None:
    """Found by review: ``Membership(interval_s=0.001)``, built directly, took what
    ``reconnect_interval_s`` refuses: each round's resolve and dials ran back to back. Less
    than 0.1 s is refused, naming ``interval_s``, before its thread exists; 0.1 s is taken."""
    source = StaticHosts(["127.0.0.1:1"])
    threads = threading.active_count()
    with pytest.raises(
        ValueError,
        match=r"^interval_s must be at least 0\.1 s and at most 1e\+06 s, got 0\.001: each",
    ):
        Membership(tier, source, interval_s=0.001)
    assert threading.active_count() == threads
    Membership(tier, source, interval_s=0.1).stop(1.0)


@pytest.mark.parametrize("value", [0.001, 0.05])
def test_a_dns_lifetime_too_short_for_a_round_trip_is_refused(value: float) -> None:
    """Found by review: ``make_resolver(lifetime_s=0.001)`` was taken, and every resolve then
    timed out before the nameserver could answer (the source kept no host). Less than 0.1 s
    is refused, naming ``lifetime_s`` and what to pass; 0.1 s is taken."""
    match = (
        r"^lifetime_s must be at least 0\.1 s and at most 1e\+06 s, got .*: one resolve's "
        r"queries .* pass 5"
    )
    with pytest.raises(ValueError, match=match):
        make_resolver("127.0.0.1", lifetime_s=value)
    assert make_resolver("127.0.0.1", lifetime_s=0.1).lifetime == 0.1


def _soak(argv: list[str]) -> object:
    parser = argparse.ArgumentParser()
    soak.add_arguments(parser)
    return parser.parse_args(argv)


def _shared_stress(argv: list[str]) -> object:
    parser = argparse.ArgumentParser()
    shared_stress.add_arguments(parser)
    return parser.parse_args(argv)


BENCHES: dict[str, Callable[[list[str]], object]] = {
    "stress": _soak,
    "shared-stress": _shared_stress,
    "frozen_writer_client": lambda argv: frozen_writer_client.main(["127.0.0.1:1", *argv]),
}


@pytest.mark.parametrize("command", list(BENCHES))
def test_a_bench_heartbeat_timeout_below_its_floor_is_refused_before_any_host_starts(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by review: ``torch-kv-tier stress --heartbeat-timeout 0.01`` took it, started its
    hosts, and its tiers lost every session at once (with the floor, each connect would have
    been refused only once the hosts ran). The option is refused as the command line is
    parsed, saying why."""
    with pytest.raises(SystemExit):
        BENCHES[command](["--heartbeat-timeout", "0.01"])
    assert (
        "--heartbeat-timeout must be at least 1 s and at most 1e+06 s, got 0.01"
        in capsys.readouterr().err
    )
