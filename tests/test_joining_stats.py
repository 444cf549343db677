"""``stats().peers`` (and vLLM's ``torch_kv_tier_connected_remotes``, counted from it) counted
a shared host still joining (its index not in yet), which ``peers()`` leaves out until its join
completed: a dashboard showed a host connected that the tier had not joined, and whose join
could still fail. Both now count joined hosts only; ``stats().peers_joining`` counts the others."""

from __future__ import annotations

import pytest
from join_support import withheld_join
from membership_support import WAIT_S

from torch_kv_tier.integrations.vllm.admission_stats import AdmissionStats
from torch_kv_tier.integrations.vllm.tier_metrics import RemoteHostMetrics, TierMetrics
from torch_kv_tier.manager import TierManager


def _connected_remotes(tier: TierManager) -> int:
    """vLLM's ``torch_kv_tier_connected_remotes`` gauge for ``tier``."""
    stats = TierMetrics("remote").stats(tier, AdmissionStats(), held_promotions=0)
    return int(stats.data["data"][RemoteHostMetrics.CONNECTED_REMOTES][("remote",)])


def test_a_host_still_joining_is_counted_as_joining_not_as_a_peer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with withheld_join(monkeypatch, "joining-stats") as join:
        tier, joining = join.tier, join.peer_id
        assert tier.placing_peers() == [joining] and tier.peers() == []  # placed, not joined
        stats = tier.stats()
        assert stats.peers == {} and stats.peers_joining == 1, stats
        assert _connected_remotes(tier) == 0
        tier.disconnect(joining)  # (its join ends)
        assert tier.connect(join.server.address, timeout_s=WAIT_S) == joining
        stats = tier.stats()
        assert list(stats.peers) == tier.peers() == [joining] and stats.peers_joining == 0
        assert _connected_remotes(tier) == 1
