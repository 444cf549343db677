"""``mooncake_tcp``: Mooncake's TransferEngine over TCP with its P2P handshake (no etcd).

Optional: needs ``pip install mooncake-transfer-engine-non-cuda`` (on GPU machines
``mooncake-transfer-engine``) and the system's ``libibverbs1``, which the wheel links against.
Mooncake cannot write into a ``torch-kv-tier serve`` pool, so its target is its own engine in a
child process (``python -m torch_kv_tier.benchmarks.mooncake_target BYTES``) on loopback, with a
pool of the same size. Calls are ``batch_transfer_async_write``/``_read`` with one entry per run of
blocks contiguous on both sides (merged as NIXL merges), completed with
``get_batch_transfer_status`` (oldest batch first; see ``MooncakeTcp.reap``).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import select
import subprocess
import sys
import time
from collections.abc import Hashable, Iterator
from typing import Any

from torch_kv_tier.benchmarks.core import Call, Op, Skip, System, TransferFailed
from torch_kv_tier.benchmarks.remote import Target
from torch_kv_tier.benchmarks.system_nixl_raw import local_arena

_START_S = 60.0


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence file descriptor 2: Mooncake's glog writes INFO lines there from C++ at setup and
    teardown, whatever Python's logging says. Failures are still reported by return codes."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


_engine_cache: list[Any] = []  # one initiator engine per process, reused by every block size


def _engine() -> Any:
    """A TransferEngine initialised for TCP with the P2P handshake (cached per process)."""
    if _engine_cache:
        return _engine_cache[0]
    try:
        os.environ.setdefault("GLOG_minloglevel", "1")  # no INFO line per batch transfer
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise Skip(
            f"Mooncake not importable ({exc}); pip install mooncake-transfer-engine-non-cuda "
            "(and apt-get install libibverbs1)"
        ) from exc
    with _quiet_stderr():
        engine = TransferEngine()
        ok = engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    if not ok:
        raise Skip("Mooncake TransferEngine.initialize(P2PHANDSHAKE, tcp) failed")
    _engine_cache.append(engine)
    atexit.register(_drop_engine)
    return engine


def _drop_engine() -> None:
    """At exit: destroy the engine with stderr silenced (its destructor logs at INFO)."""
    with _quiet_stderr():
        _engine_cache.clear()
        gc.collect()


class _Target:
    """The child process holding Mooncake's target pool; stopped on close."""

    def __init__(self, nbytes: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "torch_kv_tier.benchmarks.mooncake_target", str(nbytes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], _START_S)
        line = self.proc.stdout.readline() if ready else ""
        parts = line.split()
        if len(parts) != 3 or parts[0] != "ready":
            self.close()
            raise Skip(f"Mooncake target did not start (said {line.strip()!r})")
        self.session, self.base_addr = parts[1], int(parts[2])

    def close(self) -> None:
        """Close its stdin (it exits), kill it if it does not within 5 s."""
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


class MooncakeTcp(System):
    """Mooncake TransferEngine (TCP) between the local arena and a target process."""

    name = "mooncake_tcp"
    remote_layout = "mirror"

    def __init__(self, target: Target) -> None:
        if target.device != "cpu":
            raise Skip("the CPU (non-CUDA) Mooncake wheel moves host memory only")
        if not target.embedded:
            raise Skip("Mooncake needs its own target engine; with --remote it would stay local")
        self.local = local_arena(target, pinned=False)
        self.remote_slots = target.remote_slots
        self._block_len = target.block_len
        self._pending: dict[int, None] = {}  # batch ids in submission order
        self._registered: int | None = None
        self._engine = _engine()
        self._target: _Target | None = _Target(target.remote_slots * target.block_len)
        if self._engine.register_memory(self.local.data_ptr(), self.local.numel()) != 0:
            self.close()
            raise Skip("Mooncake could not register the local arena")
        self._registered = self.local.data_ptr()

    def _entries(self, call: Call) -> tuple[list[int], list[int], list[int]]:
        """(local addresses, remote addresses, lengths): one entry per run of the call."""
        assert self._target is not None
        bl, local, remote = self._block_len, self.local.data_ptr(), self._target.base_addr
        spans = call.spans
        return (
            [local + lo * bl for lo, _, _ in spans],
            [remote + ro * bl for _, ro, _ in spans],
            [n * bl for _, _, n in spans],
        )

    def submit(self, op: Op, call: Call) -> Hashable:
        assert self._target is not None
        local, remote, lengths = self._entries(call)
        post = (
            self._engine.batch_transfer_async_write
            if op == "write"
            else self._engine.batch_transfer_async_read
        )
        batch_id = post(self._target.session, local, remote, lengths)
        if batch_id < 0:
            raise TransferFailed(f"Mooncake refused a {op} ({batch_id})")
        self._pending[batch_id] = None
        return batch_id

    def reap(self, timeout: float) -> list[tuple[Hashable, float]]:
        """Wait for the oldest batch. ``transfer_check_status`` is no completion test for a
        batch of several entries (it looks at the first entry only, then frees the batch; bytes
        of the other entries were seen landing after it said done), so this blocks in
        ``get_batch_transfer_status``, the call that waits for every entry."""
        if not self._pending:
            return []
        batch_id = next(iter(self._pending))
        status = self._engine.get_batch_transfer_status([batch_id])
        del self._pending[batch_id]
        if status != 0:
            raise TransferFailed(f"Mooncake batch failed (status {status})")
        return [(batch_id, time.perf_counter())]

    def close(self) -> None:
        for batch_id in list(self._pending):  # never unregister memory under a transfer
            self._engine.get_batch_transfer_status([batch_id])
        self._pending.clear()
        with _quiet_stderr():
            if self._registered is not None:
                self._engine.unregister_memory(self._registered)
                self._registered = None
            if self._target is not None:
                self._target.close()
                self._target = None
