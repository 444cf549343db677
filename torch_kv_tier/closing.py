"""Closing a tier: ``close`` stops accepting work, waits (bounded) for the transfers in flight,
cancels the rest, ends the sessions and closes the transport; the loads it cancelled, and those
whose failed read might still land (``Transfers._stranded``), settle only once the transport can no
longer write into their blocks.

``Closing`` is a part of ``TierManager`` (its first base class, beside ``Transfers``,
``SharedHosts`` and ``ConnectedHosts``).

Threading: ``close`` and ``_settle_cancelled_loads`` take the manager's lock themselves; the
first ``close`` does the work, one on another thread meanwhile waits for it (``_await_close``);
``_await_transfers`` and ``_cancel_in_flight`` run with it held (the first waits on ``_cond``,
which releases it; called by a future's callback on the poller thread, it polls the transfers
it waits for itself).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from torch_kv_tier.connections import Redialer
from torch_kv_tier.deferring_lock import DeferringLock
from torch_kv_tier.promotions import Parked, Promotions
from torch_kv_tier.records import Op, Peer
from torch_kv_tier.remote.quantities import seconds
from torch_kv_tier.results import CLOSED, PEER_LOST, TRANSFER_FAILED
from torch_kv_tier.session_ends import SessionEnds
from torch_kv_tier.tier_threads import on_tier_thread
from torch_kv_tier.transport.base import DataTransport
from torch_kv_tier.withheld import WithheldReads

logger = logging.getLogger(__name__)

_POLL_S = 0.001  # how often ``close`` on the poller thread polls the transfers it waits for
_LEAST_WAIT_S = 0.1  # the least each of ``close``'s last waits is given (``_Waits``)
# how much longer than its own timeout a close waits for another thread's (``_await_close``):
# that one's least waits (``_LEAST_WAIT_S`` each) and its transport's close
_AWAIT_SLACK_S = 1.0
# what may land at any line of ``close`` and must not leave it half done: a Ctrl-C (or a
# done-callback's), and a signal handler's ``sys.exit()`` (its own ``close()`` returned at once)
_INTERRUPTS = (KeyboardInterrupt, SystemExit)
_T = TypeVar("_T")


class Closing:
    """The end of ``TierManager``'s life (module docstring)."""

    # The manager's state this part uses (set by ``TierManager.__init__``).
    transport: DataTransport
    _lock: DeferringLock
    _cond: threading.Condition
    _closing: threading.Event
    _closed: bool
    _stopping: bool
    _thread: threading.Thread
    _redialer: Redialer
    _peers: dict[str, Peer]
    _ops: dict[int, Op]
    _withheld: WithheldReads
    _promotions: Promotions
    _session_ends: SessionEnds  # starts the threads ending dropped peers' sessions
    _closer: _Closer | None = None  # the close that closes the tier (set by it, under the lock)

    if TYPE_CHECKING:  # implemented by Transfers, SharedHosts and ConnectedHosts

        def _finish(self, op: Op, reason: str | None) -> None: ...
        def _fail_awaiting(self, peer: Peer, reason: str) -> None: ...
        def _fail_parked(self, parked: list[Parked], reason: str) -> None: ...
        def _report_usage(self, now: float) -> None: ...
        def _poll_all(self) -> None: ...
        def _flush(self) -> None: ...
        def _end_sessions(self, ending: list[Any], timeout_s: float) -> None: ...
        def _uncount_ends(self, ending: list[tuple[Any, bool]]) -> None: ...

    def close(self, timeout: float = 10.0) -> None:
        """Stop accepting work, wait up to ``timeout`` s for transfers in flight, cancel the rest
        (their keys fail with "closed"), then end the sessions and close the transport; a load
        cancelled here resolves only after that, when nothing can land in its blocks any more
        (never, if the transport cannot tell: ``DataTransport.on_released``);
        a handshake on another thread still awaiting an answer gives up. Idempotent.

        Called on several threads at once (the main thread and a worker of the user's), each
        returns once the tier is closed: the first does the work, the others wait for it
        up to their own ``timeout`` plus 1 s (``TimeoutError`` past that: it goes on there);
        if it failed, a close on any other thread, then or later, raises ``RuntimeError``
        from its error (on its own thread: raised there once). Called on the thread that
        closes it (a done-callback of a future it resolves) or on one of the tier's own
        threads (``tier_threads``: a done-callback on the poller, which the close under way
        joins), it returns at once, the close under way left to finish it. A signal handler
        runs on the main thread, between any two of its lines: its ``close()`` returns at once
        once that thread's own close took the work on, but never returns if it lands while that
        thread holds the tier's lock (in ``store``, ``load``, ``close``'s cancel: the lock is
        not reentrant): have the handler start a thread that closes, or set a flag.

        ``timeout`` bounds ``close``'s own waits, not its last word to each host (ending the
        session, naming the ended sessions that resolved): one a host has not answered by then
        goes on in a daemon thread, each of its steps within ~2 s (the disconnect's answer, a
        release session's handshake), so that a host slow to answer still frees what it would
        free, rather than hold it until its ``--hold-timeout`` (default: never). What none of
        them could tell is logged once, as a warning (``last_words.LastWords``).

        A Ctrl-C (or a done-callback's ``KeyboardInterrupt``) at any line once its work began,
        as it waits, cancels or between its steps, cuts its waits short, not its duty: the
        transfers are cancelled, the sessions ended, the transport closed and every future
        resolved all the same (the steps left run again), then the ``KeyboardInterrupt`` is
        raised; a second Ctrl-C meanwhile changes nothing: it returns within ``timeout`` all
        the same, plus about 0.1 s per wait once interrupted. One before its work began (as it
        checks ``timeout``) leaves the tier open, to be closed again. Likewise a ``SystemExit``
        (a signal handler that calls ``close()``, which returns at once on the closing thread,
        then ``sys.exit()``): raised once the tier is closed. A third one as the second's retry
        ran leaves the close part-way: the closes waiting for it on other threads then raise
        ``RuntimeError`` from it (not ``TimeoutError``: nothing goes on).

        Raises ``TypeError``/``ValueError`` unless ``timeout`` is a number of seconds >= 0
        (``quantities.seconds``), before anything changes (the tier stays open, to be closed
        again)."""
        timeout = seconds("timeout", timeout, zero=True)
        self._closing.set()
        duty = _Duty(_Waits(time.monotonic() + timeout))
        try:
            self._close_steps(duty)
        except _INTERRUPTS:  # a Ctrl-C, a sys.exit at any line: done all the same
            try:
                self._close_steps(duty.cut())
            except _INTERRUPTS:  # a second one, as the first one's retry ran
                try:
                    self._close_steps(duty.cut())
                except _INTERRUPTS as exc:  # a third: left part-way, the closes waiting told
                    duty.closer.end(exc)
                    raise
            raise
        duty.waits.raise_interrupt()
        if not duty.began:  # another close did the work
            self._await_close(timeout)

    def _close_steps(self, duty: _Duty) -> None:
        """``close``'s work, resumable: run again after a ``KeyboardInterrupt`` at any of its
        lines, it does what is left, nothing it did twice (``_Duty`` keeps what it took on;
        a wait may run again: each is idempotent). Nothing if another close took it on; once
        done, or failed otherwise, says so to the closes waiting for it (``_Closer.end``)."""
        try:
            with self._lock:
                if not duty.began:
                    if self._closed:
                        return
                    self._closer = duty.closer  # (an interrupt before the next line: no claim)
                    duty.began = self._closed = True
                self._await_transfers(duty.waits.deadline)
                self._cancel_in_flight(duty)
            self._flush()
            self._close_after(duty)
        except Exception as exc:  # (an interrupt, ``_INTERRUPTS``: ``close`` runs them again)
            duty.closer.end(exc)
            raise
        duty.closer.end(None)

    def _await_close(self, timeout: float) -> None:
        """``close`` after another one took the work on (``_closer``): wait until it is done,
        up to ``timeout`` plus ``_AWAIT_SLACK_S``; not on its own thread nor a tier's (``close``
        docstring). ``TimeoutError`` past that, ``RuntimeError`` if that close failed."""
        first = self._closer
        if first is None or first.thread is threading.current_thread() or on_tier_thread():
            return
        if not first.done.wait(timeout + _AWAIT_SLACK_S):
            raise TimeoutError(
                f"close(): the tier's close on thread {first.thread.name!r} has not finished "
                f"in {timeout + _AWAIT_SLACK_S:g} s (it goes on there): wait for that call to "
                "return, or call close() again with a longer timeout"
            )
        if first.error is not None:
            raise RuntimeError(
                f"close(): the tier's close on thread {first.thread.name!r} failed "
                f"({first.error!r}): see that call's error; the tier stays closed to new work"
            ) from first.error

    def _close_after(self, duty: _Duty) -> None:
        """``close`` once its work is cancelled and resolved: stop the threads, end the
        sessions, close the transport (whatever failed before it, then raised). A Ctrl-C (or
        a ``KeyboardInterrupt`` of a done-callback) in one of its waits cuts the waits left
        to their least (``_Waits``): the sessions still end and the transport still closes,
        then it is raised; a second one is no different, so the caller is out within
        ``close``'s timeout."""
        waits = duty.waits
        try:
            if threading.current_thread() is not self._thread:  # close() from a done-callback
                waits.run(self._thread.join)
            waits.run(self._redialer.stop)
            # dropped peers' sessions whose thread never started: ended here (they stay queued)
            never_started = waits.run(self._session_ends.stop)
            self._uncount_ends(never_started)
            if duty.ending is None:  # once: ``_end_sessions`` sets out their last words in it
                duty.ending = [*duty.live, *never_started]
            waits.run(self._end_sessions, duty.ending)
        finally:  # whatever failed, a Ctrl-C between the waits too: the agent goes (then raised)
            self._close_transport(duty)

    def _close_transport(self, duty: _Duty) -> None:
        """Close the transport, then settle the loads ``close`` cancelled once nothing can land
        in their blocks (``on_released``); also when a Ctrl-C cut its close short (the NIXL
        transport then leaves its release to the registration it waited for). A close that
        failed otherwise leaves them pending: whether its reads may still land is unknown."""
        settle = partial(self.transport.on_released, partial(self._settle_cancelled_loads, duty))
        try:
            self.transport.close()
        except KeyboardInterrupt:
            settle()
            raise
        settle()

    def _settle_cancelled_loads(self, duty: _Duty) -> None:
        """``close``'s last step (unlocked): the loads it cancelled, and those whose failed
        read might still land (``Transfers._stranded``), settle, now that the transport can no
        longer write into their blocks. Each is taken out of ``duty`` as it settles (one line):
        run again (a Ctrl-C here, a second ``on_released``), it settles those left."""
        with self._lock:
            loads, stranded = duty.loads, duty.stranded
            while loads:  # (taken and settled in one line)
                self._finish(op := loads.popitem()[1], PEER_LOST if op.orphaned else CLOSED)
            stranded += self._withheld.released()
            while stranded:
                self._finish(op := stranded.pop(), PEER_LOST if op.orphaned else TRANSFER_FAILED)
        self._flush()

    def _await_transfers(self, deadline: float) -> None:
        """``close``'s first step: fail what is queued or awaits slots or a promotion (a
        promotion announced meanwhile would launch it behind the queues), then wait until
        ``deadline`` for the transfers in flight (on the poller's own thread, polling them)."""
        for peer in self._peers.values():
            while peer.queue:
                self._finish(peer.queue.popleft(), CLOSED)
            self._fail_awaiting(peer, CLOSED)
        self._fail_parked(self._promotions.take_all(), CLOSED)
        self._cond.notify_all()
        on_poller = threading.current_thread() is self._thread  # close() from a done-callback
        while any(not op.orphaned for op in self._ops.values()) and time.monotonic() < deadline:
            if on_poller:  # the poller is this thread: nobody else polls the transfers
                self._poll_all()
            wait = deadline - time.monotonic()
            self._cond.wait(timeout=min(wait, _POLL_S) if on_poller else wait)

    def _cancel_in_flight(self, duty: _Duty) -> None:
        """``close``'s second step, even when a Ctrl-C cut its wait short: cancel the transfers
        still in flight (a store's keys fail with "closed" now; a load's, kept in ``duty``,
        once the transport is closed: until then its blocks may still be written) and stop the
        poller. Notes in ``duty`` the sessions to end (clean unless a store of theirs was
        cancelled). Run again after a Ctrl-C, it cancels those left, none twice."""
        leftover = list(self._ops)
        if any(not self._ops[tid].orphaned for tid in leftover):
            logger.warning("closing with %d transfers in flight: cancelling", len(leftover))
        if leftover:  # (none left once a first run got through: the transport may be closed)
            self.transport.cancel(leftover)
        for tid in leftover:
            op = self._ops[tid]
            if op.kind == "load":
                duty.loads[tid] = op
                del self._ops[tid]
                continue
            duty.dirty.add(id(op.peer))
            if op.orphaned:
                del self._ops[tid]
            else:
                self._finish(self._ops.pop(tid), CLOSED)
        self._stopping = True
        self._cond.notify_all()
        self._report_usage(time.perf_counter())
        peers = [p for p in self._peers.values() if p.session]
        duty.live = [(p.session, id(p) not in duty.dirty) for p in peers]


