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

Threading: vLLM calls every method under its tiering manager's lock, so no two run at once, but
not always on the same thread (this tier sets ``tolerates_off_thread_polling``, so vLLM's
tier-poll thread also calls ``get_finished_jobs``). Per-job state (``_jobs``, ``_ready``,
``_failed_keys``, ``_last_counters``) is therefore touched only from those serialized calls. The one
cross-thread hand-off is ``_completions``, a thread-safe queue fed by future done-callbacks. A
callback runs on whichever thread resolves the future: the ``TierManager``'s poller, or the
submitting thread itself when the result is known at once, and that thread then holds vLLM's
lock, which is not reentrant. So a callback only enqueues a job id; it never calls into vLLM
or does work on the poller.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import queue
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from typing_extensions import override
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from torch_kv_tier.arena import BlockArena
from torch_kv_tier.integrations.vllm import tier_sizing
from torch_kv_tier.integrations.vllm.admission import PromotionAdmission, Verdict
from torch_kv_tier.integrations.vllm.tier_config import (
    RemoteHostTierConfig,
    default_config_fields,
)
from torch_kv_tier.manager import TierManager, TransferResult
from torch_kv_tier.membership import Membership, first_hosts
from torch_kv_tier.transport import NixlTransport

if TYPE_CHECKING:
    # vLLM 0.33 only; annotations are never evaluated at run time, so 0.32 imports this module.
    from vllm.v1.kv_offload.base import ConfigInfoMapping, OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

logger = logging.getLogger(__name__)

_DRAIN_WARN_EVERY_S = 5.0
_MIN_CLOSE_S = 0.5  # what closing the manager gets when the membership used up the budget

_StartTransfer = Callable[
    [Sequence[OffloadKey], Sequence[int]], "concurrent.futures.Future[TransferResult]"
]


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
    LABEL = "remote"
    REASON = "reason"  # REFUSED_PROMOTIONS' second label: one of admission.REFUSAL_REASONS


