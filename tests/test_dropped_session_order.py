"""A dropped host's session ends before anything else speaks to its host about it: nobody
names it as resolved while its end is due or under way (the host would end it first, and its
own disconnect would go unanswered), and a redial of the host waits for that end, so that what
the end hands back rides the redial's handshake; but ``close``'s last word names it (an end
that outlasts ``close`` can name nothing), and a Ctrl-C at a removal does not skip the end.
How the end itself is started is ``test_lost_session_end``."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import pytest
from release_support import RESULT_TIMEOUT_S, assert_nothing_held, held_session
from remote_support import BLOCK_LEN, wait_for

from torch_kv_tier import connections, session_releases
from torch_kv_tier.manager import TierManager
from torch_kv_tier.records import Request, resolve
from torch_kv_tier.remote import RemoteSession, ServerProcess, session_io


@pytest.fixture
def gated_end(monkeypatch: pytest.MonkeyPatch) -> tuple[list[threading.Event], threading.Event]:
    """Each dropped session's end (``_end_dropped``) waits until ``gate[0]`` is set, or 2 s
    passed (a host slow to answer its disconnect); ``ended`` is set once one is over, and
    ``gate[1]`` once one began."""
    gate, ended = [threading.Event(), threading.Event()], threading.Event()
    end_dropped = TierManager._end_dropped

    def end_at_gate(tier: TierManager, session: Any, clean: bool) -> None:
        gate[1].set()
        gate[0].wait(timeout=2.0)
        try:
            end_dropped(tier, session, clean)
        finally:
            ended.set()

    monkeypatch.setattr(TierManager, "_end_dropped", end_at_gate)
    return gate, ended


@pytest.fixture
def host() -> Iterator[ServerProcess]:
    with ServerProcess.start(64, BLOCK_LEN) as server:
        yield server


def test_a_host_removed_before_its_dropped_session_ended_is_not_told_to_release_it(
    gated_end: tuple[list[threading.Event], threading.Event],
    host: ServerProcess,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Found by review: ``remove_peer`` of a host dropped (a failed transfer) whose session's
    end had not run yet (a busy machine) named that session to the host as resolved, over a
    session of its own: the host ended it, then the session's own clean disconnect was
    refused, logged as a warning ("disconnect ... got no answer: ... no longer knows this
    session") though nothing was lost. It is named only once it ended, unless it ended clean."""
    gate, ended = gated_end
    with TierManager.create(16, BLOCK_LEN, name="removed-before-end") as tier:
        peer = tier.connect(host.address)
        session = tier._peers[peer].session
        assert session is not None
        with tier._lock:  # as a failed transfer does: the session ends on a thread of its own
            tier._lose_peer(peer, "failed a transfer")
        tier.remove_peer(peer)
        assert wait_for(  # what the removal carries over a session of its own is told
            lambda: (
                not [t for t in threading.enumerate() if t.name == session_releases.RELEASE_THREAD]
            ),
            RESULT_TIMEOUT_S,
        )
        with caplog.at_level(logging.WARNING):
            gate[0].set()
            assert ended.wait(timeout=RESULT_TIMEOUT_S)
        assert session.ended_clean, "the host had ended the session before its disconnect"
        assert [r.getMessage() for r in caplog.records if "disconnect" in r.getMessage()] == []


