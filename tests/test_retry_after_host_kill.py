"""A retry right after a ``torch-kv-tier serve`` host was killed with transfers in flight (in
the failed futures' done-callbacks and right after ``result()``): each store retried goes to
the host left, and each load retried is a miss before ``load`` returns, never a wait for a
timeout (``test_retry_after_loss`` pins the same on an in-process transport, per cause). The
killed host is stopped first (SIGSTOP), so that its transfers are in flight when it dies."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import NamedTuple

import pytest

from torch_kv_tier.benchmarks.reliability_common import ucx_over_tcp
from torch_kv_tier.keys import home_peer
from torch_kv_tier.manager import TierManager
from torch_kv_tier.remote import ServerProcess
from torch_kv_tier.results import TransferResult

BLOCK = 4096
RESULT_TIMEOUT_S = 30.0
N = 6  # stores and loads in flight as the host dies
Callback = Callable[[Future[TransferResult]], None]


class Seen(NamedTuple):
    """What a retry in a failed future's done-callback saw of the tier."""

    kind: str
    lost_listed: bool  # the lost host still in ``peers()``
    lost_used: bool  # a store retried placed on it, or a load retried found its keys stored
    peers_dropped: int
    settled_at_once: bool  # the retry's future was done as its call returned


class Retries:
    """Done-callbacks that retry at once what failed and record what they saw."""

    def __init__(self, tier: TierManager, lost: str) -> None:
        self.tier, self.lost = tier, lost
        self.seen: list[Seen] = []
        self.retried: list[tuple[str, Future[TransferResult]]] = []
        self.ran = threading.Semaphore(0)  # released once per failed future's callback

    def store(self, local: int) -> Callback:
        def retry(future: Future[TransferResult]) -> None:
            keys = list(future.result().failed)
            if not keys:  # done before the host stopped (a signal is delivered later)
                return
            peers, dropped = self.tier.peers(), self.tier.stats().peers_dropped
            placed: list[str] = []
            again = self.tier.store(keys, [local] * len(keys), placed)
            self._record(Seen("store", self.lost in peers, self.lost in placed, dropped, False))
            self._retried("store", again)

        return retry

    def load(self, local: int) -> Callback:
        def retry(future: Future[TransferResult]) -> None:
            keys = list(future.result().failed)
            if not keys:
                return
            peers, dropped = self.tier.peers(), self.tier.stats().peers_dropped
            held = any(self.tier.contains(k) for k in keys)
            again = self.tier.load(keys, [local] * len(keys))
            self._record(Seen("load", self.lost in peers, held, dropped, again.done()))
            self._retried("load", again)

        return retry

    def _record(self, seen: Seen) -> None:
        self.seen.append(seen)  # (list.append is atomic: callbacks run on several threads)

    def _retried(self, kind: str, future: Future[TransferResult]) -> None:
        self.retried.append((kind, future))
        self.ran.release()


@pytest.mark.parametrize("private", [False, True], ids=["shared", "private"])
def test_retries_as_a_killed_host_fails_its_transfers_avoid_it(private: bool) -> None:
    with (
        ucx_over_tcp(),
        ServerProcess.start(64, BLOCK) as kept,
        ServerProcess.start(64, BLOCK) as killed,
        TierManager.create(32, BLOCK, name="retry-kill") as tier,
    ):
        ids = [tier.connect(s.address, private=private) for s in (kept, killed)]
        lost = ids[1]
        homed = [k for k in (f"k{i}" for i in range(10_000)) if home_peer(k, ids) == lost]
        stored = homed[:N]
        assert tier.store(stored, list(range(N))).result(timeout=RESULT_TIMEOUT_S).ok
        retries = Retries(tier, lost)
        os.kill(killed.proc.pid, signal.SIGSTOP)  # nothing it is sent completes now
        futures = []
        for i, key in enumerate(homed[N : 2 * N]):
            futures.append(tier.store([key], [i]))
            futures[-1].add_done_callback(retries.store(i))
            futures.append(tier.load([stored[i]], [N + i]))
            futures[-1].add_done_callback(retries.load(2 * N + i))
        os.kill(killed.proc.pid, signal.SIGKILL)
        failed = sum(not f.result(timeout=RESULT_TIMEOUT_S).ok for f in futures)
        assert failed, "no transfer to the killed host failed"
        for _ in range(failed):  # (``result()`` returns before the callbacks run)
            assert retries.ran.acquire(timeout=RESULT_TIMEOUT_S)
        # in the callbacks: the host out of peers and placement, its keys gone, its loss counted
        assert {(s.lost_listed, s.lost_used, s.peers_dropped) for s in retries.seen} == {
            (False, False, 1)
        }
        assert all(s.settled_at_once for s in retries.seen if s.kind == "load")
        for kind, again in retries.retried:
            result = again.result(timeout=RESULT_TIMEOUT_S)
            assert result.ok if kind == "store" else set(result.failed.values()) == {"missing"}
        # right after ``result()``: the same
        placed: list[str] = []
        more = homed[2 * N : 3 * N]
        assert tier.store(more, list(range(N)), placed).result(timeout=RESULT_TIMEOUT_S).ok
        assert placed == [ids[0]]
        again = tier.load(stored, list(range(N, 2 * N)))
        assert again.done() and set(again.result().failed) == set(stored)