@dataclass(frozen=True)
class _Job:
    """A submitted vLLM job: what ``get_finished_jobs`` needs to report it."""

    keys: tuple[OffloadKey, ...]
    is_promotion: bool
    req_context: ReqContext
    future: concurrent.futures.Future[TransferResult]


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
        self._label = (config.remote,)
        self._emit_events = (
            config.enable_kv_events and offloading_spec.kv_events_config.enable_kv_cache_events
        )
        self._jobs: dict[int, _Job] = {}
        self._storing: Counter[OffloadKey] = Counter()  # key -> its store jobs in flight
        self._ready: list[JobResult] = []
        self._failed_keys: dict[str, set[OffloadKey]] = {}
        self._events: list[OffloadingEvent] = []
        self._completions: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._last_counters: dict[tuple[str, tuple[str, ...]], int] = {}  # (name, labels)
        rows = primary_kv_view.shape[0] if primary_kv_view.shape else 0
        tokens_per_chunk = tier_sizing.tokens_per_chunk(offloading_spec)
        self._admission = PromotionAdmission(
            tier_sizing.promotion_budget(rows),
            tokens_per_chunk,
            config.expected_prefix_tokens,
            config.promotion_guard_s,
        )
        self._flat_view: memoryview | None = None
        self._manager: TierManager | None = None
        self._membership: Membership | None = None
        try:
            self._manager = self._build_manager(primary_kv_view, offloading_spec)
            peers = {address: self._connect(address) for address in first_hosts(config.source)}
            if config.reconnect_interval_s > 0:
                self._membership = Membership(
                    self._manager,
                    config.source,
                    interval_s=config.reconnect_interval_s,
                    connect_kwargs=config.connect_kwargs(),
                    known=peers,
                )
                self._membership.start()
        except BaseException:
            self._teardown()
            raise
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
        if key in self._storing or self._tier.prefetch([key]):
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
        self._admission.on_stored(len(job_metadata.keys))
        self._submit(job_metadata, self._tier.store)

    @override
    def submit_load(self, job_metadata: TransferJob) -> None:
        """Read the job's keys into its primary rows; returns at once (result later)."""
        self._admission.on_submitted(job_metadata.req_context.req_id, job_metadata.keys)
        self._submit(job_metadata, self._tier.load)

    @override
    def get_finished_jobs(self) -> Iterable[JobResult]:
        """Every job that finished since the previous call, each reported exactly once."""
        while True:
            try:
                job_id = self._completions.get_nowait()
            except queue.Empty:
                break
            self._collect(job_id)
        finished, self._ready = self._ready, []
        self._take_tier_events()
        return finished

    @override
    def has_pending_work(self) -> bool:
        return bool(self._jobs or self._ready)

    @override
    def take_events(self) -> Iterable[OffloadingEvent]:
        self._take_tier_events()
        events, self._events = self._events, []
        return events

    @override
    def on_request_finished(self, req_context: ReqContext) -> None:
        self._failed_keys.pop(req_context.req_id, None)
        self._admission.finish(req_context.req_id)

    @override
    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        """Tell admission which requests this step scheduled or preempted (and so which
        promotions vLLM could not allocate)."""
        self._admission.end_step(context.new_req_ids, context.preempted_req_ids)

    @override
    def drain_jobs(self) -> None:
        """Wait until no transfer touches the primary region; queue every result.

        Nothing in flight is aborted (a partial copy would corrupt a chunk). Every job submitted
        so far is reported by the next ``get_finished_jobs``.

        Raises:
            TimeoutError: transfers are still in flight after ``drain_timeout_s``.
        """
        deadline = time.monotonic() + self._config.drain_timeout_s
        while self._jobs:
            pending = [job.future for job in self._jobs.values()]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"RemoteHostTier.drain_jobs: {len(pending)} transfer(s) still in flight "
                    f"after {self._config.drain_timeout_s:.0f}s; check the remote host(s) "
                    f"{self._config.remote} or raise drain_timeout_s"
                )
            _, not_done = concurrent.futures.wait(
                pending, timeout=min(remaining, _DRAIN_WARN_EVERY_S)
            )
            if not_done:
                logger.warning(
                    "RemoteHostTier.drain_jobs: waiting for %d transfer(s)", len(not_done)
                )
            # A future's done-callbacks may still be running when wait() returns, so collect
            # the finished jobs here rather than trusting the completion queue to have them.
            for job_id in [jid for jid, job in self._jobs.items() if job.future.done()]:
                self._collect(job_id)

    @override
    def shutdown(self) -> None:
        """Close the tier manager, the NIXL registration, and every view over the primary
        region, within ``close_timeout_s`` (default 3 s, inside vLLM's 5 s shutdown grace):
        transfers still in flight then are cancelled and their sessions end unclean (their
        hosts hold those slots, see the README's fencing). A handshake in progress is waited
        for at most half that budget; it then fails on the closed manager. Idempotent."""
        self._teardown()

    @classmethod
    @override
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
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
            RemoteHostMetrics.FAILED_TRANSFERS: OffloadingCounterMetadata(
                documentation="Transfers to or from remote hosts that failed.", labelnames=labels
            ),
            RemoteHostMetrics.EVICTED_CHUNKS: OffloadingCounterMetadata(
                documentation="Chunks evicted from remote hosts to make room.", labelnames=labels
            ),
            RemoteHostMetrics.REFUSED_PROMOTIONS: OffloadingCounterMetadata(
                documentation="Remote hits answered MISS (recompute), by reason: other "
                "requests were prefilling (busy), the CPU tier could not take every waiting "
                "request's prefix (pressure), or its budget for promoted chunks not yet loaded "
                "was full (budget).",
                labelnames=(*labels, RemoteHostMetrics.REASON),
            ),
            RemoteHostMetrics.LOST_PROMOTIONS: OffloadingCounterMetadata(
                documentation="Promised chunks vLLM's CPU tier lost before their request used "
                "them (allocation failed, or evicted); answered MISS, never read again.",
                labelnames=labels,
            ),
        }

    @override
    def get_stats(self) -> OffloadingConnectorStats | None:
        """This tier's gauges, and its counters' increase since the previous call."""
        if self._manager is None:
            return None
        snapshot = _stats_snapshot(self._manager)
        admission = self._admission.stats
        snapshot[RemoteHostMetrics.LOST_PROMOTIONS] = admission.refused_repeat
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

    @classmethod
    @override
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return ("remote_hosts", "chunk_bytes")

    @override
    def config_info(self) -> ConfigInfoMapping:
        return {"remote_hosts": self._label[0], "chunk_bytes": self.block_size_bytes}

    # ------------------------------------------------------------------
    # Helpers
    # ------------------------------------------------------------------

    @property
    def tier_manager(self) -> TierManager:
        """The ``TierManager`` behind this tier (for inspection; do not close it)."""
        return self._tier

    @property
    def _tier(self) -> TierManager:
        if self._manager is None:
            raise RuntimeError("RemoteHostTier is shut down")
        return self._manager

    def _build_manager(self, primary_kv_view: memoryview, spec: OffloadingSpec) -> TierManager:
        """Register vLLM's primary region with NIXL (no copy) and wrap it in a TierManager."""
        self._flat_view, region = _adopt_primary_view(primary_kv_view)
        fields = self._config.config_fields
        transport = NixlTransport(
            f"vllm-{self.tier_type}",
            region,
            default_config_fields(spec, region.shape[1]) if fields is None else fields,
            backends=list(self._config.backends) if self._config.backends else None,
            num_threads=self._config.num_threads,
            passive_progress=False,  # an initiator only: the tier's poller progresses it
        )
        try:
            return TierManager(
                BlockArena.wrap(region),
                transport,
                max_inflight=self._config.max_inflight,
                events=self._emit_events,
            )
        except BaseException:
            transport.close()
            raise

    def _dial(self, address: str) -> str:
        """Handshake with one remote host and join its shared pool (or lease slots of it);
        returns the peer id."""
        return self._tier.connect(address, **self._config.connect_kwargs())

    def _connect(self, address: str) -> str | None:
        """``_dial`` at startup.

        A host that does not answer (down, or not started yet) is left to the membership thread
        when there is one: vLLM starts without it and gains it when it comes up (``None``).
        Any other failure, and a silent host when reconnecting is off, raises with what the
        user should check (a host that answers but refuses is misconfigured, not down).
        """
        try:
            return self._dial(address)
        except TimeoutError as exc:
            if self._config.reconnect_interval_s <= 0:
                raise self._startup_error(address, exc) from exc
            logger.warning(
                "RemoteHostTier: remote host %s does not answer at startup (%s); starting "
                "without it and dialling it every %.1fs",
                address,
                exc,
                self._config.reconnect_interval_s,
            )
            return None
        except Exception as exc:
            raise self._startup_error(address, exc) from exc

    def _startup_error(self, address: str, exc: Exception) -> RuntimeError:
        """What a user must check when ``address`` cannot be used at startup."""
        n = self.block_size_bytes
        return RuntimeError(
            f"RemoteHostTier could not connect to remote host {address}: {exc}\n"
            f"The host must run `torch-kv-tier serve --block-len {n} ...` (vLLM's chunk "
            f"size here is {n} bytes), be reachable from this host, and agree with this "
            "tier's token_file and config_fields."
        )

    def _submit(self, job: TransferJob, start: _StartTransfer) -> None:
        keys = tuple(job.keys)
        rows = [int(c) for c in job.chunk_ids]
        if not keys:
            self._ready.append(JobResult(job.job_id, True, transfer_time=0.0, transfer_bytes=0))
            return
        try:
            if len(keys) != len(rows):
                raise ValueError(f"{len(keys)} keys but {len(rows)} chunk ids")
            future = start(keys, rows)
        except Exception:
            logger.exception(
                "RemoteHostTier: %s job %d rejected",
                "promotion" if job.is_promotion else "store",
                job.job_id,
            )
            self._ready.append(JobResult(job.job_id, False))
            self._record_failed_promotion(job.req_context, keys, job.is_promotion)
            return
        self._jobs[job.job_id] = _Job(keys, job.is_promotion, job.req_context, future)
        if not job.is_promotion:
            self._storing.update(keys)
        job_id = job.job_id
        future.add_done_callback(lambda _f: self._completions.put(job_id))

    def _collect(self, job_id: int) -> None:
        """Turn a finished job into its ``JobResult``; a second call for the same id is a no-op."""
        job = self._jobs.pop(job_id, None)
        if job is None:
            return
        if not job.is_promotion:
            self._storing.subtract(job.keys)
            for key in job.keys:
                if self._storing[key] <= 0:
                    del self._storing[key]
        try:
            result = job.future.result(timeout=0)
        except Exception as exc:  # the tier manager failed the future itself
            logger.warning("RemoteHostTier: job %d failed: %s", job_id, exc)
            self._ready.append(JobResult(job_id, False))
            self._record_failed_promotion(job.req_context, job.keys, job.is_promotion)
            return
        if result.ok:
            self._ready.append(
                JobResult(job_id, True, transfer_time=result.seconds, transfer_bytes=result.nbytes)
            )
            return
        logger.warning(
            "RemoteHostTier: %s job %d failed for %d of %d chunk(s): %s",
            "promotion" if job.is_promotion else "store",
            job_id,
            len(result.failed),
            len(job.keys),
            _summarize(result.failed),
        )
        succeeded = tuple(key for key in job.keys if key not in result.failed)
        self._ready.append(
            JobResult(
                job_id,
                False,
                successful_keys=succeeded if job.is_promotion and succeeded else None,
                transfer_time=result.seconds,
                transfer_bytes=result.nbytes,
            )
        )
        failed = [key for key in job.keys if key in result.failed]
        self._record_failed_promotion(job.req_context, failed, job.is_promotion)

    def _record_failed_promotion(
        self, req_context: ReqContext, keys: Collection[OffloadKey], is_promotion: bool
    ) -> None:
        """Failed promotions: a MISS for the rest of the request, and out of the budget."""
        if is_promotion and keys:
            self._failed_keys.setdefault(req_context.req_id, set()).update(keys)
            self._admission.on_read_failed(req_context.req_id, keys)

    def _take_tier_events(self) -> None:
        """Drain the tier manager's events (always, so they cannot pile up); keep them for
        vLLM only when KV events are enabled."""
        if self._manager is None:
            return
        events = self._manager.take_events()
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

    def _teardown(self) -> None:
        """Close the tier manager (and with it the NIXL registration), then release our view
        of the primary region so vLLM can unmap it.

        The view is what keeps vLLM's shared memory mapped (the tensor over it does not pin
        it), so it is released only once nothing can transfer into that memory any more: if
        closing fails, the region stays mapped rather than let the NIC write into freed memory.
        """
        deadline = time.monotonic() + self._config.close_timeout_s
        membership, self._membership = self._membership, None
        if membership is not None:
            # At most half the budget: a handshake with a host that does not answer lasts up to
            # connect_timeout_s (10 s), past vLLM's 5 s grace, which then kills the engine
            # before its worker removes the shared region. Once the manager is closed, such a
            # handshake fails cleanly ("TierManager is closed"; the transport refuses a late
            # registration) and ends its session; the thread is a daemon.
            membership.stop(timeout=self._config.close_timeout_s / 2)
        manager, self._manager = self._manager, None
        self._jobs.clear()
        self._storing.clear()
        if manager is not None:
            try:
                manager.close(timeout=max(deadline - time.monotonic(), _MIN_CLOSE_S))
            except Exception:
                logger.exception(
                    "RemoteHostTier: closing the tier manager failed; keeping vLLM's primary "
                    "region mapped since NIXL may still have it registered"
                )
                return
        flat, self._flat_view = self._flat_view, None
        if flat is not None:
            flat.release()


