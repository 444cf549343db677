"""Every public call that takes a timeout or a duration takes a numpy int or float (as the
float every wait takes), and refuses what is no number of seconds (``quantities.seconds``)
with an error naming the parameter, before anything happens."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import numpy as np
import psutil
import pytest
import torch
from late_write_support import LateWriteTransport

from torch_kv_tier.arena import BlockArena
from torch_kv_tier.host_sources import make_resolver
from torch_kv_tier.integrations.torch_loop import PagedKVOffloader
from torch_kv_tier.manager import TierManager
from torch_kv_tier.membership import Membership, StaticHosts
from torch_kv_tier.remote import ServerProcess

NOT_SECONDS = [True, "5", None, Fraction(5), math.nan, math.inf, -1.0, 1e12, np.float32(-1)]
NUMPY = [np.int64(2), np.int32(2), np.float32(2.0), np.float64(2.0)]


def _caches() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Two layers' key and value caches of 4 pages."""
    return [torch.zeros(4, 4, 2, 64) for _ in range(2)], [
        torch.zeros(4, 4, 2, 64) for _ in range(2)
    ]


BLOCK_LEN = PagedKVOffloader.block_len_for(*_caches())


def _tier(**kwargs: Any) -> TierManager:
    arena = BlockArena(4, BLOCK_LEN)
    return TierManager(arena, LateWriteTransport(arena.tensor), **kwargs)


def _offloader(tier: TierManager, **kwargs: Any) -> PagedKVOffloader:
    return PagedKVOffloader(*_caches(), tier, **kwargs)


# each public call, with the value under test as its duration, and that parameter's name
CALLS: dict[str, tuple[str, Callable[[TierManager, Any], object]]] = {
    "TierManager.close": ("timeout", lambda tier, v: tier.close(timeout=v)),
    "TierManager()": ("max_poll_interval_s", lambda _, v: _tier(max_poll_interval_s=v).close()),
    "TierManager(transfer_timeout_s)": (
        "transfer_timeout_s",
        lambda _, v: _tier(transfer_timeout_s=v).close(),
    ),
    "Membership()": (
        "interval_s",
        lambda tier, v: Membership(tier, StaticHosts(["127.0.0.1:1"]), interval_s=v).stop(1.0),
    ),
    "Membership.stop": (
        "timeout",
        lambda tier, v: Membership(tier, StaticHosts(["127.0.0.1:1"])).stop(v),
    ),
    "PagedKVOffloader()": ("timeout", lambda tier, v: _offloader(tier, timeout=v)),
    "PagedKVOffloader(reconnect_interval_s)": (
        "reconnect_interval_s",
        lambda tier, v: _offloader(tier, reconnect_interval_s=v),
    ),
    "PagedKVOffloader.flush": ("timeout", lambda tier, v: _offloader(tier).flush(v)),
    "PagedKVOffloader.close": ("timeout", lambda tier, v: _offloader(tier).close(v)),
    "make_resolver": ("lifetime_s", lambda _, v: make_resolver("127.0.0.1", lifetime_s=v)),
}


@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("value", NOT_SECONDS, ids=repr)
def test_what_is_no_number_of_seconds_is_refused_naming_the_parameter(
    call: str, value: object
) -> None:
    """Found by review: ``close(timeout=True)`` closed at once; ``Membership(interval_s="5")``
    and an offloader's ``timeout="5"`` raised ``TypeError`` from a comparison, naming no
    parameter; ``Fraction`` and ``bool`` were taken (and a ``Fraction`` reached ``threading``'s
    waits, which refuse it). Each is refused, naming the parameter, before anything happens:
    the tier stays open (``None`` is the offloader's own default for ``flush``/``close``)."""
    name, run = CALLS[call]
    if value is None and call.startswith("PagedKVOffloader.") and name == "timeout":
        pytest.skip("None: the offloader's own timeout")
    tier = _tier()
    threads = threading.active_count()
    try:
        with pytest.raises((TypeError, ValueError), match=rf"^{name} must be"):
            run(tier, value)
        assert not tier.closed, "refused, yet the tier closed"
        assert threading.active_count() == threads, "refused, yet a thread started"
    finally:
        tier.close()


@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("value", NUMPY, ids=lambda v: type(v).__name__)
def test_a_numpy_number_of_seconds_is_taken(call: str, value: object) -> None:
    """Found by review: ``close(timeout=numpy.int64(5))`` raised ``TypeError``, and a
    ``numpy.float32`` was refused by ``connect`` or reached a wait that raised deep in
    ``threading``. Each is taken, as the float it is."""
    with _tier() as tier:
        CALLS[call][1](tier, value)


@pytest.mark.parametrize("value", NOT_SECONDS, ids=repr)
def test_a_server_started_with_no_number_of_seconds_is_refused_before_it_starts(
    value: object,
) -> None:
    """Found by review: ``ServerProcess.start(timeout_s=math.inf)`` (or a ``numpy.float32``)
    started the server, then its wait for ``ready`` raised (``OverflowError``, ``TypeError``)
    and left that process running, nobody to stop it. Refused before it starts."""
    children = psutil.Process().children()
    with pytest.raises((TypeError, ValueError), match="^timeout_s must be"):
        ServerProcess.start(8, BLOCK_LEN, timeout_s=value)  # type: ignore[arg-type]
    assert psutil.Process().children() == children


def test_a_server_started_with_a_numpy_timeout_is_ready_and_stops() -> None:
    """A ``numpy.float32`` timeout (as the float it is) starts and stops a server."""
    with ServerProcess.start(8, BLOCK_LEN, timeout_s=np.float32(60.0)) as server:  # type: ignore[arg-type]
        assert server.proc.poll() is None
    assert server.stop(np.float32(5.0)) is not None  # type: ignore[arg-type]
