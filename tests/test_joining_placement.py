"""A shared host still joining (its index not in yet) already takes stores (it is placed),
while ``peers()`` leaves it out until its join completed. The torch-loop offloader groups a
batch's keys by their homes (``homes_among``) to size each host's share and to tell which
host a store waits for; grouped among ``peers()`` it counted the keys the tier placed on
the joining host as another host's (no share of its own: a frozen joining host could take
the whole arena, and make a healthy host overdue). It groups among ``placing_peers()``, and
a membership round leaves a joining host to its join as it did before."""

from __future__ import annotations

import contextlib
import threading

import pytest
from join_support import STUCK_S, withhold_index
from membership_support import WAIT_S
from remote_support import BLOCK_LEN

from torch_kv_tier.host_sources import StaticHosts
from torch_kv_tier.integrations.torch_loop.host_shares import homes_among
from torch_kv_tier.manager import TierManager
from torch_kv_tier.membership import Membership
from torch_kv_tier.remote import ServerProcess


def _connect_failing(tier: TierManager, address: str) -> None:
    """Connect the host whose index is withheld: its join fails once it is disconnected."""
    with contextlib.suppress(ConnectionError):
        tier.connect(address, timeout_s=STUCK_S)


def test_keys_placed_on_a_joining_host_are_grouped_as_the_tier_places_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, following = withhold_index(monkeypatch, lambda n: n == 1)  # the second host's
    with (
        ServerProcess.start(64, BLOCK_LEN) as first,
        ServerProcess.start(64, BLOCK_LEN) as second,
        TierManager.create(32, BLOCK_LEN, name="joining-placement") as tier,
    ):
        joined = tier.connect(first.address, timeout_s=WAIT_S)
        thread = threading.Thread(target=_connect_failing, args=(tier, second.address))
        thread.start()
        try:
            assert following.wait(WAIT_S)
            [joining] = tier._joining
            keys = [f"k{i}" for i in range(32)]
            assert tier.peers() == [joined]  # not joined yet
            grouped = homes_among(keys, tier.placing_peers())  # what the offloader groups by
            placed: list[str] = []
            tier.store(keys, range(32), placed)
            assert joining in placed  # (else the test shows nothing: 32 keys, two hosts)
            assert set(placed) <= set(grouped), (
                f"the tier placed keys on {joining} (joining), the offloader grouped them all "
                f"as {joined}'s"
            )
        finally:
            tier.disconnect(joining)
            thread.join(WAIT_S)


def test_a_membership_round_leaves_a_host_that_is_joining_to_its_join(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Found by review: since peers() leaves out a joining host, a membership round took a
    # known host whose (re)join was under way (a large index: seconds) for gone and dialled
    # it again: a second session on the host, the round held up for that connect's timeout
    # waiting for the join, and a WARNING "cannot be connected" for a host that was joining.
    _, following = withhold_index(monkeypatch, lambda _: True)
    with (
        ServerProcess.start(32, BLOCK_LEN) as server,
        TierManager.create(16, BLOCK_LEN, name="joining-membership") as tier,
    ):
        thread = threading.Thread(target=_connect_failing, args=(tier, server.address))
        thread.start()
        try:
            assert following.wait(WAIT_S)
            [joining] = tier._joining
            dialled: list[str] = []
            monkeypatch.setattr(tier, "connect", lambda address, **_: dialled.append(address))
            membership = Membership(
                tier,
                StaticHosts([server.address]),
                connect_kwargs={"timeout_s": WAIT_S},
                known={server.address: joining},
            )
            membership._round()
            assert dialled == [], "a host still joining was dialled again"
        finally:
            tier.disconnect(joining)
            thread.join(WAIT_S)