class _Waits:
    """``close``'s waits after the cancel, each bounded by what is left of its ``deadline``
    (at least ``_LEAST_WAIT_S``). A ``KeyboardInterrupt`` in one is kept, not raised: the
    deadline becomes now, so that the steps left do their duty in their least time, and
    ``raise_interrupt`` raises it once they did. Not thread-safe: ``close``'s thread's."""

    def __init__(self, deadline: float) -> None:
        self._deadline = deadline
        self._interrupt: KeyboardInterrupt | None = None

    def run(self, wait: Callable[..., _T], *args: Any) -> _T:
        """``wait(*args, seconds_left)``; interrupted, run again in its least time (so that
        its duty is done: each of close's waits may run twice). Other errors propagate."""
        try:
            return wait(*args, max(self._deadline - time.monotonic(), _LEAST_WAIT_S))
        except KeyboardInterrupt as exc:
            self._interrupt = self._interrupt or exc
            self._deadline = time.monotonic()
        return wait(*args, _LEAST_WAIT_S)

    def raise_interrupt(self) -> None:
        """Raise the first ``KeyboardInterrupt`` a wait got, if any."""
        if self._interrupt is not None:
            raise self._interrupt

    @property
    def deadline(self) -> float:
        """When the waits left end (now, once interrupted)."""
        return self._deadline

    def cut(self) -> None:
        """Cut the waits left to their least: ``close`` was interrupted outside a wait."""
        self._deadline = min(self._deadline, time.monotonic())


