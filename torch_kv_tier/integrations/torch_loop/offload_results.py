"""What ``PagedKVOffloader.offload`` returns: one future over the tier's batch futures.

An offload larger than the arena goes to the tier in batches, each with its own future.
:func:`combine` resolves one future once every batch has, reporting every requested key in call
order: stored (``keys``) or failed with the tier's reason (``failed``). Non-strict, that future
never raises; strict, it raises :class:`OffloadError` when any key failed. It is running from the
start, so ``cancel()`` returns ``False``: the batches are already with the tier. A batch that
the tier never took (no arena slots, an overdue host, the tier's refusal) is a future failed at
once (:func:`failed_now`, :func:`fail_hosts`).

Threading: a batch future's callback runs on whichever thread resolves it (the tier's poller,
or the caller when the tier settled it at once); the last one to finish builds the result, so
the combined future resolves exactly once. Like the tier's own, the combined future refuses a
wait on a tier's thread while it is not done (``tier_threads.TierFuture``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Container
from concurrent.futures import Future

from torch_kv_tier.keys import Key
from torch_kv_tier.results import TransferResult
from torch_kv_tier.tier_threads import TierFuture

__all__ = ["OffloadError", "combine", "fail_hosts", "failed_now", "partly_sent"]

log = logging.getLogger(__name__)

Batch = tuple[list[Key], Future[TransferResult]]


class OffloadError(RuntimeError):
    """Raised by a ``strict=True`` offloader when the tier fails an offload or restore."""


def combine(
    keys: list[Key], parts: list[Batch], started: float, *, strict: bool
) -> Future[TransferResult]:
    """One future over the batch futures ``parts`` (module docstring); ``started`` is the
    offload's ``time.perf_counter()`` at its start."""
    combined: Future[TransferResult] = TierFuture()  # waits refused on a tier's threads
    combined.set_running_or_notify_cancel()  # its batches are in flight: cancel() refuses
    remaining = [len(parts)]
    lock = threading.Lock()

    def finish() -> None:
        failed: dict[Key, str] = {}
        nbytes = 0
        for part_keys, part in parts:
            try:
                part_result = part.result()
            except Exception as exc:  # the tier failed the whole batch
                failed.update(dict.fromkeys(part_keys, str(exc) or type(exc).__name__))
                continue
            failed.update(part_result.failed)
            nbytes += part_result.nbytes
        result = TransferResult(
            ok=not failed,
            keys=[k for k in keys if k not in failed],
            failed=failed,
            nbytes=nbytes,
            seconds=time.perf_counter() - started,
        )
        if failed and strict:
            combined.set_exception(OffloadError(_failed(failed, len(keys))))
        else:
            if failed:
                log.warning("offload of %d pages failed: %s", len(failed), _reasons(failed))
            combined.set_result(result)

    def on_part(_: Future[TransferResult]) -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            finish()

    if not parts:
        finish()
    for _, part in parts:
        part.add_done_callback(on_part)
    return combined


def failed_now(keys: list[Key], reason: str, what: str) -> Future[TransferResult]:
    """A resolved future failing every one of ``keys`` with ``reason`` (logged with ``what``)."""
    log.warning("%s: %s", what, reason)
    future: Future[TransferResult] = Future()
    failed = dict.fromkeys(keys, reason)
    future.set_result(TransferResult(ok=False, keys=[], failed=failed, nbytes=0, seconds=0.0))
    return future


def fail_hosts(
    keys: list[Key], homes: list[str | None], hosts: Container[str | None], reason: str
) -> Batch:
    """The ``keys`` whose ``homes`` are among ``hosts``, failed at once with ``reason``."""
    failed = [k for k, home in zip(keys, homes) if home in hosts]
    named = ", ".join(sorted({str(home) for home in homes if home in hosts}))
    return failed, failed_now(failed, reason, f"offload to {named}, past its share of the arena")


def partly_sent(
    todo: dict[Key, int], parts: list[Batch], unsent: list[Key], exc: Exception
) -> OffloadError | None:
    """The error of an offload of ``todo`` (key: page) that ``exc`` stopped after it made
    ``parts`` and before ``unsent``: which pages it handed the tier (their stores go on) and
    which it did not, those of a part failed already (no slots, an overdue host, the tier's
    refusal) among them; ``None`` if it handed none (``exc`` is raised as it is)."""
    left = set(unsent)
    for part_keys, part in parts:
        if part.done():
            left.update(part_keys if part.exception() else part.result().failed)
    sent = [page for key, page in todo.items() if key not in left]
    if not sent:
        return None
    return OffloadError(
        f"offload handed {_pages(sent)} to the tier (flush() waits for their stores, lookup() "
        f"tells which are stored), then stopped: {_pages([todo[k] for k in todo if k in left])} "
        f"were not sent or failed at once, offload them again. {type(exc).__name__}: {exc}"
    )


def _pages(pages: list[int]) -> str:
    """``pages``, named for a message: at most 8 of them, and how many."""
    shown = ", ".join(map(str, pages[:8])) + (", ..." if len(pages) > 8 else "")
    return f"{len(pages)} pages (page_ids [{shown}])"


def _failed(failed: dict[Key, str], count: int) -> str:
    """A strict offload's error: how many of its ``count`` pages failed, why, and at most 4
    of their keys (a message of 10,000 keys is unreadable)."""
    shown = ", ".join(map(repr, list(failed)[:4])) + (", ..." if len(failed) > 4 else "")
    return f"offload failed {len(failed)} of {count} pages {_reasons(failed)} (keys {shown})"


def _reasons(failed: dict[Key, str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for reason in failed.values():
        counts[reason] = counts.get(reason, 0) + 1
    return counts
