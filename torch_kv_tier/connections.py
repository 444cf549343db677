"""How a tier keeps its connected hosts: how each was dialled, and dial again what it lost.

``Dial`` remembers how a host was connected (``TierManager.connect``'s arguments), so that a
host the tier dropped (heartbeats stopped, a transfer failed, the control connection was reset)
is connected again by a ``Redialer`` thread, with backoff, until it answers or the tier closes.
A user's ``disconnect``/``remove_peer`` ends that.

Threading: ``Redialer`` runs one daemon thread for all lost hosts, from the tier's first
connected host until it closes, and at most ``MAX_CONNECTS`` tries (and one greeting) at once,
each on a thread of its own; they call back into the manager without holding anything.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

from torch_kv_tier.remote.greeting import Greeting
from torch_kv_tier.remote.handshake import CANCEL_POLL_S, no_answer
from torch_kv_tier.remote.host_names import UnresolvedHost, resolving
from torch_kv_tier.tier_threads import TierThread

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0  # how long one handshake waits for a host's answer, by default
REDIAL_FIRST_S = 0.5
REDIAL_MAX_S = 10.0
REDIAL_THREAD = "tkvt-redial"  # the redialer's threads
MAX_CONNECTS = 16  # handshakes a tier's connects (``parallel_connects``) or redials run at once


@dataclass(frozen=True, eq=False)
class Dial:
    """``TierManager.connect``'s arguments for one host. Compared (and hashed) by identity:
    each is one connect's, and an equal one of a later connect is another dial (the
    ``Redialer`` keys its hosts by it; a dial the user stopped must not stand for a new one)."""

    address: str
    token: str | None
    private: bool
    slots: int | None
    timeout_s: float
    heartbeat_timeout_s: float
    # who asked for it, as a host down at its connect (``redial_if_down``'s ``dial_owner``;
    # ``None``: a caller who named none): ``cancel_dial`` with an owner withdraws only its own;
    # emptied once the address joined (``_forget_replaced``), so that no owner is held after
    askers: set[object] = field(default_factory=set, init=False)
    # set once the tier no longer dials it (cancelled, its host removed, or its address
    # answered another dial: ``LostHosts._let_go``): a handshake or greeting of it
    # still awaiting the host's answer gives up (``EitherSet``). Neither is copied by
    # ``dataclasses.replace`` (a removed host's releases go out over a copy of its dial).
    stopped: threading.Event = field(default_factory=threading.Event, init=False)


@dataclass(frozen=True)
class EitherSet:
    """A handshake's ``cancel`` (``handshake.Cancel``): set once either event is (the tier
    closing, or the dial stopped)."""

    first: threading.Event
    second: threading.Event

    def is_set(self) -> bool:
        return self.first.is_set() or self.second.is_set()


class Joining(threading.Event):
    """A connect of a host in progress, set once it ended: the address it dialled, its dial's
    ``stopped`` (set once the user removed the host or cancelled the dial: the join then never
    publishes it), whether its dial is the host's first (``first``: forgotten if the join
    fails, so it stands for no later redial), the thread connecting (the one that made it)
    and, once it failed, why (what the connects of that host that waited for it report)."""

    def __init__(self, dial: Dial, first: bool) -> None:
        super().__init__()
        self.address = dial.address
        self.stopped = dial.stopped
        self.first = first
        self.thread = threading.current_thread()
        self.failure: BaseException | None = None

    def await_end(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the join to end; whether it did. On the joining thread
        itself (a callback of its own) ``False`` at once: it cannot end while it waits."""
        if self.thread is threading.current_thread():
            return False
        return self.wait(timeout_s)


