"""``vllm_nixl``: vLLM 0.33's own ``NixlTransport``, driven as its P2P tier drives it.

vLLM's tier hands ``write_blocks`` the slots its peer's allocator chose (remote layout
"pattern": independent of the local run structure) and polls with its peer id. The transport is
constructed exactly as vLLM constructs it (its own agent configuration, progress thread
included) over a 2-D memoryview of host memory, and registered with the same remote host as the
other NIXL systems. It has no read path; write points are verified by reading the remote blocks
back with a bare NIXL agent.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Hashable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from torch_kv_tier.benchmarks.core import Call, Op, Skip, System, TransferFailed, drain
from torch_kv_tier.benchmarks.remote import Target, open_session
from torch_kv_tier.benchmarks.system_nixl_raw import NixlRaw, local_arena

_PEER = "bench-remote"


class VllmNixl(System):
    """vLLM's ``NixlTransport`` over a host arena; write only."""

    name = "vllm_nixl"
    ops = ("write",)
    remote_layout = "pattern"

    def __init__(self, target: Target) -> None:
        if target.device != "cpu":
            raise Skip("vLLM's NixlTransport registers host memory only (a memoryview)")
        from torch_kv_tier.transport.ucx_env import apply_ucx_policy

        apply_ucx_policy()
        try:
            from vllm.v1.kv_offload.tiering.p2p.data import NixlTransport
        except ImportError as exc:
            raise Skip(f"vLLM 0.33 not importable ({exc}); pip install vllm==0.33.0") from exc
        self.local = local_arena(target, pinned=False)
        self._transport: Any = None
        self._session: Any = None
        # vLLM cannot read: a bare agent over the same arena, with a one-slot lease of its own,
        # reads vLLM's remote blocks back for verification.
        self._reader = NixlRaw(replace(target, remote_slots=1), arena=self.local)
        try:
            view = memoryview(self.local.numpy())  # type: ignore[arg-type]
            self._transport = NixlTransport(f"bench-vllm-{uuid.uuid4().hex[:12]}", view)
            self._session = open_session(
                target,
                self._transport.get_agent_metadata(),
                self._transport.base_addr,
                self._transport.num_blocks,
                "DRAM",
            )
            s = self._session
            self._transport.add_remote_peer(
                _PEER, s.agent_metadata, s.base_addr, s.num_blocks, s.block_len
            )
        except BaseException:
            self.close()
            raise
        self.remote_base = s.lease.start
        self.remote_slots = len(s.lease)

    def submit(self, op: Op, call: Call) -> Hashable:
        if op != "write":
            raise TransferFailed("vLLM's NixlTransport has no read path")
        tid = self._transport.write_blocks(_PEER, call.local_list, call.remote_list)
        if tid is None:
            raise TransferFailed("vLLM's write_blocks refused the transfer")
        return int(tid)

    def reap(self, timeout: float) -> list[tuple[Hashable, float]]:
        result = self._transport.poll(_PEER)
        if result.failed:
            raise TransferFailed(f"vLLM transfers failed: {list(result.failed)}")
        now = time.perf_counter()
        if not result.done:
            os.sched_yield()  # as nixl_raw and the tier do: the same driver for every system
        return [(tid, now) for tid in result.done]

    def fetch(self, calls: Sequence[Call], scratch: Sequence[np.ndarray]) -> None:
        """Read the remote blocks back with the bare NIXL reader (vLLM cannot read)."""
        reads = [Call(s, c.remote) for c, s in zip(calls, scratch, strict=True)]
        drain(self._reader, "read", reads, timeout=60.0)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        if self._session is not None:
            self._session.close()
            self._session = None
        self._reader.close()
