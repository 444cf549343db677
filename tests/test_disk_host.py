"""A real ``torch-kv-tier serve --disk`` host and real tiers: blocks the pool evicts come back
from disk byte-identical, a restart on the same disk finds them (verified), and a host killed
mid-write, a file truncated under it, a full or unwritable disk cost a miss or a clear message,
never wrong bytes or a crash loop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from disk_support import as_format
from remote_support import BLOCK_LEN, fake_session, fill_random, wait_for

from torch_kv_tier.manager import TierManager
from torch_kv_tier.remote import ServerProcess
from torch_kv_tier.results import MISSING

RESULT_TIMEOUT_S = 30.0
POOL_BLOCKS = 32
DISK_BLOCKS = 512


def _serve(disk: Path, *, admit: int = 1, disk_blocks: int = DISK_BLOCKS) -> ServerProcess:
    return ServerProcess.start(
        POOL_BLOCKS,
        BLOCK_LEN,
        extra_args=[
            "--disk", str(disk), "--disk-bytes", str(disk_blocks * BLOCK_LEN),
            "--disk-admit", str(admit), "--max-grant", "8", "--metrics-port", "0",
        ],
    )  # fmt: skip


def _stats(address: str) -> dict[str, Any]:
    with fake_session(address, private=False) as session:
        return session.stats()


def _store_all(tier: TierManager, keys: list[bytes], address: str) -> None:
    """Store ``keys`` from arena blocks 0.. in batches of 8, each once the host's copies to
    disk caught up (so that no key is evicted before its copy: what this test is not about)."""
    for i in range(0, len(keys), 8):
        batch = keys[i : i + 8]
        result = tier.store(batch, range(i, i + len(batch))).result(timeout=RESULT_TIMEOUT_S)
        assert result.ok, result.failed
        done = i + len(batch)
        assert wait_for(lambda: _stats(address)["disk_copies"] >= done, 10.0)  # noqa: B023


def test_blocks_evicted_from_dram_are_promoted_from_disk_byte_identical(tmp_path: Path) -> None:
    keys = [f"doc-{i}".encode() for i in range(160)]  # five times the DRAM pool
    with (
        _serve(tmp_path / "disk") as server,
        TierManager.create(160, BLOCK_LEN, name="writer") as writer,
        TierManager.create(160, BLOCK_LEN, name="reader") as reader,
    ):
        writer.connect(server.address)
        original = fill_random(writer)
        _store_all(writer, keys, server.address)
        reader.connect(server.address)
        assert reader.lookup(keys) == len(keys)  # on disk or in DRAM: all counted
        assert sum(reader.contains(k) for k in keys) <= POOL_BLOCKS
        targets = torch.randperm(160).tolist()
        for i in range(0, 160, 16):  # 16 at a time: the pool holds 32
            loaded = reader.load(keys[i : i + 16], targets[i : i + 16]).result(
                timeout=RESULT_TIMEOUT_S
            )
            assert loaded.ok, loaded.failed
        assert torch.equal(reader.arena.tensor[targets], original)
        stats = _stats(server.address)
        assert stats["disk_promotions"] >= len(keys) - POOL_BLOCKS
        assert stats["disk_keys"] == len(keys) and stats["disk_failures"] == 0
        assert reader.stats().verify_failed == 0
        url = f"http://127.0.0.1:{stats['metrics_port']}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            metrics = response.read().decode()
        assert f"torch_kv_tier_server_disk_keys {len(keys)}\n" in metrics
        promotions = stats["disk_promotions"]
        assert f'disk_promotions_total{{result="done"}} {promotions}\n' in metrics
        assert 'torch_kv_tier_server_disk_blocks_total{op="written"} 160\n' in metrics
        assert "torch_kv_tier_server_disk_stuck_total 0\n" in metrics
        assert "torch_kv_tier_server_disk_stuck_in_flight 0\n" in metrics
        assert "torch_kv_tier_server_disk_writes_failing 0\n" in metrics


@pytest.mark.parametrize("format_1", [False, True])  # made before records had their order
def test_a_host_restarted_on_its_disk_serves_what_it_held(tmp_path: Path, format_1: bool) -> None:
    keys = [f"kept-{i}".encode() for i in range(96)]
    with TierManager.create(96, BLOCK_LEN, name="writer") as writer:
        original = fill_random(writer)
        with _serve(tmp_path / "disk") as server:
            writer.connect(server.address)
            _store_all(writer, keys, server.address)
        if format_1:  # an upgrade in place: migrated at start, no key lost
            as_format(tmp_path / "disk", 1)
        with (
            _serve(tmp_path / "disk") as server,
            TierManager.create(96, BLOCK_LEN, name="after") as after,
        ):
            assert _stats(server.address)["disk_keys"] == len(keys)
            after.connect(server.address)
            assert after.lookup(keys) == len(keys)
            for i in range(0, 96, 16):
                loaded = after.load(keys[i : i + 16], range(i, i + 16)).result(
                    timeout=RESULT_TIMEOUT_S
                )
                assert loaded.ok, loaded.failed
            assert torch.equal(after.arena.tensor, original)


def test_a_host_killed_while_writing_its_disk_restarts_with_verified_keys(tmp_path: Path) -> None:
    """SIGKILL while copies to disk are in flight: at restart every key it announces loads its
    own bytes or is missing; at most the blocks being written are lost."""
    keys = [f"burst-{i}".encode() for i in range(128)]
    with TierManager.create(128, BLOCK_LEN, name="writer") as writer:
        original = fill_random(writer)
        server = _serve(tmp_path / "disk")
        try:
            writer.connect(server.address)
            _store_all(writer, keys[:64], server.address)
            burst = writer.store(keys[64:], range(64, 128))  # copies of these in flight
            time.sleep(0.01)
            server.proc.send_signal(signal.SIGKILL)
            server.proc.wait(timeout=10)
            burst.exception(timeout=RESULT_TIMEOUT_S)  # settled, however it went
        finally:
            server.stop()
        with (
            _serve(tmp_path / "disk") as server,
            TierManager.create(128, BLOCK_LEN, name="after") as after,
        ):
            stats = _stats(server.address)
            assert 64 <= stats["disk_keys"] <= 128
            after.connect(server.address)
            wrong = missing = 0
            for i in range(0, 128, 16):
                loaded = after.load(keys[i : i + 16], range(i, i + 16)).result(
                    timeout=RESULT_TIMEOUT_S
                )
                missing += len(loaded.failed)
                assert set(loaded.failed.values()) <= {MISSING}
                for j, key in enumerate(keys[i : i + 16], start=i):
                    if key not in loaded.failed:
                        wrong += not torch.equal(after.arena.tensor[j], original[j])
            assert wrong == 0
            assert missing <= 64  # the first 64 were all on disk before the kill


def test_a_disk_file_truncated_under_a_running_host_costs_misses(tmp_path: Path) -> None:
    keys = [f"trunc-{i}".encode() for i in range(96)]
    with (
        _serve(tmp_path / "disk") as server,
        TierManager.create(96, BLOCK_LEN, name="writer") as writer,
    ):
        writer.connect(server.address)
        original = fill_random(writer)
        _store_all(writer, keys, server.address)
        os.truncate(tmp_path / "disk" / "blocks.dat", 0)
        writer.arena.tensor.zero_()
        results = [
            writer.load(keys[i : i + 16], range(i, i + 16)).result(timeout=RESULT_TIMEOUT_S)
            for i in range(0, 96, 16)
        ]
        for i, loaded in enumerate(results):
            assert set(loaded.failed.values()) <= {MISSING}
            for j in range(i * 16, i * 16 + 16):
                if keys[j] not in loaded.failed:
                    assert torch.equal(writer.arena.tensor[j], original[j])
        assert sum(len(r.failed) for r in results) >= 96 - POOL_BLOCKS
        assert server.proc.poll() is None  # still serving
        assert _stats(server.address)["disk_keys"] <= POOL_BLOCKS


def _serve_fails(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torch_kv_tier", "serve", "--num-blocks", "8"]
    cmd += ["--block-len", str(BLOCK_LEN), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)


def test_an_unwritable_disk_path_is_refused_with_its_name(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    done = _serve_fails("--disk", str(blocker / "sub"), "--disk-bytes", "1M")
    assert done.returncode == 1 and "ready" not in done.stdout
    assert str(blocker / "sub") in done.stderr and "its parent must exist" in done.stderr


def test_a_disk_too_small_for_disk_bytes_is_refused_with_the_free_space(tmp_path: Path) -> None:
    done = _serve_fails("--disk", str(tmp_path / "d"), "--disk-bytes", str(1 << 60))
    assert done.returncode == 1 and "ready" not in done.stdout
    assert "free" in done.stderr and "--disk-bytes" in done.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--disk-bytes", "1G"], "--disk-bytes needs --disk"),
        (["--disk", "x"], "--disk needs --disk-bytes"),  # was "at least one block ..., got 0"
        (["--disk", "x", "--disk-bytes", "100"], "at least one block"),
        (["--disk", "x", "--disk-bytes", "1 lot"], "not a byte count"),
        (["--disk", "x", "--disk", "x", "--disk-bytes", "1M"], "twice"),
        (["--disk", "x", "--disk-bytes", "1M", "--disk-admit", "0"], "--disk-admit"),
    ],
)
def test_bad_disk_options_are_refused_before_anything_starts(
    tmp_path: Path, args: list[str], message: str
) -> None:
    done = _serve_fails(*[str(tmp_path / a) if a == "x" else a for a in args])
    assert done.returncode == 2 and message in done.stderr
    assert not (tmp_path / "x").exists()


def test_a_journal_sync_that_hangs_leaves_the_control_plane_answering(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by the second review: the journals' writes, fsyncs and compactions ran on the
    host's loop thread, so a device that stopped answering an fsync (a stuck NFS mount, a dying
    disk) froze the whole host: handshakes, heartbeats and stats went unanswered, and every tier
    dropped it. They run on a thread of their own now."""
    from torch_kv_tier.remote import disk_sync
    from torch_kv_tier.remote.server import Server, ServerConfig

    disk = tmp_path / "disk"
    hung, answers = threading.Event(), threading.Event()
    real_fsync = os.fsync

    def fsync(fd: int) -> None:  # the device stops answering the journal's fsync
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(disk)) and not answers.is_set():
            hung.set()
            answers.wait(RESULT_TIMEOUT_S)
        real_fsync(fd)

    monkeypatch.setattr(disk_sync, "FSYNC_PERIOD_S", 0.01)
    server = Server(
        ServerConfig(
            num_blocks=POOL_BLOCKS,
            block_len=BLOCK_LEN,
            disk_paths=(str(disk),),
            disk_bytes=DISK_BLOCKS * BLOCK_LEN,
        )
    )
    stop = threading.Event()
    loop = threading.Thread(target=server.serve, args=(stop,), daemon=True)
    try:
        monkeypatch.setattr(os, "fsync", fsync)  # once started: its recovery syncs too
        loop.start()
        assert hung.wait(10.0)
        with fake_session(server.address, private=False, timeout_s=5.0) as session:
            assert session.stats()["disk_keys"] == 0
        assert hung.is_set() and not answers.is_set()  # still hung while it answered
    finally:
        answers.set()
        stop.set()
        loop.join(10.0)
        server.close()
    assert not loop.is_alive()


