"""The tier's half of fencing: telling hosts which ended sessions *resolved*.

A session that ended with writes in flight, or without a clean disconnect, is held by its host
until this tier names it as resolved, i.e. once the transport reported its last write
(``ended_sessions.EndedSessions`` counts them). The names go to the host with the next handshake (a
redial), with a ``Release`` on a live session of that host, or, when the tier has no session
with it any more (removed, or closing), with a short session of its own opened only to carry
them (``RELEASE_THREAD``).

``SessionReleases`` is a part of ``TierManager`` (the base class of ``LostHosts``, itself the
base of ``ConnectedHosts``).

Threading: methods without "(unlocked)" run with the manager's lock held. Handshakes never run
under it. Failure model: a host that does not answer keeps holding the sessions, which is safe;
a restarted host holds nothing of them.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from torch_kv_tier.connections import Dial
from torch_kv_tier.deferring_lock import DeferringLock
from torch_kv_tier.ended_sessions import EndedSessions
from torch_kv_tier.last_words import (
    LastWord,
    LastWords,
    Unreleased,
    end_session,
    warn_unreleased,
)
from torch_kv_tier.records import Peer
from torch_kv_tier.tier_threads import TierThread

logger = logging.getLogger(__name__)

# A session opened only to release ended ones: a host that does not answer in this time is down
# or restarted, and holds nothing of them any more.
_RELEASE_TIMEOUT_S = 2.0
_RELEASE_TRIES = 4
RELEASE_THREAD = "tkvt-release"  # the thread such a release runs in
# The longest that thread runs: every try and the pauses between them.
RELEASE_BUDGET_S = (
    _RELEASE_TRIES * _RELEASE_TIMEOUT_S + (_RELEASE_TRIES - 1) * _RELEASE_TIMEOUT_S / 4
)


class SessionReleases:
    """Releasing ended sessions, for ``TierManager`` (module docstring)."""

    # The manager's state this part uses (set by ``TierManager.__init__``).
    _lock: DeferringLock
    _cond: threading.Condition  # on ``_lock``
    _closed: bool
    _peers: dict[str, Peer]
    _dials: dict[str, Dial]
    _removed: dict[str, Dial]
    _pending: dict[str, Dial]  # address -> how to dial a host down at its connect
    _redialing: list[Dial]  # the redialer's connects in progress
    _ended: EndedSessions

    if TYPE_CHECKING:  # implemented by ConnectedHosts

        def _open(
            self, dial: Dial, release: list[str], *, private: bool, cancellable: bool = True
        ) -> Any: ...

    def _send_releases(self, address: str) -> None:
        """Tell ``address``'s host which ended sessions resolved: over its live session, else
        with the redial's handshake, else (removed: nobody dials it any more) over a session of
        their own, else (never connected: its first connect failed) with the next connect's
        handshake there. A removed host is then forgotten (``_forget_removed``)."""
        session = next(
            (p.session for p in self._peers.values() if p.session and p.session.address == address),
            None,
        )
        if session is None:
            dial = next((d for d in self._dials.values() if d.address == address), None)
            if dial is None and not self._closed:
                dial = self._removed.get(address)
                if dial is not None:
                    self._carry_off(dial)
        else:
            held = self._ended.take(address)
            try:
                session.release(held)
            except ConnectionError:
                self._ended.give_back(address, held)
        self._forget_removed(address)

    def _dial(self, address: str) -> Dial | None:
        """How the host at ``address`` was dialled (removed, or connected) or is dialled (down
        at its connect: a handshake of it may have opened a session there), if it was."""
        return (
            self._removed.get(address)
            or next((d for d in self._dials.values() if d.address == address), None)
            or self._pending.get(address)
        )

    def _forget_removed(self, address: str) -> None:
        """Forget how a removed host at ``address`` was dialled once nothing needs it: no
        session of it is left to release and no redial of it is in progress (that one checks
        it, to end a session it opened after the removal). Else a tier following a churning
        fleet would keep one entry per host that ever left."""
        dial = self._removed.get(address)
        redialing = any(d is dial for d in self._redialing)
        if dial is not None and not redialing and not self._ended.holds(address):
            del self._removed[address]

    def _carry_off(self, dial: Dial) -> None:
        """Carry the resolved sessions of ``dial``'s address (if any) to its host over a
        session of their own, on a ``RELEASE_THREAD`` (``_carry``). A thread that cannot
        start (the process at its thread limit) leaves them to be named again (``close``
        does), logged as a warning: the caller's step (a connect that succeeded, a removal)
        stands."""
        held = self._ended.take(dial.address)
        if not held:
            return
        thread = TierThread(target=self._carry, args=(dial, held), name=RELEASE_THREAD, daemon=True)
        try:
            thread.start()
        except RuntimeError as exc:
            self._ended.give_back(dial.address, held)
            logger.warning(
                "could not start a thread to tell %s that %d ended sessions resolved (named "
                "again later, at the latest by close): %s",
                dial.address,
                len(held),
                exc,
            )
            return
        self._ended.carry(dial.address, 1)  # (under the lock: the thread uncounts it after)

    def _carry(self, dial: Dial, held: list[str]) -> None:
        """A ``RELEASE_THREAD`` (unlocked): ``_release_over_own_session``, counted in
        ``_ended.carrying`` until it ends (its removed host is remembered meanwhile), so that
        ``close`` waits for what its closing made it hand back before it looks for what to
        name."""
        try:
            self._release_over_own_session(dial, held)
        finally:
            with self._lock:
                self._ended.carry(dial.address, -1)
                self._forget_removed(dial.address)
                self._cond.notify_all()

    def _release_over_own_session(
        self, dial: Dial, held: list[str], *, last_word: bool = False
    ) -> Unreleased | None:
        """Carry ``held`` to a host this tier no longer has a session with (unlocked; never
        raises: a host that does not answer keeps holding, which is safe). A slow host gets
        ``_RELEASE_TRIES`` handshakes of ``_RELEASE_TIMEOUT_S`` each, each naming too the
        session an earlier one may have opened (``AcceptLost``); when none is answered (the
        host is down, restarted or frozen) they all stay in ``_ended``, to be named again
        (``_send_releases``, a connect there, ``close``). ``last_word``: ``close``'s (one try,
        which its closing does not cancel; one it cancelled leaves them to ``close``), whose
        failure is returned for ``close`` to report with its other hosts' (``LastWords``);
        any other is logged here."""
        quick = dataclasses.replace(dial, timeout_s=min(dial.timeout_s, _RELEASE_TIMEOUT_S))
        for attempt in range(1, _RELEASE_TRIES + 1):
            try:
                session = self._open(quick, held, private=False, cancellable=not last_word)
                self._end_keeping_releases(session, True)
                return None
            except Exception as exc:  # ``_open`` handed them back, with what it may have opened
                if self._closed and not last_word:  # ``close`` names them (``_carry``)
                    return None
                if last_word:
                    return Unreleased(dial.address, len(held), exc)
                if attempt == _RELEASE_TRIES:
                    logger.warning(
                        "could not tell %s that %d ended sessions resolved (it holds their "
                        "slots until they are named again): %s",
                        dial.address,
                        len(held),
                        exc,
                    )
                    return None
                with self._lock:
                    held = self._ended.take(dial.address)
                if not held:  # another thread took them meanwhile, to carry them itself
                    return None
                time.sleep(_RELEASE_TIMEOUT_S / 4)  # counted in RELEASE_BUDGET_S
        return None

    def _end_keeping_releases(self, session: Any, clean: bool) -> None:
        """End ``session`` (unlocked; as ``end_session``) and keep the ended sessions it
        released that its host may not have read (its disconnect went unanswered:
        ``RemoteSession.unreleased``), to be told again. A session its host ended clean
        (``RemoteSession.ended_clean``) is not released itself: nothing of it is held. They
        go out at once unless a redial will carry them (``_send_releases``); a host removed
        and forgotten meanwhile is remembered again for it. Counted in ``_ended.carrying``
        meanwhile: ``close`` waits for what it hands back (up to ~2 s for a frozen host);
        once the tier is closed it names them itself, as ``close``'s last word does."""
        with self._lock:
            self._ended.end_begins(session)
        self._end_counted(session, clean)

    def _end_counted(self, session: Any, clean: bool) -> None:
        """``_end_keeping_releases`` of a session already counted (``_ended.end_begins``, under
        the lock, by whoever dropped its peer: ``LostHosts._end_later``, ``_drop_to_end``),
        uncounted here once it ended (unlocked). Counted from the drop, a removal of its host
        meanwhile keeps how it was dialled (``_forget_removed``), for what this end hands
        back; and nobody names the session itself as resolved before its end (but ``close``'s
        last word, which this end may outlast): what is owed its host then, that session
        among them unless it ended clean, goes out from here."""
        address = session.address
        with self._lock:
            dial = self._dial(address)
        try:
            unread = end_session(session, clean, [])
            with self._lock:
                self._ended.end_ends(session)
                closed = self._closed
                if session.ended_clean:
                    self._ended.forget(session)
                if closed:  # ``close`` may have looked for what to name already
                    unread += self._ended.take(address)
                else:
                    self._ended.give_back(address, unread)
                if address in self._ended.resolved and not closed:
                    if dial is not None and self._dial(address) is None:
                        self._removed[address] = dial
                    self._send_releases(address)
            if closed:
                failure = self._last_word_of(address, unread, dial)
                if failure is not None:
                    warn_unreleased([failure])
        finally:
            with self._lock:
                self._ended.end_ends(session)
                self._forget_removed(address)
                self._cond.notify_all()

    def _last_word(self, session: Any, clean: bool, dial: Dial | None) -> Unreleased | None:
        """``close``'s end of a live ``session`` (unlocked): it names the resolved sessions of
        its host (taken here, those of dropped sessions still ending too:
        ``EndedSessions.take``) and ends; what its host may not have read (the session lost
        meanwhile, its disconnect unanswered) goes over a session of its own (``dial``'s): no
        later session would carry it. Returns what could not be told (``_last_word_of``). A
        dropped peer's session the poller never started ending is among them once its writes
        resolved: it ends clean instead (its host, told so over it, would end it first and
        leave its disconnect unanswered)."""
        with self._lock:
            held = self._ended.take(session.address, closing=True)
        resolved = session.session_id in held
        held = [sid for sid in held if sid != session.session_id]
        unread = end_session(session, clean or resolved, held)
        if resolved and not session.ended_clean and session.session_id not in unread:
            unread.append(session.session_id)
        return self._last_word_of(session.address, unread, dial)

    def _last_word_of(
        self, address: str, unread: list[str], dial: Dial | None
    ) -> Unreleased | None:
        """A closed tier's last word to ``address`` (unlocked): ``unread`` over a session of
        its own (``dial``'s; one try), else kept in ``_ended``. Returns the failure of that
        session, for the caller to report (``LastWords``)."""
        if unread and dial is not None:
            return self._release_over_own_session(dial, unread, last_word=True)
        if unread:
            with self._lock:
                self._ended.give_back(address, unread)
        return None

    def _own_last_word(self, dial: Dial) -> Unreleased | None:
        """``close``'s last word to a host it has no live session with (unlocked): the
        resolved sessions of ``dial``'s address (taken here) over a session of their own."""
        with self._lock:
            held = self._ended.take(dial.address, closing=True)
        return self._release_over_own_session(dial, held, last_word=True) if held else None

    def _end_sessions(self, ending: list[Any], timeout_s: float) -> None:
        """``close``'s last word to every host (unlocked): each live session of ``ending``
        (``(session, clean)``) carries the resolved sessions of its host, then ends
        (``clean``: none of its writes was cancelled in flight); a host with resolved sessions
        and no live one gets a session of its own. A dropped session whose end has not ended
        by then is named too, if resolved (its end, past ``close``, would find the transport
        closed: ``EndedSessions.take``).
        Side by side, awaited up to ``timeout_s`` (at least 0.1 s), once the release threads
        ``close`` cancelled handed back what they carried; one still running then goes on by
        itself (each of its steps within ~2 s; not cut short, see ``close``), and reports
        what it could not tell when it ends. A host that does not answer ends the session
        itself after its lease timeout. Sessions to release at an address no longer dialled
        (its host joined at another one and a release there failed, or a connect there
        failed) are reported too. A last word whose thread cannot start (the process at its
        thread limit) is said on the calling thread after the others started (past
        ``timeout_s``, if need be: each step within ~2 s), logged as a warning. A Ctrl-C as
        it waits is raised once the last words started (each goes on by itself), and what
        they could not tell so far said (what they cannot tell later, said on its own).

        Resumable (``close`` runs it again after a Ctrl-C at any of its lines): ``ending``'s
        sessions become ``LastWord``s in place, each said once however often it is started,
        and each word takes what it names as it is said, so that a word set out and not
        started yet took nothing (a retry starts it)."""
        deadline = time.monotonic() + max(timeout_s, 0.1)  # one for all: they run side by side
        interrupt = None
        words = LastWords()
        with self._lock:
            try:
                while self._ended.carrying and time.monotonic() < deadline:
                    self._cond.wait(timeout=deadline - time.monotonic())
            except KeyboardInterrupt as exc:  # the last words still start: raised after that
                interrupt = exc
            ending[:] = [w if isinstance(w, LastWord) else self._live_word(*w) for w in ending]
            live = {w.address for w in ending}
            own = []  # (set out again by a retry: one that finds nothing taken says nothing)
            for address in [a for a in self._ended.resolved if a not in live]:
                dial = self._dial(address)
                if dial is not None:
                    own.append(LastWord(address, self._own_last_word, dial))
                else:
                    gone = ConnectionError(
                        "no longer dialled (its host joined at another address, or its "
                        "connect failed)"
                    )
                    words.add(Unreleased(address, len(self._ended.resolved[address]), gone))
        unstarted = []
        for word in [w for w in ending if w.thread is None] + own:
            thread = TierThread(target=word, args=(words,), daemon=True)
            try:
                thread.start()
            except RuntimeError as exc:  # the process at its thread limit
                unstarted.append((word, exc))
            else:
                word.thread = thread  # (interrupted before: a retry's thread says nothing)
        try:
            if interrupt is not None:  # (each started last word goes on by itself)
                raise interrupt
            if unstarted:
                logger.warning(
                    "could not start a thread for the last word to %d host(s) (%s): said one "
                    "after another on the closing thread, each within ~2 s",
                    len(unstarted),
                    unstarted[0][1],
                )
            for word, _ in unstarted:
                word(words)
            for word in [*ending, *own]:
                if word.thread is not None:
                    word.thread.join(timeout=max(deadline - time.monotonic(), 0.0))
        finally:  # interrupted too: what failed so far now, a later failure on its own
            words.report()

    def _live_word(self, session: Any, clean: bool) -> LastWord:
        """The last word to ``session``'s host over it (``_last_word``), not said yet."""
        return LastWord(
            session.address, self._last_word, session, clean, self._dial(session.address)
        )
