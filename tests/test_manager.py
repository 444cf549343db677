"""TierManager over real NIXL, with peers in other processes."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import wait

import pytest
import torch
from late_write_support import LateWriteTransport
from remote_peer import RemotePeer
from remote_support import wait_until

from torch_kv_tier.arena import BlockArena
from torch_kv_tier.integrations.torch_loop.arena_batches import ArenaBatches
from torch_kv_tier.integrations.torch_loop.page_copy import PageCopier
from torch_kv_tier.keys import home_peer
from torch_kv_tier.manager import TierManager
from torch_kv_tier.shared_host import default_grant_batch
from torch_kv_tier.transport.base import PollResult

BLOCK = 4096


@pytest.fixture(scope="module")
def peers() -> Iterator[tuple[RemotePeer, RemotePeer]]:
    with RemotePeer(1024, BLOCK) as a, RemotePeer(1024, BLOCK) as b:
        yield a, b


def make_tier(num_blocks: int = 512, **kwargs: int) -> TierManager:
    tier = TierManager.create(num_blocks, BLOCK, events=True, **kwargs)
    g = torch.Generator().manual_seed(num_blocks)
    tier.arena.tensor.copy_(
        torch.randint(0, 256, (num_blocks, BLOCK), dtype=torch.uint8, generator=g)
    )
    return tier


class Gate:
    """Holds back the transport's poll results while closed: transfers stay in flight."""

    def __init__(self, tier: TierManager) -> None:
        self._poll = tier.transport.poll
        self.open = threading.Event()
        tier.transport.poll = self.poll  # type: ignore[method-assign]

    def poll(self, peer_id: str | None = None) -> PollResult:
        if not self.open.is_set():
            return PollResult([], [])
        return self._poll(peer_id)


def test_thousand_random_blocks_over_two_peers_round_trip(
    peers: tuple[RemotePeer, RemotePeer],
) -> None:
    with make_tier(2000) as tier:
        for name, p in zip("ab", peers):
            tier.add_peer(name, *p.peer_args())
        rng = random.Random(5)
        keys = [rng.randbytes(16) for _ in range(1000)]
        src = rng.sample(range(2000), 1000)
        stored = tier.store(keys, src).result(timeout=30)
        assert stored.ok and stored.nbytes == 1000 * BLOCK
        occupancy = tier.stats().peers
        assert occupancy["a"].keys + occupancy["b"].keys == 1000
        assert min(occupancy["a"].keys, occupancy["b"].keys) > 400  # both peers hold a share
        dst = rng.sample(sorted(set(range(2000)) - set(src)), 1000)
        loaded = tier.load(keys, dst).result(timeout=30)
        assert loaded.ok and loaded.keys == keys
        assert torch.equal(tier.arena.tensor[dst], tier.arena.tensor[src])
        assert tier.stats().transfers_done == 4  # one transfer per peer per call


def test_eviction_keeps_the_most_recently_used_keys(peers: tuple[RemotePeer, RemotePeer]) -> None:
    with make_tier(256) as tier:
        tier.add_peer("a", *peers[0].peer_args(), slots=range(100, 164))
        keys = [f"k{i}" for i in range(200)]
        for i in range(0, 200, 10):
            assert tier.store(keys[i : i + 10], list(range(i, i + 10))).result(10).ok
        survivors = keys[-64:]
        assert tier.lookup(survivors) == 64
        assert not any(tier.contains(k) for k in keys[:-64])
        events = tier.take_events()
        assert [e.key for e in events if e.kind == "stored"] == keys
        assert sorted(e.key for e in events if e.kind == "evicted") == sorted(keys[:-64])
        assert tier.stats().evictions == 136 and tier.take_events() == []
        result = tier.load([keys[0], *survivors[:3]], [200, 201, 202, 203]).result(10)
        assert result.failed == {keys[0]: "missing"}
        assert torch.equal(tier.arena.tensor[201:204], tier.arena.tensor[136:139])


def test_load_refreshes_recency(peers: tuple[RemotePeer, RemotePeer]) -> None:
    with make_tier(64) as tier:
        tier.add_peer("a", *peers[0].peer_args(), slots=range(4))
        assert tier.store(["a", "b", "c", "d"], [0, 1, 2, 3]).result(10).ok
        assert tier.load(["a"], [10]).result(10).ok
        assert tier.store(["e"], [4]).result(10).ok
        assert tier.contains("a") and not tier.contains("b")


