"""``CPUKVCopyWorker``: vLLM's offload worker for an engine whose KV cache lives in CPU memory.

vLLM's own ``CPUOffloadingWorker`` copies with CUDA streams and asserts CUDA tensors, so an
engine on vLLM's CPU platform cannot offload KV at all. This worker does the same job on the CPU:
it copies KV pages between the engine's KV cache tensors and the worker's view of the offload
primary tier (vLLM's ``SharedOffloadRegion``) with one vectorised gather and one scatter per KV
cache tensor per job (never a Python loop per block). They are numpy fancy-indexing copies over
the same memory: numpy moves each page as one contiguous row copy, where torch's index ops on
``int8`` rows copy byte by byte (128 KiB pages, measured here: about 14 vs 1-3 GB/s).

Layouts: the engine side is what vLLM's offloading connector hands every worker, a
``CanonicalKVCaches`` of ``int8 [num_blocks, page_bytes]`` tensors whose rows may be strided
(per-layer block-major caches such as the CPU attention backend's ``LBHNC``, and packed
cross-layer blocks). Refused with a ``ValueError`` at construction: tensors that are not on the
CPU, not 2-D ``int8`` rows with unit inner stride (and, in the spec, ``canonical_layout``:
the parallelism-agnostic page mapping, whose ``CopyRun`` lists this worker does not interpret).
A job whose ids do not fit its group sizes, the region or the tensors is refused with a
``ValueError`` before anything is copied.

Threading and ordering: vLLM calls the worker from its model-runner thread only. A job's copy
runs to completion inside ``submit_store``/``submit_load`` (the CPU has no copy engine to
overlap with), so jobs finish in submission order, a store reads KV the model already wrote,
and a load's KV is in place before the forward pass that needs it. ``get_finished`` reports
each job once. Ownership: the worker owns the ``SharedOffloadRegion`` it is given and releases
it in ``shutdown``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

logger = logging.getLogger(__name__)


def check_cpu_kv_caches(kv_caches: CanonicalKVCaches) -> None:
    """Raise ``ValueError`` naming the first KV cache tensor or layer this worker cannot copy."""
    for i, entry in enumerate(kv_caches.tensors):
        t = entry.tensor
        if t.device.type != "cpu":
            raise ValueError(
                f"KV cache tensor {i} is on {t.device}; CPUTieringOffloadingSpec serves engines "
                "on vLLM's CPU platform only (use TieringOffloadingSpec on a GPU)"
            )
        if t.dtype != torch.int8 or t.ndim != 2 or t.stride(1) != 1:
            raise ValueError(
                f"KV cache tensor {i} is {t.dtype} {tuple(t.shape)} with strides {t.stride()}; "
                "CPUTieringOffloadingSpec copies int8 [num_blocks, page_bytes] rows with unit "
                "inner stride"
            )
    for g, refs in enumerate(kv_caches.group_data_refs):
        for ref in refs:
            if ref.page_size_bytes > kv_caches.tensors[ref.tensor_idx].tensor.shape[1]:
                raise ValueError(
                    f"KV cache group {g}: a layer's page ({ref.page_size_bytes} B) exceeds its "
                    f"tensor's row ({kv_caches.tensors[ref.tensor_idx].tensor.shape[1]} B)"
                )


class CPUKVCopyWorker(OffloadingWorker):
    """Copies KV pages between CPU KV cache tensors and the offload primary tier's rows.

    Args:
        kv_caches: the engine's KV caches, as vLLM's offloading connector canonicalizes them.
        blocks_per_chunk: engine blocks per offloaded chunk.
        mmap_region: this worker's ``SharedOffloadRegion`` (owned from now on).
    """

    def __init__(
        self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, mmap_region: Any
    ) -> None:
        check_cpu_kv_caches(kv_caches)
        self._region = mmap_region
        self._blocks_per_chunk = blocks_per_chunk
        self._refs: list[list[CanonicalKVCacheRef]] = kv_caches.group_data_refs
        # numpy views (no copies) of the engine's tensors, and of the host side of each:
        # [num_chunks, blocks_per_chunk, page_bytes], rows strided by the region's interleaving
        # of every tensor (and rank) of a chunk.
        self._kv: list[np.ndarray] = [entry.tensor.numpy() for entry in kv_caches.tensors]
        self._host: list[np.ndarray] = [
            mmap_region.create_next_worker_view(entry.page_size_bytes * blocks_per_chunk)
            .unflatten(1, (blocks_per_chunk, entry.page_size_bytes))
            .numpy()
            for entry in kv_caches.tensors
        ]
        self._finished: list[TransferResult] = []
        logger.info(
            "CPU KV offload worker: %d KV tensor(s), %d block(s) per chunk, %d chunk(s)",
            len(self._kv),
            blocks_per_chunk,
            self._host[0].shape[0] if self._host else 0,
        )

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        """Copy engine blocks ``src_spec`` into primary-tier chunks ``dst_spec``; done on return."""
        return self._transfer(job_id, src_spec, dst_spec, to_host=True)

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        """Copy primary-tier chunks ``src_spec`` into engine blocks ``dst_spec``; done on return.

        ``expedited`` (vLLM 0.33) changes nothing: no load ever queues behind another."""
        return self._transfer(job_id, dst_spec, src_spec, to_host=False)

    def get_finished(self) -> list[TransferResult]:
        finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        """Nothing to wait for: every job finished inside its submit call."""

    def shutdown(self) -> None:
        """Drop the views and release the shared region (its file too, unless the scheduler
        already unlinked it: ``cpu_spec``). Idempotent."""
        self._host.clear()
        self._kv.clear()
        region, self._region = self._region, None
        if region is not None:
            if not os.path.exists(region.mmap_path):
                region._creator = False  # nothing to unlink (vLLM would warn)
            region.cleanup()

    def _transfer(
        self, job_id: int, engine: GPULoadStoreSpec, host: LoadStoreSpec, *, to_host: bool
    ) -> bool:
        if not isinstance(host, BlockIDsLoadStoreSpec):
            raise TypeError(f"CPU KV offload worker expects chunk ids, got {type(host).__name__}")
        start = time.perf_counter()
        plan = self._plan(job_id, engine, host)  # raises before any byte is copied
        nbytes = 0
        for refs, blocks, rows, subs in plan:
            nbytes += _copy_group(self._kv, self._host, refs, blocks, rows, subs, to_host)
        self._finished.append(TransferResult(job_id, True, nbytes, time.perf_counter() - start))
        return True

    def _plan(
        self, job_id: int, engine: GPULoadStoreSpec, host: BlockIDsLoadStoreSpec
    ) -> list[tuple[list[CanonicalKVCacheRef], np.ndarray, np.ndarray, np.ndarray]]:
        """Per KV cache group with blocks in the job: its refs, engine blocks, and the chunk row
        and sub-block of each. Raises ``ValueError`` when the ids do not fit the group sizes or
        the tensors (numpy would wrap a negative id onto another block)."""
        engine_ids = np.asarray(engine.block_ids, dtype=np.int64)
        chunk_ids = np.asarray(host.block_ids, dtype=np.int64)
        _check_range(job_id, "chunk id", chunk_ids, len(self._host[0]) if self._host else 0)
        plan = []
        engine_off = chunk_off = 0
        for refs, size, first in zip(self._refs, engine.group_sizes, engine.block_indices):
            if size == 0:
                continue
            n_chunks = -(-(first % self._blocks_per_chunk + size) // self._blocks_per_chunk)
            if chunk_off + n_chunks > len(chunk_ids):
                break
            rows, subs = _chunk_slots(
                chunk_ids[chunk_off:], first % self._blocks_per_chunk, size, self._blocks_per_chunk
            )
            blocks = engine_ids[engine_off : engine_off + size]
            bound = min((len(self._kv[ref.tensor_idx]) for ref in refs), default=0)
            _check_range(job_id, "block id", blocks, bound)
            plan.append((refs, blocks, rows, subs))
            engine_off += size
            chunk_off += n_chunks
        if engine_off != len(engine_ids) or chunk_off != len(chunk_ids):
            raise ValueError(
                f"job {job_id}: {len(engine_ids)} engine blocks / {len(chunk_ids)} chunks do not "
                f"match group sizes {list(engine.group_sizes)}"
            )
        return plan


def _check_range(job_id: int, what: str, ids: np.ndarray, bound: int) -> None:
    """Raise ``ValueError`` unless every one of ``ids`` is in ``[0, bound)``."""
    if len(ids) and (ids.min() < 0 or ids.max() >= bound):
        raise ValueError(
            f"job {job_id}: a {what} is outside [0, {bound}) (ids {ids.min()} to {ids.max()})"
        )


def _chunk_slots(
    chunk_ids: np.ndarray, skip: int, count: int, blocks_per_chunk: int
) -> tuple[np.ndarray, np.ndarray]:
    """Row and sub-block index of each of ``count`` blocks laid into ``chunk_ids`` after skipping
    ``skip`` sub-blocks of the first chunk."""
    slots = np.arange(skip, skip + count, dtype=np.int64)
    return chunk_ids[slots // blocks_per_chunk], slots % blocks_per_chunk


def _copy_group(
    kv: Sequence[np.ndarray],
    host: Sequence[np.ndarray],
    refs: Sequence[CanonicalKVCacheRef],
    blocks: np.ndarray,
    rows: np.ndarray,
    subs: np.ndarray,
    to_host: bool,
) -> int:
    """One gather + one scatter per KV tensor of the group; returns the bytes copied."""
    nbytes = 0
    for ref in refs:
        n = ref.page_size_bytes
        engine_pages = kv[ref.tensor_idx][:, :n]
        host_pages = host[ref.tensor_idx][:, :, :n]
        if to_host:
            host_pages[rows, subs] = engine_pages[blocks]
        else:
            engine_pages[blocks] = host_pages[rows, subs]
        nbytes += n * len(blocks)
    return nbytes
