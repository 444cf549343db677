"""``PagedKVOffloader.create``: a tier sized for the caches, connected to its hosts side by
side, wrapped in an offloader that owns it.

``PagedKVOffloader`` takes ``create`` from here as its classmethod. Its arguments are checked
before the tier is built; a failure once it is built closes it (its handshakes under way too).
Threading: any thread; it returns once every handshake answered or gave up
(``ParallelConnects``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from torch_kv_tier.integrations.torch_loop.offloader_args import connect_kwargs, tier_kwargs
from torch_kv_tier.manager import TierManager
from torch_kv_tier.overdue import TRANSFER_TIMEOUT_S
from torch_kv_tier.parallel_connects import ParallelConnects
from torch_kv_tier.remote.quantities import flag, seconds

if TYPE_CHECKING:
    from torch_kv_tier.integrations.torch_loop.offloader import PagedKVOffloader, Staging

__all__ = ["create"]


def create(
    cls: type[PagedKVOffloader],
    key_caches: Sequence[torch.Tensor],
    value_caches: Sequence[torch.Tensor],
    *,
    remote: str | Sequence[str] | None = None,
    token: str | None = None,
    private: bool = False,
    slots: int | None = None,
    staging: Staging = "host",
    arena_blocks: int = 64,
    name: str = "torch-loop",
    config_fields: dict[str, object] | None = None,
    timeout: float = 30.0,
    connect_timeout: float | None = None,
    strict: bool = False,
    reconnect_interval_s: float = 5.0,
    transfer_timeout_s: float = TRANSFER_TIMEOUT_S,
) -> PagedKVOffloader:
    """Build a tier sized for these caches, connect it to ``remote`` and wrap it.

    ``remote`` is one ``HOST:PORT`` of a ``torch-kv-tier serve`` host or a list of them
    (``token``/``private``/``slots``/``connect_timeout`` apply to each, as in
    ``PagedKVOffloader.connect``), all dialled side by side: hosts that do not answer delay
    ``create`` by one ``connect_timeout`` in all. A host that cannot be reached is logged and
    skipped (its pages are recomputed; one that does not answer is dialled again until it joins)
    unless ``strict``, which raises for the first one listed; arguments no host could accept
    raise ``ValueError`` before the tier is built (``PagedKVOffloader.connect``). ``timeout``
    and ``reconnect_interval_s`` are the offloader's (``PagedKVOffloader.__init__``); without
    ``connect_timeout`` each handshake waits the offloader's ``timeout``, but at most the tier's
    default (``CONNECT_TIMEOUT_S``, 10 s) and at least 0.1 s (as in
    ``PagedKVOffloader.connect``). A host with a transfer in flight ``transfer_timeout_s`` after
    its post is dropped and dialled again (0: never; see ``TierManager``); a restore's read from
    it keeps its arena slots until it is reported. ``staging="device"`` puts the arena on the
    caches' device (VRAM registration for CUDA caches); ``"host"`` puts it in host memory.
    ``arena_blocks`` arena slots bound how many pages are in flight at once; larger offloads and
    restores proceed in batches (a whole number > 0, numpy's taken; ``TypeError``/``ValueError``
    naming it otherwise).

    ``config_fields`` are hashed into the tier's config fingerprint, which a shared host
    partitions its pool by (and a host started with ``--config-fields`` checks). Unset, they
    are the caches' layout (``{"kv_layout": {dtype, layers, page shape}}``), so caches of
    another dtype or layout never restore these pages, whatever keys they use; set them,
    and put the dtype and layout in them yourself.
    """
    block_len = cls.block_len_for(key_caches, value_caches)
    timeout = seconds("timeout", timeout)
    reconnect_interval_s = seconds("reconnect_interval_s", reconnect_interval_s, zero=True)
    flag("strict", strict)
    remotes = [remote] if isinstance(remote, str) else list(remote or [])
    kwargs = connect_kwargs(
        remotes, timeout, connect_timeout, token=token, private=private, slots=slots
    )
    tier = tier_kwargs(arena_blocks, block_len, key_caches, staging, config_fields)
    manager = TierManager.create(**tier, name=name, transfer_timeout_s=transfer_timeout_s)
    connects = None
    try:
        offloader = cls(
            key_caches,
            value_caches,
            manager,
            owns_manager=True,
            timeout=timeout,
            strict=strict,
            reconnect_interval_s=reconnect_interval_s,
        )
        kwargs["redial_if_down"] = offloader._redial
        connects = ParallelConnects(manager, remotes, kwargs)
        for address, outcome in connects.outcomes():
            if isinstance(outcome, Exception):
                offloader._unavailable(address, outcome)
    except BaseException:
        manager.close()  # first: closing the tier ends the handshakes still under way
        raise
    finally:
        if connects is not None:
            connects.join(timeout)
    return offloader
