"""The control plane never hangs, never goes silently stale, and no single call takes a host
away: duplicate stores while waiting for slots, keys the wire cannot carry, a reset control
connection, a refused grant, and a peer dropped while a store polls it (issue 18, items 1-5)."""

from __future__ import annotations

import contextlib
import math
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import psutil
import pytest
import torch
import zmq
from remote_support import BLOCK_LEN, control_ports, fake_session, fill_random, wait_for
from test_index import LateWriteTransport, late_write_tier

from torch_kv_tier import connected_hosts
from torch_kv_tier.arena import BlockArena
from torch_kv_tier.benchmarks.reliability_common import ucx_over_tcp
from torch_kv_tier.connections import Dial
from torch_kv_tier.keys import MAX_KEY_BYTES, MAX_KEYS_PER_CALL, home_peer
from torch_kv_tier.manager import TierManager
from torch_kv_tier.remote import HandshakeRejected, Region, RemoteSession, ServerProcess
from torch_kv_tier.remote import protocol as p
from torch_kv_tier.remote.handshake import AcceptLost
from torch_kv_tier.remote.replica import IndexFollower
from torch_kv_tier.remote.session_io import COMMIT_QUIET_S
from torch_kv_tier.results import CAPACITY
from torch_kv_tier.session_ends import END_THREAD
from torch_kv_tier.session_releases import _RELEASE_TRIES, RELEASE_THREAD
from torch_kv_tier.shared_host import SharedHost
from torch_kv_tier.transport import nixl as nixl_module

RESULT_TIMEOUT_S = 20.0


def test_a_duplicate_store_waiting_for_slots_joins_the_first_and_a_discard_unpublishes_it() -> None:
    with (
        ServerProcess.start(256, BLOCK_LEN, extra_args=["--max-grant", "4"]) as server,
        TierManager.create(64, BLOCK_LEN, name="dup", grant_batch=4) as tier,
    ):
        tier.connect(server.address)
        fill_random(tier)
        burst = [
            tier.store([f"k{i}-{j}" for j in range(8)], range(8 * i, 8 * i + 8)) for i in range(4)
        ]
        first = tier.store([b"dup"], [40])  # waits for a grant: the burst took every slot
        second = tier.store([b"dup"], [41])
        gone = tier.store([b"gone"], [42])
        tier.discard([b"gone"])
        for future in [*burst, first, second, gone]:
            assert future.result(timeout=RESULT_TIMEOUT_S).ok
        assert tier.lookup([b"dup"]) == 1 and tier.lookup([b"gone"]) == 0
        assert tier.stats().blocks_stored == 4 * 8 + 2  # the duplicate sent nothing
        tier.arena.tensor[50].zero_()
        assert tier.load([b"dup"], [50]).result(timeout=RESULT_TIMEOUT_S).ok
        assert torch.equal(tier.arena.tensor[50], tier.arena.tensor[40])


@pytest.mark.parametrize("private", [False, True])
def test_a_key_the_wire_cannot_carry_is_refused_at_the_call_and_the_host_stays(
    private: bool,
) -> None:
    with (
        ServerProcess.start(64, BLOCK_LEN) as server,
        TierManager.create(32, BLOCK_LEN, name="badkey") as tier,
    ):
        tier.connect(server.address, private=private, slots=32 if private else None)
        keys = [f"k{i}" for i in range(8)]
        assert tier.store(keys, range(8)).result(timeout=RESULT_TIMEOUT_S).ok
        for bad, limit in (
            (1 << 64, "64 bits"),
            (-(1 << 63) - 1, "64 bits"),
            (b"x" * 100_000, f"at most {MAX_KEY_BYTES} bytes"),
            ("é" * 33, f"at most {MAX_KEY_BYTES} bytes"),
        ):
            for call in (tier.store, tier.load):
                with pytest.raises(ValueError, match=limit):
                    call([bad], [9])
        with pytest.raises(ValueError, match=f"at most {MAX_KEYS_PER_CALL}"):
            tier.store(list(range(MAX_KEYS_PER_CALL + 1)), [0] * (MAX_KEYS_PER_CALL + 1))
        assert (
            tier.store([(1 << 64) - 1, -(1 << 63), b"y" * MAX_KEY_BYTES], [9, 10, 11])
            .result(timeout=RESULT_TIMEOUT_S)
            .ok
        )  # the limits themselves are fine
        assert tier.lookup(keys) == 8 and len(tier.peers()) == 1
        assert tier.store(["after"], [12]).result(timeout=RESULT_TIMEOUT_S).ok


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs iproute2's ss to reset a connection")
def test_a_reset_control_connection_is_noticed_and_the_tier_follows_the_host_again() -> None:
    with (
        ServerProcess.start(256, BLOCK_LEN) as server,
        TierManager.create(64, BLOCK_LEN, name="a") as a,
        TierManager.create(64, BLOCK_LEN, name="b") as b,
    ):
        b.connect(server.address)
        b_ports = control_ports(server)
        peer = a.connect(server.address)
        fill_random(a)
        before = [f"before-{i}" for i in range(8)]
        assert a.store(before, range(8)).result(timeout=RESULT_TIMEOUT_S).ok
        assert wait_for(lambda: b.lookup(before) == 8, 5.0)
        for port in b_ports:  # as a NAT or a load balancer does: ZeroMQ reconnects silently
            subprocess.run(
                ["ss", "-K", "src", f"127.0.0.1:{port}"], check=True, capture_output=True
            )
        after = [f"after-{i}" for i in range(8)]
        assert a.store(after, range(8, 16)).result(timeout=RESULT_TIMEOUT_S).ok
        # b dropped the host at once (its session's frames may be gone) and dialled it again:
        # it sees what a stored after the reset, through a new session's snapshot
        assert wait_for(lambda: b.lookup(after) == 8 and b.lookup(before) == 8, 15.0), (
            "b stayed stale after its control connection was reset"
        )
        assert b.peers() == [peer]
        loaded = b.load(after, range(8)).result(timeout=RESULT_TIMEOUT_S)
        assert loaded.ok and torch.equal(b.arena.tensor[:8], a.arena.tensor[8:16])


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs iproute2's ss to reset a connection")
@pytest.mark.parametrize("tcp", [False, True], ids=["ucx-default", "tcp"])
def test_resets_that_drop_a_host_cost_no_sockets_on_the_tier_or_the_host(tcp: bool) -> None:
    """Each reset drops the host and dials it again; its NIXL agent is the same process's, so
    the tier loads it again rather than removing it, which would leave about 10 sockets open on
    each side per drop (NIXL keeps a removed agent's: ``nixl_peers``)."""
    with contextlib.ExitStack() as stack:
        if tcp:
            stack.enter_context(ucx_over_tcp())
        server = stack.enter_context(ServerProcess.start(64, BLOCK_LEN))
        tier = stack.enter_context(TierManager.create(16, BLOCK_LEN, name="reset"))
        tier.connect(server.address)
        fill_random(tier)
        port = server.address.rsplit(":", 1)[1]

        def round_trip(i: int) -> None:
            keys = [f"{i}-{j}" for j in range(4)]
            assert tier.store(keys, range(4)).result(timeout=RESULT_TIMEOUT_S).ok
            loaded = tier.load(keys, range(4, 8)).result(timeout=RESULT_TIMEOUT_S)
            assert loaded.ok and torch.equal(tier.arena.tensor[4:8], tier.arena.tensor[:4])

        round_trip(0)
        host = psutil.Process(server.proc.pid)
        fds = psutil.Process().num_fds(), host.num_fds()
        for i in range(1, 6):
            dropped = tier.stats().peers_dropped
            subprocess.run(
                ["ss", "-K", "dst", f"127.0.0.1:{port}"], check=True, capture_output=True
            )
            assert wait_for(
                lambda d=dropped: tier.stats().peers_dropped > d and bool(tier.peers()), 15.0
            ), "the tier did not drop the host and dial it again"
            round_trip(i)
        assert tier.stats().peers_dropped == 5
        grown = psutil.Process().num_fds() - fds[0], host.num_fds() - fds[1]
        assert max(grown) <= 4, f"fds grown over 5 drops (tier, host): {grown}"