class Redialer:
    """Dials lost hosts again in the background (module docstring): one thread (started by
    ``arm``) for all lost hosts, each dialled with its own backoff (``REDIAL_FIRST_S`` doubling
    to ``REDIAL_MAX_S``). Each try runs on a thread of its own (named ``REDIAL_THREAD`` too),
    so that hosts are dialled side by side: a host that does not answer holds up no other.

    At most ``MAX_CONNECTS`` tries run at once (200 hosts lost at once made 200 threads, each
    handshaking). When more hosts are due than tries may start, one more thread greets them
    (``greeting.Greeting``, each within its ``timeout_s``), and those falling due while it
    runs join it: those that answer are tried first, as tries end; those that do not fail
    that round as their try would have (``remote.UnresolvedHost`` for a name that did not
    resolve in time, else ``TimeoutError``; their next try after their backoff) and hold no try;
    those the tier no longer dials (``Dial.stopped``) are let go at once. So a host that is
    back waits for no other host's timeout.

    ``dial(spec)`` connects one host (blocking; raises on failure); ``wanted(spec)`` says
    whether the host is still to be connected (not removed by the user, tier open). A failure
    of a kind new for its host is logged as a warning, repeats of it at info (one of a host no
    longer wanted meanwhile, or ended by ``stop``, at debug: no next try). Both are
    bound methods of the tier, held weakly: the tier owns the redialer, and a strong reference
    would be a cycle keeping the tier (and its NIXL agent) alive until the garbage collector
    runs; once the tier is gone, redialling stops.
    """

    def __init__(self, dial: Callable[[Dial], object], wanted: Callable[[Dial], bool]) -> None:
        self._dial = weakref.WeakMethod(dial)
        self._wanted = weakref.WeakMethod(wanted)
        self._stop = threading.Event()
        self._lock = threading.Condition()
        self._due: dict[Dial, tuple[float, float]] = {}  # lost host -> (next try, backoff)
        self._failures: dict[Dial, set[type[BaseException]]] = {}  # kinds logged as warnings
        self._trying: dict[Dial, threading.Thread] = {}  # host -> the thread of its try
        # hosts being tried that were lost again meanwhile (``start``): their try, which may
        # have seen them joined, must not forget them
        self._lost_again: set[Dial] = set()
        self._greeting: set[Dial] = set()  # hosts handed to the greeter, not answered yet
        self._to_greet: list[Dial] = []  # those of them it has not greeted yet
        self._answered: list[Dial] = []  # hosts that answered it, to be tried first
        self._greeter: threading.Thread | None = None
        self._thread: threading.Thread | None = None
        self._unarmed = False  # whether the thread could not start (logged as a warning)

    def arm(self) -> None:
        """Start the thread (idempotent). The tier arms it when it connects its first host, so
        that the thread runs from then until the tier closes, whether or not it loses a host.
        One that cannot start (the process at its thread limit) is logged (a warning once,
        then at debug); the next ``arm`` (the tier's poller arms it about once a second) or
        ``start`` starts it."""
        with self._lock:
            if self._thread is None and not self._stop.is_set():
                thread = TierThread(target=self._run, name=REDIAL_THREAD, daemon=True)
                try:
                    thread.start()
                except RuntimeError as exc:
                    level = logging.DEBUG if self._unarmed else logging.WARNING
                    self._unarmed = True
                    msg = "could not start the thread re-dialling lost hosts (tried again): %s"
                    logger.log(level, msg, exc)
                    return
                self._thread = thread

    def start(self, spec: Dial, failed: type[BaseException] | None = None) -> None:
        """Dial ``spec`` again until it answers; ``failed``: the kind of failure its caller
        logged already (not logged as a warning again)."""
        self.arm()
        with self._lock:
            if self._stop.is_set():
                return
            if spec in self._due:
                if spec in self._trying:
                    self._lost_again.add(spec)
                return
            self._due[spec] = (time.monotonic() + REDIAL_FIRST_S, REDIAL_FIRST_S)
            self._failures[spec] = set() if failed is None else {failed}
            self._lock.notify()

    def stop(self, timeout: float) -> None:
        """Stop redialling; wait up to ``timeout`` s in all for the handshakes in progress (and
        the greeting), which give up within ``CANCEL_POLL_S`` once their tier is closing (the
        handshake's ``cancel``); a thread still running then is logged as a warning."""
        deadline = time.monotonic() + timeout
        self._stop.set()
        with self._lock:
            self._lock.notify()
            threads = [self._thread, self._greeter, *self._trying.values()]
        others = [t for t in threads if t is not None and t is not threading.current_thread()]
        for thread in others:
            thread.join(timeout=max(deadline - time.monotonic(), 0.0))
        running = sum(thread.is_alive() for thread in others)
        if running:
            logger.warning(
                "%d thread(s) re-dialling lost hosts still running %.1f s after the tier closed "
                "(a host's join, a NIXL registration, may take long): left to end by themselves",
                running,
                timeout,
            )

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                now = time.monotonic()
                busy = self._trying.keys() | self._greeting | set(self._answered)
                idle = {s: at for s, (at, _) in self._due.items() if s not in busy}
                due = [spec for spec, at in idle.items() if at <= now]
                free = max(MAX_CONNECTS - len(self._trying), 0)
                if self._stop.is_set():  # (``stop`` joins the threads it finds under the lock)
                    return
                ready, self._answered = self._answered[:free], self._answered[free:]
                if len(due) <= free - len(ready):
                    ready += due
                else:
                    self._hand_to_greeter(due)
                for spec in ready:
                    thread = TierThread(
                        target=self._try_once, args=(spec,), name=REDIAL_THREAD, daemon=True
                    )
                    if self._started(thread, [spec]):
                        self._trying[spec] = thread
                if not ready:  # (woken by a new host, an answer, or a try or greeting ended)
                    wake = min((at for at in idle.values() if at > now), default=now + 1.0)
                    self._lock.wait(timeout=max(wake - now, 0.01))

    def _started(self, thread: threading.Thread, specs: list[Dial]) -> bool:
        """Start ``thread``, the try or greeting of ``specs`` (under the lock); a process at
        its thread limit (``RuntimeError``) puts them off to their next round instead."""
        try:
            thread.start()
        except RuntimeError as exc:
            backoff = max(self._back_off(spec) for spec in specs)
            hosts = specs[0].address if len(specs) == 1 else f"{len(specs)} hosts"
            msg = "could not start a thread to re-dial %s (next try in up to %.1f s): %s"
            logger.warning(msg, hosts, backoff, exc)
            return False
        return True

    def _hand_to_greeter(self, due: list[Dial]) -> None:
        """Have ``due`` greeted (under the lock): by the greeter running, else a new one."""
        if self._greeter is None:
            greeter = TierThread(target=self._greet, name=REDIAL_THREAD, daemon=True)
            if not self._started(greeter, due):
                return
            self._greeter = greeter
        self._greeting.update(due)
        self._to_greet += due

    def _greet(self) -> None:
        """The greeter's thread: greets the hosts handed to it as they come (``Greeting``),
        each within its own ``timeout_s`` while its host name is looked up, as its try would
        first (``host_names.resolving``), until it awaits none. Each that answers is tried
        next, as it answers; each that does not fails its round (``UnresolvedHost`` for a name
        that did not resolve, else ``TimeoutError``); each the tier stopped dialling
        (``Dial.stopped``) is let go at once."""
        greeting: Greeting[Dial] = Greeting()
        lookups: dict[Dial, Callable[[], UnresolvedHost | None]] = {}  # one per host awaited
        try:
            while self._take_greetings(greeting):
                new = set(greeting.keys()) - lookups.keys()  # (greeted since it last looked)
                lookups.update((spec, resolving(spec.address)) for spec in new)
                heard, silent = greeting.wait(CANCEL_POLL_S)
                self._answer(heard)
                for spec in silent:
                    why = lookups[spec]() or no_answer(spec.address, spec.timeout_s)
                    self._fail_round(spec, why)
                for spec in greeting.drop(lambda spec: spec.stopped.is_set()):
                    self._fail_round(spec, ConnectionError("cancelled while it was greeted"))
                kept = greeting.keys()  # (a host let go keeps no lookup: a new one if greeted)
                lookups = {spec: lookups[spec] for spec in kept}
        finally:  # (stopped, or an exception: its sockets closed before ``stop``'s join ends)
            awaited = greeting.keys()
            greeting.close()
            with self._lock:
                if self._greeter is threading.current_thread():
                    self._greeter_ends(awaited)

    def _take_greetings(self, greeting: Greeting[Dial]) -> bool:
        """Greet the hosts handed to the greeter since it last looked; ``False`` (the greeter
        ends) once it awaits none, or the redialer stopped. One that cannot be greeted (a bad
        address, no socket left) is tried all the same: its handshake says why."""
        with self._lock:
            if self._stop.is_set():
                return False
            new, self._to_greet = self._to_greet, []
            if not (new or greeting):
                self._greeter_ends([])
                return False
        self._answer([spec for spec in new if not greeting.add(spec, spec.address, spec.timeout_s)])
        return True

    def _greeter_ends(self, awaited: list[Dial]) -> None:
        """The greeter's thread ends (under the lock); ``awaited``, and the hosts handed to it
        that it did not take yet, are not greeted any more (due, unless stopped)."""
        self._greeting.difference_update([*awaited, *self._to_greet])
        self._to_greet = []
        self._greeter = None
        self._lock.notify()

    def _answer(self, specs: list[Dial]) -> None:
        """``specs`` answered their greeting: tried next."""
        if specs:  # (else no wake-up of ``_run``: the greeter looks 20 times a second)
            with self._lock:
                self._greeting.difference_update(specs)
                self._answered += specs
                self._lock.notify()

    def _fail_round(self, spec: Dial, why: Exception) -> None:
        """``spec`` did not answer its greeting (``why``): its next try is due after its
        backoff (or it is forgotten, no longer wanted), before it is let go (else ``_run``
        would take it for due still), and ``_run`` is woken to look at its next try."""
        wanted = self._wanted()
        if wanted is None or not self._again_unless_unwanted(spec, why, wanted):
            self._forget(spec)
        with self._lock:
            self._greeting.discard(spec)
            self._lock.notify()

    def _try_once(self, spec: Dial) -> None:
        """A try's thread: ``_try``, then ``spec`` may be tried again."""
        try:
            if not self._stop.is_set():
                self._try(spec)
        finally:
            with self._lock:
                del self._trying[spec]
                self._lost_again.discard(spec)
                self._lock.notify()

    def _try(self, spec: Dial) -> None:
        wanted, dial = self._wanted(), self._dial()
        if wanted is None or dial is None:
            self._stop.set()
            return
        try:
            if wanted(spec):
                dial(spec)
                logger.info("re-connected %s", spec.address)
                if wanted(spec):  # lost again before the dial returned: its drop found it due
                    raise ConnectionError("the new session was lost at once")
        except Exception as exc:
            if self._again_unless_unwanted(spec, exc, wanted):
                return
        finally:
            del wanted, dial
        self._forget(spec)

    def _forget(self, spec: Dial) -> None:
        """``spec`` joined, or is no longer wanted: no next try, unless it was lost again
        since its try saw it joined (``start`` found it due still): dialled anew then."""
        with self._lock:
            if spec in self._lost_again:
                self._lost_again.discard(spec)
                self._due[spec] = (time.monotonic() + REDIAL_FIRST_S, REDIAL_FIRST_S)
                self._failures[spec] = set()
                return
            self._due.pop(spec, None)
            self._failures.pop(spec, None)

    def _again_unless_unwanted(
        self, spec: Dial, exc: Exception, wanted: Callable[[Dial], bool]
    ) -> bool:
        """A try of ``spec`` failed with ``exc``: ``True`` when its next try is due after its
        backoff, ``False`` when there is none (stopped, or no longer wanted meanwhile)."""
        if self._stop.is_set() or not wanted(spec):
            logger.debug("re-dialling %s ended, no longer wanted: %s", spec.address, exc)
            return False
        with self._lock:
            backoff = self._back_off(spec)
            kinds = self._failures.setdefault(spec, set())
            new = type(exc) not in kinds
            kinds.add(type(exc))
        logger.log(
            logging.WARNING if new else logging.INFO,
            "re-dialling %s failed (next try in %.1f s, up to every %g s): %s",
            spec.address,
            backoff,
            REDIAL_MAX_S,
            exc,
        )
        return True

    def _back_off(self, spec: Dial) -> float:
        """A round of ``spec`` failed (under the lock): its next is due after its backoff,
        doubled (up to ``REDIAL_MAX_S``), which this returns."""
        backoff = min(self._due[spec][1] * 2, REDIAL_MAX_S)
        self._due[spec] = (time.monotonic() + backoff, backoff)
        return backoff
