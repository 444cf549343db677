"""Membership (issue 20, item 4): a tier's remote hosts follow a source with no restart. The loop
that connects appearing hosts and disconnects vanishing ones, on a fake tier and source (resolve
and connect failures, retries, stop), and on a real tier following a watched file."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from membership_support import WAIT_S, FakeTier, following, write_hosts
from remote_support import BLOCK_LEN, wait_until

from torch_kv_tier.manager import TierManager
from torch_kv_tier.membership import (
    Membership,
    SourceError,
    StaticHosts,
    parse_source,
)
from torch_kv_tier.remote import ServerProcess


class FakeSource:
    def __init__(self, *hosts: str) -> None:
        self.hosts = list(hosts)
        self.failing = False
        self.resolves = 0

    def resolve(self) -> list[str]:
        self.resolves += 1
        if self.failing:
            raise SourceError("fake: DNS blinked")
        return sorted(self.hosts)

    def __str__(self) -> str:
        return "fake"


def rounds(source: FakeSource, n: int) -> None:
    """Wait until Membership resolved ``source`` ``n`` more times (a round ends after that only
    with its dials, so ``n`` >= 2 means one whole round ran)."""
    seen = source.resolves
    wait_until(lambda: source.resolves >= seen + n, f"{n} more rounds")


@pytest.fixture
def fake() -> Iterator[tuple[FakeTier, FakeSource, Membership]]:
    tier, source = FakeTier(), FakeSource("a:1")
    with following(tier, source, connect_kwargs={"timeout_s": 1.0}) as membership:
        yield tier, source, membership


def test_membership_connects_appearing_and_disconnects_vanishing_hosts(
    fake: tuple[FakeTier, FakeSource, Membership],
) -> None:
    tier, source, membership = fake
    wait_until(lambda: membership.hosts() == {"a:1": "host:a:1"}, "a:1 is connected")
    assert tier.kwargs == [{"timeout_s": 1.0}]
    source.hosts = ["a:1", "b:2"]
    wait_until(lambda: membership.hosts().get("b:2") == "host:b:2", "b:2 is connected")
    source.hosts = ["b:2"]
    wait_until(lambda: "a:1" not in membership.hosts(), "a:1 is dropped")
    wait_until(lambda: tier.peers() == ["host:b:2"], "the tier disconnects a:1")
    rounds(source, 5)  # more rounds change nothing
    assert tier.count(("connect", "a:1")) == 1 and tier.count(("connect", "b:2")) == 1
    assert tier.count(("disconnect", "host:a:1")) == 1
    assert tier.callers == {"tkvt-connect-a:1", "tkvt-connect-b:2"}  # never the caller's thread


def test_membership_redials_a_peer_the_tier_dropped(
    fake: tuple[FakeTier, FakeSource, Membership],
) -> None:
    tier, _, membership = fake
    wait_until(lambda: tier.peers() == ["host:a:1"], "a:1 is connected")
    with tier.lock:
        tier.live.clear()  # the tier lost the host (it died, a transfer failed)
    wait_until(lambda: tier.peers() == ["host:a:1"], "a:1 is re-dialled")
    assert tier.count(("connect", "a:1")) == 2
    assert membership.hosts() == {"a:1": "host:a:1"}


def test_a_failed_resolve_drops_nothing_and_is_logged_once(
    fake: tuple[FakeTier, FakeSource, Membership], caplog: pytest.LogCaptureFixture
) -> None:
    tier, source, membership = fake
    caplog.set_level(logging.INFO, logger="torch_kv_tier.membership")
    wait_until(lambda: tier.peers() == ["host:a:1"], "a:1 is connected")
    source.failing = True
    rounds(source, 5)
    assert tier.peers() == ["host:a:1"] and membership.hosts() == {"a:1": "host:a:1"}
    assert not any(call[0] == "disconnect" for call in tier.calls)
    assert caplog.text.count("DNS blinked; keeping the last known remote hosts") == 1
    with tier.lock:
        tier.live.clear()  # still re-dialled while the source fails
    wait_until(lambda: tier.peers() == ["host:a:1"], "a:1 is re-dialled during the outage")
    source.failing, source.hosts = False, []
    wait_until(lambda: tier.peers() == [], "a:1 is dropped once the source answers")
    assert "fake resolves again: 0 remote host(s)" in caplog.text


def test_a_failed_connect_is_retried_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    tier, source = FakeTier(), FakeSource("a:1")
    tier.down.add("a:1")
    with following(tier, source) as membership:
        wait_until(lambda: tier.count(("connect", "a:1")) > 5, "several tries")
        assert membership.hosts() == {"a:1": None}
        assert caplog.text.count("remote host a:1 cannot be connected") == 1
        with tier.lock:
            tier.down.clear()
        wait_until(lambda: membership.hosts() == {"a:1": "host:a:1"}, "a:1 connects")


def test_known_hosts_are_not_dialled_again_and_a_shared_peer_stays() -> None:
    """``known`` (the caller dialled them) keeps a connected host as it is; two addresses of one
    host (A and AAAA): losing one address keeps the peer."""
    tier, source = FakeTier(), FakeSource("a:1", "a:1/v6")
    tier.live.add("host:a:1")
    known = {"a:1": "host:a:1", "a:1/v6": "host:a:1"}
    with following(tier, source, known=known) as membership:
        rounds(source, 3)
        assert tier.calls == []
        source.hosts = ["a:1"]
        wait_until(lambda: "a:1/v6" not in membership.hosts(), "the v6 address leaves")
        rounds(source, 3)
        assert tier.calls == [] and tier.peers() == ["host:a:1"]


def test_membership_ends_when_the_tier_closes() -> None:
    tier, source = FakeTier(), FakeSource("a:1")
    tier.closed = True
    with following(tier, source) as membership:
        wait_until(lambda: not membership._thread.is_alive(), "the thread ends")
        assert source.resolves == 1


def test_a_runtime_error_of_an_open_tier_is_a_failed_connect() -> None:
    """Only a closed tier ends the thread (found by review: any ``RuntimeError`` did, such as
    NIXL's "registration superseded" when a connect raced a disconnect of the same host, and
    the tier then followed its source no more)."""

    class RacingTier(FakeTier):
        def __init__(self) -> None:
            super().__init__()
            self.races = 2

        def connect(self, address: str, **kwargs: Any) -> str:
            with self.lock:
                self.races -= 1
                racing = self.races >= 0
            if racing:
                raise RuntimeError(f"registration of peer {address!r} was superseded")
            return super().connect(address, **kwargs)

    tier, source = RacingTier(), FakeSource("a:1")
    with following(tier, source) as membership:
        wait_until(lambda: membership.hosts() == {"a:1": "host:a:1"}, "a:1 connects")
        with tier.lock:
            tier.closed = True
        source.hosts = ["a:1", "b:2"]
        wait_until(lambda: not membership._thread.is_alive(), "the thread ends once closed")


def test_a_failed_disconnect_or_peers_call_of_an_open_tier_is_retried() -> None:
    """Only a closed tier ends the thread, as the module says (found by review: a
    ``RuntimeError`` of an open tier's ``disconnect`` or ``peers`` ended it, and any other
    exception too, so the tier followed its source no more; only a stack on stderr said so)."""

    class FailingTier(FakeTier):
        def __init__(self) -> None:
            super().__init__()
            self.failures = [RuntimeError("NIXL: remove failed"), OSError("peers: EBADF")]

        def disconnect(self, peer_id: str) -> None:
            with self.lock:
                failure = self.failures.pop(0) if self.failures else None
            if failure is not None:
                raise failure
            super().disconnect(peer_id)

        def placing_peers(self) -> list[str]:
            with self.lock:
                failure = self.failures.pop(0) if len(self.failures) == 1 else None
            if failure is not None:
                raise failure
            return super().placing_peers()

    tier, source = FailingTier(), FakeSource("a:1", "b:2")
    with following(tier, source):
        wait_until(lambda: tier.peers() == ["host:a:1", "host:b:2"], "both connect")
        source.hosts = ["b:2"]
        wait_until(lambda: not tier.failures, "disconnect and peers failed once each")
        wait_until(lambda: tier.peers() == ["host:b:2"], "a:1 is disconnected at a later round")
        source.hosts = ["b:2", "c:3"]
        wait_until(lambda: "host:c:3" in tier.peers(), "the thread still follows its source")


def test_a_host_whose_disconnect_keeps_failing_holds_up_no_other_host(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One host that left and cannot be disconnected (every try raises) is tried every round,
    logged once; hosts that come meanwhile are connected, and other hosts that leave are
    disconnected."""

    class StuckTier(FakeTier):
        def disconnect(self, peer_id: str) -> None:
            if peer_id == "host:a:1":
                raise RuntimeError("NIXL: remove failed")
            super().disconnect(peer_id)

    tier, source = StuckTier(), FakeSource("a:1", "b:2")
    with following(tier, source) as membership:
        wait_until(lambda: tier.peers() == ["host:a:1", "host:b:2"], "both connect")
        source.hosts = ["c:3"]
        wait_until(lambda: "host:c:3" in tier.peers(), "c:3 connects")
        wait_until(lambda: "host:b:2" not in tier.peers(), "b:2 is disconnected")
        rounds(source, 3)
        assert "host:a:1" in tier.peers() and membership.hosts() == {"c:3": "host:c:3"}
        assert caplog.text.count("cannot be disconnected") == 1