def test_a_tier_runs_the_same_threads_whether_or_not_it_lost_a_host() -> None:
    """A tier's thread count must not depend on whether it lost a host, or when: a leak check
    that compares trials (the peer-death scenario) cannot tell a late first start from a leak.
    The redial thread used to start with the first loss, from the thread that ends the lost
    session, racing the caller's ``disconnect`` (CI failed with one thread grown in trial 2)."""

    def names() -> set[str]:
        return {t.name for t in threading.enumerate()}

    with (
        ServerProcess.start(64, BLOCK_LEN) as server,
        TierManager.create(16, BLOCK_LEN, name="lost") as tier,
    ):
        peer = tier.connect(server.address)
        connected = names()
        server.kill()
        assert wait_for(lambda: tier.peers() == [], 15.0)
        assert wait_for(lambda: END_THREAD not in names(), 15.0), "the lost session never ended"
        tier.disconnect(peer)  # the dial stops; the thread that dials stays with the tier
        # a release told to the dead host runs in a thread of its own for up to
        # RELEASE_BUDGET_S and then ends (the peer-death scenario waits for it)
        grown = names() - connected - {RELEASE_THREAD}
        assert not grown, f"threads started by the loss: {grown}"


@contextlib.contextmanager
def _tier_on_one_shared_host(
    *, max_grant: int, grant_batch: int
) -> Iterator[tuple[TierManager, SharedHost]]:
    """A tier joined to one shared host of 64 slots that grants a session ``max_grant``."""
    with (
        ServerProcess.start(64, BLOCK_LEN, extra_args=["--max-grant", str(max_grant)]) as server,
        TierManager.create(16, BLOCK_LEN, name="grants", grant_batch=grant_batch) as tier,
    ):
        tier.connect(server.address)
        (host,) = tier._peers.values()
        assert isinstance(host, SharedHost)
        yield tier, host


def test_a_grant_answered_with_an_error_is_handled_not_raised() -> None:
    """Regression: an ``Error`` answer (a frozen client that came back after its session
    expired) raised ``'Error' object has no attribute 'slots'`` in the grant callback."""
    with _tier_on_one_shared_host(max_grant=2, grant_batch=2) as (tier, host):
        refused: Future[p.ServerMessage] = Future()
        refused.set_result(p.Error(0, p.UNKNOWN_SESSION))
        host.refilling = True  # as when the request went out
        tier._on_granted(host, host.commits, 2, refused)
        keys = [f"k{i}" for i in range(6)]  # more than one grant: the next grants still come
        assert tier.store(keys, range(6)).result(timeout=RESULT_TIMEOUT_S).ok


def test_a_grant_that_times_out_is_asked_again_and_never_fails_capacity() -> None:
    """Regression (CI, a host SIGKILLed while frozen): a grant request that timed out before
    the heartbeat declared the session lost failed the stores waiting for it with "capacity".
    No answer says nothing about capacity: the tier asks again, and the stores go out."""
    with _tier_on_one_shared_host(max_grant=16, grant_batch=4) as (tier, host):
        with tier._lock:  # as while a grant request is out: no slots, the store waits
            host.grants.clear()  # (4 of the session's 16 granted slots, never written)
            host.refilling = True
        waiting = tier.store(["a", "b"], range(2))
        timed_out: Future[p.ServerMessage] = Future()
        timed_out.set_exception(TimeoutError("no answer within 10 s"))
        tier._on_granted(host, host.commits, 4, timed_out)
        result = waiting.result(timeout=RESULT_TIMEOUT_S)
        assert result.ok, result.failed


def test_a_grant_the_host_refuses_with_an_error_is_no_hang_for_the_stores_waiting() -> None:
    """A host (a bug, a hostile one) answered a grant request with an ``Error`` and kept the
    session alive: the tier neither asked again nor failed the stores waiting for slots, so
    they waited for good (an idle tier sent no other request). A refused grant is a grant of
    no slots: they fail "capacity" when nothing of the tier's could free any, and the host's
    reason is logged."""
    with _tier_on_one_shared_host(max_grant=16, grant_batch=4) as (tier, host):
        with tier._lock:  # as while a grant request is out: no slots, the store waits
            host.grants.clear()
            host.refilling = True
        waiting = tier.store(["a", "b"], range(2))
        refused: Future[p.ServerMessage] = Future()
        refused.set_result(p.Error(0, "grants are off"))
        tier._on_granted(host, host.commits, 4, refused)
        result = waiting.result(timeout=RESULT_TIMEOUT_S)
        assert result.failed == {"a": CAPACITY, "b": CAPACITY}
        assert host.session.lost is None  # the host stays; a later store asks again
        assert tier.store(["c"], [2]).result(timeout=RESULT_TIMEOUT_S).ok


