"""A tier dialling many hosts at once: dials run side by side on a few threads, joins happen one
at a time, two connects of one host both get its peer, each connect keeps its own timeout, and
a bad timeout is refused before anything is dialled."""

from __future__ import annotations

import contextlib
import math
import re
import threading
import time
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
import torch
from membership_support import WAIT_S, FakeTier, following, session_threads
from remote_support import BLOCK_LEN, SilentHosts, free_port, wait_until

from torch_kv_tier import parallel_connects
from torch_kv_tier.manager import TierManager
from torch_kv_tier.membership import (
    StaticHosts,
)
from torch_kv_tier.parallel_connects import ParallelConnects
from torch_kv_tier.remote import ServerProcess
from torch_kv_tier.remote.connect_args import check_timeouts


def test_a_round_dials_the_hosts_that_do_not_answer_side_by_side() -> None:
    """Found by review: a round dialled its hosts one after another, so N hosts that do not
    answer made each round last N x the handshake timeout, and a host added to the source (or
    one that came back) waited behind them; they are dialled side by side now."""
    silent = SilentHosts(3)
    with (
        contextlib.closing(silent),
        TierManager.create(4, BLOCK_LEN, name="side-by-side") as tier,
        following(tier, StaticHosts(silent.addresses), connect_kwargs={"timeout_s": 5.0}),
    ):
        assert silent.dialled_side_by_side(within=4.0), "each host waited for the one before"


