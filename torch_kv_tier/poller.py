"""The tier's poller: the one background thread that drains ``transport.poll()`` while
transfers are in flight (polling is what progresses an initiator's transfers), applies what it
reports (``Transfers._complete``), resolves the futures settled meanwhile (``_flush``) and
faults the peers of transfers past ``transfer_timeout_s`` (``overdue``); idle, it sleeps on
the tier's condition, waking for parked promotions' deadlines and usage reports.

``Poller`` is a part of ``TierManager`` (the base class of ``Transfers``). Threading: ``_run``
is the poller thread's target, and takes the manager's lock itself; ``_poll_all`` runs with it
held (``close`` on the poller's own thread, waiting for transfers). It returns once ``close``
set ``_stopping``. A done-callback's exception never ends it (``_run``).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from torch_kv_tier.keys import Key
from torch_kv_tier.overdue import Overdue
from torch_kv_tier.promotions import Parked, Promotions
from torch_kv_tier.records import Op, Request
from torch_kv_tier.results import MISSING, TIMED_OUT
from torch_kv_tier.transport.base import DataTransport, PollResult
from torch_kv_tier.withheld import WithheldReads

logger = logging.getLogger(__name__)

_SPIN_S = 0.002  # how long the poller polls back to back after activity


class Poller:
    """The poller thread of ``TierManager`` (module docstring)."""

    # The manager's state this part uses (set by ``TierManager.__init__``).
    transport: DataTransport
    _cond: threading.Condition
    _stopping: bool
    _poller_idle: bool
    _ops: dict[int, Op]
    _overdue: Overdue
    _withheld: WithheldReads
    _ready: list[Request]
    _promotions: Promotions
    _max_poll_interval_s: float

    if TYPE_CHECKING:  # implemented by Transfers, Finishes and SharedHosts

        def _complete(self, result: PollResult, faults: dict[str, str]) -> None: ...
        def _flush(self) -> None: ...
        def _lose_peer(self, peer_id: str, why: str) -> None: ...
        def _report_usage(self, now: float) -> None: ...
        def _settle(self, op: Op, bad: list[Key], reason: str | None) -> None: ...
        def _fail_parked(self, parked: list[Parked], reason: str) -> None: ...

    def _run(self) -> None:
        """The poller thread: ``_poll_loop`` until ``close`` stops it. A done-callback that
        raises ``KeyboardInterrupt`` here (``Future`` logs only an ``Exception``) is logged
        likewise and the poller goes on: the futures it left unresolved went back to
        ``_ready`` (``_flush``), resolved on the next turn; without a poller, no later
        transfer would ever complete."""
        while True:
            try:
                self._poll_loop()
                return
            except KeyboardInterrupt:
                logger.exception("a done-callback raised KeyboardInterrupt on the tier's poller")

    def _poll_loop(self) -> None:
        """Drain ``transport.poll()`` while transfers are in flight; sleep on ``_cond`` when idle.

        Polling is what progresses an initiator's transfers (UCX moves a large transfer in
        fragments, each needing a progress call), so for ``_SPIN_S`` after waking up or after
        its last completion the thread polls back to back, yielding the GIL between polls.
        After that it sleeps 50 us, doubling up to ``max_poll_interval_s``.
        """
        delay = 0.0
        last_activity = time.perf_counter()
        while True:
            with self._cond:
                if not self._ops:
                    delay, last_activity = 0.0, time.perf_counter()
                if self._promotions:
                    self._fail_parked(self._promotions.take_expired(time.monotonic()), MISSING)
                while not (self._ops or self._stopping or self._ready):
                    self._poller_idle = True
                    # idle: report the last bytes moved; look at promotions' deadlines after
                    # every wake-up (each load that parks wakes it)
                    if not self._cond.wait(timeout=0.1 if self._promotions else 1.0):
                        self._report_usage(time.perf_counter())
                    if self._promotions:
                        now = time.monotonic()
                        self._fail_parked(self._promotions.take_expired(now), MISSING)
                self._poller_idle = False
                if self._stopping:
                    return
            if self._ready:  # settled without a transfer (promotions), maybe while others fly
                self._flush()
                if not self._ops:
                    continue
            try:
                result = self.transport.poll()
                faults = self.transport.faulted_peers()
            except Exception:
                logger.exception("transport.poll failed; retrying")
                time.sleep(0.01)
                continue
            if result.done or result.failed or faults:
                try:
                    with self._cond:
                        self._complete(result, faults)
                        self._cond.notify_all()
                    self._flush()
                except Exception:  # a bug here must not leave every later future hanging
                    logger.exception("completing transfers failed")
                delay, last_activity = 0.0, time.perf_counter()
            elif time.perf_counter() - last_activity < _SPIN_S:
                time.sleep(0)
            else:
                time.sleep(delay)
                delay = min(max(delay * 2, 50e-6), self._max_poll_interval_s)
            if self._overdue.timeout_s and time.perf_counter() >= self._overdue.due:
                self._expire_overdue()

    def _expire_overdue(self) -> None:
        """Fault the peers of the transfers the transport still holds ``transfer_timeout_s``
        after their post, as a refused transfer does (``_lose_peer``: its stores settle "peer
        lost", their slots fenced), and settle each such load "timed out", its blocks withheld
        until the transport reports it (``overdue``; unless its ``settle_loads`` is off: the
        load then settles when the transport reports it). Takes the lock; resolves the
        futures."""
        with self._cond:
            bound = self._overdue.timeout_s
            for tid, op in self._overdue.take(self._ops, time.perf_counter()):
                if not op.orphaned:
                    self._lose_peer(op.peer_id, f"left a transfer unfinished for {bound:g} s")
                if self._overdue.settles(op):
                    self._settle(op, [], TIMED_OUT)
                    self._withheld.hold_late(tid, op)
                    op.expired = True
        self._flush()

    def _poll_all(self) -> None:
        """Poll every peer and apply what the transport reported (lock held: for a caller that
        waits for transfers on the poller's own thread)."""
        try:
            result, faults = self.transport.poll(), self.transport.faulted_peers()
        except Exception:
            logger.exception("transport.poll failed; retrying")
            return
        if result.done or result.failed or faults:
            self._complete(result, faults)