def test_stop_waits_for_a_handshake_in_progress_but_is_bounded() -> None:
    release = threading.Event()
    entered = threading.Event()

    class SlowTier(FakeTier):
        def connect(self, address: str, **kwargs: Any) -> str:
            entered.set()
            release.wait(timeout=WAIT_S)
            return super().connect(address, **kwargs)

    tier = SlowTier()
    with following(tier, FakeSource("a:1")) as membership:
        assert entered.wait(timeout=WAIT_S)
        start = time.monotonic()
        membership.stop(timeout=0.2)  # the handshake is still running: gives up after 0.2 s
        assert 0.15 < time.monotonic() - start < 2.0
        release.set()
        membership.stop(timeout=WAIT_S)  # it ends once the handshake does, dials nothing more
        assert not membership._thread.is_alive()
        assert tier.calls == [("connect", "a:1")]


@pytest.mark.parametrize("interval_s", [0, -1.0, float("nan"), float("inf")])
def test_membership_needs_a_positive_finite_interval(interval_s: float) -> None:
    # inf (found by review) was taken: the thread's first wait raised OverflowError, which
    # ended it after one round.
    with pytest.raises(ValueError, match=r"interval_s must be at least 0\.1 s and at most"):
        Membership(FakeTier(), FakeSource(), interval_s=interval_s)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"timout_s": 5.0}, TypeError, "timout_s"),
        ({"slots": 8}, ValueError, "private=True"),
        ({"token": ""}, ValueError, "token is empty"),
        ({"token": " s3cret"}, ValueError, "surrounding whitespace"),
        ({"timeout_s": "5"}, TypeError, r"timeout_s must be a number of seconds.*'5'"),
        (
            {"heartbeat_timeout_s": 0.0},
            ValueError,
            "heartbeat_timeout_s must be at least 1 s and at most",
        ),
    ],
)
def test_connect_kwargs_no_host_could_accept_are_refused_at_once(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    """Found by review: they were taken, and every round's connect of every host failed on
    them, logged as "cannot be connected; retrying" as if the hosts were down."""
    with (
        TierManager.create(4, BLOCK_LEN, name="connect-kwargs") as tier,
        pytest.raises(error, match=match),
    ):
        Membership(tier, StaticHosts(["127.0.0.1:5600"]), connect_kwargs=kwargs)


# -- a real tier and a real host ---------------------------------------------------------------


def test_a_real_tier_joins_and_leaves_a_host_named_in_a_watched_file(tmp_path: Path) -> None:
    path = tmp_path / "kv-hosts"
    write_hosts(path, "# no hosts yet\n")
    with (
        ServerProcess.start(64, BLOCK_LEN) as server,
        TierManager.create(16, BLOCK_LEN, name="membership") as tier,
        following(
            tier,
            parse_source(f"file:{path}"),
            interval_s=0.1,
            stop_s=WAIT_S,
            connect_kwargs={"timeout_s": 5.0},
        ) as membership,
    ):
        assert tier.peers() == []
        write_hosts(path, f"# kv hosts\n{server.address}\n")
        wait_until(
            lambda: membership.hosts().get(server.address) is not None,
            "the tier joins the host",
        )
        assert list(membership.hosts().values()) == tier.peers() and len(tier.peers()) == 1
        tier.arena.tensor[:4].random_(0, 256)
        keys = [f"block-{i}" for i in range(4)]
        assert tier.store(keys, range(4)).result(timeout=WAIT_S).ok
        assert tier.load(keys, range(8, 12)).result(timeout=WAIT_S).ok
        assert torch.equal(tier.arena.tensor[8:12], tier.arena.tensor[:4])
        write_hosts(path, f"# {server.address}\n")
        wait_until(lambda: tier.peers() == [], "the tier drops the host")
        assert membership.hosts() == {} and tier.lookup(keys) == 0
