"""``RemoteHostTier``: a vLLM secondary offload tier on ``torch-kv-tier serve`` hosts.

vLLM's ``TieringOffloadingManager`` keeps KV chunks in a CPU primary tier (a shared-memory
region) and cascades every stored chunk to its secondary tiers. This tier keeps those chunks in
the DRAM of one or more remote hosts running ``torch-kv-tier serve`` and promotes them back
into the primary tier on a lookup hit. Load it out of tree, with no vLLM patch::

    "secondary_tiers": [{"type": "RemoteHostTier",
                         "module_path": "torch_kv_tier.integrations.vllm.remote_tier",
                         "remote": "10.0.0.5:5600"}]

Data plane: one NIXL registration over vLLM's primary region (``primary_kv_view``, a
``num_chunks x chunk_bytes`` memoryview), adopted without a copy as a ``BlockArena``. A
``TransferJob``'s ``chunk_ids`` are rows of that region: a store sends those rows to the remote
host, a promotion reads the remote copies into them. See
:mod:`torch_kv_tier.integrations.vllm.tier_config` for every config key.

vLLM versions: 0.32 and 0.33 (both tested). What 0.33 added is declared here and simply unused
on 0.32: ``tolerates_off_thread_polling`` (0.32 has no tier-poll thread, so completions are
collected on the scheduler's steps) and ``config_info_keys``/``config_info`` (0.32 has no
config-info metric); ``ConfigInfoMapping`` is imported for type checking only.

Parts, one module each in this package: what the tier owns and releases (the region's view,
the ``TierManager``, the hosts) ``tier_resources``; vLLM's jobs and their results ``tier_jobs``;
which lookup hits become promotions ``admission``; landed promotions held in vLLM's CPU tier
until their request is scheduled ``promotion_pin``; the metrics ``tier_metrics``.

Threading: vLLM calls every method under its tiering manager's lock, so no two run at once, but
not always on the same thread (this tier sets ``tolerates_off_thread_polling``, so vLLM's
tier-poll thread also calls ``get_finished_jobs``). Per-request state (``_failed_keys``, the
admission, the jobs) is therefore touched only from those serialized calls; the one cross-thread
hand-off, from the futures' done-callbacks, is inside ``TierJobs``.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Collection, Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from typing_extensions import override
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from torch_kv_tier.integrations.vllm import tier_sizing
from torch_kv_tier.integrations.vllm.admission import PromotionAdmission, Verdict
from torch_kv_tier.integrations.vllm.promotion_pin import PromotionPins
from torch_kv_tier.integrations.vllm.tier_config import RemoteHostTierConfig
from torch_kv_tier.integrations.vllm.tier_jobs import TierJobs
from torch_kv_tier.integrations.vllm.tier_metrics import (
    RemoteHostMetrics,
    TierMetrics,
    metric_definitions,
)
from torch_kv_tier.integrations.vllm.tier_resources import TierResources
from torch_kv_tier.manager import TierManager

if TYPE_CHECKING:
    # vLLM 0.33 only; annotations are never evaluated at run time, so 0.32 imports this module.
    from vllm.v1.kv_offload.base import ConfigInfoMapping, OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

logger = logging.getLogger(__name__)


class RemoteHostTier(SecondaryTierManager):
    """Secondary tier whose chunks live in the DRAM of ``torch-kv-tier serve`` remote hosts.

    Every key of the ``secondary_tiers`` entry except ``type``/``module_path``/``backpressure``
    arrives here as a keyword argument (see :class:`RemoteHostTierConfig`); unknown keys are
    accepted and logged.

    Raises:
        ValueError: a config key is invalid, or ``primary_kv_view`` is not a writable,
            C-contiguous 2-D byte region. Nothing is allocated or connected in that case.
        RuntimeError: a remote host refused the handshake or could not be reached. The message
            names the host, the reason and the ``--block-len`` the server needs; everything
            this tier built is released before raising.
    """

    medium: ClassVar[Medium] = Medium.CPU
    # The chunks come from a remote store, not from this engine's host memory.
    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.EXTERNAL_UNSPECIFIED
    # All state is guarded by vLLM's manager lock plus one thread-safe queue (module docstring),
    # so vLLM's tier-poll thread may collect completions between engine steps.
    tolerates_off_thread_polling: ClassVar[bool] = True

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        **options: Any,
    ) -> None:
        config = RemoteHostTierConfig.from_options(options)
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self._config = config
        self.locality = Locality(config.locality)
        self._emit_events = bool(  # (the tier takes a bool: vLLM's field may be any truthy)
            config.enable_kv_events and offloading_spec.kv_events_config.enable_kv_cache_events
        )
        self._pins = PromotionPins(offloading_spec)
        self._jobs = TierJobs(self._promotion_finished)
        self._failed_keys: dict[str, set[OffloadKey]] = {}
        self._events: list[OffloadingEvent] = []
        self._metrics = TierMetrics(config.remote)
        rows = primary_kv_view.shape[0] if primary_kv_view.shape else 0
        tokens_per_chunk = tier_sizing.tokens_per_chunk(offloading_spec)
        self._admission = PromotionAdmission(
            tier_sizing.promotion_budget(rows),
            tokens_per_chunk,
            config.expected_prefix_tokens,
            config.promotion_guard_s,
            primary_chunks=rows,
        )
        self._resources = TierResources(
            primary_kv_view,
            offloading_spec,
            config,
            f"vllm-{tier_type}",
            block_bytes=self.block_size_bytes,
            events=self._emit_events,
        )
        logger.info(
            "RemoteHostTier ready: %d chunks of %d bytes, remote host(s) %s",
            rows,
            self.block_size_bytes,
            config.remote,
        )
        tier_sizing.log_startup_sizing(
            rows,
            self.block_size_bytes,
            tokens_per_chunk,
            config.expected_prefix_tokens,
            config.expected_concurrency,
        )

    # ------------------------------------------------------------------
    # SecondaryTierManager interface
    # ------------------------------------------------------------------

    @override
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self._admission.on_new_request(req_context.req_id)
        return RequestOffloadingContext()

    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """For a completed copy of ``key`` on a remote host, what :class:`PromotionAdmission`
        decides (HIT: promote it; RETRY: the request arrived in this step, or waits for another
        request's promotion; MISS: recompute from here); RETRY while a store of it to this tier
        is still in flight, or while a host brings it from its disk into DRAM (asked here, at
        most ``TierManager.promotion_timeout_s``); else MISS, or RETRY while another request's
        promotion is under way (admission's guard). From local state only (no network).

        A key whose promotion already failed for this request is a MISS for the rest of the
        request, so vLLM recomputes it instead of retrying the promotion forever.
        """
        failed = self._failed_keys.get(req_context.req_id)
        if failed is not None and key in failed:
            return LookupResult.MISS
        self._admission.observe(req_context.req_id, req_context.get_offload_key_position(key))
        if self._tier.contains(key):
            return _LOOKUP[self._admission.admit(req_context.req_id, key)]
        if key in self._jobs.storing or self._tier.prefetch([key]):
            return LookupResult.RETRY  # a store in flight, or a promotion from a host's disk
        return _LOOKUP[self._admission.recompute(req_context.req_id)]

    @override
    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Mark ``keys`` recently used on their remote hosts, so a full host evicts them last."""
        self._tier.touch(keys)

    @override
    def submit_store(self, job_metadata: TransferJob) -> None:
        """Send the job's primary rows to the remote hosts; returns at once (result later)."""
        ctx = job_metadata.req_context
        for key in job_metadata.keys:
            self._admission.observe(ctx.req_id, ctx.get_offload_key_position(key))
        self._jobs.submit(job_metadata, self._tier.store)

    @override
    def submit_load(self, job_metadata: TransferJob) -> None:
        """Read the job's keys into its primary rows; returns at once (result later). A
        promotion vLLM could allocate only part of is reported failed unread
        (``PromotionAdmission.on_submitted``): the request recomputes instead of waiting."""
        if self._admission.on_submitted(job_metadata.req_context.req_id, job_metadata.keys):
            self._jobs.fail(job_metadata)
            return
        self._jobs.submit(job_metadata, self._tier.load)

    @override
    def get_finished_jobs(self) -> Iterable[JobResult]:
        """Every job that finished since the previous call, each reported exactly once (one
        at a time: a promotion's chunks are held as vLLM marks them ready, ``promotion_pin``)."""
        finished = self._jobs.finished()
        self._take_tier_events()
        return self._pins.reported(finished)

    @override
    def has_pending_work(self) -> bool:
        return bool(self._jobs)

    @override
    def take_events(self) -> Iterable[OffloadingEvent]:
        self._take_tier_events()
        events, self._events = self._events, []
        return events

    @override
    def on_request_finished(self, req_context: ReqContext) -> None:
        """Forget the request; a promotion of it still pending (vLLM's contract lets a request
        end with its jobs in flight: an aborted request) ends forgotten too, pinning nothing."""
        req_id = req_context.req_id
        self._failed_keys.pop(req_id, None)
        self._admission.finish(req_id)
        self._pins.release([req_id])
        self._jobs.end_attempts((req_id,))

    @override
    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        """Tell admission which requests this step scheduled or preempted (and so which
        promotions vLLM could not allocate); release the promotions held for those requests
        (``promotion_pin``), and keep any of their promotions still in flight from pinning
        (``TierJobs.end_attempts``: those requests recomputed, or wait again afresh)."""
        self._jobs.end_attempts({*context.new_req_ids, *context.preempted_req_ids})
        self._admission.end_step(context.new_req_ids, context.preempted_req_ids)
        self._pins.end_step(context.new_req_ids, context.preempted_req_ids)

    @override
    def drain_jobs(self) -> None:
        """Wait until no transfer may write into the primary region; queue every result.

        Nothing in flight is aborted (a partial copy would corrupt a chunk). Every job submitted
        so far is reported by the next ``get_finished_jobs``. A store whose host was dropped
        was reported failed at the drop, and its write may still read its chunks after this
        returns (vLLM's contract asks for no I/O at all): what it sends lands only in remote
        slots kept fenced until the transport reports it, so no load ever returns those bytes.

        Raises:
            TimeoutError: transfers are still in flight after ``drain_timeout_s``.
        """
        self._jobs.drain(self._config.drain_timeout_s, self._config.remote)
        self._pins.release_all()  # vLLM resets its CPU tier next (``promotion_pin``)

    @override
    def shutdown(self) -> None:
        """Close the tier manager, the NIXL registration, and every view over the primary
        region, within ``close_timeout_s`` (default 3 s, inside vLLM's 5 s shutdown grace):
        transfers still in flight then are cancelled and their sessions end unclean (their
        hosts hold those slots, see the README's fencing). A handshake in progress (a host
        that does not answer) gives up at once. Idempotent."""
        self._resources.close()
        self._jobs.clear()

    @classmethod
    @override
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        return metric_definitions()

    @override
    def get_stats(self) -> OffloadingConnectorStats | None:
        """This tier's gauges, and its counters' increase since the previous call."""
        manager = self._resources.manager
        if manager is None:
            return None
        return self._metrics.stats(manager, self._admission.stats, self._pins.held)

    @classmethod
    @override
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return ("remote_hosts", "chunk_bytes")

    @override
    def config_info(self) -> ConfigInfoMapping:
        return {"remote_hosts": self._config.remote, "chunk_bytes": self.block_size_bytes}

    # ------------------------------------------------------------------
    # Helpers
    # ------------------------------------------------------------------

    @property
    def tier_manager(self) -> TierManager:
        """The ``TierManager`` behind this tier (for inspection; do not close it)."""
        return self._tier

    @property
    def _tier(self) -> TierManager:
        manager = self._resources.manager
        if manager is None:
            raise RuntimeError("RemoteHostTier is shut down")
        return manager

    def _promotion_finished(
        self,
        req_context: ReqContext,
        landed: Sequence[OffloadKey],
        failed: Collection[OffloadKey],
    ) -> None:
        """A promotion finished: what landed is to be held in vLLM's CPU tier until its
        request is scheduled (``promotion_pin``); what failed is a MISS for the rest of the
        request, and out of the budget. (A request that ended meanwhile is not told:
        ``TierJobs.end_attempts``.)"""
        if landed:
            self._pins.landed(req_context, landed)
        if failed:
            self._failed_keys.setdefault(req_context.req_id, set()).update(failed)
            self._admission.on_read_failed(req_context.req_id, failed)

    def _take_tier_events(self) -> None:
        """Drain the tier manager's events (always, so they cannot pile up); keep them for
        vLLM only when KV events are enabled."""
        manager = self._resources.manager
        if manager is None:
            return
        events = manager.take_events()
        if not self._emit_events or not events:
            return
        # One vLLM event per run of same-direction changes, in order, so a key stored again
        # after its eviction ends up stored. This tier stores only vLLM's (bytes) OffloadKeys.
        for removed, run in itertools.groupby(events, key=lambda e: e.kind != "stored"):
            keys = [OffloadKey(e.key) for e in run if isinstance(e.key, bytes)]
            self._events.append(
                OffloadingEvent(
                    keys=keys,
                    medium=Medium.CPU,
                    removed=removed,
                    locality=self.locality,
                    ownership=self.tier_type,
                )
            )


_LOOKUP = {
    Verdict.HIT: LookupResult.HIT,
    Verdict.RETRY: LookupResult.RETRY,
    Verdict.MISS: LookupResult.MISS,
}


__all__ = ["RemoteHostMetrics", "RemoteHostTier"]
