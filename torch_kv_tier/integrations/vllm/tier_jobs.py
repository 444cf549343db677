"""The transfer jobs vLLM hands a ``RemoteHostTier``: started on its ``TierManager``, each
reported exactly once as a ``JobResult`` when its future resolves.

Threading: every method runs under vLLM's tiering manager lock (``RemoteHostTier``'s module
docstring), so no two run at once. The one cross-thread hand-off is ``_completions``, a
thread-safe queue fed by the futures' done-callbacks: a callback runs on whichever thread
resolves the future (the ``TierManager``'s poller, or the submitting thread itself when the
result is known at once, and that thread then holds vLLM's lock, which is not reentrant), so a
callback only enqueues a job id.

Failure model: a job the tier manager rejects, or whose future fails, is reported failed; a
promotion that fails for some of its keys is reported with the keys that did land. Every
finished promotion also goes to ``on_promotion`` with the keys that landed and those that failed
(the tier holds the first in vLLM's CPU tier until their request is scheduled, and answers MISS
for the second from then on), before vLLM hears of it; unless its attempt ended meanwhile
(``end_attempts``): its request ended (vLLM may give a later request the same id, and that one
must not inherit the result), or was scheduled or preempted while it flew (it recomputed those
chunks, or waits again with a fresh attempt: pinned, they would stay so until it finished).
``on_promotion`` is held weakly: it is the owning tier's bound method, and a strong reference
would be a cycle that keeps the tier, and its NIXL agent, alive until the garbage collector
runs.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import time
import weakref
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob

from torch_kv_tier.manager import TransferResult

logger = logging.getLogger(__name__)

_DRAIN_WARN_EVERY_S = 5.0

StartTransfer = Callable[
    [Sequence[OffloadKey], Sequence[int]], "concurrent.futures.Future[TransferResult]"
]
# (the promotion's request, the keys that landed in the job's order, the keys that failed)
OnPromotion = Callable[[ReqContext, Sequence[OffloadKey], Collection[OffloadKey]], None]


@dataclass
class _Job:
    """A submitted vLLM job: what ``finished`` needs to report it."""

    keys: tuple[OffloadKey, ...]
    is_promotion: bool
    req_context: ReqContext
    future: concurrent.futures.Future[TransferResult]
    ended: bool = False  # its attempt ended: its result goes to vLLM only, not to on_promotion


class TierJobs:
    """vLLM's jobs in flight on one tier, and the results not yet reported (module docstring).

    ``storing`` counts, per key, the store jobs in flight (a lookup of such a key answers
    RETRY).
    """

    def __init__(self, on_promotion: OnPromotion) -> None:
        self._on_promotion = weakref.WeakMethod(on_promotion)
        self._jobs: dict[int, _Job] = {}
        self._ready: list[JobResult] = []
        self._completions: queue.SimpleQueue[int] = queue.SimpleQueue()
        self.storing: Counter[OffloadKey] = Counter()

    def __bool__(self) -> bool:
        """Whether a job is in flight or a result waits to be reported."""
        return bool(self._jobs or self._ready)

    def submit(self, job: TransferJob, start: StartTransfer) -> None:
        """Start ``job`` with ``start(keys, rows)`` (the tier manager's ``store`` or ``load``);
        a job it rejects is reported failed at the next ``finished``."""
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
            self.fail(job)
            return
        self._jobs[job.job_id] = _Job(keys, job.is_promotion, job.req_context, future)
        if not job.is_promotion:
            self.storing.update(keys)
        job_id = job.job_id
        future.add_done_callback(lambda _f: self._completions.put(job_id))

    def end_attempts(self, req_ids: Collection[str]) -> None:
        """The attempts of ``req_ids`` ended (each request ended, or was scheduled or preempted):
        their jobs still in flight (or not yet collected) are reported to vLLM as usual, but
        their promotions no longer go to ``on_promotion`` (module docstring). A later request
        vLLM gives the same id, or the same request's next attempt, gets none of their
        results."""
        if not req_ids:
            return
        for job in self._jobs.values():
            if job.req_context.req_id in req_ids:
                job.ended = True

    def fail(self, job: TransferJob) -> None:
        """Report ``job`` failed, unstarted, at the next ``finished`` (a promotion's keys go to
        ``on_promotion`` as failed)."""
        self._ready.append(JobResult(job.job_id, False))
        self._promoted(job.req_context, job.is_promotion, (), tuple(job.keys))

    def finished(self) -> list[JobResult]:
        """Every job that finished since the previous call, each reported exactly once."""
        while True:
            try:
                job_id = self._completions.get_nowait()
            except queue.Empty:
                break
            self._collect(job_id)
        finished, self._ready = self._ready, []
        return finished

    def drain(self, timeout_s: float, remote: str) -> None:
        """Wait until no job is in flight (nothing is aborted: a partial copy would corrupt a
        chunk); their results are reported by the next ``finished``.

        Raises ``TimeoutError`` when jobs are still in flight after ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while self._jobs:
            pending = [job.future for job in self._jobs.values()]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"RemoteHostTier.drain_jobs: {len(pending)} transfer(s) still in flight "
                    f"after {timeout_s:.0f}s; check the remote host(s) {remote} or raise "
                    "drain_timeout_s"
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

    def clear(self) -> None:
        """Forget every job and every result not yet reported (the tier is shutting down):
        nothing is pending, and ``finished`` reports nothing from then on."""
        self._jobs.clear()
        self._ready.clear()
        self.storing.clear()

    def _collect(self, job_id: int) -> None:
        """Turn a finished job into its ``JobResult``; a second call for the same id is a no-op."""
        job = self._jobs.pop(job_id, None)
        if job is None:
            return
        if not job.is_promotion:
            self.storing.subtract(job.keys)
            for key in job.keys:
                if self.storing[key] <= 0:
                    del self.storing[key]
        result, landed, failed = _result(job_id, job)
        if not job.ended:
            self._promoted(job.req_context, job.is_promotion, landed, failed)
        self._ready.append(result)

    def _promoted(
        self,
        req_context: ReqContext,
        is_promotion: bool,
        landed: Sequence[OffloadKey],
        failed: Collection[OffloadKey],
    ) -> None:
        if is_promotion:
            on_promotion = self._on_promotion()
            if on_promotion is not None:
                on_promotion(req_context, landed, failed)


def _result(
    job_id: int, job: _Job
) -> tuple[JobResult, tuple[OffloadKey, ...], Collection[OffloadKey]]:
    """The finished ``job``'s ``JobResult``, the keys that landed and those that failed."""
    try:
        result = job.future.result(timeout=0)
    except Exception as exc:  # the tier manager failed the future itself
        logger.warning("RemoteHostTier: job %d failed: %s", job_id, exc)
        return JobResult(job_id, False), (), job.keys
    if result.ok:
        return (
            JobResult(job_id, True, transfer_time=result.seconds, transfer_bytes=result.nbytes),
            job.keys,
            (),
        )
    logger.warning(
        "RemoteHostTier: %s job %d failed for %d of %d chunk(s): %s",
        "promotion" if job.is_promotion else "store",
        job_id,
        len(result.failed),
        len(job.keys),
        _summarize(result.failed),
    )
    succeeded = tuple(key for key in job.keys if key not in result.failed)
    failed = [key for key in job.keys if key in result.failed]
    return (
        JobResult(
            job_id,
            False,
            successful_keys=succeeded if job.is_promotion and succeeded else None,
            transfer_time=result.seconds,
            transfer_bytes=result.nbytes,
        ),
        succeeded,
        failed,
    )


def _summarize(failed: dict[Any, str]) -> str:
    """``reason x count`` for each distinct failure reason."""
    counts: dict[str, int] = {}
    for reason in failed.values():
        counts[reason] = counts.get(reason, 0) + 1
    return ", ".join(f"{reason} x{n}" for reason, n in sorted(counts.items()))


__all__ = ["StartTransfer", "TierJobs"]