def _copy(tier: TierManager, keys: list[bytes]) -> dict[bytes, tuple[int, int] | str]:
    """The tier's copy of a shared host's index for ``keys``: DRAM slot and digest, or on disk."""
    copy: dict[bytes, tuple[int, int] | str] = {}
    with tier._lock:
        index = tier._index
        for key in keys:
            holder = index.holder(key)
            if holder is not None:
                (slot,), (digest,) = holder.find([key])  # type: ignore[union-attr]
                copy[key] = (slot, digest)
            elif index.disk_holder(key) is not None:
                copy[key] = "disk"
    return copy


def test_a_tier_joining_while_keys_are_stored_evicted_and_promoted_ends_with_the_hosts_index(
    tmp_path: Path,
) -> None:
    """A tier joins a host with a disk while another stores, evicts (to disk) and promotes at
    full speed, its snapshot walked one slot per page so that every page races the changes:
    once they stop, its copy is exactly that of a tier that joined after (the host's index),
    and every load it makes is a hit with the stored bytes or a miss."""
    from unittest import mock

    from torch_kv_tier.remote import shared_snapshot
    from torch_kv_tier.remote.server import Server
    from torch_kv_tier.remote.server_config import ServerConfig

    config = ServerConfig(
        num_blocks=POOL_BLOCKS, block_len=BLOCK_LEN, max_grant=8, disk_admit=1,
        disk_paths=(str(tmp_path / "disk"),), disk_bytes=128 * BLOCK_LEN,
    )  # fmt: skip
    keys = [f"doc-{i}".encode() for i in range(192)]
    stop, churned = threading.Event(), threading.Event()
    with (
        mock.patch.object(shared_snapshot, "CHUNK", 1),
        mock.patch.object(shared_snapshot, "SCAN_SLOTS", 1),
        mock.patch.object(shared_snapshot, "MAX_WALK", 1),
    ):
        server = Server(config)
        serving = threading.Thread(target=server.serve, args=(stop,), daemon=True)
        serving.start()
        try:
            with (
                TierManager.create(384, BLOCK_LEN, name="writer") as writer,
                TierManager.create(192, BLOCK_LEN, name="joiner") as joiner,
            ):
                writer.connect(server.address)
                original = fill_random(writer)[:192]  # blocks 192..: loads land there
                rng = torch.Generator().manual_seed(7)

                def churn() -> None:
                    while not churned.is_set():
                        picked = torch.randperm(192, generator=rng)[:8].tolist()
                        batch = [keys[i] for i in picked]
                        if torch.rand(1, generator=rng).item() < 0.5:
                            writer.store(batch, picked).result(timeout=RESULT_TIMEOUT_S)
                        else:  # promotions of what is on disk
                            into = [192 + i for i in picked]
                            writer.load(batch, into).result(timeout=RESULT_TIMEOUT_S)

                churner = threading.Thread(target=churn, daemon=True)
                churner.start()
                time.sleep(0.5)
                joiner.connect(server.address)
                time.sleep(0.5)
                churned.set()
                churner.join(timeout=RESULT_TIMEOUT_S)
                assert not churner.is_alive()
                time.sleep(1.0)  # the host's copies to disk and its events settle
                with TierManager.create(192, BLOCK_LEN, name="late") as late:
                    late.connect(server.address)
                    expected = _copy(late, keys)
                    assert wait_for(lambda: _copy(joiner, keys) == expected, 10.0), sorted(
                        set(_copy(joiner, keys).items()) ^ set(expected.items())
                    )
                held = [k for k in keys if k in expected]
                at = [keys.index(k) for k in held]
                loaded = joiner.load(held, at).result(timeout=RESULT_TIMEOUT_S)
                got = [at[i] for i, k in enumerate(held) if k not in loaded.failed]
                assert set(loaded.failed.values()) <= {MISSING}, loaded.failed
                assert torch.equal(joiner.arena.tensor[got], original[got])
        finally:
            stop.set()
            serving.join(timeout=10)
            server.close()