def test_capacity_failure_when_everything_is_being_loaded(
    peers: tuple[RemotePeer, RemotePeer],
) -> None:
    with make_tier(64) as tier:
        tier.add_peer("a", *peers[0].peer_args(), slots=range(8))
        over = tier.store([f"k{i}" for i in range(10)], list(range(10))).result(10)
        assert over.failed == {"k8": "capacity", "k9": "capacity"}
        gate = Gate(tier)
        loading = tier.load([f"k{i}" for i in range(8)], list(range(20, 28)))
        blocked = tier.store(["new"], [30]).result(10)  # nothing evictable: fails, no hang
        assert blocked.failed == {"new": "capacity"}
        gate.open.set()
        assert loading.result(10).ok
        assert torch.equal(tier.arena.tensor[20:28], tier.arena.tensor[0:8])
        assert tier.store(["new"], [30]).result(10).ok  # unpinned now: LRU evicted


def test_dedupe_and_joining_a_store_in_flight(peers: tuple[RemotePeer, RemotePeer]) -> None:
    with make_tier(64) as tier:
        tier.add_peer("a", *peers[0].peer_args())
        gate = Gate(tier)
        first = tier.store(["x", "y"], [0, 1])
        second = tier.store(["y", "z"], [1, 2])
        assert not tier.contains("x")  # visible only after the write completed
        time.sleep(0.05)
        assert not first.done() and not second.done()
        gate.open.set()
        assert first.result(10).ok and second.result(10).ok
        assert second.result().nbytes == BLOCK  # only z was sent by the second call
        again = tier.store(["x", "y", "z"], [5, 6, 7]).result(10)
        assert again.ok and again.nbytes == 0
        assert tier.stats().transfers_done == 2


def test_a_store_says_which_peers_it_sent_to(peers: tuple[RemotePeer, RemotePeer]) -> None:
    # The torch loop counts a store's arena slots against the host it went to: a host that
    # joined as the store ran gets its keys, so the caller's own guess can be wrong.
    with make_tier(64) as tier:
        for name, p in zip("ab", peers):
            tier.add_peer(name, *p.peer_args())
        on_b = [k for k in (f"placed-{i}" for i in range(64)) if home_peer(k, ["a", "b"]) == "b"]
        placed: list[str] = []
        assert tier.store(on_b[:2], [0, 1], placed).result(10).ok
        assert placed == ["b"]
        again: list[str] = []
        assert tier.store(on_b[:2], [0, 1], again).result(10).ok
        assert again == []  # stored already: sent nowhere


def test_a_store_joining_one_in_flight_says_which_peer_it_waits_for(
    peers: tuple[RemotePeer, RemotePeer],
) -> None:
    # Found by review: a key whose store was in flight to a host joins that store; a host that
    # joined meanwhile may be the key's home now, but the call's future waits for the other
    # host. ``placed`` said nothing of it ([]), so the torch loop counted the slots against
    # the key's home: with the other host frozen, the healthy home was "overdue" until the
    # frozen host's session was lost, its pages failing at once ("host overdue").
    with make_tier(64) as tier:
        tier.add_peer("b", *peers[1].peer_args())
        on_a = [k for k in (f"joined-{i}" for i in range(64)) if home_peer(k, "ab") == "a"]
        joining, new = on_a[:2]
        gate = Gate(tier)
        first = tier.store([joining], [0])  # in flight to b, the only host then
        tier.add_peer("a", *peers[0].peer_args())  # joining's home from now on
        alone: list[str] = []
        second = tier.store([joining], [1], alone)
        both: list[str] = []
        third = tier.store([joining, new], [1, 2], both)
        gate.open.set()
        assert all(f.result(10).ok for f in (first, second, third))
        assert alone == ["b"]  # before: [], the store sent nothing
        assert sorted(both) == ["a", "b"]  # before: ["a"]
        assert tier.stats().transfers_done == 2  # joining was sent once, to b


