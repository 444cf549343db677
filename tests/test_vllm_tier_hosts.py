"""RemoteHostTier inside vLLM's own TieringOffloadingManager, on a real remote host: chunks
stored, evicted and promoted back, shared by tiers on one host, touched and looked up while
their stores fly, and a host that dies, drops a read, restarts, comes and goes with a watched
file, or is silent at shutdown. Built and driven as vLLM does
(``vllm_tier_support``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip(
    "vllm.v1.kv_offload.tiering.spec",
    reason="vLLM 0.33.0 is not installed (see requirements/vllm-0.33-cpu.txt)",
)

from remote_support import (  # noqa: E402
    control_ports,
    wait_until,
)
from vllm.v1.kv_offload.base import (  # noqa: E402
    LookupResult,
    ReqContext,
)
from vllm.v1.kv_offload.tiering.base import TieringOffloadingMetrics  # noqa: E402
from vllm_tier_support import (  # noqa: E402
    BUDGET,
    CHUNK_BYTES,
    PRIMARY_CHUNKS,
    REMOTE_BLOCKS,
    TIER_LABEL,
    TIER_SLOTS,
    Driver,
    driven_manager,
    keys_for,
    make_manager,
    offload_then_evict,
)

from torch_kv_tier.benchmarks.reliability_common import stop_process  # noqa: E402
from torch_kv_tier.integrations.vllm.remote_tier import RemoteHostMetrics  # noqa: E402
from torch_kv_tier.remote.launch import ServerProcess  # noqa: E402
from torch_kv_tier.transport import nixl as nixl_module  # noqa: E402


@pytest.fixture
def tcp_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[ServerProcess]:
    """A server reached over UCX's TCP transport on both sides, so a transfer really stays in
    flight while the server is stopped (shared memory would finish it inside the call)."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    with ServerProcess.start(REMOTE_BLOCKS, CHUNK_BYTES, env={"UCX_TLS": "tcp"}) as srv:
        yield srv


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
        silent.settimeout(10.0)
        dialled, _ = silent.accept()  # the membership thread's handshake with it is under way
        with contextlib.closing(dialled):  # (open: the handshake waits out its 10 s)
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
