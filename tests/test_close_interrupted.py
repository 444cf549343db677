"""A Ctrl-C as ``TierManager.close`` waits for the transfers in flight: the tier is closed all
the same (its transfers cancelled, their keys failed, the transport closed, the poller stopped),
and the interrupt still reaches the caller. (A Ctrl-C in a done-callback that ``close`` runs:
``test_dropped_session_order``.)"""

from __future__ import annotations

import itertools
import threading

import pytest
from release_support import RESULT_TIMEOUT_S
from test_index import BLOCK, late_write_tier

from torch_kv_tier.arena import BlockArena


def test_a_ctrl_c_as_close_waits_for_transfers_still_closes_the_tier(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: ``close`` marked the tier closed, then waited (up to its ``timeout``)
    for the transfers in flight; a Ctrl-C there, where a user's Ctrl-C lands as ``close``
    blocks, skipped the rest: the store in flight never resolved, the load in flight never
    settled, the poller ran on, the transport stayed open (with a host's session), and a
    second ``close`` returned at once, closing nothing."""
    with late_write_tier(BlockArena(8, BLOCK), {"p": 4}) as (tier, transport):
        assert tier.store(["b"], [1]).result(timeout=RESULT_TIMEOUT_S).ok
        transport.hold = True  # the next store's write stays in flight
        reads = itertools.count(10_000)
        monkeypatch.setattr(transport, "read_blocks", lambda *_: next(reads))  # never lands
        closed = threading.Event()
        monkeypatch.setattr(transport, "close", closed.set)
        stored, loaded = tier.store(["a"], [0]), tier.load(["b"], [2])
        closing, wait = threading.get_ident(), tier._cond.wait

        def interrupted(timeout: float | None = None) -> bool:
            if threading.get_ident() == closing:
                raise KeyboardInterrupt  # Ctrl-C as close waits for the transfers in flight
            return wait(timeout)

        monkeypatch.setattr(tier._cond, "wait", interrupted)
        with pytest.raises(KeyboardInterrupt):
            tier.close(timeout=60.0)
        assert stored.result(timeout=RESULT_TIMEOUT_S).failed == {"a": "closed"}
        assert loaded.result(timeout=RESULT_TIMEOUT_S).failed == {"b": "closed"}
        assert closed.is_set(), "the transport outlived close"
        tier._thread.join(timeout=RESULT_TIMEOUT_S)
        assert not tier._thread.is_alive(), "the poller outlived close"