def test_a_key_joining_a_store_in_flight_leaves_its_torch_loop_home_usable(
    peers: tuple[RemotePeer, RemotePeer],
) -> None:
    # What the above cost a user of the torch loop: the batch of a key that joined a store in
    # flight to b (frozen) was counted against a, the key's home once it joined; a, healthy,
    # was "overdue" and its next pages failed at once ("host overdue") until b's session was
    # lost. ``placed`` names b now, and the batch counts as b's.
    with make_tier(8) as tier:
        tier.add_peer("b", *peers[1].peer_args())
        gate = Gate(tier)  # b froze
        caches = [torch.zeros(4, 1, 1, BLOCK // 8)]  # one layer: keys and values, one block
        pages = PageCopier(caches, caches, tier.arena.view(torch.float32, 1, 2, 1, 1, BLOCK // 8))
        arena = ArenaBatches(tier, pages, 0.0)  # a store is overdue as soon as it began
        on_a = [k for k in (f"home-{i}" for i in range(64)) if home_peer(k, "ab") == "a"]
        joining, on_a = on_a[:2]
        assert arena.store_all({joining: 0}, time.monotonic() + 60).pop()[1].running()
        tier.add_peer("a", *peers[0].peer_args())  # joining's home from now on
        assert arena.store_all({joining: 1}, time.monotonic() + 60).pop()[1].running()
        ((_, next_on_a),) = arena.store_all({on_a: 2}, time.monotonic() + 60)
        assert not next_on_a.done()  # before: failed at once, "host overdue"
        gate.open.set()
        assert arena.wait_idle(time.monotonic() + 10) and next_on_a.result().ok


def test_missing_keys_fail_and_the_rest_still_load(peers: tuple[RemotePeer, RemotePeer]) -> None:
    with make_tier(64) as tier:
        tier.add_peer("a", *peers[0].peer_args())
        assert tier.store(["a", "b", "c"], [0, 1, 2]).result(10).ok
        assert tier.lookup(["a", "b", "nope", "c"]) == 2
        result = tier.load(["a", "nope", "c"], [10, 11, 12]).result(10)
        assert not result.ok and result.keys == ["a", "c"] and result.failed == {"nope": "missing"}
        assert torch.equal(tier.arena.tensor[[10, 12]], tier.arena.tensor[[0, 2]])


def test_discard(peers: tuple[RemotePeer, RemotePeer]) -> None:
    with make_tier(64) as tier:
        tier.add_peer("a", *peers[0].peer_args(), slots=range(2))
        assert tier.store(["a", "b"], [0, 1]).result(10).ok
        tier.discard(["a", "unknown"])
        assert not tier.contains("a") and tier.contains("b")
        assert tier.load(["a"], [5]).result(10).failed == {"a": "missing"}
        assert [e.kind for e in tier.take_events()] == ["stored", "stored", "discarded"]
        gate = Gate(tier)
        pending = tier.store(["c"], [2])
        tier.discard(["c"])
        gate.open.set()
        assert pending.result(10).ok
        assert not tier.contains("c")
        assert tier.stats().peers["a"].used == 1  # the slot of "c" went back to the pool


def test_store_after_discard_of_a_store_in_flight_publishes_the_key(
    peers: tuple[RemotePeer, RemotePeer],
) -> None:
    with make_tier(64) as tier:
        tier.add_peer("a", *peers[0].peer_args())
        gate = Gate(tier)
        first = tier.store(["k"], [0])
        tier.discard(["k"])
        second = tier.store(["k"], [1])  # a new store, not a join of the discarded one
        gate.open.set()
        assert first.result(10).ok and second.result(10).ok
        assert tier.contains("k")
        assert tier.load(["k"], [2]).result(10).ok
        assert torch.equal(tier.arena.tensor[2], tier.arena.tensor[1])
        assert tier.stats().peers["a"].used == 1


def test_readding_a_peer_id_fails_the_old_transfers_only(
    peers: tuple[RemotePeer, RemotePeer],
) -> None:
    with make_tier(64) as tier:
        tier.add_peer("p", *peers[0].peer_args(), slots=range(4))
        gate = Gate(tier)
        old = tier.store(["a", "b"], [0, 1])
        tier.add_peer("p", *peers[1].peer_args(), slots=range(4))
        gate.open.set()
        assert old.result(10).failed == {"a": "peer lost", "b": "peer lost"}
        assert tier.peers() == ["p"]  # the new registration survives the old failures
        # the old writes' slots are fenced till then
        wait_until(lambda: tier.stats().inflight == 0, "the old writes are reported")
        assert tier.store(["c", "d", "e", "f"], [2, 3, 4, 5]).result(10).ok  # all 4 slots free
        assert tier.load(["c"], [9]).result(10).ok


def test_bad_input_raises_before_anything_is_sent(peers: tuple[RemotePeer, RemotePeer]) -> None:
    with make_tier(64) as tier:
        tier.add_peer("a", *peers[0].peer_args())
        for call, args, error in [
            (tier.store, ([1.5], [0]), TypeError),
            (tier.store, (["a", "a"], [0, 1]), ValueError),
            (tier.store, (["a"], [64]), IndexError),
            (tier.store, (["a", "b"], [0]), ValueError),
            (tier.load, (["a", "b"], [3, 3]), ValueError),
            (tier.load, ([None], [0]), TypeError),
        ]:
            with pytest.raises(error):
                call(*args)
        stats = tier.stats()
        assert stats.transfers_done == stats.inflight == stats.queued == stats.keys == 0
        with pytest.raises(ValueError, match="block_len"):
            tier.add_peer("b", *peers[1].peer_args()[:3], BLOCK * 2)
        with pytest.raises(KeyError):
            tier.remove_peer("nobody")


@pytest.mark.parametrize(
    "bad",
    [{"base_addr": -1}, {"base_addr": 1.5}, {"num_blocks": 0}, {"block_len": BLOCK * 2}],
    ids=["negative address", "float address", "no blocks", "other block size"],
)
def test_readding_a_peer_with_a_bad_region_raises_and_keeps_its_keys(
    peers: tuple[RemotePeer, RemotePeer], bad: dict[str, object]
) -> None:
    """Re-adding a known peer id replaces its registration, but a region that cannot be one
    raises before the old registration and its keys are dropped (found by review: only the
    block size was checked first; any other bad argument lost every key stored there)."""
    with make_tier(64) as tier:
        metadata, base_addr, num_blocks, block_len = peers[0].peer_args()
        tier.add_peer("a", metadata, base_addr, num_blocks, block_len)
        tier.arena.tensor[:2].random_(0, 256)
        assert tier.store(["k0", "k1"], [0, 1]).result(10).ok
        region = {"base_addr": base_addr, "num_blocks": num_blocks, "block_len": block_len}
        with pytest.raises((TypeError, ValueError)):
            tier.add_peer("a", metadata, **{**region, **bad})  # type: ignore[arg-type]
        assert tier.peers() == ["a"] and tier.lookup(["k0", "k1"]) == 2
        assert tier.load(["k0", "k1"], [2, 3]).result(10).ok
        assert torch.equal(tier.arena.tensor[2:4], tier.arena.tensor[0:2])


def test_the_grant_batch_defaults_to_a_reserve_sized_for_the_block() -> None:
    with TierManager.create(4, 64 << 10, name="reserve") as tier:
        assert tier.grant_batch == default_grant_batch(64 << 10) == 1024
    with TierManager.create(4, 64 << 10, name="reserve", grant_batch=8) as tier:
        assert tier.grant_batch == 8


@pytest.mark.parametrize(
    "bad", [{"max_inflight": 0}, {"grant_batch": 0}, {"grant_batch": 1 << 20}], ids=str
)
def test_create_refuses_bad_settings_before_it_builds_an_arena_or_an_agent(
    bad: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``create`` checked its settings only once it had allocated the arena and started a NIXL
    agent over it, which the ``ValueError`` then left behind (its threads, its registration)."""

    def built(*args: object, **kwargs: object) -> None:
        raise AssertionError("built before the settings were checked")

    monkeypatch.setattr("torch_kv_tier.manager_create.BlockArena", built)
    monkeypatch.setattr("torch_kv_tier.transport.nixl.NixlTransport", built)
    with pytest.raises(ValueError, match=next(iter(bad))):
        TierManager.create(4, BLOCK, name="bad", **bad)


@pytest.mark.parametrize("shape", [(8, BLOCK), (4, 2 * BLOCK)], ids=str)
def test_a_transport_over_another_region_is_refused(shape: tuple[int, int]) -> None:
    """A transport registered over a region other than the arena's (more blocks, longer
    blocks) would move bytes to and from the wrong places: the tier refuses it, saying how to
    build it."""
    with pytest.raises(ValueError, match="build the transport over arena.tensor"):
        TierManager(BlockArena(4, BLOCK), LateWriteTransport(BlockArena(*shape).tensor))


def test_store_without_peers_fails_every_key() -> None:
    with make_tier(8) as tier:
        assert tier.store(["a"], [0]).result(10).failed == {"a": "no peers"}


def test_submissions_beyond_max_inflight_queue_in_order(
    peers: tuple[RemotePeer, RemotePeer],
) -> None:
    with make_tier(64, max_inflight=2) as tier:
        tier.add_peer("a", *peers[0].peer_args())
        gate = Gate(tier)
        submitted: list[int] = []  # local block of each transfer, in submission order
        write_blocks = tier.transport.write_blocks

        def recording_write(peer_id: str, local: list[int], remote: list[int]) -> int | None:
            submitted.extend(local)
            return write_blocks(peer_id, local, remote)

        tier.transport.write_blocks = recording_write  # type: ignore[method-assign]
        futures = [tier.store([f"k{i}"], [i]) for i in range(5)]
        stats = tier.stats()
        assert (stats.inflight, stats.queued) == (2, 3)
        assert submitted == [0, 1]
        gate.open.set()
        assert all(f.result(10).ok for f in futures)
        # Queued stores are submitted in call order; two in flight at once may complete in
        # either order, so the events (completion order) only have to name every key once.
        assert submitted == [0, 1, 2, 3, 4]
        assert sorted(e.key for e in tier.take_events()) == [f"k{i}" for i in range(5)]


def test_a_stalled_peer_does_not_hold_back_the_others(peers: tuple[RemotePeer, RemotePeer]) -> None:
    with make_tier(256, max_inflight=2) as tier:
        tier.add_peer("slow", *peers[0].peer_args())
        tier.add_peer("fast", *peers[1].peer_args())
        real_poll = tier.transport.poll
        release = threading.Event()
        held: list[int] = []

        def poll(peer_id: str | None = None) -> PollResult:  # "slow" never completes until released
            result = real_poll(peer_id)
            ops = dict(tier._ops)
            held.extend(t for t in result.done if ops[t].peer_id == "slow")
            done = [t for t in result.done if ops[t].peer_id != "slow"]
            if release.is_set():
                done, held[:] = done + held, []
            return PollResult(done, result.failed)

        tier.transport.poll = poll  # type: ignore[method-assign]
        keys = [f"k{i}" for i in range(64)]
        slow = [k for k in keys if home_peer(k, tier.peers()) == "slow"]
        fast = [k for k in keys if k not in slow]
        stuck = [tier.store([k], [i]) for i, k in enumerate(slow[:5])]  # 2 in flight, 3 queued
        assert tier.stats().queued == 3
        quick = [tier.store([k], [100 + i]) for i, k in enumerate(fast[:5])]
        assert all(f.result(10).ok for f in quick)
        assert not any(f.done() for f in stuck)
        release.set()
        assert all(f.result(10).ok for f in stuck)


def test_a_raising_callback_does_not_stop_the_tier(peers: tuple[RemotePeer, RemotePeer]) -> None:
    with make_tier(64) as tier:
        tier.add_peer("a", *peers[0].peer_args())
        future = tier.store(["a"], [0])
        future.add_done_callback(lambda f: 1 / 0)
        assert future.result(10).ok
        seen = threading.Event()
        later = tier.store(["b"], [1])
        later.add_done_callback(lambda f: seen.set())
        assert later.result(10).ok and seen.wait(5)


def test_remove_peer_fails_its_futures_and_drops_its_keys(
    peers: tuple[RemotePeer, RemotePeer],
) -> None:
    with make_tier(64) as tier:
        tier.add_peer("a", *peers[0].peer_args())
        assert tier.store(["old"], [0]).result(10).ok
        gate = Gate(tier)
        pending = tier.store(["new"], [1])
        tier.remove_peer("a")
        gate.open.set()
        assert pending.result(10).failed == {"new": "peer lost"}
        assert not tier.contains("old")
        assert ("lost", "old") in [(e.kind, e.key) for e in tier.take_events()]
        # The future resolved at once; the cancelled write is reported (and forgotten) after:
        # by the transport's poll, then by the tier under its lock (not at the same instant).
        wait_until(
            lambda: (
                tier.transport.inflight_count() == 0  # type: ignore[attr-defined]
                and tier.stats().inflight == 0
            ),
            "the cancelled write is reported and forgotten",
        )


def test_close_under_load_resolves_every_future_within_its_timeout(
    peers: tuple[RemotePeer, RemotePeer],
) -> None:
    tier = make_tier(512, max_inflight=8)
    tier.add_peer("a", *peers[0].peer_args())
    Gate(tier)  # never opens: everything stays in flight or queued
    futures = [tier.store([f"k{i}"], [i]) for i in range(300)]
    start = time.monotonic()
    tier.close(timeout=0.5)
    assert time.monotonic() - start < 3
    assert all(f.done() for f in futures)
    assert {r for f in futures for r in f.result().failed.values()} == {"closed"}
    tier.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        tier.store(["x"], [0])


@pytest.mark.parametrize("timeout", [None, float("nan"), float("inf"), -1.0, "1"])
def test_a_refused_close_timeout_leaves_the_tier_to_close_again(timeout: object) -> None:
    """``close`` marked the tier closed before it used its timeout: one it could not use
    (``None``, nan, inf, a string) raised halfway, with an error that did not name it, and
    every later ``close()`` returned at once: the poller thread, the transport and the
    sessions stayed open for good. It is refused now before anything changes."""
    tier = make_tier(8)
    with pytest.raises((TypeError, ValueError), match="timeout must be"):
        tier.close(timeout=timeout)  # type: ignore[arg-type]
    assert not tier.closed
    tier.close()
    tier._thread.join(timeout=10)
    assert not tier._thread.is_alive()


def test_eight_threads_store_and_load_without_loss_or_corruption(
    peers: tuple[RemotePeer, RemotePeer],
) -> None:
    with make_tier(8 * 64) as tier:
        tier.add_peer("a", *peers[0].peer_args())
        tier.add_peer("b", *peers[1].peer_args())
        errors: list[str] = []

        def worker(w: int) -> None:
            base = w * 64
            rng = random.Random(w)
            for round_ in range(10):
                keys = [f"w{w}-r{round_}-{i}" for i in range(16)]
                src = list(range(base, base + 16))
                for i, key in enumerate(keys):
                    tier.arena.tensor[src[i]].fill_(hash((key,)) % 251)
                    tier.arena.tensor[src[i], :8] = torch.tensor(list(key.encode()[:8].ljust(8)))
                if not tier.store(keys, src).result(30).ok:
                    errors.append(f"store {w}/{round_}")
                dst = list(range(base + 32, base + 48))
                rng.shuffle(dst)
                res = tier.load(keys, dst).result(30)
                if not res.ok:
                    errors.append(f"load {w}/{round_}: {res.failed}")
                for i in range(16):
                    if not torch.equal(tier.arena.tensor[dst[i]], tier.arena.tensor[src[i]]):
                        errors.append(f"corrupt {keys[i]}")

        threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads)
        assert errors == []
        assert tier.stats().keys == 8 * 10 * 16


def test_sigkill_of_one_peer_fails_its_futures_and_the_other_keeps_serving(
    monkeypatch: pytest.MonkeyPatch, peers: tuple[RemotePeer, RemotePeer]
) -> None:
    monkeypatch.setenv("UCX_TLS", "tcp")
    with RemotePeer(512, BLOCK, env={"UCX_TLS": "tcp"}) as victim, make_tier(512) as tier:
        tier.add_peer("victim", *victim.peer_args())
        tier.add_peer("good", *peers[1].peer_args())
        keys = [f"key{i}" for i in range(256)]
        assert tier.store(keys[:128], list(range(128))).result(30).ok
        victim.stop()
        futures = [
            tier.store(keys[i : i + 16], list(range(i, i + 16))) for i in range(128, 256, 16)
        ]
        victim.kill()
        done, _ = wait(futures, timeout=10)  # the bound: every one done within it
        assert len(done) == len(futures), "a future hung after its peer died"
        reasons = {r for f in futures for r in f.result().failed.values()}
        assert reasons <= {"transfer failed", "peer lost"} and reasons
        assert tier.peers() == ["good"]
        on_good = [k for k in keys[:128] if tier.contains(k)]
        assert on_good and len(on_good) < 128
        idx = [keys.index(k) for k in on_good]
        result = tier.load(on_good, [256 + i for i in range(len(on_good))]).result(10)
        assert result.ok
        assert torch.equal(tier.arena.tensor[256 : 256 + len(on_good)], tier.arena.tensor[idx])


def test_one_key_in_place_of_a_list_is_refused_by_every_call_taking_keys(
    peers: tuple[RemotePeer, RemotePeer],
) -> None:
    # store and load refused a bare key, but discard("ab") forgot the stored keys "a" and "b"
    # and kept "ab"; lookup, holders, touch and prefetch answered for "a" and "b" likewise.
    with make_tier(64) as tier:
        tier.add_peer("a", *peers[0].peer_args())
        assert tier.store(["a", "b", "ab"], [0, 1, 2]).result(10).ok
        for call in (tier.discard, tier.lookup, tier.holders, tier.touch, tier.prefetch):
            for bare in ("ab", b"ab"):
                with pytest.raises(TypeError, match=r"a sequence of keys.*\[key\]"):
                    call(bare)  # type: ignore[arg-type]
        assert all(map(tier.contains, ["a", "b", "ab"]))
        assert tier.lookup(["ab"]) == 1 and tier.holders(["ab", "a"]) == ["a", "a"]
