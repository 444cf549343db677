"""Random schedules of vLLM's scheduler against RemoteHostTier: requests that arrive, are
scheduled, preempted or aborted, GPU stores (some still in flight for a while), cache resets
(whose drain times out while reads are in flight) and promotions whose reads land late, or fail
after writing torn bytes. Whatever the order, no promotion's read lands in a CPU-tier chunk
vLLM gave to anything else (the read of a failed or ended promotion included), every chunk a
scheduled request loads holds its key's bytes, and once every request ended nothing is left
pending, promised, pinned or failed. Built and driven as vLLM does (``vllm_tier_support``).
"""

from __future__ import annotations

import concurrent.futures
import random
from typing import Any

import numpy as np
import pytest

pytest.importorskip(
    "vllm.v1.kv_offload.tiering.spec",
    reason="vLLM 0.33.0 is not installed (see requirements/vllm-0.33-cpu.txt)",
)

from vllm.v1.kv_offload.base import (  # noqa: E402
    LookupResult,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
)
from vllm_tier_support import (  # noqa: E402
    BUDGET,
    CHUNK_BYTES,
    PRIMARY_CHUNKS,
    Driver,
    driven_manager,
    keys_for,
    offload_then_evict,
)

from torch_kv_tier.remote.launch import ServerProcess  # noqa: E402
from torch_kv_tier.results import TransferResult  # noqa: E402

STEPS = 400
MAX_REQUESTS = 6
_WAITING = (LookupResult.HIT_PENDING, LookupResult.RETRY)


class LateReads:
    """Stands in for the tier manager's ``load``: each read lands only when :meth:`land` picks
    it, then reports it (a quarter of its chunks fail, torn bytes written first, as a read that
    failed part-way). Landing, it records each chunk that vLLM no longer holds for its key's
    write."""

    def __init__(self, driver: Driver, rng: random.Random, monkeypatch: pytest.MonkeyPatch) -> None:
        self._driver = driver
        self._rng = rng
        self.in_flight: list[tuple[list[OffloadKey], list[int], concurrent.futures.Future[Any]]]
        self.in_flight = []
        self.misplaced: list[str] = []
        monkeypatch.setattr(driver.tier.tier_manager, "load", self._load)

    def _load(self, keys: Any, rows: Any) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self.in_flight.append((list(keys), [int(r) for r in rows], future))
        return future

    def land(self, n: int) -> None:
        """Land ``n`` of the reads in flight, picked at random."""
        self._rng.shuffle(self.in_flight)
        landing, self.in_flight = self.in_flight[:n], self.in_flight[n:]
        primary = self._driver.manager.primary_tier
        rows = np.asarray(primary.get_kv_memoryview()).view(np.uint8)
        try:
            for keys, chunk_ids, future in landing:
                failed = {}
                for key, row in zip(keys, chunk_ids, strict=True):
                    chunk = primary._policy.get(key)
                    if chunk is None or chunk.chunk_id != row or chunk.is_ready:
                        self.misplaced.append(f"{key!r} read into chunk {row}, now {chunk}")
                    if self._rng.random() < 0.25:
                        rows[row] = 0xEE
                        failed[key] = "transfer failed"
                    else:
                        rows[row] = np.frombuffer(self._driver.written[key], dtype=np.uint8)
                landed = [k for k in keys if k not in failed]
                nbytes = len(landed) * CHUNK_BYTES
                future.set_result(TransferResult(not failed, landed, failed, nbytes, 0.0))
        finally:
            del rows  # a live export would keep vLLM's shared region mapped