def test_a_peer_dropped_while_a_store_polls_it_fails_its_keys_not_the_call() -> None:
    """Regression: ``store`` looked the peers it submitted to up again after polling them, and
    raised ``KeyError(peer_id)`` when the poll had dropped one (seen as ``KeyError('r1')``)."""
    with late_write_tier(BlockArena(16, BLOCK_LEN), {"r0": 8, "r1": 8}) as (tier, transport):
        transport.fault("r1", "SIGKILLed")  # the store's own poll of r1 drops it
        keys = [f"k{i}" for i in range(8)]
        result = tier.store(keys, range(8)).result(timeout=RESULT_TIMEOUT_S)  # no KeyError
        assert set(result.failed.values()) <= {"peer lost", "transfer failed"}
        assert tier.peers() == ["r0"]


def test_tiers_agree_on_homes_whatever_order_they_connect_and_across_a_reconnect() -> None:
    with (
        ServerProcess.start(64, BLOCK_LEN) as h1,
        ServerProcess.start(64, BLOCK_LEN) as h2,
        TierManager.create(8, BLOCK_LEN, name="a") as a,
        TierManager.create(8, BLOCK_LEN, name="b") as b,
    ):
        a.connect(h1.address)
        a.connect(h2.address)
        b.connect(h2.address)
        first = b.connect(h1.address)
        assert sorted(a.peers()) == sorted(b.peers()) == sorted([h1.address, h2.address])
        keys = [f"k{i}" for i in range(200)]
        homes = {k: home_peer(k, a.peers()) for k in keys}
        b.disconnect(first)
        assert b.connect(h1.address) == first  # the host's id, not the session's
        assert {k: home_peer(k, b.peers()) for k in keys} == homes


def test_a_slow_registration_does_not_hold_up_lookups() -> None:
    """NIXL registers one descriptor per remote block (seconds for a big pool): that runs
    outside the tier's lock, so a scheduler's ``lookup`` answers meanwhile. Asserted while the
    registration is held, not by seconds: a ceiling of 0.5 s was one a loaded machine exceeds."""
    registering, release = threading.Event(), threading.Event()

    class SlowRegistration(LateWriteTransport):
        def add_remote_peer_async(self, *args: Any, **kwargs: Any) -> Future[None]:
            future: Future[None] = Future()

            def register() -> None:
                registering.set()
                release.wait(30)
                self.add_remote_peer(*args)
                future.set_result(None)

            threading.Thread(target=register, daemon=True).start()
            return future

    arena = BlockArena(8, BLOCK_LEN)
    transport = SlowRegistration(arena.tensor)
    transport.remotes[b"slow"] = torch.zeros(8, BLOCK_LEN, dtype=torch.uint8)
    with TierManager(arena, transport) as tier:
        adding = threading.Thread(target=tier.add_peer, args=("p", b"slow", 0, 8, BLOCK_LEN))
        adding.start()
        try:
            assert registering.wait(10)
            answers: list[tuple[int, list[str]]] = []
            looking = threading.Thread(
                target=lambda: answers.append((tier.lookup(["x"]), tier.peers())), daemon=True
            )
            looking.start()
            looking.join(timeout=10)
            assert answers == [(0, [])], "the lookup waited for the registration"
        finally:
            release.set()
        adding.join(timeout=10)
        assert tier.peers() == ["p"]


