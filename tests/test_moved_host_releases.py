"""Releases owed at the address a host left (``session_releases``, ``LostHosts._moved``): a host
lost at one address that joins at another under the same ``--host-id`` leaves the ended
sessions to release at the first address; only the process there can release them, so they go
there over a session of their own, and ``close`` says which it could not tell."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from release_support import RESULT_TIMEOUT_S
from remote_support import BLOCK_LEN, fake_session, wait_for

from torch_kv_tier import session_releases
from torch_kv_tier.connections import Dial
from torch_kv_tier.manager import TierManager
from torch_kv_tier.remote import RemoteSession, ServerProcess


@contextmanager
def _one_host_id_at_two_addresses() -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """Two hosts of ``--host-id h`` (a long lease: a session ends only when told), as one host
    lost at the first address that joins at the second."""
    args = ["--host-id", "h", "--lease-timeout", "600"]
    with (
        ServerProcess.start(32, BLOCK_LEN, extra_args=args) as first,
        ServerProcess.start(32, BLOCK_LEN, extra_args=args) as second,
    ):
        yield first, second


def _lose_frozen(tier: TierManager, host: ServerProcess) -> None:
    """Connect ``host``, freeze it (SIGSTOP: the caller resumes or kills it) and wait until
    ``tier`` lost it."""
    tier.connect(host.address, private=True, slots=8, heartbeat_timeout_s=1.0)
    os.kill(host.proc.pid, signal.SIGSTOP)
    assert wait_for(lambda: tier.peers() == [], RESULT_TIMEOUT_S), "never lost"


def test_sessions_to_release_at_the_address_a_host_left_go_there_when_it_joins_elsewhere() -> None:
    """Found by review: a host lost at one address (frozen) that joined at another under the
    same ``--host-id`` left the session the tier had to release at the first address to
    nobody: no dial stood for that address any more, so it was never sent, nor said, and the
    process there (resumed) held its slots for good. They now go there over a session of their
    own as the host joins elsewhere (only that process can release them)."""
    with (
        _one_host_id_at_two_addresses() as (first, second),
        TierManager.create(4, BLOCK_LEN, name="moved") as tier,
    ):
        try:
            _lose_frozen(tier, first)
            assert tier.connect(second.address, private=True, slots=8) == "h"
        finally:
            os.kill(first.proc.pid, signal.SIGCONT)
        with fake_session(first.address, slots=1) as probe:
            assert wait_for(lambda: probe.stats()["held_blocks"] == 0, RESULT_TIMEOUT_S)


def test_releases_a_redial_of_the_address_a_host_left_held_go_there_when_it_joins_elsewhere() -> (
    None
):
    """Found by review: as above, but with the tier's redial of the first address awaiting the
    frozen host as the host joined elsewhere (its handshake holds for ``timeout_s``, so it
    mostly is): that redial had taken the sessions to release there, and its handshake, let go,
    handed them back after the join had looked for them, to nobody (the process there, resumed,
    held 8 slots for good; only ``close`` named them). They now go there once it gives up."""
    with (
        _one_host_id_at_two_addresses() as (first, second),
        TierManager.create(4, BLOCK_LEN, name="moved") as tier,
    ):
        try:
            _lose_frozen(tier, first)
            assert wait_for(
                lambda: bool(tier._redialing) and not tier._ended.holds(first.address),
                RESULT_TIMEOUT_S,
            ), "no redial took the releases"
            assert tier.connect(second.address, private=True, slots=8) == "h"
            # (the host resumed before the redial saw it let go would answer it instead)
            assert wait_for(lambda: not tier._redialing, RESULT_TIMEOUT_S), "the redial went on"
        finally:
            os.kill(first.proc.pid, signal.SIGCONT)
        with fake_session(first.address, slots=1) as probe:  # the lost session's slots freed
            assert wait_for(lambda: _holds_only(probe), RESULT_TIMEOUT_S), probe.stats()


def _holds_only(probe: RemoteSession) -> bool:
    """Whether ``probe``'s host holds no slot but its lease: no session but ``probe``'s, and
    none held for an ended one."""
    stats = probe.stats()
    return len(stats["sessions"]) == 1 and stats["held_blocks"] == 0


def test_close_says_which_sessions_it_could_not_release_at_an_address_a_host_left(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """As above, the process at the first address killed: ``close`` could name them to no one
    (no dial stands for that address), and said nothing. It now says so, naming the address."""
    with _one_host_id_at_two_addresses() as (first, second):
        tier = TierManager.create(4, BLOCK_LEN, name="moved")
        try:
            _lose_frozen(tier, first)
            assert tier.connect(second.address, private=True, slots=8) == "h"
        finally:
            first.proc.kill()
            first.proc.wait(timeout=RESULT_TIMEOUT_S)
            with caplog.at_level("WARNING", logger=session_releases.__name__):
                tier.close()
    said = [r.getMessage() for r in caplog.records if r.name == session_releases.__name__]
    assert any(first.address in m and "ended sessions" in m for m in said), said


def test_a_host_joining_elsewhere_joins_though_no_thread_can_carry_its_old_releases(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by review: with the process at its thread limit, the thread that carries the
    releases owed at the address a host left could not start, and the connect that joined the
    host at its new address raised ``RuntimeError`` though it had joined; the releases it took
    were lost (nor said by ``close``), and ``close`` waited its whole timeout for a carry that
    never ran. The connect now returns its peer, and ``close`` names them. The redial of the
    first address waits for the join: one that took the releases first (a busy machine) would
    carry them itself (``test_releases_a_redial_of_the_address_a_host_left_held_...``)."""
    joined, redial = threading.Event(), TierManager._redial

    def redial_after_the_join(tier: TierManager, dial: Dial) -> None:
        joined.wait(timeout=RESULT_TIMEOUT_S)
        redial(tier, dial)

    monkeypatch.setattr(TierManager, "_redial", redial_after_the_join)
    start = threading.Thread.start

    def no_release_thread(thread: threading.Thread) -> None:
        if thread.name == session_releases.RELEASE_THREAD:
            raise RuntimeError("can't start new thread")
        start(thread)

    with _one_host_id_at_two_addresses() as (first, second):
        tier = TierManager.create(4, BLOCK_LEN, name="moved")
        try:
            _lose_frozen(tier, first)
            monkeypatch.setattr(threading.Thread, "start", no_release_thread)
            assert tier.connect(second.address, private=True, slots=8) == "h"
            assert tier.peers() == ["h"]
        finally:
            joined.set()
            monkeypatch.undo()
            with caplog.at_level("WARNING", logger=session_releases.__name__):
                tier.close(timeout=RESULT_TIMEOUT_S)
            first.proc.kill()
            first.proc.wait(timeout=RESULT_TIMEOUT_S)
    said = [r.getMessage() for r in caplog.records if r.name == session_releases.__name__]
    assert any("could not start a thread" in m and first.address in m for m in said), said
    assert any("could not tell" in m and first.address in m for m in said), said
