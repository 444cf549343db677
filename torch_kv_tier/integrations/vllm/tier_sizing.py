"""How large vLLM's CPU primary tier must be for ``RemoteHostTier`` to serve concurrent prefixes.

Every chunk promoted from a remote host lands in the CPU primary tier first, and a request can
load its prefix into the GPU only once *all* of that prefix's chunks are there at once. So the
tier admits promotions into at most :data:`PROMOTION_SHARE` of the primary tier's chunks (see
:mod:`torch_kv_tier.integrations.vllm.admission`); the rest absorbs what vLLM writes there at
the same time (every computed chunk is stored to the CPU tier and, while it is cascaded to the
remote host, pinned there). The rule, per concurrently promoted request::

    cpu_bytes_to_use >= concurrency x ceil(prefix_tokens / tokens_per_chunk) x chunk_bytes
                        / PROMOTION_SHARE

A smaller tier stays correct: the requests that do not fit are recomputed at once (their
lookups answer MISS), they just gain nothing from the remote host. Pure functions, plus
:func:`tokens_per_chunk` for vLLM's offloading spec; no vLLM import.
"""

from __future__ import annotations

import logging
import math
from typing import Any

logger = logging.getLogger(__name__)

PROMOTION_SHARE = 0.5
_MIB = 1 << 20


def promotion_budget(primary_chunks: int) -> int:
    """Chunks of a ``primary_chunks``-chunk CPU tier that promotions may occupy at once."""
    return int(primary_chunks * PROMOTION_SHARE)


def chunks_per_prefix(prefix_tokens: int, tokens_per_chunk: int) -> int:
    return max(1, math.ceil(prefix_tokens / tokens_per_chunk))


def recommended_cpu_bytes(
    concurrency: int, prefix_tokens: int, tokens_per_chunk: int, chunk_bytes: int
) -> int:
    """``cpu_bytes_to_use`` (rounded up to a MiB) for ``concurrency`` requests to have their
    whole ``prefix_tokens``-token prefixes promoted at once."""
    chunks = concurrency * chunks_per_prefix(prefix_tokens, tokens_per_chunk)
    nbytes = math.ceil(chunks / PROMOTION_SHARE) * chunk_bytes
    return math.ceil(nbytes / _MIB) * _MIB


def concurrent_prefixes(primary_chunks: int, prefix_tokens: int, tokens_per_chunk: int) -> int:
    """How many whole ``prefix_tokens``-token prefixes a tier of ``primary_chunks`` promotes
    at once (0: not even one; such a prefix is then always recomputed)."""
    return promotion_budget(primary_chunks) // chunks_per_prefix(prefix_tokens, tokens_per_chunk)


def log_startup_sizing(
    primary_chunks: int,
    chunk_bytes: int,
    tokens_per_chunk: int,
    prefix_tokens: int | None,
    concurrency: int,
) -> bool | None:
    """Log what this CPU tier promotes at once for ``concurrency`` requests of
    ``prefix_tokens``-token prefixes; warn, with the size to use, when it cannot serve them
    all, or not one. Returns whether the size suffices for ``concurrency`` (``None``, and
    only the tier's size logged, when ``prefix_tokens`` is not configured)."""
    if prefix_tokens is None:
        logger.info(
            "RemoteHostTier sizing: the CPU primary tier holds %d chunks of %d tokens, "
            "promotions up to %d; set expected_prefix_tokens (and expected_concurrency) to "
            "have the size checked",
            primary_chunks,
            tokens_per_chunk,
            promotion_budget(primary_chunks),
        )
        return None
    fits = concurrent_prefixes(primary_chunks, prefix_tokens, tokens_per_chunk)
    need = recommended_cpu_bytes(concurrency, prefix_tokens, tokens_per_chunk, chunk_bytes)
    have = primary_chunks * chunk_bytes
    logger.info(
        "RemoteHostTier sizing: the CPU primary tier holds %d chunks (%.1f MiB); promotions use "
        "up to %d of them, i.e. %d concurrent %d-token prefixes (%d chunks of %d tokens each); "
        "%d concurrent requests need cpu_bytes_to_use >= %d (%.0f MiB)",
        primary_chunks,
        have / _MIB,
        promotion_budget(primary_chunks),
        fits,
        prefix_tokens,
        chunks_per_prefix(prefix_tokens, tokens_per_chunk),
        tokens_per_chunk,
        concurrency,
        need,
        need / _MIB,
    )
    if fits == 0:
        one = recommended_cpu_bytes(1, prefix_tokens, tokens_per_chunk, chunk_bytes)
        logger.warning(
            "RemoteHostTier: the CPU primary tier (cpu_bytes_to_use=%d) can never promote a "
            "whole %d-token prefix, so such requests are always recomputed (admission "
            "promotes whole prefixes only); use cpu_bytes_to_use >= %d for one at a time, "
            ">= %d for %d concurrent",
            have,
            prefix_tokens,
            one,
            need,
            concurrency,
        )
    elif fits < concurrency:
        logger.warning(
            "RemoteHostTier: the CPU primary tier (cpu_bytes_to_use=%d) promotes only %d "
            "concurrent %d-token prefixes; with %d concurrent requests the rest are recomputed. "
            "Use cpu_bytes_to_use >= %d",
            have,
            fits,
            prefix_tokens,
            concurrency,
            need,
        )
    return fits >= concurrency


def tokens_per_chunk(spec: Any) -> int:
    """Tokens one chunk of vLLM's offloading ``spec`` holds (block size x
    ``blocks_per_chunk``; 1 when the spec does not say)."""
    tokens_per_block = getattr(spec, "tokens_per_block", None) or (1,)
    return max(1, int(tokens_per_block[0]) * int(getattr(spec, "blocks_per_chunk", 1)))


__all__ = [
    "PROMOTION_SHARE",
    "chunks_per_prefix",
    "concurrent_prefixes",
    "log_startup_sizing",
    "promotion_budget",
    "recommended_cpu_bytes",
    "tokens_per_chunk",
]