def test_a_registration_that_outlives_the_tiers_wait_is_abandoned(
    peer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``add_peer`` gave up on a slow NIXL registration with a bare ``TimeoutError`` and left it
    running: it published the peer in the transport later, a registration the tier never knew
    (its remote agent and descriptors held until close). Now the registration is abandoned."""
    monkeypatch.setattr(connected_hosts, "REGISTER_TIMEOUT_S", 0.5)
    with TierManager.create(8, BLOCK_LEN, name="abandon") as tier:
        transport: Any = tier.transport
        agent = transport._agent
        release = threading.Event()

        class SlowLoad:
            def __getattr__(self, name: str) -> Any:
                real = getattr(agent, name)
                if name != "add_remote_agent":
                    return real

                def slow(*args: Any) -> Any:
                    assert release.wait(30)
                    return real(*args)

                return slow

        transport._agent = SlowLoad()
        try:
            with pytest.raises(TimeoutError, match="did not finish within 0.5 s"):
                tier.add_peer("p", *peer.peer_args())
        finally:
            release.set()
        transport._registrar.submit(lambda: None).result(timeout=10)  # runs after it
        transport._agent = agent
        assert tier.peers() == [] and transport._peers.get("p") is None
        assert transport.write_blocks("p", [0], [0]) is None  # unknown to the transport too


def test_a_load_cancelled_by_close_waits_for_a_release_left_to_a_stuck_registration(
    peer: Any, peer2: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``NixlTransport.close`` leaves its release to a registration stuck past
    ``CLOSE_REGISTRATION_WAIT_S``: until then a cancelled read may still land, so the tier's
    close must not settle that load before the transport says it released everything."""
    monkeypatch.setattr(nixl_module, "CLOSE_REGISTRATION_WAIT_S", 0.3)
    tier = TierManager.create(8, BLOCK_LEN, name="stuck-close")
    transport: Any = tier.transport
    tier.add_peer("q", *peer.peer_args())
    assert tier.store(["k"], [0]).result(timeout=RESULT_TIMEOUT_S).ok
    agent = transport._agent
    release, entered = threading.Event(), threading.Event()

    class Stuck:  # reads never finish; loading a remote agent blocks until ``release``
        def __getattr__(self, name: str) -> Any:
            real = getattr(agent, name)
            if name == "check_xfer_state":
                return lambda handle: "PROC"
            if name != "add_remote_agent":
                return real

            def slow(*args: Any) -> Any:
                entered.set()
                assert release.wait(30)
                return real(*args)

            return slow

    transport._agent = Stuck()
    try:
        load = tier.load(["k"], [1])
        transport.add_remote_peer_async("p", *peer2.peer_args())
        assert entered.wait(10)
        closer = threading.Thread(target=tier.close, kwargs={"timeout": 0.3})
        closer.start()
        closer.join(timeout=10)
        assert not closer.is_alive()
        time.sleep(0.2)
        assert not load.done(), "settled while the agent may still write its block"
    finally:
        release.set()
    assert load.result(timeout=RESULT_TIMEOUT_S).failed == {"k": "closed"}


def test_an_index_snapshot_superseded_by_a_resync_is_ignored() -> None:
    """Two snapshot chains at once gave duplicate pages and an ``event_seq`` that moved back."""
    requests: list[tuple[int, Any]] = []
    changes: list[tuple[list[Any], bool]] = []
    follower = IndexFollower(
        lambda cursor, on_page, on_sent: requests.append((cursor, on_page)),
        lambda stored, slots, digests, evicted, reset, sent: changes.append((stored, reset)),
        host="host",
        pool=8,
    )
    follower.start()
    follower.start()  # a resync before the first snapshot's page came
    (_, old), (_, new) = requests

    def page(keys: list[Any], event_seq: int) -> Future[p.ServerMessage]:
        future: Future[p.ServerMessage] = Future()
        future.set_result(p.SnapshotPage(0, keys, [0] * len(keys), [0] * len(keys), event_seq, -1))
        return future

    new(page([b"new"], 7))
    old(page([b"old"], 3))  # the superseded chain's page arrives late: ignored
    assert changes == [([b"new"], True)] and follower.event_seq == 7
    follower.check(9)  # the host pushed batches 8 and 9 ...
    follower.check(9)  # ... and they never came: a new snapshot
    assert follower.syncing and len(requests) == 3


def test_a_snapshot_carries_the_commits_sent_after_its_request_and_no_others() -> None:
    """A commit made before a resync but sent after the snapshot's request is not in the
    snapshot: it goes with it (``sent``), as does one made later; one sent before the request,
    or while an older chain's request was the last sent, does not; after the snapshot, none."""
    requests: list[tuple[Any, Any]] = []
    changes: list[tuple[list[Any], bool, Any]] = []
    follower = IndexFollower(
        lambda cursor, on_page, on_sent: requests.append((on_page, on_sent)),
        lambda stored, slots, digests, evicted, reset, sent: changes.append((stored, reset, sent)),
        host="host",
        pool=8,
    )
    follower.start()
    follower.on_commits([b"before"], [1], [11])  # queued before the request, sent ahead of it
    follower.start()  # a resync before the first request went out: that chain is superseded
    requests[0][1]()  # its request goes out (first: requests leave in order)
    follower.on_commits([b"between"], [2], [12])  # sent before the new chain's request
    requests[1][1]()
    follower.on_commits([b"after"], [3], [13])
    follower.on_commits([b"later"], [4], [14])
    future: Future[p.ServerMessage] = Future()
    future.set_result(p.SnapshotPage(0, [b"snap"], [5], [15], 7, -1))
    requests[1][0](future)
    follower.on_commits([b"echoed"], [6], [16])  # after the snapshot: its echo is enough
    assert changes == [([b"snap"], True, [([b"after"], [3], [13]), ([b"later"], [4], [14])])]
    follower.on_events(p.Events(0, 8, [b"echoed"], [6], [16], []))
    assert changes[-1] == ([b"echoed"], False, ())


def test_a_snapshot_page_with_fewer_slots_than_keys_never_shifts_the_next_pages_keys() -> None:
    """A host (a bug, another version) sent a page with one slot and digest fewer than keys:
    the pages were joined before their lengths were checked, so every key after it took the
    slot and digest of the key before it, and a load of that key read its neighbour's bytes,
    which matched the digest: wrong bytes served as a hit. Each page is checked on its own."""
    requests: list[Any] = []
    changes: list[tuple[list[Any], list[int], list[int]]] = []
    follower = IndexFollower(
        lambda cursor, on_page, on_sent: requests.append(on_page),
        lambda stored, slots, digests, evicted, reset, sent: changes.append(
            (stored, slots, digests)
        ),
        host="host",
        pool=8,
    )
    follower.start()
    for keys, slots, digests, next_cursor in (
        ([b"a", b"b", b"c"], [1, 2], [11, 12], 3),  # c's slot and digest are missing
        ([b"d"], [4], [14], -1),
    ):
        future: Future[p.ServerMessage] = Future()
        future.set_result(p.SnapshotPage(0, keys, slots, digests, 7, next_cursor))
        requests[-1](future)
    assert changes == [([b"a", b"b", b"d"], [1, 2, 4], [11, 12, 14])]


def test_a_snapshot_page_whose_next_cursor_does_not_advance_ends_the_snapshot() -> None:
    """A host (a bug, another version) answered a snapshot page with a ``next_cursor`` at or
    before the one asked for: the follower asked for it again, for ever, holding every page and
    every event batch that came meanwhile, and its copy never synced. The snapshot is refused,
    saying why, and no more page is asked for."""
    requests: list[tuple[int, Any]] = []
    follower = IndexFollower(
        lambda cursor, on_page, on_sent: requests.append((cursor, on_page)),
        lambda *change: None,
        host="host",
        pool=8,
    )
    follower.start()
    for next_cursor in (2, 2):  # the second page points back at itself
        future: Future[p.ServerMessage] = Future()
        future.set_result(p.SnapshotPage(0, [b"k"], [1], [11], 7, next_cursor))
        requests[-1][1](future)
    assert [cursor for cursor, _ in requests] == [0, 2]
    assert not follower.syncing and follower.snapshots == 0


def test_a_fingerprint_longer_than_any_config_is_rejected() -> None:
    with (
        ServerProcess.start(8, BLOCK_LEN) as server,
        pytest.raises(HandshakeRejected, match="fingerprint longer"),
    ):
        RemoteSession.open(
            server.address,
            agent_metadata=b"x",
            region=Region(4096, 8, BLOCK_LEN),
            config_fingerprint="f" * (p.MAX_FINGERPRINT + 1),
        )


def test_a_release_of_a_session_the_host_still_counts_live_ends_it_clean() -> None:
    """Regression (found by the shared stress with host freezes): a tier gave up its session
    while the host was frozen, and its redial released that session before the host had ended
    it; the release was ignored, the session then expired, and its slots stayed held forever."""
    with ServerProcess.start(32, BLOCK_LEN) as server:
        old = fake_session(server.address, slots=16)
        new = fake_session(server.address, slots=8, release=[old.session_id])
        stats = new.stats()
        assert stats["held_blocks"] == 0 and stats["leased_blocks"] == 8
        assert wait_for(lambda: old.lost is not None, 10.0)  # the host no longer knows it
        old.close()
        new.close()


def test_more_sessions_to_release_than_a_handshake_carries_are_all_released() -> None:
    """A handshake carries at most ``MAX_RELEASE`` sessions to release: the rest of a longer
    list (a host lost and redialled many times) were dropped, and the host held their slots
    for good. They go out in ``Release`` messages once the session is open."""
    n = p.MAX_RELEASE + 6
    with ServerProcess.start(n + 8, BLOCK_LEN) as server:
        ended = []
        for _ in range(n):
            session = fake_session(server.address, slots=1)
            session.close(clean=False)  # as if a write of it could still land: held
            ended.append(session.session_id)
        with fake_session(server.address, slots=8, release=ended) as new:
            assert wait_for(lambda: new.stats()["held_blocks"] == 0, 10.0), new.stats()
            assert new.stats()["leased_blocks"] == 8


def _hello(address: str) -> tuple[zmq.Socket[bytes], p.Challenge]:
    """A raw control connection to ``address`` that said hello; its challenge."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(f"tcp://{address}")
    sock.send(p.encode(p.Hello(p.PROTOCOL_VERSION, 1, b"c" * 32)))
    assert sock.poll(10_000)
    challenge = p.decode_server(sock.recv())
    assert isinstance(challenge, p.Challenge)
    return sock, challenge


def _private_handshake(nonce: bytes) -> bytes:
    region = Region(0x10000, 8, BLOCK_LEN)
    hs = p.Handshake(
        p.PROTOCOL_VERSION, 2, nonce, b"", b"x", region, "", None, private=True,
        client_nonce=b"c" * 32,
    )  # fmt: skip
    return p.encode(hs)


def test_stats_of_more_sessions_than_a_frame_holds_are_cut_short_not_a_lost_session() -> None:
    """A host with a few thousand sessions (a fleet's every tier joins every host; the sessions
    list takes ~250 B each) answered ``stats()`` with a frame over ``MAX_FRAME_BYTES``: the
    asking tier's socket refused it and dropped the connection, so asking for stats lost the
    session. The host cuts the lists short to fit, and says how much it left out."""
    n = 4500  # ~1.1 MiB of sessions with names of 128 characters
    region = Region(0x10000, 8, BLOCK_LEN)
    extra = ["--max-sessions", str(n + 8), "--lease-timeout", "600"]
    with ServerProcess.start(64, BLOCK_LEN, extra_args=extra) as server:
        sock, challenge = _hello(server.address)
        try:
            for i in range(n):
                if i:
                    sock.send(p.encode(p.Hello(p.PROTOCOL_VERSION, 1, b"c" * 32)))
                    assert sock.poll(10_000)
                    challenge = p.decode_server(sock.recv())  # type: ignore[assignment]
                name = f"{i:0128d}"
                hs = p.Handshake(
                    p.PROTOCOL_VERSION, 2, challenge.nonce, b"", b"x", region, "", None, name,
                    client_nonce=b"c" * 32,
                )  # fmt: skip
                sock.send(p.encode(hs))
                assert sock.poll(10_000)
                assert isinstance(p.decode_server(sock.recv()), p.Accept)
            with fake_session(server.address, private=False) as asking:
                stats = asking.stats()
                assert asking.lost is None
            assert stats["sessions_omitted"] > 0
            assert len(stats["sessions"]) + stats["sessions_omitted"] == n + 1
        finally:
            sock.close(linger=0)


def test_a_session_whose_accept_was_never_read_is_released_by_its_id() -> None:
    """An Accept queued but never read (the client's deadline passed first): the client knows
    the session's id all the same (the nonce it answered) and names it in its next handshake's
    release, which ends the session clean."""
    with ServerProcess.start(32, BLOCK_LEN) as server:
        sock, challenge = _hello(server.address)
        try:
            sock.send(_private_handshake(challenge.nonce))
            assert sock.poll(10_000)  # the Accept is there, unread
            with fake_session(server.address, slots=8, release=[challenge.nonce.hex()]) as new:
                stats = new.stats()
            assert len(stats["sessions"]) == 1, stats["sessions"]
            assert (stats["held_blocks"], stats["leased_blocks"]) == (0, 8), stats
        finally:
            sock.close(linger=0)


def test_a_session_released_before_its_handshake_arrived_never_opens() -> None:
    """The release can overtake the handshake it gives up (two connections): the nonce is
    revoked, so the late handshake is refused and nothing is leased for it."""
    with ServerProcess.start(32, BLOCK_LEN) as server:
        sock, challenge = _hello(server.address)
        try:
            with fake_session(server.address, slots=8, release=[challenge.nonce.hex()]) as new:
                sock.send(_private_handshake(challenge.nonce))
                assert sock.poll(10_000)
                reply = p.decode_server(sock.recv())
                assert isinstance(reply, p.Reject) and "nonce" in reply.reason, reply
                assert new.stats()["leased_blocks"] == 8
        finally:
            sock.close(linger=0)


@contextlib.contextmanager
def _host_that_never_accepts(handshakes: int) -> Iterator[tuple[str, list[p.Handshake]]]:
    """A control port that answers hello and then nothing (a frozen host, or its Accept lost):
    the ``i``-th hello's nonce is ``i`` repeated. Yields its address and the ``Handshake``s it
    got, until it got ``handshakes`` of them."""
    router: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    got: list[p.Handshake] = []

    def host() -> None:
        while len(got) < handshakes and router.poll(20_000):
            identity, frame = router.recv_multipart()
            message = p.decode_client(frame)
            if isinstance(message, p.Hello):
                nonce = bytes([len(got)]) * p.NONCE_BYTES
                challenge = p.Challenge(p.PROTOCOL_VERSION, 1, nonce, b"")
                router.send_multipart([identity, p.encode(challenge)])
            elif isinstance(message, p.Handshake):
                got.append(message)

    thread = threading.Thread(target=host, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{port}", got
        thread.join(timeout=10)
    finally:
        router.close(linger=0)


def test_a_tier_whose_accept_never_came_releases_that_session_at_its_next_handshake() -> None:
    """A host that answers hello and then nothing (frozen, or its Accept lost): the tier's
    connect raises ``AcceptLost`` (a ``TimeoutError``) naming the session the host may have
    opened, and the tier's next handshake there releases it."""
    with (
        _host_that_never_accepts(2) as (address, handshakes),
        TierManager.create(4, BLOCK_LEN, name="lost-accept") as tier,
    ):
        for _ in range(2):
            with pytest.raises(AcceptLost) as lost:
                tier.connect(address, private=True, timeout_s=0.5)
    assert lost.value.session_id == (b"\x01" * p.NONCE_BYTES).hex()
    assert [h.release for h in handshakes] == [[], [(b"\x00" * p.NONCE_BYTES).hex()]]


def test_a_release_over_a_session_of_its_own_keeps_what_its_tries_may_have_opened() -> None:
    """A removed host's ended sessions go to it over a session of their own, in a few tries:
    a try whose Accept never came may have opened a session, which the next try's handshake
    left out (the host held it for good), and once every try failed the tier forgot them all,
    though a host that did not answer (frozen a while) still holds them. Each try names what
    the earlier ones may have opened, and the last one's failure keeps them all, to be named
    again (the next time a session of that host resolves, a connect there, or ``close``)."""
    with (
        _host_that_never_accepts(_RELEASE_TRIES) as (address, handshakes),
        TierManager.create(4, BLOCK_LEN, name="own-release") as tier,
    ):
        tier._release_over_own_session(Dial(address, None, False, None, 0.5, 10.0), ["ended"])
        opened = [(bytes([i]) * p.NONCE_BYTES).hex() for i in range(_RELEASE_TRIES)]
        assert [h.release for h in handshakes] == [
            ["ended", *opened[:i]] for i in range(_RELEASE_TRIES)
        ]
        assert tier._ended.resolved[address] == ["ended", *opened]


@pytest.mark.parametrize(
    ("field", "value", "problem"),
    [
        ("lease_timeout_s", 0.0, "lease timeout"),
        ("lease_timeout_s", math.nan, "lease timeout"),
        ("lease_stop", 9, "lease"),
        ("region", Region(0x10000, 0, BLOCK_LEN), "num_blocks > 0"),
        ("max_granted", -1, "max granted"),
    ],
    ids=[
        "no-lease-timeout",
        "nan-lease-timeout",
        "lease-past-the-region",
        "empty-region",
        "negative-max-granted",
    ],
)
def test_an_accept_the_client_cannot_use_is_refused_and_the_session_ended_on_the_host(
    field: str, value: Any, problem: str
) -> None:
    """A host (a bug, another version) accepted with a lease timeout of 0 or NaN, which made
    the session heartbeat in a busy loop (its interval is a third of it), or with a lease or
    region no session can use, or a negative cap on granted slots (a tier's reserve below 0:
    it was never topped up ahead of the stores, which waited for grants): the session opened
    all the same. ``open`` refuses it, saying what is wrong, and ends the session on the
    host."""
    router: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    got: list[p.ClientMessage] = []

    def host() -> None:  # accepts every handshake with the bad field
        while not any(isinstance(m, p.Disconnect) for m in got) and router.poll(10_000):
            identity, frame = router.recv_multipart()
            message = p.decode_client(frame)
            got.append(message)
            if isinstance(message, p.Hello):
                challenge = p.Challenge(p.PROTOCOL_VERSION, 1, b"n" * p.NONCE_BYTES, b"")
                router.send_multipart([identity, p.encode(challenge)])
            elif isinstance(message, p.Handshake):
                accept = p.Accept(
                    2, "sid", "s1", "bad", b"meta", Region(0x10000, 8, BLOCK_LEN), 0, 4, 30.0
                )
                setattr(accept, field, value)
                router.send_multipart([identity, p.encode(accept)])

    thread = threading.Thread(target=host, daemon=True)
    thread.start()
    try:
        with pytest.raises(ConnectionError, match=f"unusable.*{problem}"):
            fake_session(f"127.0.0.1:{port}", slots=4, timeout_s=5.0).close()
        thread.join(timeout=10)
        assert isinstance(got[-1], p.Disconnect) and got[-1].session_id == "sid", got
    finally:
        router.close(linger=0)


def test_a_commit_made_while_the_io_thread_takes_the_batch_still_reaches_the_host() -> None:
    """Regression (``test_burst``, 2 runs of 8: the host stored 806 and 928 of 992 chunks
    that the tier had reported stored, its session's 248 granted slots never committed).
    ``commit`` looked its batch up before taking the session's lock; the I/O thread, taking
    the batch in between (it swaps in a new list), sent the old one, and the commit appended to
    it was never sent. Here the I/O thread takes the batch at exactly that moment."""
    with ServerProcess.start(256, BLOCK_LEN) as server:  # grants up to 16 slots a session
        session = fake_session(server.address, private=False)
        try:
            answer: Future[Any] = Future()
            session.grant(4, lambda future: answer.set_result(future.result()))
            slots = answer.result(timeout=10).slots
            assert len(slots) == 4
            enqueue = session._enqueue

            def batch_taken_first(put: Any, allow_closed: bool) -> None:
                with session._lock:  # as the I/O thread's _send_commits does
                    session._commits, session._touches = [], []
                enqueue(put, allow_closed)

            session._enqueue = batch_taken_first  # type: ignore[method-assign]
            keys = [f"key-{i}".encode() for i in range(4)]
            session.commit(keys, slots, [1, 2, 3, 4])
            del session._enqueue  # the rest as usual
            assert wait_for(lambda: session.stats()["shared_stored_blocks"] == 4, 10.0), (
                session.stats()
            )
        finally:
            session.close()


def test_a_commit_with_a_negative_digest_is_refused_and_followers_stay_in_step(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A digest is a 64-bit unsigned int, but msgpack carries negative ints too: the host stored
    a rogue client's ``-1`` and pushed it, every follower of the namespace failed to apply it
    (to a ``uint64`` array), resynced, failed on the snapshot too, and so on (thousands of
    snapshots a second, for as long as the key stayed)."""
    with (
        ServerProcess.start(64, BLOCK_LEN) as server,
        TierManager.create(16, BLOCK_LEN, name="follower") as tier,
    ):
        tier.connect(server.address)
        fill_random(tier)
        assert tier.store([b"good"], [0]).result(timeout=RESULT_TIMEOUT_S).ok
        rogue = fake_session(server.address, private=False)
        try:
            answer: Future[Any] = Future()
            rogue.grant(2, lambda future: answer.set_result(future.result()))
            slots = answer.result(timeout=10).slots
            rogue.commit([b"rogue"], slots[:1], [-1])
            rogue.stats()  # a request goes out after the commits made before it: a frame apart
            rogue.commit([b"benign"], slots[1:], [7])
            assert wait_for(lambda: tier.lookup([b"benign"]) == 1, 10.0)
            assert tier.lookup([b"rogue"]) == 0
            assert rogue.stats()["shared_stored_blocks"] == 2  # good and benign
        finally:
            rogue.close()
        assert not [r for r in caplog.records if "not applied" in r.getMessage()]
        tier.arena.tensor[5].zero_()
        assert tier.load([b"good"], [5]).result(timeout=RESULT_TIMEOUT_S).ok
        assert torch.equal(tier.arena.tensor[5], tier.arena.tensor[0])


def test_a_grant_asked_right_after_a_commit_counts_the_slots_that_commit_returned() -> None:
    """A session batches its commits for up to ``COMMIT_PERIOD_S``, but a request made after a
    commit always reaches the host after it: a grant asked right after committing every granted
    slot gets slots again (sent ahead of its commit, the host would count them still granted,
    cap the grant at zero, and the tier's waiting stores would fail "capacity")."""
    with ServerProcess.start(64, BLOCK_LEN, extra_args=["--max-grant", "4"]) as server:
        session = fake_session(server.address, private=False)
        try:
            assert session.max_granted == 4  # the handshake announces the cap: the reserve

            def grant() -> list[int]:
                answer: Future[Any] = Future()
                session.grant(4, lambda future: answer.set_result(future.result()))
                return list(answer.result(timeout=10).slots)

            slots = grant()
            for round_ in range(40):
                assert len(slots) == 4, f"round {round_}: granted {slots}"
                keys = [f"r{round_}-{i}".encode() for i in range(4)]
                session.commit(keys, slots, [1, 2, 3, 4])
                slots = grant()  # no wait between them: the commit is still batched
        finally:
            session.close()


def test_a_top_up_grant_goes_out_with_the_next_commits_and_is_answered() -> None:
    """A top-up (``with_commits``) waits for the session's next batch of commits instead of a
    wake-up of its own: made while commits flow, it still reaches the host, after the commits
    made before it (so it counts the slots they returned); made while none flow, it goes out
    at once."""
    with ServerProcess.start(64, BLOCK_LEN, extra_args=["--max-grant", "4"]) as server:
        session = fake_session(server.address, private=False)
        try:

            def ask(*, with_commits: bool) -> Future[Any]:
                answer: Future[Any] = Future()
                session.grant(
                    4,
                    lambda future: answer.set_result(future.result()),
                    with_commits=with_commits,
                )
                return answer

            slots = list(ask(with_commits=False).result(timeout=10).slots)
            for round_ in range(20):
                assert len(slots) == 4, f"round {round_}: granted {slots}"
                keys = [f"r{round_}-{i}".encode() for i in range(4)]
                session.commit(keys, slots, [1, 2, 3, 4])
                slots = list(ask(with_commits=True).result(timeout=10).slots)
            time.sleep(0.2)  # commits stopped flowing: a top-up wakes the I/O thread
            assert len(ask(with_commits=True).result(timeout=10).slots) == 0  # 4 still granted
        finally:
            session.close()


def test_a_top_up_made_after_the_commits_stopped_goes_out_at_once() -> None:
    """Regression: a top-up made after the quiet period that follows a commit's send, and
    before that send's deadline, once the I/O thread had seen the quiet period end, woke it;
    it sent nothing (no commit was due) and then watched no deadline: the top-up waited for
    the next heartbeat, seconds later."""
    with ServerProcess.start(64, BLOCK_LEN, extra_args=["--lease-timeout", "300"]) as server:
        session = fake_session(
            server.address, private=False, heartbeat_interval_s=60.0, heartbeat_timeout_s=300.0
        )
        try:
            for round_ in range(5):
                answer: Future[Any] = Future()
                session.commit([f"r{round_}".encode()], [0], [1])  # quiet: sent at once
                time.sleep(2 * COMMIT_QUIET_S)  # past the quiet period, before the deadline
                seen: Future[Any] = Future()  # an answer wakes the I/O thread: it sees that
                session.grant(0, seen.set_result)
                seen.result(timeout=10)
                session.grant(1, answer.set_result, with_commits=True)
                assert isinstance(answer.result(timeout=1.0).result(), p.Granted), round_
        finally:
            session.close()


def test_a_new_session_waits_for_its_first_commit_instead_of_polling_for_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression: a new session's I/O thread took its start for the time of a last commit
    send, so for the quiet period after it (``COMMIT_QUIET_S``) it watched a commit deadline
    already past and polled without waiting: hundreds of wake-ups, a core busy, each time a
    session opened."""
    polls_without_wait = [0]
    poll = zmq.Poller.poll

    def counting_poll(self: zmq.Poller, timeout: int | None = None) -> Any:
        if timeout == 0 and threading.current_thread().name.startswith("tkvt-session"):
            polls_without_wait[0] += 1
        return poll(self, timeout)

    monkeypatch.setattr(zmq.Poller, "poll", counting_poll)
    with ServerProcess.start(64, BLOCK_LEN) as server:
        session = fake_session(server.address, private=False)
        try:
            time.sleep(10 * COMMIT_QUIET_S)
        finally:
            session.close()
    assert polls_without_wait[0] <= 2  # the first heartbeat, due at once


def test_a_top_up_waiting_for_commits_fails_when_its_session_closes() -> None:
    with ServerProcess.start(64, BLOCK_LEN) as server:
        session = fake_session(server.address, private=False)
        answers: list[Future[Any]] = []
        try:
            for _ in range(50):
                session.commit([b"unknown"], [0], [1])  # commits flow: top-ups wait for them
                answers.append(Future())
                session.grant(4, answers[-1].set_result, with_commits=True)
        finally:
            session.close()
        for answer in answers:  # each answered, or failed by the close: none left waiting
            outcome = answer.result(timeout=10)
            error = outcome.exception(timeout=0)
            assert isinstance(error, ConnectionError) or isinstance(outcome.result(), p.Granted)


def test_an_io_thread_held_past_close_is_logged_with_where_it_is(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``close`` waits ``timeout_s`` for the session's I/O thread, then returns; a thread still
    running then (here, held by an answer callback that blocks) is logged with its stack, so
    whatever held it can be found (seen once in ``chaos --tcp``, unexplained)."""
    with ServerProcess.start(64, BLOCK_LEN) as server:
        session = fake_session(server.address, private=False, timeout_s=0.5)
        entered, release = threading.Event(), threading.Event()

        def hold_the_io_thread(_answer: Future[Any]) -> None:
            entered.set()
            release.wait(30)

        try:
            session.grant(1, hold_the_io_thread)
            assert entered.wait(10)
            started = time.monotonic()
            session.close()
            assert time.monotonic() - started < 10  # the Disconnect's wait, then the join's
        finally:
            release.set()
        message = next(m for r in caplog.records if "did not stop" in (m := r.getMessage()))
        assert "hold_the_io_thread" in message and "release.wait(30)" in message


@contextlib.contextmanager
def _misannounced(
    misannounce: Callable[[bytes], p.ServerMessage], monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[TierManager, Any]]:
    """A tier and its host, whose messages reach the tier through ``misannounce`` once the tier
    joined; the tier has stored ``b"good"`` and ``b"bad"``, and its copy of the index applied
    the events and a new snapshot announcing them, and settled (no resync after)."""
    with (
        ServerProcess.start(64, BLOCK_LEN) as server,
        TierManager.create(16, BLOCK_LEN, name="misannounced") as tier,
    ):
        tier.connect(server.address)
        (host,) = tier._peers.values()
        follower = host.session._follower
        assert follower is not None and follower.snapshots == 1
        monkeypatch.setattr(p, "decode_server", misannounce)
        before = follower.event_seq
        fill_random(tier)
        assert tier.store([b"good", b"bad"], [0, 1]).result(timeout=RESULT_TIMEOUT_S).ok
        assert wait_for(lambda: follower.event_seq > before and not follower.syncing, 10.0)
        host.session.resync()  # the snapshot has them too
        assert wait_for(lambda: follower.snapshots >= 2 and not follower.syncing, 10.0)
        time.sleep(0.5)
        assert follower.snapshots == 2 and not follower.syncing
        yield tier, host


@pytest.mark.parametrize(
    ("field", "value"),
    [("slots", 64), ("slots", -5), ("digests", -1)],
    ids=["slot-past-the-pool", "negative-slot", "negative-digest"],
)
def test_a_host_announcing_a_key_the_tier_cannot_hold_is_refused_once_not_resynced_forever(
    field: str, value: int, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A host (a bug, another version) announced a key in a slot outside the pool it told the
    session of, or with a digest no ``uint64`` holds: the tier's copy failed to apply it and
    took a new snapshot, which had it too, and so on, hundreds a second for as long as the key
    stayed (a negative slot was even applied, as a slot counted from the pool's end). The
    follower leaves such a key out (it misses), says so once, and stays in step."""
    decode = p.decode_server

    def misannounce(frame: bytes) -> p.ServerMessage:
        message = decode(frame)
        if isinstance(message, p.SnapshotPage | p.Events):
            keys = message.keys if isinstance(message, p.SnapshotPage) else message.stored
            values = getattr(message, field)
            setattr(message, field, [value if k == b"bad" else v for k, v in zip(keys, values)])
        return message

    with _misannounced(misannounce, monkeypatch) as (tier, host):
        assert tier.lookup([b"good"]) == 1 and tier.lookup([b"bad"]) == 0
        tier.arena.tensor[5:7].zero_()
        loaded = tier.load([b"good", b"bad"], [5, 6]).result(timeout=RESULT_TIMEOUT_S)
        assert loaded.failed == {b"bad": "missing"}
        assert torch.equal(tier.arena.tensor[5], tier.arena.tensor[0])
        refused = [r.getMessage() for r in caplog.records if "cannot hold" in r.getMessage()]
        assert len(refused) == 2 and f"{field[:-1]} {value}" in refused[0], refused


@pytest.mark.parametrize("bad", [[1, 2], {"a": 1}, 1.5, True, None], ids=repr)
def test_a_host_announcing_something_that_is_no_key_is_refused_and_the_tier_serves_on(
    bad: object, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A host (a bug, a hostile one that knows the token) announced something that is no key
    (unhashable, or of a type no tier stores: a float or bool equals an int key) as stored or
    evicted, in events and snapshots. Applying it raised in the tier's copy, which took a new
    snapshot, which had it again: resyncs for as long as the host said so. The follower leaves
    such a "key" out, says so, and stays in step; the keys beside it are served."""
    decode = p.decode_server

    def misannounce(frame: bytes) -> p.ServerMessage:
        message = decode(frame)
        if isinstance(message, p.SnapshotPage):
            message.keys = [bad if k == b"bad" else k for k in message.keys]
        elif isinstance(message, p.Events):
            message.stored = [bad if k == b"bad" else k for k in message.stored]
            message.evicted = [*message.evicted, bad] if message.stored else message.evicted
        return message

    with _misannounced(misannounce, monkeypatch) as (tier, host):
        assert host.session.lost is None and tier.peers() == [host.slots.peer_id]
        assert tier.lookup([b"good"]) == 1
        tier.arena.tensor[5].zero_()
        assert tier.load([b"good"], [5]).result(timeout=RESULT_TIMEOUT_S).ok
        assert torch.equal(tier.arena.tensor[5], tier.arena.tensor[0])
        refused = [r.getMessage() for r in caplog.records if "no key" in r.getMessage()]
        assert refused and all(type(bad).__name__ in m for m in refused), refused
