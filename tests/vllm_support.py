"""vLLM's ``OffloadingConfig`` as its offloading connector builds it for one single-rank model,
for tests that build an offloading spec without an engine (vLLM 0.32 and 0.33)."""

from __future__ import annotations

import uuid
from typing import Any

from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)


def offloading_config(
    extra_config: dict[str, Any], block_bytes: int, *, kv_events: bool = False, **fields: Any
) -> OffloadingConfig:
    """One KV group of 16-token blocks of ``block_bytes`` each, one block per chunk, rank 0 of 1;
    ``fields`` override ``OffloadingConfig`` fields (e.g. ``canonical_layout=True``)."""
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("layer.0",), group_id=0),),
        worker_kv_bytes_per_block=block_bytes,
        enable_kv_cache_events=kv_events,
        extra_config=extra_config,
        engine_id=f"test-{uuid.uuid4().hex[:8]}",
        model=OffloadingModelConfig(name="test-model", dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
        **fields,
    )
