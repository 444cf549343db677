"""A shared host SIGKILLed and replaced on its address (same port) by a host with a smaller pool,
while two tiers store and load overlapping keys there: the tiers drop the dead host, dial the
new one again and follow its pool, and no load returns bytes other than its key's (first
promise), though the new pool is too small for the keys and evicts while they read. Nothing
hangs: every future settles within a bound. The chaos run restarts its hosts at their own size."""

from __future__ import annotations

import random
import threading
from collections import Counter

import torch
from remote_support import BLOCK_LEN, fake_session, wait_for

from torch_kv_tier.manager import TierManager
from torch_kv_tier.remote import ServerProcess

KEYS = 96  # more than the new pool holds: it evicts while the tiers read
OLD_POOL, NEW_POOL = 512, 32
BATCH = 8
RESULT_TIMEOUT_S = 20.0


def _block(i: int) -> torch.Tensor:
    """The bytes key ``i`` names: they differ for every key."""
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, 256, (BLOCK_LEN,), dtype=torch.uint8, generator=g)


TABLE = torch.stack([_block(i) for i in range(KEYS)])


def _store_and_load(tier: TierManager, mine: range, stop: threading.Event, seen: Counter) -> None:
    """Store random batches of ``mine``, load random batches of every key, count the outcomes
    (``wrong``: a load ok with other bytes; ``hung``: a future unsettled after the bound)."""
    rng = random.Random(mine.start)
    while not stop.is_set():
        idx = rng.sample(mine, BATCH)
        tier.arena.tensor[:BATCH].copy_(TABLE[idx])
        stored = tier.store([f"k{i}" for i in idx], range(BATCH))
        idx = rng.sample(range(KEYS), BATCH)
        tier.arena.tensor[BATCH:].zero_()
        loaded = tier.load([f"k{i}" for i in idx], range(BATCH, 2 * BATCH))
        try:
            stored.result(timeout=RESULT_TIMEOUT_S)
            ok = set(loaded.result(timeout=RESULT_TIMEOUT_S).keys)
        except TimeoutError:
            seen["hung"] += 1
            return
        for row, i in enumerate(idx):
            if f"k{i}" in ok:
                right = torch.equal(tier.arena.tensor[BATCH + row], TABLE[i])
                seen["ok" if right else "wrong"] += 1
        seen["rounds"] += 1


def test_a_host_replaced_by_a_smaller_one_never_makes_a_load_return_wrong_bytes() -> None:
    old = ServerProcess.start(OLD_POOL, BLOCK_LEN)
    port = old.address.rsplit(":", 1)[1]
    tiers = [TierManager.create(2 * BATCH, BLOCK_LEN, name=f"replaced-{i}") for i in range(2)]
    new: ServerProcess | None = None
    stop, seen = threading.Event(), Counter[str]()
    workers = [
        threading.Thread(target=_store_and_load, args=(tier, mine, stop, seen), daemon=True)
        for tier, mine in zip(tiers, [range(0, 64), range(32, KEYS)])
    ]
    try:
        (peer,) = {tier.connect(old.address) for tier in tiers}
        for worker in workers:
            worker.start()
        assert wait_for(lambda: seen["ok"] > 0, RESULT_TIMEOUT_S), seen
        old.kill()  # mid-store and mid-load
        new = ServerProcess.start(NEW_POOL, BLOCK_LEN, extra_args=["--port", port])

        def rejoined() -> bool:  # each tier dropped the dead host and dialled the new one
            return all(t.peers() == [peer] and t.stats().peers_dropped > 0 for t in tiers)

        assert wait_for(rejoined, RESULT_TIMEOUT_S), [t.stats() for t in tiers]
        rounds = seen["rounds"]
        assert wait_for(lambda: seen["rounds"] > rounds + 100 or seen["hung"], 30.0), seen
        stop.set()
        for worker in workers:
            worker.join(timeout=2 * RESULT_TIMEOUT_S)
        assert not any(w.is_alive() for w in workers)
        assert (seen["wrong"], seen["hung"]) == (0, 0), seen
        for tier in tiers:  # each follows the new pool: its size, no keys beyond it
            stats = tier.stats()
            assert stats.peers[peer].capacity == NEW_POOL, stats.peers
            assert stats.inflight == 0, stats
            # its copy of the host's index holds no more keys than the pool, once the host's
            # evictions (pushed at most every 10 ms) reached it
            assert wait_for(lambda t=tier: t.stats().keys <= NEW_POOL, 5.0), tier.stats().peers
        with fake_session(new.address, private=False) as observer:
            host = observer.stats()
        assert host["shared_evictions"] > 0  # the new pool evicted under the tiers' reads
        assert host["commit_slots_refused"] == 0  # no slot of the old pool was committed here
    finally:
        stop.set()
        for tier in tiers:
            tier.close()
        old.kill()
        if new is not None:
            new.stop()