def test_many_hosts_are_dialled_side_by_side_on_a_few_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: a startup or a round made one thread per host, with no cap (200 hosts,
    200 threads and their handshakes' sockets). Past ``MAX_CONNECTS`` hosts one thread greets
    them all at once and only those that answer get a connect: the hosts that do not answer
    still cost one timeout in all, not one per ``MAX_CONNECTS`` of them."""
    monkeypatch.setattr(parallel_connects, "MAX_CONNECTS", 2)
    silent = SilentHosts(6)
    peak = [0]
    done = threading.Event()

    def count_threads() -> None:
        while not done.wait(0.01):
            names = [t.name for t in threading.enumerate()]
            peak[0] = max(peak[0], sum(n.startswith("tkvt-connect") for n in names))

    with (
        contextlib.closing(silent),
        ServerProcess.start(64, BLOCK_LEN) as server,
        TierManager.create(4, BLOCK_LEN, name="many-hosts") as tier,
    ):
        counter = threading.Thread(target=count_threads, daemon=True)
        counter.start()
        addresses = [*silent.addresses, server.address]
        connects = ParallelConnects(tier, addresses, {"timeout_s": 3.0})
        try:
            assert silent.dialled_side_by_side(within=2.0), "each few hosts waited for others"
            outcomes = dict(connects.outcomes())
            connects.join(timeout=WAIT_S)
        finally:
            done.set()
            counter.join(timeout=WAIT_S)
        assert outcomes.pop(server.address) == server.address == tier.peers()[0]
        assert all(isinstance(o, TimeoutError) for o in outcomes.values()), outcomes
        assert peak[0] <= 3, f"{peak[0]} connect threads at once (2 connects and the greeter)"


@pytest.mark.parametrize("timeout_s", [-1.0, math.nan, "5"])
def test_many_hosts_dialled_with_a_bad_timeout_each_say_so(
    monkeypatch: pytest.MonkeyPatch, timeout_s: Any
) -> None:
    """Past ``MAX_CONNECTS`` hosts the greeting uses the connects' ``timeout_s``: one that is
    no timeout must not make every host "not answer"; each connect says what is wrong."""
    monkeypatch.setattr(parallel_connects, "MAX_CONNECTS", 1)
    tier = FakeTier()
    connects = ParallelConnects(tier, ["a:1", "b:2"], {"timeout_s": timeout_s})
    assert dict(connects.outcomes()) == {"a:1": "host:a:1", "b:2": "host:b:2"}
    connects.join(timeout=WAIT_S)


@pytest.mark.parametrize("threads", [2, 1])
def test_a_connect_stuck_past_its_own_timeouts_ends_its_wait_with_timeout_error(
    monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    """Found by the waits audit: ``outcomes`` waited for each connect with no bound of its own,
    so a connect whose thread was stuck (a NIXL call that never returns, past every timeout of
    the connect's own) stopped a tier's startup, or every membership round, for good. It now
    yields ``TimeoutError`` for it, and for a connect waiting behind it on the only thread;
    the other hosts' outcomes are as before."""
    monkeypatch.setattr(parallel_connects, "longest_connect_s", lambda _timeout_s: 0.5)
    monkeypatch.setattr(parallel_connects, "MAX_CONNECTS", threads)
    # past MAX_CONNECTS hosts are greeted first: here every one answers at once
    monkeypatch.setattr(parallel_connects, "answering", lambda addresses, *_: range(len(addresses)))
    release = threading.Event()

    class StuckTier(FakeTier):
        def connect(self, address: str, **kwargs: Any) -> str:
            if address == "stuck:1":
                release.wait(WAIT_S)
            return super().connect(address, **kwargs)

    tier = StuckTier()
    connects = ParallelConnects(tier, ["stuck:1", "b:2"], {"timeout_s": 1.0})
    try:
        outcomes = dict(connects.outcomes())
    finally:
        release.set()
        connects.join(timeout=WAIT_S)
    assert isinstance(outcomes["stuck:1"], TimeoutError), outcomes
    assert "stuck" in str(outcomes["stuck:1"])
    if threads == 2:
        assert outcomes["b:2"] == "host:b:2"
    else:  # b:2 waited behind the stuck connect on the one thread
        assert isinstance(outcomes["b:2"], TimeoutError), outcomes


def test_many_hosts_dialled_with_a_numpy_int_timeout_are_greeted_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: past ``MAX_CONNECTS`` hosts, a ``timeout_s`` the connects take that is
    no ``int`` or ``float`` (a numpy ``int64``) was taken for no timeout: no greeting, so each
    host that does not answer held a connect's thread for its timeout, 16 at a time. The
    greeting takes what the connects take."""
    monkeypatch.setattr(parallel_connects, "MAX_CONNECTS", 1)
    tier = FakeTier()
    silent = [f"127.0.0.1:{free_port()}" for _ in range(2)]  # nobody listens there
    connects = ParallelConnects(tier, silent, {"timeout_s": np.int64(1)})
    outcomes = dict(connects.outcomes())
    connects.join(timeout=WAIT_S)
    assert all(isinstance(o, TimeoutError) for o in outcomes.values()), outcomes
    assert tier.calls == [], "hosts that did not answer the greeting were connected"


def test_hosts_dialled_side_by_side_join_the_tier_one_at_a_time() -> None:
    """Found by review, once hosts were dialled side by side: their joins overlapped, and a
    shared host's snapshot takes the tier's CPU (seconds at millions of keys), so each join
    lasted as long as all of them together, past its timeout (every round again). The
    handshakes still overlap; the joins after them take turns."""
    lock = threading.Lock()
    inside: list[int] = [0, 0]  # joins under way, the most at once

    with (
        ServerProcess.start(64, BLOCK_LEN) as a,
        ServerProcess.start(64, BLOCK_LEN) as b,
        TierManager.create(16, BLOCK_LEN, name="join-turns") as tier,
    ):
        register = tier._register

        def counted_register(*args: Any) -> None:
            with lock:
                inside[0] += 1
                inside[1] = max(inside)
            try:
                time.sleep(1.0)  # a long join: the other host's handshake ends meanwhile
                register(*args)
            finally:
                with lock:
                    inside[0] -= 1

        tier._register = counted_register  # type: ignore[method-assign]
        connects = ParallelConnects(tier, [a.address, b.address], {"timeout_s": 5.0})
        joined = dict(connects.outcomes())
        connects.join(timeout=WAIT_S)
        assert sorted(joined.values()) == sorted(tier.peers()) and len(tier.peers()) == 2
        assert inside[1] == 1


def test_a_connect_that_waited_past_its_timeout_for_another_hosts_join_says_so() -> None:
    """Joins take turns (a shared host's snapshot takes the tier's CPU): a user's connect made
    while the redialer or a membership round joins a very large host waits for that join, up
    to its ``timeout_s``. The host it dialled had answered, yet its ``TimeoutError`` said only
    "other hosts' joins went on": not which host, nor that its own host was fine."""
    with (
        ServerProcess.start(64, BLOCK_LEN) as big,
        ServerProcess.start(64, BLOCK_LEN) as small,
        TierManager.create(16, BLOCK_LEN, name="join-turn-wait") as tier,
    ):
        done = threading.Event()
        register = tier._register

        def slow_register(*args: Any) -> None:
            if args[0] == big.address:  # (its peer id: the address it listens on)
                done.wait(timeout=WAIT_S)  # a very large host's join
            register(*args)

        tier._register = slow_register  # type: ignore[method-assign]
        joining = ParallelConnects(tier, [big.address], {"timeout_s": WAIT_S})
        wait_until(lambda: big.address in tier._joining, "the large host joins")
        try:
            with pytest.raises(TimeoutError) as waited:
                tier.connect(small.address, timeout_s=0.5)
        finally:
            done.set()
        assert dict(joining.outcomes()) == {big.address: big.address}
        message = str(waited.value)
        assert f"{small.address} answered" in message and big.address in message, message
        assert tier.connect(small.address) == small.address  # its session was ended


def test_two_connects_of_one_host_at_once_both_return_its_peer() -> None:
    """Membership's thread and the tier's redialer (or a user) may dial one host at the same
    time: both get its peer id, and one session stays (found by review: one of them failed with
    "registration superseded", a ``RuntimeError`` that ended Membership's thread, or left a
    session open that nobody would ever close)."""
    with (
        ServerProcess.start(64, BLOCK_LEN) as server,
        TierManager.create(16, BLOCK_LEN, name="two-connects") as tier,
    ):
        register = tier._register
        entered: list[threading.Event] = [threading.Event(), threading.Event()]

        def overlapping_register(*args: Any) -> None:
            """The first registration waits (1 s at most) until the other connect reaches
            its own; each then registers in turn, so both joins overlap."""
            first = not entered[0].is_set()
            entered[0 if first else 1].set()
            if first:
                entered[1].wait(timeout=1.0)
            register(*args)

        tier._register = overlapping_register  # type: ignore[method-assign]
        start = threading.Barrier(2)
        results: list[object] = []

        def connect() -> None:
            start.wait(timeout=WAIT_S)
            try:
                results.append(tier.connect(server.address, timeout_s=5.0))
            except Exception as exc:
                results.append(exc)

        threads = [threading.Thread(target=connect) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=WAIT_S * 2)
        assert len(results) == 2 and all(isinstance(r, str) for r in results), results
        assert results[0] == results[1] and tier.peers() == [results[0]]
        wait_until(lambda: len(session_threads()) == 1, f"one session left: {session_threads()}")
        tier.arena.tensor[:2].random_(0, 256)
        assert tier.store(["x", "y"], [0, 1]).result(timeout=WAIT_S).ok
        assert tier.load(["x", "y"], [2, 3]).result(timeout=WAIT_S).ok
        assert torch.equal(tier.arena.tensor[2:4], tier.arena.tensor[:2])


def test_a_connect_waiting_for_a_failed_join_at_another_address_says_what_failed() -> None:
    """Two addresses of one host (dual-stack, or a name and its IP) dialled side by side: the
    one whose handshake ended second waits for the other's join. When that join failed, it
    raised "a connect of it on another thread failed": no word of which connect, nor why."""
    with (
        ServerProcess.start(64, BLOCK_LEN) as server,
        TierManager.create(16, BLOCK_LEN, name="dual-stack") as tier,
    ):
        port = server.address.rsplit(":", 1)[1]
        first, second = f"127.0.0.1:{port}", f"localhost:{port}"
        waiting = threading.Event()
        await_join = tier._await_join

        def noted_await_join(*args: Any) -> None:
            waiting.set()
            await_join(*args)

        def failing_register(*args: Any) -> None:
            assert waiting.wait(timeout=WAIT_S), "the other connect never waited"
            raise RuntimeError("registration failed (a test)")

        tier._await_join = noted_await_join  # type: ignore[method-assign]
        tier._register = failing_register  # type: ignore[method-assign]
        joining = ParallelConnects(tier, [first], {"timeout_s": 5.0})
        wait_until(lambda: tier._joining, "the first connect joins")
        with pytest.raises(ConnectionError) as failed:
            tier.connect(second, timeout_s=5.0)
        ((_, outcome),) = joining.outcomes()
        assert isinstance(outcome, RuntimeError) and tier.peers() == [], outcome
        assert f"at {first} on another thread failed" in str(failed.value), failed.value
        assert "registration failed (a test)" in str(failed.value), failed.value


@pytest.mark.parametrize("timeout_s", [math.inf, math.nan, -1.0])
def test_dial_later_refuses_a_timeout_no_handshake_takes(timeout_s: float) -> None:
    """``dial_later`` took any ``timeout_s``: the redialer then tried the host for good, each
    try failing with ``ValueError`` (and a greeting of hosts past its cap waits within the
    longest of their timeouts: an infinite one held every other host). It says so at once."""
    with TierManager.create(4, BLOCK_LEN, name="dial-later-timeout") as tier:
        with pytest.raises(ValueError, match=r"timeout_s must be at least 0\.1 s and at most"):
            tier.dial_later("127.0.0.1:1", TimeoutError("down (a test)"), timeout_s=timeout_s)
        assert tier.cancel_dial("127.0.0.1:1") is False


@pytest.mark.parametrize("name", ["timeout_s", "heartbeat_timeout_s"])
@pytest.mark.parametrize("value", ["5", None, True, Fraction(5)])
def test_a_timeout_that_is_no_number_is_refused_before_anything_is_dialled(
    monkeypatch: pytest.MonkeyPatch, name: str, value: object
) -> None:
    """Found by review: ``connect``/``dial_later`` with ``timeout_s="5"`` (read from a config
    file, say) raised ``TypeError: '<' not supported between instances of 'int' and 'str'``,
    naming no argument, and ``timeout_s=True`` dialled with a 1 s timeout (``dial_later``
    took it silently). Each is refused first, naming the argument and what to pass. So is a
    ``Fraction`` (no int, no float; a ``numpy.float32`` is taken as the float it is)."""
    with TierManager.create(4, BLOCK_LEN, name="timeout-type") as tier:
        opened: list[object] = []
        monkeypatch.setattr(tier, "_open", lambda dial, *_args, **_kw: opened.append(dial))
        got = re.escape(repr(value))
        match = rf"{name} must be a number of seconds.*got {got}.*pass e\.g\. {name}=10\.0"
        with pytest.raises(TypeError, match=match):
            tier.connect("127.0.0.1:1", redial_if_down=True, **{name: value})
        with pytest.raises(TypeError, match=match):
            tier.dial_later("127.0.0.1:1", TimeoutError("down (a test)"), **{name: value})
        assert opened == [] and not tier._pending


def test_a_numpy_timeout_is_taken() -> None:
    """A numpy int or float timeout is taken (``tests/test_timeout_args.py``: as a float)."""
    check_timeouts(timeout_s=np.float64(5.0), heartbeat_timeout_s=np.int64(5))
    check_timeouts(timeout_s=np.float32(5.0))