@dataclass
class _Closer:
    """What the closes waiting for the one that closes the tier need of it (``_await_close``):
    its thread, and once it is over (``done``) whether it failed (``error``). Kept by the tier
    apart from ``_Duty``, whose last words hold the tier (a closed tier must be freed without
    the collector). Written by that close's thread; read by any once ``done`` is set."""

    thread: threading.Thread = field(default_factory=threading.current_thread)
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    def end(self, error: BaseException | None) -> None:
        """The close is over (``error``: it failed): the closes waiting for it go on."""
        self.error = error
        self.done.set()


@dataclass
class _Duty:
    """What one ``close`` call took on, kept across its retries after a Ctrl-C
    (``_close_steps``): whether it closed the tier, the cancelled loads to settle (by transfer
    id) and stranded ones, the peers a cancelled store dirtied (by id), the live sessions to
    end, then their last words (``_end_sessions`` sets them out in ``ending``); ``closer``,
    for the closes that wait for it. ``close``'s thread's (the settling may run on the
    transport's, under the tier's lock)."""

    waits: _Waits
    began: bool = False
    loads: dict[int, Op] = field(default_factory=dict)
    stranded: list[Op] = field(default_factory=list)
    dirty: set[int] = field(default_factory=set)
    live: list[tuple[Any, bool]] = field(default_factory=list)
    ending: list[Any] | None = None  # (session, clean), then ``last_words.LastWord``s
    closer: _Closer = field(default_factory=_Closer)

    def cut(self) -> _Duty:
        """This duty, its waits cut to their least (``close`` was interrupted)."""
        self.waits.cut()
        return self
