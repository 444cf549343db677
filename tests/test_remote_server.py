"""``torch-kv-tier serve`` as a child process: start-up and exit, what it imports, its ports
and metrics, its index out of the garbage collector's reach. (Handshakes and leases, bad input
and liveness: ``test_remote_server_*.py``.)"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from remote_server_support import metrics_page, module_open_server
from remote_support import (
    BLOCK_LEN,
    fake_session,
    fill_random,
    free_port,
    wait_for,
)

from torch_kv_tier.manager import TierManager
from torch_kv_tier.remote import ServerProcess
from torch_kv_tier.remote.server import Server

open_server = module_open_server()


def test_sigterm_exits_zero_within_5s_releasing_everything() -> None:
    server = ServerProcess.start(16, BLOCK_LEN, extra_args=["--metrics-port", "0"])
    try:
        session = fake_session(server.address, heartbeat_timeout_s=30)
        t0 = time.monotonic()
        code = server.stop(timeout=10)
        elapsed = time.monotonic() - t0
    finally:
        server.kill()
    session.close()  # the server is gone: close must still return promptly
    assert code == 0, server.stderr
    assert elapsed < 5
    assert "closed" in server.stderr  # the NIXL registration was released
    assert server.stderr.rstrip().endswith("stopped")


# the host's sitecustomize: at exit it writes whether the host imported torch
_TORCH_AT_EXIT = """\
import atexit, os, sys

def _report():
    with open(os.environ["TKVT_TORCH_IMPORTED"], "w") as out:
        out.write(str("torch" in sys.modules))

