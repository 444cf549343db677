"""The checks of ``PagedKVOffloader``'s caches, pages and timeouts, the keyword arguments of its
connects and of the tier ``create`` builds (``tier_kwargs``), and what a failed connect of it
does (``unavailable``).

Each check raises ``ValueError`` (``TypeError`` for a value of the wrong type) naming a bad
argument, before the offloader touches memory or the network; none has state (any thread).
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Sequence
from typing import Any

import torch

from torch_kv_tier.connections import CONNECT_TIMEOUT_S, REDIAL_MAX_S
from torch_kv_tier.integrations.torch_loop.offload_results import OffloadError
from torch_kv_tier.keys import Key, check_keys
from torch_kv_tier.remote.connect_args import check_connect_args
from torch_kv_tier.remote.handshake_errors import not_ready
from torch_kv_tier.remote.quantities import CONNECT_TIMEOUT, count, seconds

__all__ = [
    "check_caches",
    "check_pages",
    "check_wait",
    "connect_kwargs",
    "tier_kwargs",
    "unavailable",
]

logger = logging.getLogger(__name__)


def connect_kwargs(
    addresses: Sequence[str],
    timeout: float,
    connect_timeout: float | None,
    *,
    token: str | None,
    private: bool,
    slots: int | None,
    **kwargs: Any,
) -> dict[str, Any]:
    """``TierManager.connect``'s keyword arguments for each of ``addresses``, once they are
    arguments a host could accept (``connect_args.check_connect_args``: ``ValueError``
    otherwise): ``token``, ``private``, ``slots``, ``kwargs``, and the handshake's
    ``connect_timeout`` (``None``: the offloader's ``timeout``, at least the handshake's floor,
    0.1 s, and at most ``CONNECT_TIMEOUT_S``; ``ValueError`` unless a finite number of at
    least that floor: ``quantities.CONNECT_TIMEOUT``)."""
    for address in addresses:
        check_connect_args(address, slots, private, token)
    if connect_timeout is None:
        connect_timeout = min(max(timeout, CONNECT_TIMEOUT.least_s), CONNECT_TIMEOUT_S)
    return {
        **kwargs,
        "token": token,
        "private": private,
        "slots": slots,
        "timeout_s": seconds("connect_timeout", connect_timeout, floor=CONNECT_TIMEOUT),
    }


def tier_kwargs(
    arena_blocks: int,
    block_len: int,
    key_caches: Sequence[torch.Tensor],
    staging: str,
    config_fields: dict[str, object] | None,
) -> dict[str, Any]:
    """``TierManager.create``'s keyword arguments but the tier's name and bound, for caches
    whose key pools are ``key_caches``: ``arena_blocks`` blocks (``quantities.count``) of
    ``block_len`` bytes on the caches' device (``staging="device"``) or in host memory
    (``"host"``; ``ValueError`` for another), fingerprinted by ``config_fields`` (``None``: the
    caches' layout, ``{"kv_layout": {dtype, layers, page shape}}``). A load past the bound waits
    for its read (``settle_late_loads=False``, see ``overdue``): settled, its arena slots would
    go back to the offloader's batches, whose next transfer into them the tier refuses."""
    if staging not in ("device", "host"):
        raise ValueError(f'staging must be "device" or "host", got {staging!r}')
    first = key_caches[0]
    layout = {"dtype": str(first.dtype), "layers": len(key_caches), "page": [*first.shape[1:]]}
    return {
        "num_blocks": count("arena_blocks", arena_blocks),
        "block_len": block_len,
        "device": str(first.device) if staging == "device" else "cpu",
        "config_fields": {"kv_layout": layout} if config_fields is None else config_fields,
        "settle_late_loads": False,
    }


def unavailable(address: str, exc: Exception, *, strict: bool, redialled: bool) -> bool:
    """``address`` failed to connect with ``exc`` (its connect had ``redial_if_down``
    when ``redialled``): ``strict``, raise ``OffloadError`` naming it; else log it once and
    return whether the tier dials it in the background now (``handshake_errors.not_ready``:
    it did not answer, was lost while joining, or refused for now)."""
    if strict:
        raise OffloadError(f"cannot connect to remote host {address}: {exc}") from exc
    later = redialled and not_ready(exc)
    logger.warning(
        "remote host %s unavailable, KV pages will be recomputed%s: %s",
        address,
        f" until it joins (the tier dials it again, up to every {REDIAL_MAX_S:g} s)"
        if later
        else "",
        exc,
    )
    return later


def check_wait(timeout: float | None) -> float | None:
    """``timeout`` as a float (``None`` stays): ``TypeError``/``ValueError`` unless it is
    ``None`` or a number of seconds >= 0 (``quantities.seconds``)."""
    return None if timeout is None else seconds("timeout", timeout, zero=True)


def check_caches(
    key_caches: Sequence[torch.Tensor], value_caches: Sequence[torch.Tensor]
) -> torch.Tensor:
    """The first cache, once ``ValueError`` did not say otherwise: the caches are equally many,
    all 4-D ``[num_pages, page_size, heads, head_dim]`` of one shape, floating dtype and device,
    and not empty."""
    caches = list(key_caches) + list(value_caches)
    if not key_caches or len(key_caches) != len(value_caches):
        raise ValueError(
            f"need one key and one value cache per layer, got {len(key_caches)} key and "
            f"{len(value_caches)} value caches"
        )
    first = caches[0]
    for cache in caches:
        if not isinstance(cache, torch.Tensor) or cache.dim() != 4:
            raise ValueError(
                "each cache must be a 4-D tensor [num_pages, page_size, heads, "
                f"head_dim], got {getattr(cache, 'shape', type(cache))}"
            )
        if (cache.shape, cache.dtype, cache.device) != (first.shape, first.dtype, first.device):
            raise ValueError(
                "all caches must share shape, dtype and device: "
                f"{tuple(cache.shape)} {cache.dtype} {cache.device} != "
                f"{tuple(first.shape)} {first.dtype} {first.device}"
            )
    if not first.dtype.is_floating_point:
        raise ValueError(f"caches must have a floating dtype, got {first.dtype}")
    if first.numel() == 0:
        raise ValueError(f"caches must not be empty, got shape {tuple(first.shape)}")
    return first


def check_pages(
    keys: Sequence[Key],
    page_ids: Sequence[int],
    num_pages: int,
    what: str,
    *,
    distinct: bool = False,
) -> tuple[list[Key], list[int]]:
    """``keys`` and ``page_ids`` of an ``offload`` or ``restore`` (``what``, named in each
    error) as lists, for caches of ``num_pages`` pages: ``TypeError`` for a non-key
    (``keys.check_keys``) or a page id that is no int (``operator.index``), ``ValueError`` for
    a repeated key, fewer or more page ids than keys, a page id outside ``0..num_pages - 1``
    or (``distinct``: a restore's pages) one given twice."""
    checked = check_keys(keys)  # TypeError for a non-key, ValueError for a repeat
    pages = [operator.index(p) for p in page_ids]
    if len(pages) != len(checked):
        raise ValueError(f"{what}: {len(pages)} page ids but {len(checked)} keys")
    bad = [p for p in pages if not 0 <= p < num_pages]
    if bad:
        raise ValueError(f"{what}: page ids {bad[:5]} outside 0..{num_pages - 1}")
    if distinct and len(set(pages)) != len(pages):
        raise ValueError(f"{what} page_ids must be distinct: two blocks cannot share a page")
    return checked, pages
