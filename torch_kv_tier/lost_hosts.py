"""The tier's half of losing a connected host and dialling it again (see ``connections``).

``LostHosts`` is a part of ``TierManager`` (the base class of ``ConnectedHosts``): a session
that is lost drops its peer (``_on_session_lost``); a dropped peer's session is ended on a thread
of its own, which ``session_ends`` starts (``_end_later``: never the caller's thread, nor under
the lock, nor waiting for the poller); once ended, a host lost rather than removed is dialled
again (``_end_dropped``) by the manager's ``Redialer``, which calls ``_redial`` until the
host answers or is no longer wanted (``_wants_dial``). So is a host down at its first connect
with ``redial_if_down`` (``_dial_later``; ``cancel_dial`` stops it). A dial also stops when
the user removes its host (``_stop_dialling``) or its address answers under another id
(``_forget_replaced``); a join under way of a stopped dial never publishes its host
(``_stopped_join``). Telling hosts which ended sessions resolved (fencing, client half) is
its base ``session_releases.SessionReleases``.

Threading: methods without "(unlocked)" run with the manager's lock held. Handshakes never run
under it, nor does anything start a thread under it (the redialer's included).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from torch_kv_tier.connections import CONNECT_TIMEOUT_S, Dial, Joining, Redialer
from torch_kv_tier.last_words import warn_unreleased
from torch_kv_tier.remote.connect_args import check_connect_args, check_timeouts
from torch_kv_tier.remote.handshake_errors import AcceptAbandoned
from torch_kv_tier.session_ends import SessionEnds
from torch_kv_tier.session_releases import SessionReleases
from torch_kv_tier.transport.base import DataTransport

logger = logging.getLogger(__name__)


class LostHosts(SessionReleases):
    """Lost hosts and their redials, for ``TierManager`` (module docstring)."""

    # The manager's state this part uses (set by ``TierManager.__init__``).
    verify: bool
    transport: DataTransport
    _redialer: Redialer
    _joining: Mapping[str, Joining]  # peer id -> its connect in progress
    _closing: threading.Event  # set when ``close`` starts
    _session_ends: SessionEnds  # starts the threads ending dropped peers' sessions

    if TYPE_CHECKING:  # implemented by TierManager and ConnectedHosts

        def _check_open(self) -> None: ...
        def _connect(self, dial: Dial) -> str: ...
        def _lose_peer(self, peer_id: str, why: str) -> None: ...
        def _drop_peer(self, peer_id: str, *, lost: bool = False) -> tuple[Any, bool]: ...
        def _flush(self) -> None: ...
        def remove_peer(self, peer_id: str) -> None: ...

    def _end_later(self, session: Any, clean: bool) -> None:
        """A dropped peer's ``session`` is to end (``_end_dropped``), which waits for its
        host: handed to ``_session_ends``, whose thread starts its thread at once, so that no
        caller waits for a thread to start (the caller may be a ``store`` whose transfer was
        refused, under the lock), nor does the end wait for the poller. ``close`` ends those
        it never started (``_uncount_ends``). Counted in ``_ended.carrying`` from now, under
        the caller's lock (``_end_counted``): a removal of the host before the end's thread
        runs (a busy machine) keeps how it was dialled, for what the end hands back."""
        self._ended.end_begins(session)
        self._session_ends.put(session, clean)

    def _uncount_ends(self, ending: list[tuple[Any, bool]]) -> None:
        """``close``: the sessions ``_end_later`` counted whose thread never started, which
        ``close`` ends itself, are uncounted (``close`` waits for the count to drop)."""
        with self._lock:
            for session, _ in ending:
                self._ended.end_ends(session)

    def _drop_to_end(self, peer_id: str, *, lost: bool = False) -> tuple[Any, bool]:
        """``_drop_peer`` for a caller that ends the session itself (``_flush_then_end``): the
        session counts as ending under the drop's lock (``_ended.end_begins``), so that nobody
        names it to its host as resolved before it ended (a connect there on another thread,
        meanwhile: the host would end it first, and its own disconnect go unanswered)."""
        session, clean = self._drop_peer(peer_id, lost=lost)
        if session is not None:
            self._ended.end_begins(session)
        return session, clean

    def _flush_then_end(self, session: Any, clean: bool, *, redial: bool = False) -> None:
        """After ``_drop_to_end`` (unlocked): resolve the futures the drop settled (``_flush``),
        then end ``session`` (if any) all the same when a done-callback raised (a
        ``KeyboardInterrupt``, raised on after the end): skipped, the session would stay open
        with its host (its slots held), and, counted as ending, hold up ``close`` and every
        redial of its address. ``redial``: as ``_end_dropped`` (a host lost rather than
        removed meanwhile is dialled again), else as ``_end_counted``."""
        try:
            self._flush()
        finally:
            if session is not None:
                (self._end_dropped if redial else self._end_counted)(session, clean)

    def _end_dropped(self, session: Any, clean: bool) -> None:
        """End a dropped peer's session, counted at its drop (``_ended.end_begins``: by
        ``_end_later``, for ``_session_ends``' threads, or ``_drop_to_end``) (unlocked); dial the
        host again if it was lost rather than removed. The ended sessions it released the host
        may not have read (its connection reset, say) are released again, with the redial."""
        self._end_counted(session, clean)
        with self._lock:
            lost = not self._closed and session.peer_id not in self._peers
            dial = self._dials.get(session.peer_id) if lost else None
        if dial is not None:  # (unlocked: starting the redialer may wait for a thread start)
            self._redialer.start(dial)

    def _on_session_lost(self, peer_id: str) -> None:
        """A session's I/O thread: the session is lost (see ``RemoteSession``). A peer whose
        current session is alive (a newer one) stays."""
        with self._lock:
            peer = self._peers.get(peer_id)
            if self._closed or peer is None or peer.session is None or not peer.session.lost:
                return
            self._lose_peer(peer_id, f"lost its session ({peer.session.lost})")
        self._flush()

    def _rearm_redialer(self) -> None:
        """``_session_ends``' tick (unlocked, about once a second): a redialer whose thread
        could not start (the process at its thread limit) is started once there is a host to
        dial (connected, lost, or down at its connect), not only by the next connect or loss.
        The lock is held only to look: the start waits for a thread to start."""
        with self._lock:
            wanted = bool(self._dials or self._pending)
        if wanted:
            self._redialer.arm()

    def _redial(self, dial: Dial) -> None:
        """The redialer's ``dial`` (unlocked): connect a lost host again. ``ConnectionError``
        when it is no longer wanted (removed, connected by another call, the tier closed); a
        host the user removed meanwhile has its new session ended at once, and the releases it
        and a failed handshake of this attempt took back still go out. ``_redialing`` lists the
        hosts the redialer is dialling (side by side). The releases a failed try took back at
        an address nobody dials any more (its host joined at another one while the try awaited
        it, ``_moved``) go there over a session of their own, as ``_moved`` sends the others.
        A dropped session of the host still ending (a redial whose new session was lost at
        once) is waited for, up to ``dial.timeout_s`` (``TimeoutError``: tried again later),
        so that what its end hands back rides this handshake."""
        deadline = time.monotonic() + dial.timeout_s
        with self._lock:
            while self._wants(dial) and self._ended.ending(dial.address):
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"the previous session with {dial.address} was still ending after "
                        f"{dial.timeout_s:g} s (its host slow to answer its disconnect)"
                    )
                self._cond.wait(timeout=deadline - time.monotonic())
            if not self._wants(dial):
                raise ConnectionError(
                    f"{dial.address} is no longer to be dialled (removed or connected meanwhile, "
                    "or the tier closed)"
                )
            self._redialing.append(dial)
        try:
            peer_id = self._connect(dial)
        except BaseException:
            with self._lock:
                self._redialing.remove(dial)
                if self._removed.get(dial.address) is dial:
                    self._send_releases(dial.address)
                elif self._dial(dial.address) is None and not self._closed:
                    self._carry_off(dial)  # its host joined elsewhere (``_moved``) meanwhile
            raise
        with self._lock:
            self._redialing.remove(dial)
            removed = self._removed.get(dial.address) is dial
            if removed:
                self._dials.pop(peer_id, None)
            peer = self._peers.get(peer_id)  # (an ``add_peer`` that replaced it stays)
            published = removed and peer is not None and peer.session is not None
        if published:
            self.remove_peer(peer_id)
        if removed:
            with self._lock:
                self._send_releases(dial.address)

    def dial_later(
        self,
        address: str,
        why: Exception,
        *,
        token: str | None = None,
        private: bool = False,
        slots: int | None = None,
        timeout_s: float = CONNECT_TIMEOUT_S,
        heartbeat_timeout_s: float = 10.0,
        dial_owner: object = None,
    ) -> None:
        """Dial the host at ``address`` in the background until it joins, as
        ``connect(..., redial_if_down=True)`` does once the host did not answer, without a
        handshake now: for a caller that saw it not answer (``why``, which gets the same note;
        ``parallel_connects``' greeting). The keyword arguments are ``connect``'s, checked as
        it checks them (``ValueError``); ``RuntimeError`` once the tier is closed. Any thread."""
        dial = self._new_dial(
            address, token, private, slots, timeout_s, heartbeat_timeout_s, dial_owner
        )
        with self._lock:
            self._check_open()
        self._dial_later(dial, why, dial_owner)

    def _new_dial(
        self,
        address: str,
        token: str | None,
        private: bool,
        slots: int | None,
        timeout_s: float,
        heartbeat_timeout_s: float,
        owner: object,
    ) -> Dial:
        """How to dial ``address`` (``connect``'s arguments), once they are checked (every
        dial's handshake, and the redialer's greeting, waits within its timeouts; ``owner``
        is a ``dial_owner``, kept if the host is down)."""
        slots = check_connect_args(address, slots, private, token)
        check_dial_owner(owner)
        timeouts = check_timeouts(timeout_s=timeout_s, heartbeat_timeout_s=heartbeat_timeout_s)
        timeout_s, heartbeat_timeout_s = timeouts["timeout_s"], timeouts["heartbeat_timeout_s"]
        if not private and not self.verify:
            raise ValueError(
                "a shared pool needs verify=True: its loads read unpinned slots and rely on "
                "digests to turn a slot rewritten meanwhile into a miss"
            )
        return Dial(address, token, private, slots, timeout_s, heartbeat_timeout_s)

    def cancel_dial(self, address: str, dial_owner: object = None) -> bool:
        """Stop dialling ``address``, a host ``connect(..., redial_if_down=True)`` left to join
        in the background; ``False`` when none is dialled there (it joined meanwhile: it is a
        peer now, ``disconnect`` it by its peer id; or the tier is closed). A handshake with it
        under way ends its session once it returns; the ended sessions the host may hold are
        still released. ``dial_owner`` (that of the connects that asked, e.g. a library's over
        the user's tier): withdraw only its request, ``False`` when it made none; the address
        is still dialled while another caller's request stands. Any thread."""
        check_dial_owner(dial_owner)
        with self._lock:
            return self._cancel_pending(address, dial_owner)

    def _cancel_pending(self, address: str, owner: object = None) -> bool:
        """``cancel_dial``, under the lock: the dial is remembered as removed, so that a redial
        of it under way ends what it connects (``_redial``)."""
        dial = None if self._closed else self._pending.get(address)
        if dial is None or (owner is not None and owner not in dial.askers):
            return False
        dial.askers.discard(owner)
        if owner is not None and dial.askers:
            return True  # another caller's request stands
        del self._pending[address]
        self._removed[address] = dial
        dial.stopped.set()
        self._send_releases(address)
        logger.info("no longer dialling %s", address)
        return True

    def _release_for_failed_connect(self, dial: Dial, exc: Exception) -> None:
        """A connect of ``dial`` failed with ``exc`` once its handshake may have opened sessions
        (handed back to ``_ended``; a private one's lease the host holds until it is named):
        they go out at once (``_send_releases``), over the live session of a host connected
        there, with the next handshake of a dial there, else over a session of their own
        (``close`` names them if that fails). An address nothing dials is remembered as
        removed for it, as ``cancel_dial`` does; one still remembered so (a release there under
        way, which took its list before these came back) gets another. Once the tier is closed
        (``close`` may have said its last words before these came back) this says its own
        (unlocked, one try: ~2 s at most), a failure logged as ``close``'s are; not for a
        handshake ``close`` abandoned (``AcceptAbandoned``: its ``Disconnect`` went out, and
        the connect returns within ``close``)."""
        with self._lock:
            closed = self._closed
            if not closed:
                if self._dial(dial.address) is None:
                    self._removed[dial.address] = dial
                    dial.stopped.set()
                self._send_releases(dial.address)
        if closed and not isinstance(exc, AcceptAbandoned):  # (none ``close`` took already)
            failure = self._own_last_word(dial)
            if failure is not None:
                warn_unreleased([failure])

    def _dial_later(self, dial: Dial, exc: Exception, owner: object) -> None:
        """``connect(..., redial_if_down=True, dial_owner=owner)`` of ``dial``'s host failed
        with ``exc`` (unlocked): dial it in the background, as a lost host, until it joins
        (module docstring); ``exc`` gets a note saying so. Nothing once the tier is closed,
        nor for an address the tier dials already as a connected host's (joined meanwhile, or
        lost); an earlier such connect's dial stands, ``owner`` added to who asked for it
        (``cancel_dial`` stops the one there is).
        A host's first join under way (another thread's connect, which ``exc`` may have
        waited out) stands for no dial: its dial is forgotten if it fails, and its success
        ends this one (``_forget_replaced``)."""
        with self._lock:
            if self._closing.is_set() or any(
                d.address == dial.address
                and not (pid in self._joining and self._joining[pid].first)
                for pid, d in self._dials.items()
            ):
                return
            pending = self._pending.setdefault(dial.address, dial)  # an earlier one stands
            pending.askers.add(owner)
        self._redialer.start(pending, type(exc))  # (unlocked: it may start a thread)
        exc.add_note(
            f"{dial.address} is dialled again in the background until it joins "
            f"(redial_if_down); cancel_dial({dial.address!r}) stops that"
        )

    def _stop_dialling(self, peer_id: str) -> Dial | None:
        """The user removed or replaced ``peer_id``: it is not dialled again (nor is the address
        of a host down at its connect whose join it is: ``redial_if_down``), and a join of it
        under way never publishes it (``_stopped_join``), also one dialled apart (a connect of
        a lost host); how it was dialled is remembered as removed, for its ended sessions,
        still to be released. ``None`` when it was not a connected host."""
        if peer_id in self._joining:
            self._joining[peer_id].stopped.set()
        dial = self._dials.pop(peer_id, None)
        if dial is not None:
            self._removed[dial.address] = dial
            dial.stopped.set()
            if self._pending.get(dial.address) is dial:
                del self._pending[dial.address]
        return dial

    def _stopped_join(self, peer_id: str) -> ConnectionError | None:
        """Before a join publishes ``peer_id`` (under the lock that publishes it): what its
        connect raises when the user removed the host (``disconnect``, ``remove_peer``,
        ``add_peer``) or cancelled its dial (``cancel_dial``) as it joined, else ``None``. The
        region the join registered is let go then (but one another call published meanwhile,
        ``add_peer``'s, or once the tier is closed: its transport holds nothing); the caller
        ends the session."""
        joining = self._joining.get(peer_id)
        if joining is None or not joining.stopped.is_set():
            return None
        if peer_id not in self._peers and not self._closed:
            self._remove_from_transport(peer_id)
        return ConnectionError(
            f"{peer_id} was removed (disconnect, remove_peer, cancel_dial) while it joined: it "
            "is not connected; connect it again to join it"
        )

    def _join_failure(self, peer_id: str, exc: BaseException) -> BaseException:
        """What a failed join of ``peer_id`` raises (unlocked): ``exc``, or ``_stopped_join``'s
        ``ConnectionError`` when the user removed the host as it joined (the removal superseded
        the registration NIXL was building: ``RuntimeError``), unless ``exc`` says so already,
        is no ``Exception`` (a Ctrl-C), or the tier is closing (it says that)."""
        if not isinstance(exc, Exception) or isinstance(exc, ConnectionError):
            return exc
        with self._lock:
            closing = self._closed or self._closing.is_set()
            removed = None if closing else self._stopped_join(peer_id)
        return exc if removed is None else removed

    def _forget_replaced(self, peer_id: str, dial: Dial) -> None:
        """``dial``'s address answered as ``peer_id``: a host this tier lost that was dialled
        there under another id (restarted with another ``--host-id``, a new pod on a reused IP)
        is gone, and is not dialled again (its ended sessions are still released there); nor
        is the address as a host down at its connect (``redial_if_down``), unless ``dial`` was
        cancelled meanwhile (its host is then removed, and a dial asked since stands)."""
        address = dial.address
        pending = None if self._removed.get(address) is dial else self._pending.pop(address, None)
        if pending is not None:
            pending.askers.clear()  # nobody can withdraw a request of it now: owners let go
            self._let_go(pending)
        replaced = [
            pid
            for pid, d in self._dials.items()
            if d.address == address
            and pid != peer_id
            and pid not in self._peers
            and pid not in self._joining
        ]
        for pid in replaced:
            stale = self._dials.pop(pid)
            self._let_go(stale)
            self._remove_from_transport(pid)
            logger.info("%s now answers as %s: no longer dialling %s", address, peer_id, pid)

    def _moved(self, old: Dial, new: Dial) -> None:
        """``old``'s host joined at ``new``'s address, under the same id: the ended sessions
        still to be released at ``old``'s address go there over a session of their own, as a
        removed host's do (only the process that answered there can release them; the one at
        the new address may be another). ``close`` reports those it could not tell."""
        if old.address != new.address:
            self._carry_off(old)

    def _let_go(self, dial: Dial) -> None:
        """``dial`` was dropped from what the tier dials (its address answered another dial):
        its handshake or greeting under way gives up at once (``Dial.stopped``), as a
        cancelled one's does, unless it still stands for a host or an address."""
        if dial not in self._dials.values() and self._pending.get(dial.address) is not dial:
            dial.stopped.set()

    def _remove_from_transport(self, peer_id: str) -> None:
        """The transport lets go of ``peer_id`` (logged, never raised: a closed transport holds
        nothing): a lost peer that is not dialled again (its NIXL agent was parked for a
        redial), or a registration abandoned while it runs (superseded: it never publishes)."""
        try:
            self.transport.remove_remote_peer(peer_id)
        except Exception:
            logger.exception("removing peer %s from the transport failed", peer_id)

    def _wants_dial(self, dial: Dial) -> bool:
        """Whether the redialer should go on dialling ``dial`` (lost, not removed)."""
        with self._lock:
            return self._wants(dial)

    def _wants(self, dial: Dial) -> bool:
        """``_wants_dial``, under the lock."""
        return not self._closed and (
            self._pending.get(dial.address) is dial
            or any(d is dial and pid not in self._peers for pid, d in self._dials.items())
        )


def check_dial_owner(owner: object) -> None:
    """``TypeError`` unless ``owner`` can be a ``dial_owner``: a dial keeps its owners in a
    set (an owner is told apart by ``==``), so it must be hashable."""
    try:
        hash(owner)
    except TypeError:
        raise TypeError(
            f"dial_owner must be hashable (a dial keeps who asked for it in a set), got a "
            f"{type(owner).__name__}: pass a token of your own, e.g. object()"
        ) from None
