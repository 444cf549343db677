"""The Prometheus metrics a ``RemoteHostTier`` adds to vLLM's offloading connector: their
definitions (``metric_definitions``) and each step's values (``TierMetrics.stats``), labelled by
the tier's ``remote`` setting.

Threading: ``TierMetrics`` is used under vLLM's tiering manager lock, like the tier itself.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
)

from torch_kv_tier.integrations.vllm.admission_stats import AdmissionStats
from torch_kv_tier.manager import TierManager


class RemoteHostMetrics:
    """Prometheus names of the metrics this tier adds, labelled by its ``remote`` setting."""

    STORED_CHUNKS = "torch_kv_tier_stored_chunks"
    CAPACITY_CHUNKS = "torch_kv_tier_capacity_chunks"
    CONNECTED_REMOTES = "torch_kv_tier_connected_remotes"
    INFLIGHT_TRANSFERS = "torch_kv_tier_inflight_transfers"
    FAILED_TRANSFERS = "torch_kv_tier_failed_transfers"
    EVICTED_CHUNKS = "torch_kv_tier_evicted_chunks"
    REFUSED_PROMOTIONS = "torch_kv_tier_refused_promotions"
    LOST_PROMOTIONS = "torch_kv_tier_lost_promotions"
    HELD_PROMOTIONS = "torch_kv_tier_held_promotions"
    LABEL = "remote"
    REASON = "reason"  # REFUSED_PROMOTIONS' second label: one of admission_stats.REFUSAL_REASONS


_GAUGES = (
    RemoteHostMetrics.STORED_CHUNKS,
    RemoteHostMetrics.CAPACITY_CHUNKS,
    RemoteHostMetrics.CONNECTED_REMOTES,
    RemoteHostMetrics.INFLIGHT_TRANSFERS,
    RemoteHostMetrics.HELD_PROMOTIONS,
)
_COUNTERS = (  # labelled by remote only (REFUSED_PROMOTIONS, by reason too, is apart)
    RemoteHostMetrics.FAILED_TRANSFERS,
    RemoteHostMetrics.EVICTED_CHUNKS,
    RemoteHostMetrics.LOST_PROMOTIONS,
)


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    """What ``RemoteHostTier.build_metric_definitions`` declares to vLLM."""
    labels = (RemoteHostMetrics.LABEL,)
    return {
        RemoteHostMetrics.STORED_CHUNKS: OffloadingGaugeMetadata(
            documentation="KV chunks held on torch-kv-tier remote hosts.", labelnames=labels
        ),
        RemoteHostMetrics.CAPACITY_CHUNKS: OffloadingGaugeMetadata(
            documentation="Remote-host slots leased by this tier.", labelnames=labels
        ),
        RemoteHostMetrics.CONNECTED_REMOTES: OffloadingGaugeMetadata(
            documentation="torch-kv-tier remote hosts currently connected.",
            labelnames=labels,
        ),
        RemoteHostMetrics.INFLIGHT_TRANSFERS: OffloadingGaugeMetadata(
            documentation="Transfers to or from remote hosts in flight.", labelnames=labels
        ),
        RemoteHostMetrics.HELD_PROMOTIONS: OffloadingGaugeMetadata(
            documentation="Promoted chunks held in vLLM's CPU tier until their request is "
            "scheduled (0 once no request waits for a promotion).",
            labelnames=labels,
        ),
        RemoteHostMetrics.FAILED_TRANSFERS: OffloadingCounterMetadata(
            documentation="Transfers to or from remote hosts that failed.", labelnames=labels
        ),
        RemoteHostMetrics.EVICTED_CHUNKS: OffloadingCounterMetadata(
            documentation="Chunks evicted from remote hosts to make room.", labelnames=labels
        ),
        RemoteHostMetrics.REFUSED_PROMOTIONS: OffloadingCounterMetadata(
            documentation="Remote hits answered MISS (recompute), by reason: the CPU tier "
            "could not hold the prefix beside the stores of the recomputes around it (busy), "
            "it could not take every waiting request's prefix (pressure), or its budget for "
            "promoted chunks not yet loaded was full (budget).",
            labelnames=(*labels, RemoteHostMetrics.REASON),
        ),
        RemoteHostMetrics.LOST_PROMOTIONS: OffloadingCounterMetadata(
            documentation="Promised chunks vLLM's CPU tier lost before their request used "
            "them (allocation failed, or evicted); answered MISS, never read again.",
            labelnames=labels,
        ),
    }


class TierMetrics:
    """One tier's metric values; counters are reported as their increase since the last
    ``stats`` call."""

    def __init__(self, remote: str) -> None:
        self._label = (remote,)
        self._last_counters: dict[tuple[str, tuple[str, ...]], int] = {}  # (name, labels)

    def stats(
        self, manager: TierManager, admission: AdmissionStats, held_promotions: int
    ) -> OffloadingConnectorStats:
        """The gauges now, and the counters' increase since the previous call;
        ``held_promotions``: the chunks ``PromotionPins`` holds."""
        snapshot = _stats_snapshot(manager)
        snapshot[RemoteHostMetrics.LOST_PROMOTIONS] = admission.refused_repeat
        snapshot[RemoteHostMetrics.HELD_PROMOTIONS] = held_promotions
        stats = OffloadingConnectorStats()
        for name in _GAUGES:
            stats.set_gauge(name, snapshot[name], self._label)
        counters: dict[tuple[str, tuple[str, ...]], int] = {
            (name, self._label): snapshot[name] for name in _COUNTERS
        }
        for reason, refused in admission.refused().items():
            counters[RemoteHostMetrics.REFUSED_PROMOTIONS, (*self._label, reason)] = refused
        for (name, labels), total in counters.items():
            delta = total - self._last_counters.get((name, labels), 0)
            if delta > 0:
                stats.increase_counter(name, delta, labels)
        self._last_counters = counters
        return stats


def _stats_snapshot(manager: TierManager) -> dict[str, int]:
    """The tier manager's figures under this tier's metric names."""
    stats = manager.stats()
    return {
        RemoteHostMetrics.STORED_CHUNKS: stats.keys,
        RemoteHostMetrics.CAPACITY_CHUNKS: sum(p.capacity for p in stats.peers.values()),
        RemoteHostMetrics.CONNECTED_REMOTES: len(stats.peers),
        RemoteHostMetrics.INFLIGHT_TRANSFERS: stats.inflight + stats.queued,
        RemoteHostMetrics.FAILED_TRANSFERS: stats.transfers_failed,
        RemoteHostMetrics.EVICTED_CHUNKS: stats.evictions,
    }


__all__ = ["RemoteHostMetrics", "TierMetrics", "metric_definitions"]