atexit.register(_report)
"""


def test_a_host_never_imports_torch_and_serves_its_pool_disk_and_metrics(tmp_path: Path) -> None:
    """``serve`` with a DRAM pool starts without importing torch (~1.2 s of CPU per start): the
    pool is numpy memory, NIXL's backend is chosen without torch, the package imports lazily;
    its tiers still get their bytes back, and the disk tier and metrics still work."""
    (tmp_path / "sitecustomize.py").write_text(_TORCH_AT_EXIT)
    report = tmp_path / "torch_imported"
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    keys = [f"no-torch-{i}".encode() for i in range(16)]
    with (
        ServerProcess.start(
            32,
            BLOCK_LEN,
            extra_args=[
                "--disk", str(tmp_path / "disk"), "--disk-bytes", str(64 * BLOCK_LEN),
                "--disk-admit", "1", "--metrics-port", "0",
            ],
            env={"PYTHONPATH": path, "TKVT_TORCH_IMPORTED": str(report)},
        ) as server,
        TierManager.create(16, BLOCK_LEN, name="writer") as writer,
        TierManager.create(16, BLOCK_LEN, name="reader") as reader,
    ):  # fmt: skip
        writer.connect(server.address)
        reader.connect(server.address)
        original = fill_random(writer)
        assert writer.store(keys, range(16)).result(timeout=30).ok
        assert wait_for(lambda: reader.lookup(keys) == len(keys), timeout_s=10)
        loaded = reader.load(keys, range(16)).result(timeout=30)
        assert loaded.ok, loaded.failed
        assert torch.equal(reader.arena.tensor, original)
        session = fake_session(server.address, private=False)
        assert wait_for(lambda: session.stats()["disk_copies"] == len(keys), timeout_s=10)
        port = session.stats()["metrics_port"]
        session.close()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            assert "torch_kv_tier_server_disk_keys 16\n" in response.read().decode()
        assert server.stop(timeout=10) == 0, server.stderr
    assert report.read_text() == "False"  # (absent: its sitecustomize never ran)


def test_every_public_name_of_the_lazy_package_resolves() -> None:
    """The package imports its public names on first use: each of ``__all__`` still resolves."""
    import torch_kv_tier

    for name in torch_kv_tier.__all__:
        assert getattr(torch_kv_tier, name).__name__ == name
    with pytest.raises(AttributeError, match="no attribute 'Tier'"):
        torch_kv_tier.Tier  # noqa: B018


def test_nixl_is_loaded_without_torch_from_the_backend_import_nixl_picks() -> None:
    """``import_nixl_api`` loads the backend wheel ``import nixl`` would, in a fresh process."""
    api = "sys.modules['nixl._api'].__name__"
    plain = f"import sys, nixl._api; print({api})"
    ours = (
        "import sys; from torch_kv_tier.transport.nixl_import import import_nixl_api; "
        f"import_nixl_api(); print({api}, 'torch' in sys.modules)"
    )
    picked = [
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
        ).stdout.split()
        for code in (plain, ours)
    ]
    assert picked[1] == [picked[0][0], "False"]


def test_a_lease_timeout_of_years_still_binds_its_port() -> None:
    """The host pings silent connections every lease timeout: one longer than ZeroMQ's option
    holds is capped, not an ``OverflowError`` at start."""
    Server._bind("127.0.0.1", 0, 1e8).close(linger=0)


def test_refuses_non_loopback_without_token_and_a_busy_port_saying_why(
    open_server: ServerProcess,
) -> None:
    with pytest.raises(RuntimeError) as info:
        ServerProcess.start(8, BLOCK_LEN, host="0.0.0.0")
    assert "code 2" in str(info.value)
    assert "refusing to listen on 0.0.0.0 without a token" in str(info.value)
    busy_port = open_server.address.rsplit(":", 1)[1]
    with pytest.raises(RuntimeError) as info:
        ServerProcess.start(8, BLOCK_LEN, extra_args=["--port", busy_port])
    assert "code 1" in str(info.value)
    assert f"cannot listen on tcp://127.0.0.1:{busy_port}" in str(info.value)


def test_a_metrics_scrape_during_start_up_gets_the_stats(monkeypatch: pytest.MonkeyPatch) -> None:
    """The metrics port serves from the start; a scrape that comes while the pool is still being
    made waits for it and answers the whole stats, not an error."""
    from torch_kv_tier.remote import server as server_module
    from torch_kv_tier.remote.server_config import ServerConfig

    port = free_port()
    answers: list[str | BaseException] = []

    def scrape() -> None:
        try:
            answers.append(metrics_page(port))
        except BaseException as exc:
            answers.append(exc)

    scraper = threading.Thread(target=scrape)
    make_pool = server_module.make_pool

    def slow_pool(num_blocks: int, block_len: int) -> Any:
        scraper.start()  # the metrics server is up; the control plane is not built yet
        time.sleep(0.3)
        return make_pool(num_blocks, block_len)

    monkeypatch.setattr(server_module, "make_pool", slow_pool)
    server = server_module.Server(
        ServerConfig(num_blocks=8, block_len=BLOCK_LEN, metrics_port=port)
    )
    try:
        scraper.join(timeout=10)
        assert len(answers) == 1 and isinstance(answers[0], str), answers
        assert "torch_kv_tier_server_sessions 0\n" in answers[0]
    finally:
        server.close()


def test_a_serving_hosts_index_is_out_of_the_garbage_collectors_reach() -> None:
    """Found by review: a full collection traversed the host's index, millions of keys, in
    the loop: 0.23 s per million keys in DRAM and on disk (1 s at 4 M), every tier's control
    plane stalled meanwhile. The loop freezes the index's containers when it starts and a
    namespace's entries once it is made, so a collection no longer walks them."""
    import gc

    from torch_kv_tier.remote.server import Server
    from torch_kv_tier.remote.server_config import ServerConfig

    def tracked(obj: object) -> bool:
        return any(o is obj for o in gc.get_objects())

    server = Server(ServerConfig(num_blocks=32, block_len=BLOCK_LEN))
    try:
        cache = server._control.shared.cache
        stop = mock.Mock(spec=threading.Event)
        stop.is_set.side_effect = [False, True]  # one turn of the loop
        server.serve(stop, freeze_index=True)  # as `torch-kv-tier serve` does
        assert not tracked(cache._lru) and not tracked(cache._owners.pairs)
        cache.join("s", "ns")  # as a handshake does
        entries = cache.namespace_of("s").entries
        entries[b"k"] = 0
        assert tracked(entries)
        server._freeze_index()  # the loop's next turn
        assert not tracked(entries)
    finally:
        gc.unfreeze()
        server.close()