def test_a_redial_waits_for_the_end_of_the_hosts_dropped_session(
    gated_end: tuple[list[threading.Event], threading.Event],
    host: ServerProcess,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: a redial whose new session was lost at once dials its host again after
    its backoff, whether or not that session's end (a thread of its own) is over: on a busy
    machine, or with a host slow to answer the disconnect, the next handshake took what was
    owed the host first, and the releases the end then handed back (ones the session carried
    that its host may not have read) came while the host joined, with nothing to carry them:
    the host held those sessions' slots until the tier closed. The redial waits for the end
    (here its handshake, unfixed, lets the end run; fixed, the end runs after its 2 s)."""
    gate, ended = gated_end
    monkeypatch.setattr(connections, "REDIAL_FIRST_S", 0.01)
    held = held_session(host.address)
    with TierManager.create(16, BLOCK_LEN, name="redial-before-end") as tier:
        peer = tier.connect(host.address)
        session = tier._peers[peer].session
        assert session is not None
        session.unreleased = lambda: [held.session_id]  # type: ignore[method-assign]
        dial, open_session = tier._dials[peer], RemoteSession.open

        def handshake_then_end(cls: Any, *args: Any, **kwargs: Any) -> RemoteSession:
            redial = not gate[0].is_set()
            opened = open_session(*args, **kwargs)
            if redial:
                gate[0].set()
                assert ended.wait(timeout=RESULT_TIMEOUT_S)
            return opened

        monkeypatch.setattr(RemoteSession, "open", classmethod(handshake_then_end))
        with tier._lock:  # as the new session's loss does
            tier._lose_peer(peer, "lost its session (reset)")
        tier._redialer.start(dial)  # as the redialer does, that session lost at once
        assert wait_for(lambda: tier.peers() == [peer], RESULT_TIMEOUT_S), "never redialled"
        monkeypatch.undo()
        assert_nothing_held(host.address)


@pytest.fixture(params=["remove_peer", "add_peer", "failed join"])
def dropping(
    request: pytest.FixtureRequest, host: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[TierManager, Callable[[], object], list[RemoteSession]]]:
    """A tier, a call that drops a host's session, and (once known) that session: the host's
    removal, an ``add_peer`` over it (its session replaced by a raw region), or a connect whose
    join fails once the host was published (lost as it asks for the host's index: the
    connect raises ``ConnectionError``, unless something else interrupts it)."""
    sessions: list[RemoteSession] = []
    with TierManager.create(16, BLOCK_LEN, name=f"dropping-{request.param}") as tier:
        if request.param == "failed join":

            def lost_as_it_joins(session: RemoteSession, _: object) -> None:
                sessions.append(session)
                raise ConnectionError("lost as it joined")

            def connect() -> None:
                with pytest.raises(ConnectionError, match="lost as it joined"):
                    tier.connect(host.address)

            monkeypatch.setattr(RemoteSession, "follow", lost_as_it_joins)
            yield tier, connect, sessions
            return
        peer = tier.connect(host.address)
        session = tier._peers[peer].session
        assert session is not None
        sessions.append(session)
        if request.param == "remove_peer":
            yield tier, partial(tier.remove_peer, peer), sessions
            return
        region = (session.agent_metadata, session.base_addr, session.num_blocks)
        yield tier, partial(tier.add_peer, peer, *region, session.block_len), sessions


def at_next_flush(tier: TierManager, *, interrupt: bool) -> list[list[str]]:
    """The next ``_flush`` on this thread (the drop's) first takes what a connect of the host
    there would name to it as resolved (given back at once), returned; then, with
    ``interrupt``, a settled future's done-callback raises ``KeyboardInterrupt`` in it (the
    poller, which flushes too, never sees that future)."""
    taken: list[list[str]] = []
    flush, caller = tier._flush, threading.get_ident()

    def looked_at() -> None:
        if taken or threading.get_ident() != caller:
            return flush()
        with tier._lock:
            address = next(iter({*tier._ended.resolved, *tier._ended.carrying}), "")
            taken.append(tier._ended.take(address))
            tier._ended.give_back(address, taken[-1])
        flush()
        if interrupt:
            settled = Request([b"k"])
            settled.settle(settled.keys, None)
            settled.future.add_done_callback(_interrupt)
            resolve([settled])

    tier._flush = looked_at  # type: ignore[method-assign]
    return taken


def _interrupt(_: object) -> None:
    raise KeyboardInterrupt


def test_a_ctrl_c_in_a_callback_as_a_host_is_dropped_still_ends_its_session(
    dropping: tuple[TierManager, Callable[[], object], list[RemoteSession]],
) -> None:
    """Found by review: ``remove_peer``, ``add_peer`` over a connected host and a join that
    failed once its host was published resolve the futures the drop settled before they end
    the host's session; a ``KeyboardInterrupt`` in a done-callback there skipped the end: the
    session stayed open with the host (its heartbeats going on, its slots held until the
    process exited), and, counted as ending from the drop, it held up ``close`` for its whole
    timeout, and the host, connected again, was never redialled once lost (each try gave up
    waiting for that end). The session ends all the same, and the interrupt still reaches
    the caller."""
    tier, drop, sessions = dropping
    at_next_flush(tier, interrupt=True)
    with pytest.raises(KeyboardInterrupt):
        drop()
    session = sessions[0]
    assert session.ended_clean, "the dropped host's session was never ended"
    assert not tier._ended.carrying and not tier._ended.ending(session.address)


def test_a_dropped_session_is_not_named_to_its_host_before_it_ended(
    dropping: tuple[TierManager, Callable[[], object], list[RemoteSession]],
) -> None:
    """Found by review: ``add_peer`` over a connected host and a join that failed once its
    host was published counted the dropped session as ending only after the futures the drop
    settled were resolved: meanwhile a connect of the host there (another thread) named the
    session to it as resolved, the host ended it, and the session's own clean disconnect was
    refused, logged as a warning ("disconnect ... got no answer") though nothing was lost. It
    counts as ending under the drop's lock, as ``remove_peer``'s does."""
    tier, drop, sessions = dropping
    taken = at_next_flush(tier, interrupt=False)
    drop()
    session = sessions[0]
    assert taken and session.session_id not in taken[0], "named to its host before it ended"
    assert session.ended_clean
    assert not tier._ended.carrying and not tier._ended.ending(session.address)


@pytest.mark.parametrize("ends", ["unclean", "lost"])
def test_a_dropped_session_still_ending_as_the_tier_closes_is_named_by_close(
    gated_end: tuple[list[threading.Event], threading.Event],
    host: ServerProcess,
    ends: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Found by review: a dropped session its host holds once it ended (a write of it was in
    flight, resolved since; or its control connection was reset) was left for its own end to
    name; an end that outlasted ``close`` (``close(timeout=0)``, a host slow to answer the
    disconnect, a busy machine) found the transport closed, could open no session to name it
    ('could not tell ... that 1 ended sessions resolved ...: NixlTransport ... is closed'),
    and a host that held it (its write in flight) held its slots for good. ``close``'s last
    word names it (a host that still counts it live ends it first: nothing lost)."""
    gate, ended = gated_end
    tier = TierManager.create(16, BLOCK_LEN, name=f"{ends}-at-close")
    peer = tier.connect(host.address)
    session = tier._peers[peer].session
    assert session is not None
    if ends == "lost":

        def reset() -> None:
            raise session_io._Lost("the control connection was closed or reset")

        session._enqueue_action(reset)  # the I/O thread ends the session as a reset does
    else:
        with tier._lock:  # a store was in flight as it was dropped, its write resolved since
            tier._drop_peer(peer, lost=True)
            tier._end_later(session, False)
    assert gate[1].wait(timeout=RESULT_TIMEOUT_S), "its end never began"
    tier.close(timeout=0)
    gate[0].set()
    assert ended.wait(timeout=RESULT_TIMEOUT_S)
    assert_nothing_held(host.address)
    assert [r.getMessage() for r in caplog.records if "could not tell" in r.getMessage()] == []
    assert tier._ended.carrying == {} and tier._ended.resolved == {}


def test_a_ctrl_c_in_a_callback_as_the_tier_closes_still_ends_its_sessions_and_its_agent(
    host: ServerProcess,
) -> None:
    """Found by review: ``close`` resolves the futures it cancelled before it ends its
    sessions and closes the transport; a ``KeyboardInterrupt`` in a done-callback there
    skipped both, and a second ``close`` returned at once: the session stayed open with its
    host (slots held until the process exited) and the NIXL agent with its registrations
    lived on. Both happen all the same, and the interrupt still reaches the caller."""
    tier = TierManager.create(16, BLOCK_LEN, name="closing-interrupted")
    try:
        peer = tier.connect(host.address)
        session = tier._peers[peer].session
        assert session is not None
        at_next_flush(tier, interrupt=True)
        with pytest.raises(KeyboardInterrupt):
            tier.close()
        assert session.ended_clean, "the host's session was never ended"
        assert not tier.transport.available, "the NIXL agent outlived close"
    finally:
        tier.close()
    assert_nothing_held(host.address)
