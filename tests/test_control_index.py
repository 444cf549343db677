"""A tier's copy of a host's index over the control plane: lookups are not held up by a slow or
abandoned registration of the host's region, index snapshots (superseded, carrying exactly the
commits sent after their request, paged) stay in step, and a host announcing a key the tier
cannot hold, or no key at all, is refused once while the tier serves on."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import pytest
import torch
from late_write_support import LateWriteTransport
from remote_support import BLOCK_LEN, RESULT_TIMEOUT_S, fill_random, wait_for

from torch_kv_tier import connected_hosts
from torch_kv_tier.arena import BlockArena
from torch_kv_tier.manager import TierManager
from torch_kv_tier.remote import ServerProcess
from torch_kv_tier.remote import protocol as p
from torch_kv_tier.remote.replica import IndexFollower
from torch_kv_tier.transport import nixl as nixl_module


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