_LOOKUP = {
    Verdict.HIT: LookupResult.HIT,
    Verdict.RETRY: LookupResult.RETRY,
    Verdict.MISS: LookupResult.MISS,
}

_GAUGES = (
    RemoteHostMetrics.STORED_CHUNKS,
    RemoteHostMetrics.CAPACITY_CHUNKS,
    RemoteHostMetrics.CONNECTED_REMOTES,
    RemoteHostMetrics.INFLIGHT_TRANSFERS,
)
_COUNTERS = (  # labelled by remote only (REFUSED_PROMOTIONS, by reason too, is apart)
    RemoteHostMetrics.FAILED_TRANSFERS,
    RemoteHostMetrics.EVICTED_CHUNKS,
    RemoteHostMetrics.LOST_PROMOTIONS,
)


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


def _adopt_primary_view(view: memoryview) -> tuple[memoryview, torch.Tensor]:
    """A flat byte view of vLLM's primary region and a ``uint8 [rows, row_bytes]`` tensor over
    it, sharing its memory (no copy).

    The view keeps vLLM's mapping alive; the tensor does not (``torch.frombuffer`` holds no
    buffer export), so release the view only after the tensor's last user is gone.
    """
    if view.ndim != 2 or not view.shape or not view.strides:
        raise ValueError(f"primary_kv_view must be 2-D (num_chunks x chunk_bytes), got {view!r}")
    if view.itemsize != 1 or not view.c_contiguous or view.readonly:
        raise ValueError(
            "primary_kv_view must be a writable, C-contiguous byte region "
            f"(format {view.format!r}, c_contiguous={view.c_contiguous}, "
            f"readonly={view.readonly})"
        )
    rows, row_bytes = view.shape
    flat = view.cast("B")
    tensor = torch.frombuffer(flat, dtype=torch.uint8).view(rows, row_bytes)
    return flat, tensor


def _summarize(failed: dict[Any, str]) -> str:
    """``reason x count`` for each distinct failure reason."""
    counts: dict[str, int] = {}
    for reason in failed.values():
        counts[reason] = counts.get(reason, 0) + 1
    return ", ".join(f"{reason} x{n}" for reason, n in sorted(counts.items()))


__all__ = ["RemoteHostMetrics", "RemoteHostTier"]
