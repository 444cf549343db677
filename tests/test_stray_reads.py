"""A read that failed on a transport whose failures are not final (``failures_are_final``
False: vLLM's contract, ``NixlTransport(fence_failures=False)``, any ``DataTransport`` that
does not say otherwise) may still land part-way in the blocks it read into. Its load must not
resolve while it may: a caller that reused those blocks for another load would find that load's
verified bytes overwritten by the stray read's (the first promise: a load returns the bytes
its key names, or a miss)."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import pytest
import torch
from late_write_support import LateWriteTransport
from remote_support import BLOCK_LEN, wait_for

from torch_kv_tier.arena import BlockArena
from torch_kv_tier.manager import TierManager

RESULT_TIMEOUT_S = 10.0


class StrayReadTransport(LateWriteTransport):
    """``LateWriteTransport`` whose reads, while ``hold_reads`` is set, stay in flight until
    ``land_read`` copies their bytes; ``fail_read`` reports one failed while it may still
    land, and ``refuse_reads`` makes a submission refused with ``None`` after it was sent."""

    def __init__(self, region: torch.Tensor) -> None:
        super().__init__(region)
        self.hold_reads = False
        self.refuse_reads = False
        self.reads: dict[int, tuple[str, list[int], torch.Tensor]] = {}  # held: not landed
        self.read_posted = threading.Event()

    def read_blocks(
        self, peer_id: str, local_idxs: Sequence[int], remote_idxs: Sequence[int]
    ) -> int | None:
        if not self.hold_reads:
            return super().read_blocks(peer_id, local_idxs, remote_idxs)
        with self._lock:  # the bytes it read on the wire, to land later
            tid = next(self._ids)
            sent = self._peers[peer_id][list(remote_idxs)].clone()
            self.reads[tid] = (peer_id, list(local_idxs), sent)
        self.read_posted.set()
        return None if self.refuse_reads else tid

    def fail_read(self, tid: int) -> None:
        with self._lock:
            self._failed[tid] = self.reads[tid][0]

    def land_read(self, tid: int, *, report_done: bool = False) -> None:
        """The bytes read ``tid`` had on the wire arrive (``report_done``: and it is reported
        done)."""
        with self._lock:
            peer_id, local, sent = self.reads.pop(tid)
            self.region.owner[local] = sent
            if report_done:
                self._done[tid] = peer_id


@contextmanager
def _tier() -> Iterator[tuple[TierManager, StrayReadTransport, BlockArena]]:
    """A tier over 4 blocks and a private peer ``p`` of 4 slots (closed on exit)."""
    arena = BlockArena(4, BLOCK_LEN)
    transport = StrayReadTransport(arena.tensor)
    transport.remotes[b"p"] = torch.zeros(4, BLOCK_LEN, dtype=torch.uint8)
    tier = TierManager(arena, transport)
    try:
        tier.add_peer("p", b"p", 0, 4, BLOCK_LEN)
        yield tier, transport, arena
    finally:
        tier.close()


@pytest.mark.parametrize("how", ["reported failed", "refused after it was sent", "orphaned"])
def test_a_read_that_may_still_land_keeps_its_load_unresolved_until_the_tier_closes(
    how: str,
) -> None:
    """The load of a read that failed but may still land resolved at once ("transfer
    failed"); its caller reused the block for another key, whose load verified, and then the
    stray bytes landed over it: the second load's block held the first key's bytes. Now the
    first load resolves only once the transport can no longer write (its tier closed), as its
    docstring says, and the block is never handed back meanwhile."""
    with _tier() as (tier, transport, arena):
        arena.tensor[0].fill_(0xAA)
        arena.tensor[1].fill_(0xBB)
        assert tier.store(["a", "b"], [0, 1]).result(timeout=RESULT_TIMEOUT_S).ok
        transport.hold_reads, transport.refuse_reads = True, how == "refused after it was sent"
        stray = tier.load(["a"], [2])
        assert transport.read_posted.wait(RESULT_TIMEOUT_S)
        (tid,) = transport.reads
        if how == "orphaned":  # the peer is dropped first; then its read is reported failed
            tier.remove_peer("p")
        if how != "refused after it was sent":
            transport.fail_read(tid)
        assert wait_for(lambda: tier.stats().inflight == 0 and not tier.peers(), 5.0)
        transport.hold_reads = transport.refuse_reads = False
        tier.add_peer("p", b"p", 0, 4, BLOCK_LEN)  # the tier works on with the same peer
        assert tier.store(["b"], [1]).result(timeout=RESULT_TIMEOUT_S).ok
        reused = stray.done()  # the caller sees the load over: block 2 is free for another key
        if reused:
            assert tier.load(["b"], [2]).result(timeout=RESULT_TIMEOUT_S).ok
        transport.land_read(tid)
        if reused:
            assert torch.equal(arena.tensor[2], arena.tensor[1]), "b loaded with a's bytes"
        assert not reused, "a load resolved while its read could still land"
        tier.close()
        assert stray.result(timeout=RESULT_TIMEOUT_S).failed == {
            "a": "peer lost" if how == "orphaned" else "transfer failed"
        }


def test_a_stranded_read_is_counted_and_its_split_load_settles_each_key_once_at_close() -> None:
    """Found by review: a stranded read showed nowhere (``stats().inflight`` 0, its load's
    future pending until close, nothing saying why); ``stats().stranded_reads`` counts it.
    A load split over two peers, one of its keys missing, whose read from one peer is
    stranded: the other peer's key loads, and at close every key is settled once (the
    stranded one "transfer failed", the missing one "missing")."""
    arena = BlockArena(8, BLOCK_LEN)
    transport = StrayReadTransport(arena.tensor)
    for peer in (b"p", b"q"):
        transport.remotes[peer] = torch.zeros(4, BLOCK_LEN, dtype=torch.uint8)
    tier = TierManager(arena, transport)
    try:
        tier.add_peer("p", b"p", 0, 4, BLOCK_LEN)
        arena.tensor[0].fill_(0xAA)
        assert tier.store(["a"], [0]).result(timeout=RESULT_TIMEOUT_S).ok  # p's only
        tier.add_peer("q", b"q", 0, 4, BLOCK_LEN)
        others = ["c", "d", "e"]
        arena.tensor[1:4].fill_(0xCC)
        assert tier.store(others, [1, 2, 3]).result(timeout=RESULT_TIMEOUT_S).ok
        on_q = [k for k, holder in zip(others, tier.holders(others)) if holder == "q"]
        assert on_q, "no key homed on q"
        transport.hold_reads = True
        load = tier.load(["a", on_q[0], "z"], [4, 5, 6])
        assert wait_for(lambda: len(transport.reads) == 2, RESULT_TIMEOUT_S)
        tid_of = {local[0]: tid for tid, (_, local, _) in transport.reads.items()}
        transport.fail_read(tid_of[4])
        transport.land_read(tid_of[5], report_done=True)
        assert wait_for(lambda: tier.stats().inflight == 0, RESULT_TIMEOUT_S)
        assert tier.stats().stranded_reads == 1 and not load.done()
        assert torch.equal(arena.tensor[5], arena.tensor[1])
    finally:
        tier.close()
    result = load.result(timeout=RESULT_TIMEOUT_S)
    assert result.keys == [on_q[0]]
    assert result.failed == {"a": "transfer failed", "z": "missing"}
    assert tier.stats().stranded_reads == 0


def test_a_load_into_a_block_a_stranded_read_may_still_write_is_refused() -> None:
    """Found by review: each stranded read stayed in ``stats().stranded_reads`` until close,
    and nothing stopped a caller from loading again into its blocks, so a peer that stranded
    read after read into the same blocks grew that list without bound, and the stray bytes
    could land over a later load's verified ones. A load into a withheld block now raises
    ``ValueError`` before anything is read: every stranded read withholds blocks of its own, so
    there are never more of them than arena blocks. Other blocks load as before."""
    with _tier() as (tier, transport, arena):
        arena.tensor[0].fill_(0xAA)
        arena.tensor[1].fill_(0xBB)
        assert tier.store(["a", "b"], [0, 1]).result(timeout=RESULT_TIMEOUT_S).ok
        transport.hold_reads = True
        stray = tier.load(["a"], [2])
        assert transport.read_posted.wait(RESULT_TIMEOUT_S)
        (tid,) = transport.reads
        transport.fail_read(tid)
        assert wait_for(lambda: tier.stats().stranded_reads == 1 and not tier.peers(), 5.0)
        transport.hold_reads = False
        tier.add_peer("p", b"p", 0, 4, BLOCK_LEN)  # the peer comes back (a flapping peer)
        assert tier.store(["a", "b"], [0, 1]).result(timeout=RESULT_TIMEOUT_S).ok
        for keys, blocks in ((["a"], [2]), (["b", "a"], [3, 2])):
            with pytest.raises(ValueError, match=r"local blocks \[2\] .*stranded_reads"):
                tier.load(keys, blocks)
        assert tier.load(["b"], [3]).result(timeout=RESULT_TIMEOUT_S).ok
        assert torch.equal(arena.tensor[3], arena.tensor[1])
        assert tier.stats().stranded_reads == 1 and not stray.done()
