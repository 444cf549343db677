"""Commits and grants on a session's IO thread: a commit made while the thread takes its batch
still reaches the host, a bad digest is refused with followers kept in step, grants count the
slots commits returned, top-ups go out with the next commits or at once, a new session waits for
its first commit, and an IO thread held past close is logged with where it is."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any

import pytest
import torch
import zmq
from remote_support import BLOCK_LEN, RESULT_TIMEOUT_S, fake_session, fill_random, wait_for

from torch_kv_tier.manager import TierManager
from torch_kv_tier.remote import ServerProcess
from torch_kv_tier.remote import protocol as p
from torch_kv_tier.remote.session_io import COMMIT_QUIET_S


def test_a_commit_made_while_the_io_thread_takes_the_batch_still_reaches_the_host() -> None:
    """Regression (``test_burst``, 2 runs of 8: the host stored 806 and 928 of 992 chunks
    that the tier had reported stored, its session's 248 granted slots never committed).
    ``commit`` looked its batch up before taking the session's lock; the I/O thread, taking
    the batch in between (it swaps in a new list), sent the old one, and the commit appended to
    it was never sent. Here the I/O thread takes the batch at exactly that moment."""
    with ServerProcess.start(256, BLOCK_LEN) as server:  # grants up to 16 slots a session
        session = fake_session(server.address, private=False)
        try:
            answer: Future[Any] = Future()
            session.grant(4, lambda future: answer.set_result(future.result()))
            slots = answer.result(timeout=10).slots
            assert len(slots) == 4
            enqueue = session._enqueue

            def batch_taken_first(put: Any, allow_closed: bool) -> None:
                with session._lock:  # as the I/O thread's _send_commits does
                    session._commits, session._touches = [], []
                enqueue(put, allow_closed)

            session._enqueue = batch_taken_first  # type: ignore[method-assign]
            keys = [f"key-{i}".encode() for i in range(4)]
            session.commit(keys, slots, [1, 2, 3, 4])
            del session._enqueue  # the rest as usual
            assert wait_for(lambda: session.stats()["shared_stored_blocks"] == 4, 10.0), (
                session.stats()
            )
        finally:
            session.close()


def test_a_commit_with_a_negative_digest_is_refused_and_followers_stay_in_step(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A digest is a 64-bit unsigned int, but msgpack carries negative ints too: the host stored
    a rogue client's ``-1`` and pushed it, every follower of the namespace failed to apply it
    (to a ``uint64`` array), resynced, failed on the snapshot too, and so on (thousands of
    snapshots a second, for as long as the key stayed)."""
    with (
        ServerProcess.start(64, BLOCK_LEN) as server,
        TierManager.create(16, BLOCK_LEN, name="follower") as tier,
    ):
        tier.connect(server.address)
        fill_random(tier)
        assert tier.store([b"good"], [0]).result(timeout=RESULT_TIMEOUT_S).ok
        rogue = fake_session(server.address, private=False)
        try:
            answer: Future[Any] = Future()
            rogue.grant(2, lambda future: answer.set_result(future.result()))
            slots = answer.result(timeout=10).slots
            rogue.commit([b"rogue"], slots[:1], [-1])
            rogue.stats()  # a request goes out after the commits made before it: a frame apart
            rogue.commit([b"benign"], slots[1:], [7])
            assert wait_for(lambda: tier.lookup([b"benign"]) == 1, 10.0)
            assert tier.lookup([b"rogue"]) == 0
            assert rogue.stats()["shared_stored_blocks"] == 2  # good and benign
        finally:
            rogue.close()
        assert not [r for r in caplog.records if "not applied" in r.getMessage()]
        tier.arena.tensor[5].zero_()
        assert tier.load([b"good"], [5]).result(timeout=RESULT_TIMEOUT_S).ok
        assert torch.equal(tier.arena.tensor[5], tier.arena.tensor[0])


def test_a_grant_asked_right_after_a_commit_counts_the_slots_that_commit_returned() -> None:
    """A session batches its commits for up to ``COMMIT_PERIOD_S``, but a request made after a
    commit always reaches the host after it: a grant asked right after committing every granted
    slot gets slots again (sent ahead of its commit, the host would count them still granted,
    cap the grant at zero, and the tier's waiting stores would fail "capacity")."""
    with ServerProcess.start(64, BLOCK_LEN, extra_args=["--max-grant", "4"]) as server:
        session = fake_session(server.address, private=False)
        try:
            assert session.max_granted == 4  # the handshake announces the cap: the reserve

            def grant() -> list[int]:
                answer: Future[Any] = Future()
                session.grant(4, lambda future: answer.set_result(future.result()))
                return list(answer.result(timeout=10).slots)

            slots = grant()
            for round_ in range(40):
                assert len(slots) == 4, f"round {round_}: granted {slots}"
                keys = [f"r{round_}-{i}".encode() for i in range(4)]
                session.commit(keys, slots, [1, 2, 3, 4])
                slots = grant()  # no wait between them: the commit is still batched
        finally:
            session.close()


def test_a_top_up_grant_goes_out_with_the_next_commits_and_is_answered() -> None:
    """A top-up (``with_commits``) waits for the session's next batch of commits instead of a
    wake-up of its own: made while commits flow, it still reaches the host, after the commits
    made before it (so it counts the slots they returned); made while none flow, it goes out
    at once."""
    with ServerProcess.start(64, BLOCK_LEN, extra_args=["--max-grant", "4"]) as server:
        session = fake_session(server.address, private=False)
        try:

            def ask(*, with_commits: bool) -> Future[Any]:
                answer: Future[Any] = Future()
                session.grant(
                    4,
                    lambda future: answer.set_result(future.result()),
                    with_commits=with_commits,
                )
                return answer

            slots = list(ask(with_commits=False).result(timeout=10).slots)
            for round_ in range(20):
                assert len(slots) == 4, f"round {round_}: granted {slots}"
                keys = [f"r{round_}-{i}".encode() for i in range(4)]
                session.commit(keys, slots, [1, 2, 3, 4])
                slots = list(ask(with_commits=True).result(timeout=10).slots)
            time.sleep(0.2)  # commits stopped flowing: a top-up wakes the I/O thread
            assert len(ask(with_commits=True).result(timeout=10).slots) == 0  # 4 still granted
        finally:
            session.close()


def test_a_top_up_made_after_the_commits_stopped_goes_out_at_once() -> None:
    """Regression: a top-up made after the quiet period that follows a commit's send, and
    before that send's deadline, once the I/O thread had seen the quiet period end, woke it;
    it sent nothing (no commit was due) and then watched no deadline: the top-up waited for
    the next heartbeat, seconds later."""
    with ServerProcess.start(64, BLOCK_LEN, extra_args=["--lease-timeout", "300"]) as server:
        session = fake_session(
            server.address, private=False, heartbeat_interval_s=60.0, heartbeat_timeout_s=300.0
        )
        try:
            for round_ in range(5):
                answer: Future[Any] = Future()
                session.commit([f"r{round_}".encode()], [0], [1])  # quiet: sent at once
                time.sleep(2 * COMMIT_QUIET_S)  # past the quiet period, before the deadline
                seen: Future[Any] = Future()  # an answer wakes the I/O thread: it sees that
                session.grant(0, seen.set_result)
                seen.result(timeout=10)
                session.grant(1, answer.set_result, with_commits=True)
                assert isinstance(answer.result(timeout=1.0).result(), p.Granted), round_
        finally:
            session.close()


def test_a_new_session_waits_for_its_first_commit_instead_of_polling_for_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression: a new session's I/O thread took its start for the time of a last commit
    send, so for the quiet period after it (``COMMIT_QUIET_S``) it watched a commit deadline
    already past and polled without waiting: hundreds of wake-ups, a core busy, each time a
    session opened."""
    polls_without_wait = [0]
    poll = zmq.Poller.poll

    def counting_poll(self: zmq.Poller, timeout: int | None = None) -> Any:
        if timeout == 0 and threading.current_thread().name.startswith("tkvt-session"):
            polls_without_wait[0] += 1
        return poll(self, timeout)

    monkeypatch.setattr(zmq.Poller, "poll", counting_poll)
    with ServerProcess.start(64, BLOCK_LEN) as server:
        session = fake_session(server.address, private=False)
        try:
            time.sleep(10 * COMMIT_QUIET_S)
        finally:
            session.close()
    assert polls_without_wait[0] <= 2  # the first heartbeat, due at once


def test_a_top_up_waiting_for_commits_fails_when_its_session_closes() -> None:
    with ServerProcess.start(64, BLOCK_LEN) as server:
        session = fake_session(server.address, private=False)
        answers: list[Future[Any]] = []
        try:
            for _ in range(50):
                session.commit([b"unknown"], [0], [1])  # commits flow: top-ups wait for them
                answers.append(Future())
                session.grant(4, answers[-1].set_result, with_commits=True)
        finally:
            session.close()
        for answer in answers:  # each answered, or failed by the close: none left waiting
            outcome = answer.result(timeout=10)
            error = outcome.exception(timeout=0)
            assert isinstance(error, ConnectionError) or isinstance(outcome.result(), p.Granted)


def test_an_io_thread_held_past_close_is_logged_with_where_it_is(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``close`` waits ``timeout_s`` for the session's I/O thread, then returns; a thread still
    running then (here, held by an answer callback that blocks) is logged with its stack, so
    whatever held it can be found (seen once in ``chaos --tcp``, unexplained)."""
    with ServerProcess.start(64, BLOCK_LEN) as server:
        session = fake_session(server.address, private=False, timeout_s=0.5)
        entered, release = threading.Event(), threading.Event()

        def hold_the_io_thread(_answer: Future[Any]) -> None:
            entered.set()
            release.wait(30)

        try:
            session.grant(1, hold_the_io_thread)
            assert entered.wait(10)
            started = time.monotonic()
            session.close()
            assert time.monotonic() - started < 10  # the Disconnect's wait, then the join's
        finally:
            release.set()
        message = next(m for r in caplog.records if "did not stop" in (m := r.getMessage()))
        assert "hold_the_io_thread" in message and "release.wait(30)" in message
