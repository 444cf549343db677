"""``close``'s last words to its hosts: ``end_session`` (name the resolved ended sessions,
then end a session), ``LastWord`` (one of them, said once however often it is started),
``Unreleased`` and ``LastWords`` (what they could not tell, said in one warning).

Threading: ``end_session`` blocks on its host (each step within ~2 s) and never raises;
``LastWord`` and ``LastWords`` are for any thread. The warnings keep the logger of
``session_releases`` (the part of the tier that says these words), which users filter on.
Failure model: what a host did not hear it keeps holding (safe), until named again or its
``--hold-timeout``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("torch_kv_tier.session_releases")


@dataclasses.dataclass(frozen=True)
class Unreleased:
    """Ended sessions ``close``'s last word could not name to the host at ``address``."""

    address: str
    sessions: int
    why: Exception

    def detail(self) -> tuple[str, int, Exception]:
        return self.address, self.sessions, self.why


class LastWords:
    """What ``close``'s last words to its hosts could not tell them, said in one warning for
    all (a tier that followed a churning fleet knew many dead hosts), each host's detail at
    debug: ``add`` from any thread, ``report`` once they were awaited; one added after that
    (a last word that outlived ``close``'s wait) is reported on its own."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._failures: list[Unreleased] = []
        self._reported = False

    def add(self, failure: Unreleased | None) -> None:
        """A last word ended; ``failure``: what it could not tell (``None``: all was told)."""
        if failure is None:
            return
        with self._lock:
            if not self._reported:
                self._failures.append(failure)
                return
        warn_unreleased([failure])

    def report(self) -> None:
        """Say what the last words added so far could not tell (nothing when all was told)."""
        with self._lock:
            self._reported = True
            failures, self._failures = self._failures, []
        if failures:
            warn_unreleased(failures)


def warn_unreleased(failures: list[Unreleased]) -> None:
    """One warning for ``failures``; each host's reason at debug."""
    for f in failures:
        logger.debug("could not tell %s that %d ended sessions resolved: %s", *f.detail())
    hosts = sorted({f.address for f in failures})
    shown = ", ".join(hosts[:3]) + (f" and {len(hosts) - 3} more" if len(hosts) > 3 else "")
    logger.warning(
        "could not tell %d host(s) (%s) that %d ended sessions resolved as the tier closed: "
        "each keeps those sessions' slots until its --hold-timeout, if it has one (a host "
        "restarted since holds none). First reason (each host's at debug): %s",
        len(hosts),
        shown,
        sum(f.sessions for f in failures),
        failures[0].why,
    )


def end_session(session: Any, clean: bool, held: list[str]) -> list[str]:
    """Tell a host which ended sessions resolved, then end ``session`` (clean: no write of it
    in flight); return the ended sessions it released that the host may not have read (the
    session refused them, was lost, or its disconnect went unanswered: ``unreleased``), to
    be named again. Never raises: a host that does not answer ends the session itself."""
    refused: list[str] = []
    if held:
        try:
            session.release(held)
        except ConnectionError:  # (some may have gone out: ``unreleased`` names those)
            logger.info("%s: could not release %d ended sessions", session.peer_id, len(held))
            refused = held
    session.close(clean=clean)
    return list(dict.fromkeys([*session.unreleased(), *refused]))


class LastWord:
    """One of ``close``'s last words to the host at ``address``, ``say(*args)``, said at most
    once however often it is started (``close`` run again after a Ctrl-C starts again those
    it has not seen started); ``thread``: the thread it was started on, once it was. Any
    thread."""

    def __init__(self, address: str, say: Callable[..., Unreleased | None], *args: Any) -> None:
        self.address = address
        self._say, self._args = say, args
        self._once = threading.Lock()
        self.thread: threading.Thread | None = None

    def __call__(self, words: LastWords) -> None:
        """Say it (a second call does nothing); what it could not tell goes to ``words``."""
        if self._once.acquire(blocking=False):
            words.add(self._say(*self._args))
