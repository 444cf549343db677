"""Promotions of RemoteHostTier inside vLLM's own TieringOffloadingManager: the promotion
budget, promotions held from their landing until their request is scheduled and pinning nothing
once it ends or is preempted, reads still in flight through drains and timeouts, chunks the CPU
tier cannot allocate, and chunks read from the host's disk. Built and driven as vLLM does
(``vllm_tier_support``).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import time
from collections.abc import Sequence
from typing import Any

import pytest

pytest.importorskip(
    "vllm.v1.kv_offload.tiering.spec",
    reason="vLLM 0.33.0 is not installed (see requirements/vllm-0.33-cpu.txt)",
)

from remote_support import (  # noqa: E402
    fake_session,
    wait_for,
    wait_until,
)
from test_transfer_timeout import NeverDone  # noqa: E402
from vllm.v1.kv_offload.base import (  # noqa: E402
    LookupResult,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.base import TieringOffloadingMetrics  # noqa: E402
from vllm_tier_support import (  # noqa: E402
    BUDGET,
    CHUNK_BYTES,
    PRIMARY_CHUNKS,
    STEP,
    TIER_LABEL,
    Driver,
    driven_manager,
    keys_for,
    offload_then_evict,
)

from torch_kv_tier.integrations.vllm.promotion_pin import PromotionPins  # noqa: E402
from torch_kv_tier.integrations.vllm.remote_tier import RemoteHostMetrics, RemoteHostTier  # noqa: E402
from torch_kv_tier.integrations.vllm.tier_config import RemoteHostTierConfig  # noqa: E402
from torch_kv_tier.remote.launch import ServerProcess  # noqa: E402


def hold_with_stores_in_flight(driver: Driver, chunks: int) -> None:
    """GPU -> CPU stores of one request, never completed, take ``chunks`` of the CPU tier: vLLM
    cannot evict them."""
    writer = driver.arrive("req-writing")
    with driver.manager.lock:
        assert driver.manager.prepare_store(keys_for("pending", chunks), writer) is not None


def test_a_burst_beyond_the_promotion_budget_waits_then_misses_leading_chunks_first(
    server: ServerProcess,
) -> None:
    """Two requests whose prefixes together exceed what the CPU tier may promote: the first
    gets its leading chunks; the second waits while that promotion is under way (RETRY: its
    prefill would fill the first one's steps), at most ``promotion_guard_s``, then gets a MISS
    on its first chunk (vLLM recomputes it, no longer waiting); once the first is scheduled the
    budget serves the next."""
    with driven_manager(server.address) as (_, manager, driver):
        keys = offload_then_evict(driver, PRIMARY_CHUNKS)
        first, second = keys[:BUDGET], keys[BUDGET:]
        ctx_1, ctx_2 = driver.arrive("req-1"), driver.arrive("req-2")
        assert driver.lookup(ctx_1, first) == [LookupResult.HIT_PENDING] * BUDGET
        assert driver.lookup(ctx_2, second[:1]) == [LookupResult.RETRY]  # budget spent: waits
        time.sleep(RemoteHostTierConfig.promotion_guard_s + 0.01)
        driver.step()  # the guard's clock is read once a step: the next one
        assert driver.lookup(ctx_2, second[:1]) == [LookupResult.MISS]  # waited long enough
        driver.run_until_idle()  # the reads landed: the budget is free for the next request
        assert driver.lookup(ctx_1, first) == [LookupResult.HIT] * BUDGET
        assert driver.loaded_bytes(ctx_1, first) == [driver.written[k] for k in first]
        driver.step(scheduled=["req-1"])
        ctx_3 = driver.arrive("req-3")
        assert driver.promote(ctx_3, second) == [LookupResult.HIT] * len(second)
        assert driver.loaded_bytes(ctx_3, second) == [driver.written[k] for k in second]
        data = driver.metrics()
        assert data[TieringOffloadingMetrics.READ_BYTES][TIER_LABEL] == len(keys) * CHUNK_BYTES
        assert data[RemoteHostMetrics.REFUSED_PROMOTIONS] == {(server.address, "budget"): 1}
        for ctx in (ctx_1, ctx_2, ctx_3):
            with manager.lock:
                manager.on_request_finished(ctx)


def test_a_queue_the_cpu_tier_cannot_take_whole_recomputes_until_it_drains(
    server: ServerProcess,
) -> None:
    """Two waiting requests whose expected prefixes (4 chunks each) together exceed what the
    CPU tier may promote (4): both recompute (MISS on their first chunk), so neither waits
    three steps for a promotion while the other's prefill fills them. Once one is scheduled
    the last one fits and is promoted, beside that recompute (refused, it would prefill too)."""
    with driven_manager(server.address, expected_prefix_tokens=BUDGET * 16) as (_, manager, driver):
        keys = offload_then_evict(driver, BUDGET)
        ctx_1, ctx_2 = driver.arrive("req-1"), driver.arrive("req-2")
        assert driver.lookup(ctx_1, keys[:1]) == [LookupResult.MISS]
        assert driver.lookup(ctx_2, keys[:1]) == [LookupResult.MISS]
        driver.step(scheduled=["req-1"])  # req-1 recomputes; req-2 is alone in the queue
        assert driver.promote(ctx_2, keys) == [LookupResult.HIT] * BUDGET
        assert driver.loaded_bytes(ctx_2, keys) == [driver.written[k] for k in keys]
        data = driver.metrics()
        assert data[RemoteHostMetrics.REFUSED_PROMOTIONS] == {(server.address, "pressure"): 2}
        for ctx in (ctx_1, ctx_2):
            with manager.lock:
                manager.on_request_finished(ctx)


def land_unheard(driver: Driver, ctx: ReqContext, keys: Sequence[OffloadKey]) -> None:
    """Promote ``keys`` for ``ctx``'s request and let the read land without vLLM hearing of it:
    vLLM learns of it at its next poll (in the next store, right before that store allocates)."""
    assert driver.lookup(ctx, keys) == [LookupResult.HIT_PENDING] * len(keys)
    driver.step()  # vLLM submits the promotion at the step's end
    driver.tier._jobs.drain(10.0, "the test's host")  # landed; reported at vLLM's next poll


def test_a_promotion_heard_of_in_a_store_is_held_before_that_store_allocates(
    server: ServerProcess,
) -> None:
    """vLLM polls the tier's finished jobs at the start of a store and allocates right after:
    the chunks of a promotion it hears of there are already held when it allocates, so a
    store that would need them is refused (vLLM retries it at the next step) and the
    request hits every chunk (before, that store evicted them and the reads were wasted)."""
    with driven_manager(server.address) as (_, manager, driver):
        keys = offload_then_evict(driver, BUDGET)
        ctx = driver.arrive("req-1")
        land_unheard(driver, ctx, keys)
        writer = ReqContext(req_id="req-writer")
        with manager.lock:
            manager.on_new_request(writer)
            assert manager.prepare_store(keys_for("other", PRIMARY_CHUNKS), writer) is None
            manager.on_request_finished(writer)
        assert driver.lookup(ctx, keys) == [LookupResult.HIT] * BUDGET
        assert driver.loaded_bytes(ctx, keys) == [driver.written[k] for k in keys]
        with manager.lock:
            manager.on_request_finished(ctx)


def test_a_promoted_chunk_lost_before_use_is_never_read_again(
    server: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the tier cannot hold a landed promotion (a vLLM build whose CPU tier it cannot
    reach), a promoted chunk that vLLM's CPU tier evicts before its request is scheduled is a
    MISS when the request looks it up again: the request recomputes from there, the tier does
    not read the chunk a second time (under load that re-read looped, step after step)."""
    monkeypatch.setattr(PromotionPins, "_primary", lambda self: None)
    with driven_manager(server.address) as (_, manager, driver):
        keys = offload_then_evict(driver, BUDGET)
        ctx = driver.arrive("req-1")
        assert driver.promote(ctx, keys) == [LookupResult.HIT] * BUDGET
        # The request is not scheduled yet; what vLLM stores meanwhile evicts its chunks.
        evicted = driver.store("req-other", keys_for("other", PRIMARY_CHUNKS))
        assert set(keys) <= set(evicted)
        assert driver.lookup(ctx, keys[:1]) == [LookupResult.MISS]
        driver.run_until_idle()
        data = driver.metrics()
        assert data[TieringOffloadingMetrics.READ_BYTES][TIER_LABEL] == BUDGET * CHUNK_BYTES
        assert data[RemoteHostMetrics.LOST_PROMOTIONS][(server.address,)] == 1
        with manager.lock:
            manager.on_request_finished(ctx)
        assert driver.promote_request("req-2", keys) == [driver.written[k] for k in keys]


def test_a_landed_promotion_is_held_until_its_request_is_scheduled(server: ServerProcess) -> None:
    """Once vLLM heard that a promotion landed, its stores cannot evict it while its request
    waits: a store that would need its chunks is refused (vLLM retries it at the next step)
    and the request hits every chunk. Its request scheduled (or finished unscheduled),
    the chunks are evictable again; and vLLM can reset its CPU tier with a promotion held."""
    with driven_manager(server.address) as (_, manager, driver):
        writer = ReqContext(req_id="req-writer")
        probes = itertools.count()

        def can_store(n: int) -> bool:
            """Whether vLLM's CPU tier takes a store of ``n`` new chunks now (whose GPU copy then
            fails, so nothing is cascaded or kept)."""
            keys = keys_for(f"probe-{next(probes)}", n)
            with manager.lock:
                out = manager.prepare_store(keys, writer)
                if out is not None:
                    manager.complete_store(out.keys_to_store, writer, success=False)
            return out is not None

        keys = offload_then_evict(driver, BUDGET)
        with manager.lock:
            manager.on_new_request(writer)
        ctx = driver.arrive("req-1")
        assert driver.promote(ctx, keys) == [LookupResult.HIT] * BUDGET
        assert held_promotions(driver) == BUDGET
        assert not can_store(PRIMARY_CHUNKS - BUDGET + 1)  # it would evict the promotion
        assert driver.lookup(ctx, keys) == [LookupResult.HIT] * BUDGET
        assert driver.loaded_bytes(ctx, keys) == [driver.written[k] for k in keys]
        driver.step(scheduled=["req-1"])
        assert held_promotions(driver) == 0
        assert can_store(PRIMARY_CHUNKS)  # evicts all of it
        with manager.lock:
            manager.on_request_finished(ctx)

        ctx = driver.arrive("req-2")  # promoted, then finished (aborted) unscheduled
        assert driver.promote(ctx, keys) == [LookupResult.HIT] * BUDGET
        assert not can_store(PRIMARY_CHUNKS - BUDGET + 1)
        with manager.lock:
            manager.on_request_finished(ctx)
        assert held_promotions(driver) == 0
        assert can_store(PRIMARY_CHUNKS)

        # vLLM resets its CPU tier with one promotion held and another landed, unheard (it
        # hears of it in the reset, which clears both).
        held = driver.arrive("req-3")
        assert driver.promote(held, keys[:2]) == [LookupResult.HIT] * 2
        unheard = driver.arrive("req-4")
        land_unheard(driver, unheard, keys[2:])
        with manager.lock:
            manager.reset_cache()
            if hasattr(manager, "on_reset_flushed"):  # vLLM 0.33 promotes again once told so
                manager.on_reset_flushed()
            manager.on_request_finished(held)
            manager.on_request_finished(unheard)
        assert held_promotions(driver) == 0
        assert can_store(PRIMARY_CHUNKS)
        with manager.lock:
            manager.on_request_finished(writer)
        assert driver.promote_request("req-5", keys) == [driver.written[k] for k in keys]


def held_promotions(driver: Driver) -> int:
    """The tier's gauge of promoted chunks held in vLLM's CPU tier."""
    return driver.metrics()[RemoteHostMetrics.HELD_PROMOTIONS][(driver.tier._config.remote,)]


@pytest.mark.parametrize("lands", [True, False], ids=["landed", "failed"])
def test_a_request_that_ends_while_its_promotion_flies_keeps_nothing(
    server: ServerProcess, lands: bool
) -> None:
    """Found by review: a request aborted while its promotion was in flight (vLLM lets a request
    end with its jobs in flight) had the promotion's chunks pinned in vLLM's CPU tier once it
    landed, for a request that would never be scheduled or finish again: they could never be
    evicted. A failed promotion likewise left the request's failed keys behind for good."""
    with driven_manager(server.address) as (_, manager, driver):
        keys = offload_then_evict(driver, BUDGET)
        ctx = driver.arrive("req-1")
        assert driver.lookup(ctx, keys) == [LookupResult.HIT_PENDING] * len(keys)
        if not lands:
            driver.tier.tier_manager.discard(keys)  # the remote copies go before the read
        with manager.lock:  # the read is done but not collected: as if still in flight
            manager.on_schedule_end(STEP)  # the promotion is submitted
            jobs = driver.tier._jobs._jobs.values()
            assert jobs and concurrent.futures.wait([j.future for j in jobs], timeout=10).done
            manager.on_request_finished(ctx)  # the client aborted the waiting request
        driver.run_until_idle()  # vLLM hears of the promotion now
        assert held_promotions(driver) == 0 and driver.tier._failed_keys == {}


class HeldReads:
    """Holds back the results of the tier's reads (as from a host that answers late) until
    :meth:`release`; the reads themselves run as usual."""

    def __init__(self, tier: RemoteHostTier, monkeypatch: pytest.MonkeyPatch) -> None:
        self._held: list[tuple[concurrent.futures.Future[Any], concurrent.futures.Future[Any]]]
        self._held = []
        load = tier.tier_manager.load

        def held_load(keys: Any, rows: Any) -> concurrent.futures.Future[Any]:
            seen: concurrent.futures.Future[Any] = concurrent.futures.Future()
            self._held.append((load(keys, rows), seen))
            return seen

        monkeypatch.setattr(tier.tier_manager, "load", held_load)

    def release(self) -> None:
        """Let the tier see every read held so far, in the order they were started."""
        for real, seen in self._held:
            seen.set_result(real.result(timeout=10))
        self._held.clear()


def test_a_request_id_vllm_reuses_inherits_nothing_of_the_ended_request(
    server: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: vLLM may give a new request the id of one that ended (with
    ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION``, or an engine driven with its own ids). The tier
    remembered by id that a request ended with its promotion in flight, so a new request of
    that id promoting meanwhile was taken for the ended one: what landed for it was not held
    in vLLM's CPU tier (and what failed not answered MISS)."""
    with driven_manager(server.address) as (_, manager, driver):
        keys = offload_then_evict(driver, BUDGET)
        reads = HeldReads(driver.tier, monkeypatch)
        old, new_keys = keys[: BUDGET // 2], keys[BUDGET // 2 :]
        ended = driver.arrive("req-1")
        assert driver.lookup(ended, old) == [LookupResult.HIT_PENDING] * len(old)
        driver.step()  # the promotion is submitted; its read is held back
        with manager.lock:
            manager.on_request_finished(ended)  # the client aborted the waiting request
        ctx = driver.arrive("req-1")  # a new request, with the same id
        assert driver.lookup(ctx, new_keys) == [LookupResult.HIT_PENDING] * len(new_keys)
        driver.step()
        reads.release()
        driver.run_until_idle()
        assert held_promotions(driver) == len(new_keys)  # the new request's, none of the old
        assert driver.lookup(ctx, new_keys) == [LookupResult.HIT] * len(new_keys)
        assert driver.loaded_bytes(ctx, new_keys) == [driver.written[k] for k in new_keys]
        with manager.lock:
            manager.on_request_finished(ctx)
        assert held_promotions(driver) == 0


@pytest.mark.parametrize("how", ["scheduled", "preempted"])
def test_a_promotion_in_flight_when_its_request_is_scheduled_or_preempted_pins_nothing(
    server: ServerProcess, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """Found by review: vLLM schedules a request whose promotion is still in flight when an
    earlier chunk of its prefix answered MISS (it recomputes from there), and may then preempt
    it; either way that attempt is over (admission gave its promises back), yet the promotion's
    chunks, once landed, were pinned in vLLM's CPU tier, outside the budget, until the request
    finished (a resumed request is never among a step's new ones): through its whole decode.
    Now such a promotion's result goes to vLLM only, as an ended request's does."""
    with driven_manager(server.address) as (_, manager, driver):
        keys = offload_then_evict(driver, BUDGET)
        reads = HeldReads(driver.tier, monkeypatch)
        ctx = driver.arrive("req-1")
        assert driver.lookup(ctx, keys) == [LookupResult.HIT_PENDING] * len(keys)
        driver.step()  # the promotion is submitted; its read is held back
        ids = ["req-1"]
        with manager.lock:
            manager.on_schedule_end(
                ScheduleEndContext(new_req_ids=ids, preempted_req_ids=())
                if how == "scheduled"
                else ScheduleEndContext(new_req_ids=(), preempted_req_ids=ids)
            )
        reads.release()
        driver.run_until_idle()
        assert held_promotions(driver) == 0
        assert driver.tier._admission.held == 0 and driver.tier._failed_keys == {}
        with manager.lock:
            manager.on_request_finished(ctx)


def test_a_read_not_yet_reported_keeps_its_chunks_through_a_drain_that_times_out(
    server: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A promotion whose read the transport has not reported (a frozen host the heartbeat has
    not dropped yet) may still land in its chunks, so it is never reported before: vLLM's
    ``reset_cache`` raises ``TimeoutError`` after ``drain_timeout_s`` and nothing is reported
    meanwhile (vLLM keeps the chunks); once the read lands, the job is reported."""
    with driven_manager(server.address, drain_timeout_s=0.2) as (_, manager, driver):
        keys = offload_then_evict(driver, BUDGET)
        reads = HeldReads(driver.tier, monkeypatch)
        ctx = driver.arrive("req-1")
        assert driver.lookup(ctx, keys) == [LookupResult.HIT_PENDING] * BUDGET
        driver.step()  # the promotion is submitted; its read is held back
        with manager.lock, pytest.raises(TimeoutError, match="drain_timeout_s"):
            manager.reset_cache()
        driver.step()  # vLLM polls the tier: nothing is reported
        with manager.lock:
            assert manager.has_pending_work()
        reads.release()
        driver.run_until_idle()
        assert driver.lookup(ctx, keys) == [LookupResult.HIT] * BUDGET
        assert driver.loaded_bytes(ctx, keys) == [driver.written[k] for k in keys]
        with manager.lock:
            manager.on_request_finished(ctx)


def test_a_read_stalled_past_transfer_timeout_s_drops_its_host_and_stays_pending_until_reported(
    server: ServerProcess,
) -> None:
    """NIXL once kept a transfer in flight for good while its host heartbeated fine: the host
    then served nothing new until shutdown. Past ``transfer_timeout_s`` the host is dropped and
    dialled again, but the promotion stalled on it stays pending (vLLM keeps its chunks, in
    which the read may still land) until its read is reported; then it fails (recompute)."""
    with driven_manager(server.address, transfer_timeout_s=1, reconnect_interval_s=0) as (
        _,
        manager,
        driver,
    ):
        keys = offload_then_evict(driver, BUDGET)
        tier = driver.tier.tier_manager
        agent = NeverDone(tier.transport._agent)  # type: ignore[attr-defined]
        tier.transport._agent = agent  # type: ignore[attr-defined]
        ctx = driver.arrive("req-c")
        assert driver.lookup(ctx, keys) == [LookupResult.HIT_PENDING] * len(keys)
        agent.stuck = True
        try:
            driver.step()  # the promotion's read is submitted, and never reported
            wait_until(lambda: tier.stats().peers_dropped == 1, "the bound drops the host", 20.0)
            driver.step()
            with manager.lock:
                assert manager.has_pending_work()  # the read may still land
        finally:
            agent.stuck = False
        driver.run_until_idle()  # the read is reported: the promotion fails
        assert driver.lookup(ctx, keys) == [LookupResult.MISS] * len(keys)
        with manager.lock:
            manager.on_request_finished(ctx)
        wait_until(lambda: bool(tier.peers()), "the tier dials the host again", 20.0)


def test_a_promotion_the_cpu_tier_cannot_allocate_is_a_miss_without_a_retry(
    server: ServerProcess,
) -> None:
    """With the CPU tier full of chunks vLLM is still writing, a remote hit cannot be allocated:
    vLLM answers MISS, and the tier keeps it a MISS for that request (no read, no deferral),
    and gives the budget back at the end of the step."""
    with driven_manager(server.address) as (_, _, driver):
        keys = offload_then_evict(driver, 2)
        hold_with_stores_in_flight(driver, PRIMARY_CHUNKS)  # the whole CPU tier
        ctx = driver.arrive("req-1")
        assert driver.lookup(ctx, keys) == [LookupResult.MISS, LookupResult.MISS]
        driver.step()
        assert driver.tier._admission.held == 0
        assert driver.lookup(ctx, keys[:1]) == [LookupResult.MISS]
        data = driver.metrics()
        assert TieringOffloadingMetrics.READ_BYTES not in data


def test_a_promotion_the_cpu_tier_can_allocate_only_in_part_is_not_read(
    server: ServerProcess,
) -> None:
    """With room in the CPU tier for one chunk of a two-chunk prefix, vLLM promotes the first
    and answers MISS for the second (its scan ends there). Reading the first would defer the
    request for the promotion and then recompute the rest; the tier reports the promotion
    failed unread instead, and the request recomputes whole (a MISS from its first chunk) with
    nothing left pending and the budget given back."""
    with driven_manager(server.address) as (_, _, driver):
        keys = offload_then_evict(driver, 2)
        hold_with_stores_in_flight(driver, PRIMARY_CHUNKS - 1)  # all but one chunk
        ctx = driver.arrive("req-1")
        assert driver.lookup(ctx, keys) == [LookupResult.HIT_PENDING, LookupResult.MISS]
        driver.run_until_idle()  # the job is submitted at the step's end and reported failed
        assert driver.lookup(ctx, keys[:1]) == [LookupResult.MISS]
        assert driver.tier._admission.held == 0
        assert driver.tier._admission.stats.dropped_partial == 1
        assert TieringOffloadingMetrics.READ_BYTES not in driver.metrics()


def test_a_chunk_on_the_hosts_disk_is_retried_while_promoted_then_a_hit(tmp_path: Any) -> None:
    """A chunk the host's pool evicted to its disk (``serve --disk``): vLLM's lookup answers
    RETRY while the host promotes it (never a MISS, never a HIT before it is in DRAM), then the
    promotion delivers the bytes stored."""
    disk = ["--disk", str(tmp_path / "disk"), "--disk-bytes", str(256 * CHUNK_BYTES)]
    with (
        ServerProcess.start(
            16, CHUNK_BYTES, extra_args=[*disk, "--disk-admit", "1", "--max-grant", "4"]
        ) as host,
        driven_manager(host.address, private=False, slots=None) as (_, _, driver),
    ):
        keys = keys_for("deep", 4)
        driver.store("req-a", keys)
        driver.run_until_idle()
        # The host copies ahead of eviction when its loop gets to it: a chunk evicted before
        # its copy is gone, disk and all. Only deep-* must be copied before the fills.
        with fake_session(host.address, block_len=CHUNK_BYTES, private=False) as observer:
            wait_until(
                lambda: observer.stats()["disk_copies"] >= len(keys), "the host's copies to disk"
            )
        for j in range(6):  # 48 more chunks through a 16-slot pool: deep-* go to disk
            driver.store(f"fill-{j}", keys_for(f"fill{j}", PRIMARY_CHUNKS))
            driver.run_until_idle()
        tier = driver.tier.tier_manager
        assert wait_for(
            lambda: not any(map(tier.contains, keys)) and tier.lookup(keys) == len(keys), 10.0
        ), "the host to announce the chunks on its disk"
        ctx = driver.arrive("req-c")
        seen: list[LookupResult] = []
        deadline = time.monotonic() + 10.0
        while True:
            results = driver.lookup(ctx, keys)
            seen += results
            # Each chunk leaves RETRY once the host promoted it: HIT_PENDING while vLLM loads
            # it, HIT once loaded (one promoted a step before the others may be loaded already)
            if LookupResult.RETRY not in results:
                break
            assert time.monotonic() < deadline, results
            driver.step()
            time.sleep(0.01)
        assert LookupResult.RETRY in seen and LookupResult.MISS not in seen
        driver.run_until_idle()
        assert driver.lookup(ctx, keys) == [LookupResult.HIT] * len(keys)
        assert driver.loaded_bytes(ctx, keys) == [driver.written[k] for k in keys]
