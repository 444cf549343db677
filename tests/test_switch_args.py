"""Every public switch (``private``, ``strict``, ``verify``, ...) takes a ``bool`` and refuses
anything else with a ``TypeError`` naming it (``quantities.flag``), before anything is
allocated, started or dialled: a str from a config file (``"false"``) was true."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from late_write_support import LateWriteTransport

from torch_kv_tier.arena import BlockArena
from torch_kv_tier.integrations.torch_loop import PagedKVOffloader
from torch_kv_tier.manager import TierManager
from torch_kv_tier.membership import Membership, StaticHosts


def _caches() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return [torch.zeros(4, 4, 2, 64)], [torch.zeros(4, 4, 2, 64)]


BLOCK_LEN = PagedKVOffloader.block_len_for(*_caches())


def _tier(**kwargs: Any) -> TierManager:
    arena = BlockArena(4, BLOCK_LEN)
    return TierManager(arena, LateWriteTransport(arena.tensor), **kwargs)


# each public call, with the value under test as its switch, and that switch's name
CALLS: dict[str, tuple[str, Callable[[TierManager, Any], object]]] = {
    "TierManager(verify)": ("verify", lambda _, v: _tier(verify=v)),
    "TierManager(events)": ("events", lambda _, v: _tier(events=v)),
    "TierManager(compact_index)": ("compact_index", lambda _, v: _tier(compact_index=v)),
    "TierManager.create(verify)": ("verify", lambda _, v: TierManager.create(4, 64, verify=v)),
    "TierManager.connect(private)": (
        "private",
        lambda tier, v: tier.connect("127.0.0.1:1", private=v, slots=4),
    ),
    "Membership(private)": (
        "private",
        lambda tier, v: Membership(
            tier, StaticHosts(["127.0.0.1:1"]), connect_kwargs={"private": v}
        ),
    ),
    "BlockArena(pin_memory)": ("pin_memory", lambda _, v: BlockArena(4, 64, pin_memory=v)),
    "PagedKVOffloader(strict)": (
        "strict",
        lambda tier, v: PagedKVOffloader(*_caches(), tier, strict=v),
    ),
    "PagedKVOffloader.create(strict)": (
        "strict",
        lambda _, v: PagedKVOffloader.create(*_caches(), strict=v),
    ),
    "PagedKVOffloader.create(private)": (
        "private",
        lambda _, v: PagedKVOffloader.create(*_caches(), remote="127.0.0.1:1", private=v),
    ),
}


@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("value", ["false", 0, 1], ids=repr)
def test_a_switch_that_is_no_bool_is_refused_naming_it(call: str, value: object) -> None:
    """Found by review: ``connect(private="false")`` leased private slots (the str is true),
    ``PagedKVOffloader.create(strict="no")`` raised for the first host down, and
    ``BlockArena(pin_memory="no")`` failed saying ``pin_memory=True``. Each is refused, naming
    the switch and what to pass, before a tier, a thread or a dial exists."""
    name, run = CALLS[call]
    with _tier() as tier:
        threads = threading.active_count()
        with pytest.raises(TypeError, match=rf"^{name} must be True or False, got .*: pass e\.g\."):
            run(tier, value)
        assert threading.active_count() == threads, "refused, yet a thread started"
