"""The counters of :class:`~torch_kv_tier.integrations.vllm.admission.PromotionAdmission`:
what its lookups answered and why, read by the tier's metrics and the serving benchmark.

Threading: plain ints, updated by the admission under vLLM's manager lock; a reader on another
thread sees each counter's latest value.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class AdmissionStats:
    """Counters since the tier started (monotonic)."""

    admitted: int = 0  # lookups answered HIT
    held: int = 0  # RETRY: the request arrived in this scheduler step, beside others
    guarded: int = 0  # RETRY: it would recompute while another request's promotion is under way
    refused_busy: int = 0  # MISS: its prefix would land amid stores the CPU tier cannot hold
    refused_pressure: int = 0  # MISS: the waiting queue's prefixes do not fit the CPU tier
    refused_budget: int = 0  # MISS: no room for the (whole) prefix in the budget
    refused_repeat: int = 0  # MISS: promised before in this attempt, and lost by vLLM
    unallocated: int = 0  # promises vLLM could not allocate (never submitted)
    dropped_partial: int = 0  # promotions not read: vLLM allocated only part of the promises

    def refused(self) -> dict[str, int]:
        """First promotions refused (MISS), by reason (``REFUSAL_REASONS``)."""
        return {
            "busy": self.refused_busy,
            "pressure": self.refused_pressure,
            "budget": self.refused_budget,
        }


# Why a first promotion is refused: the keys of ``AdmissionStats.refused`` (a metric label).
REFUSAL_REASONS = ("busy", "pressure", "budget")