class Schedule:
    """vLLM's scheduler, one random action at a time, over ``prefix`` (keys on the host only)."""

    def __init__(
        self, driver: Driver, prefix: list[OffloadKey], reads: LateReads, seed: int
    ) -> None:
        self._driver = driver
        self._manager = driver.manager
        self._prefix = prefix
        self._reads = reads
        self._rng = random.Random(seed)
        self._waiting: dict[str, tuple[ReqContext, list[OffloadKey]]] = {}
        self._running: dict[str, ReqContext] = {}
        self._storing: list[tuple[ReqContext, Any]] = []  # GPU stores not yet complete
        self._ids = 0
        self.wrong_bytes: list[str] = []

    def act(self) -> None:
        """One action, picked at random (weighted)."""
        action = self._rng.choices(
            [self._arrive, self._step, self._land, self._abort, self._reset, self._store],
            weights=[15, 35, 15, 10, 3, 22],
        )[0]
        action()

    def end(self) -> None:
        """Land every read, complete every store, end every request; step until idle."""
        self._reads.land(len(self._reads.in_flight))
        while self._storing:
            self._complete_store()
        with self._manager.lock:
            for ctx in [c for c, _ in self._waiting.values()] + list(self._running.values()):
                self._manager.on_request_finished(ctx)
        self._driver.run_until_idle()

    def _new_id(self, prefix: str) -> str:
        self._ids += 1
        return f"{prefix}{self._ids}"

    def _arrive(self) -> None:
        if len(self._waiting) + len(self._running) < MAX_REQUESTS:
            ctx = ReqContext(req_id=self._new_id("r"))
            with self._manager.lock:
                self._manager.on_new_request(ctx)
            self._waiting[ctx.req_id] = (ctx, self._some_prefix())

    def _some_prefix(self) -> list[OffloadKey]:
        return self._prefix[: self._rng.randint(1, len(self._prefix))]

    def _step(self) -> None:
        """Scan each waiting request's prefix as vLLM does; schedule some of those not deferred
        (loading what hit), maybe preempt a running one, and end the step."""
        scheduled = []
        for req_id, (ctx, keys) in list(self._waiting.items()):
            with self._manager.lock:
                results = []
                for key in keys:
                    results.append(self._manager.lookup(key, ctx))
                    if results[-1] is not LookupResult.HIT:
                        break
            if any(r in _WAITING for r in results) or self._rng.random() < 0.3:
                continue
            hits = keys[: results.count(LookupResult.HIT)]
            if hits:
                loaded = self._driver.loaded_bytes(ctx, hits)
                self.wrong_bytes += [
                    f"{req_id}: {k!r}"
                    for k, got in zip(hits, loaded, strict=True)
                    if got != self._driver.written[k]
                ]
            scheduled.append(req_id)
            self._running[req_id] = self._waiting.pop(req_id)[0]
        preempted = []
        if self._running and self._rng.random() < 0.1:
            req_id = self._rng.choice(list(self._running))
            preempted.append(req_id)
            self._waiting[req_id] = (self._running.pop(req_id), self._some_prefix())
        context = ScheduleEndContext(new_req_ids=scheduled, preempted_req_ids=preempted)
        with self._manager.lock:
            self._manager.on_schedule_end(context)

    def _land(self) -> None:
        self._reads.land(self._rng.randint(0, 2))

    def _abort(self) -> None:
        if self._waiting or self._running:
            req_id = self._rng.choice([*self._waiting, *self._running])
            ctx = (
                self._waiting.pop(req_id)[0]
                if req_id in self._waiting
                else self._running.pop(req_id)
            )
            with self._manager.lock:
                self._manager.on_request_finished(ctx)

    def _reset(self) -> None:
        """vLLM's cache reset; its drain times out while a transfer is in flight (a read held
        here, or a store on its way to the host), and nothing is reset then."""
        with self._manager.lock:
            try:
                self._manager.reset_cache()
            except TimeoutError:
                return
            if hasattr(self._manager, "on_reset_flushed"):  # vLLM 0.33 promotes again once told
                self._manager.on_reset_flushed()
            for ctx, _ in self._storing:  # vLLM discards the stores of before the reset
                self._manager.on_request_finished(ctx)
        self._storing.clear()

    def _store(self) -> None:
        """A GPU store of chunks the host holds too, evicting promoted ones; some stay in flight
        (their chunks cannot be evicted) until a later action completes them."""
        if self._storing and self._rng.random() < 0.3:
            self._complete_store()
            return
        ctx = ReqContext(req_id=self._new_id("s"))
        keys = self._rng.sample(keys_for("filler", PRIMARY_CHUNKS), self._rng.randint(1, 4))
        with self._manager.lock:
            self._manager.on_new_request(ctx)
            out = self._manager.prepare_store(keys, ctx)
        if out is None or not out.keys_to_store:
            with self._manager.lock:
                self._manager.on_request_finished(ctx)
            return
        rows = np.asarray(self._manager.primary_tier.get_kv_memoryview()).view(np.uint8)
        for key, row in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
            rows[row] = np.frombuffer(self._driver.written[key], dtype=np.uint8)
        del rows
        self._storing.append((ctx, out))
        if self._rng.random() < 0.7:
            self._complete_store()

    def _complete_store(self) -> None:
        ctx, out = self._storing.pop(self._rng.randrange(len(self._storing)))
        with self._manager.lock:
            self._manager.complete_store(out.keys_to_store, ctx)
            self._manager.on_request_finished(ctx)


@pytest.mark.parametrize("seed", range(4))
def test_no_read_lands_in_a_chunk_vllm_reused_under_random_schedules(
    server: ServerProcess, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    """A review's property check (no fault found by it): 400 random actions per seed, each
    promotion's read landing late or failing torn. Treating a promotion of an aborted,
    scheduled or preempted request as finished before its read lands, or a failed read as
    done, each fails it (tried)."""
    with driven_manager(server.address, drain_timeout_s=0.05) as (_, manager, driver):
        if not hasattr(manager.primary_tier, "_policy"):  # where vLLM 0.33 keeps its chunks
            pytest.skip("this vLLM's CPU tier keeps its chunks elsewhere")
        prefix = offload_then_evict(driver, BUDGET)
        reads = LateReads(driver, random.Random(seed), monkeypatch)
        schedule = Schedule(driver, prefix, reads, seed)
        for _ in range(STEPS):
            schedule.act()
        schedule.end()
        assert reads.misplaced == [] and schedule.wrong_bytes == []
        tier = driver.tier
        with manager.lock:
            assert not manager.has_pending_work()
        assert (tier._admission.held, tier._pins.held, tier._failed_keys) == (0, 0, {})
