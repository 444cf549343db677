"""What ``TierManager.close`` leaves behind once its hosts went silent, froze or died while it
dialled them: no thread of its, no connection to a host, no NIXL agent (real hosts: ``serve``
children, one SIGSTOPped, one SIGKILLed, and a port that accepts and never answers)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import traceback

import psutil
import pytest
import zmq
from membership_support import redial_quickly
from remote_support import BLOCK_LEN, SilentHosts, wait_for

from torch_kv_tier import shared_hosts
from torch_kv_tier.benchmarks.reliability_common import stop_process
from torch_kv_tier.manager import TierManager
from torch_kv_tier.remote import ServerProcess
from torch_kv_tier.results import TIER_CLOSED

RESULT_TIMEOUT_S = 10.0
DIAL_TIMEOUT_S = 60.0  # each dial's own wait: far past close's


def _connected_to(ports: set[int]) -> list[psutil._common.pconn]:
    """This process's TCP connections to ``ports`` that are open on its side."""
    open_states = (psutil.CONN_ESTABLISHED, psutil.CONN_SYN_SENT, psutil.CONN_CLOSE_WAIT)
    return [
        c
        for c in psutil.Process().net_connections(kind="tcp")
        if c.raddr and c.raddr.port in ports and c.status in open_states
    ]


def _fds() -> list[str]:
    """This process's open file descriptors, each as ``NUMBER->WHAT`` (a socket's inode)."""
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # (the listing's own, closed since)
            fds.append(f"{fd}->{os.readlink(f'/proc/self/fd/{fd}')}")
    return fds


def _started_since(before: set[threading.Thread]) -> list[threading.Thread]:
    return [t for t in set(threading.enumerate()) - before if t.is_alive()]


def _stacks(threads: list[threading.Thread]) -> list[str]:
    """Where each of ``threads`` is, for a failing assertion."""
    frames = sys._current_frames()
    return [
        f"{t.name}: {''.join(traceback.format_stack(frames[t.ident]))}"
        for t in threads
        if t.ident in frames
    ]


def test_close_leaves_no_dial_behind_with_hosts_silent_frozen_and_killed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Hosts that stopped answering while the tier dials them (lost and dialled again, or down
    at their connect) hold none of its threads, file descriptors, connections or its NIXL
    agent past ``close``, whatever their dials' ``timeout_s``. (A guard: these hosts, each
    awaited for a first answer, left none behind before either; a handshake awaiting its
    ``Accept``, which did, is ``test_dial_close.py``'s.)"""
    # the silent host is tried 0.5 s at a time, then again after its backoff: grown to
    # REDIAL_MAX_S (10 s), that was as long as the wait below for a try of it beside the frozen
    # host's, which could then fall between two of its tries
    redial_quickly(monkeypatch)
    silent = SilentHosts(1)
    with (
        ServerProcess.start(16, BLOCK_LEN) as frozen,
        ServerProcess.start(16, BLOCK_LEN) as killed,
    ):
        ports = {
            int(a.rsplit(":", 1)[1]) for a in [frozen.address, killed.address, *silent.addresses]
        }
        before = set(threading.enumerate())
        zmq.Context.instance().socket(zmq.DEALER).close()  # its I/O thread's descriptors stay
        fds = _fds()
        tier = TierManager.create(16, BLOCK_LEN, name="close-leftovers")
        try:
            for host in (frozen, killed):
                tier.connect(host.address, timeout_s=DIAL_TIMEOUT_S, heartbeat_timeout_s=1.0)
            stop_process(frozen.proc.pid)
            killed.proc.kill()
            killed.proc.wait(timeout=RESULT_TIMEOUT_S)
            with pytest.raises(TimeoutError):  # then dialled in the background
                tier.connect(silent.addresses[0], timeout_s=0.5, redial_if_down=True)
            assert wait_for(lambda: tier.peers() == [], RESULT_TIMEOUT_S), tier.peers()
            assert wait_for(lambda: len(tier._redialer._trying) >= 2, RESULT_TIMEOUT_S)
            tier.close(timeout=2.0)
            # (a thread that has nothing left to do but end, e.g. the transport's registrar,
            # may still be ending as close returns: waited for, far below the dials' timeouts)
            assert wait_for(lambda: not _started_since(before), RESULT_TIMEOUT_S), _stacks(
                _started_since(before)
            )
            assert wait_for(lambda: set(_fds()) <= set(fds), RESULT_TIMEOUT_S), sorted(
                set(_fds()) - set(fds)
            )
            assert tier.transport._agent is None, "the NIXL agent outlived close"  # type: ignore[attr-defined]
            assert wait_for(lambda: not _connected_to(ports), RESULT_TIMEOUT_S), _connected_to(
                ports
            )
        finally:
            os.kill(frozen.proc.pid, signal.SIGCONT)
            tier.close()
            silent.close()


def test_close_while_a_shared_hosts_join_awaits_its_snapshot_ends_its_session_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: ``close`` took the session of a shared host whose join awaited its
    snapshot and ended it, then the join, failing ("closed"), dropped the host and ended the
    same session again (logging a transport already closed): a clean end of the join's could
    come first, though ``close`` knew a store to the host cancelled in flight. It is
    ``close``'s alone."""
    waiting, ends = threading.Event(), []
    init = shared_hosts._HostChanges.__init__

    def held(changes: object, tier: object, host: object, synced: threading.Event) -> None:
        init(changes, tier, host, threading.Event())  # type: ignore[arg-type]  # never synced
        session = host.session  # type: ignore[attr-defined]
        end = session.close
        monkeypatch.setattr(
            session, "close", lambda *, clean: (ends.append(clean), end(clean=clean))
        )
        waiting.set()

    monkeypatch.setattr(shared_hosts._HostChanges, "__init__", held)
    failures: list[BaseException] = []

    def connect(tier: TierManager, address: str) -> None:
        try:
            tier.connect(address, timeout_s=DIAL_TIMEOUT_S)
        except BaseException as exc:
            failures.append(exc)

    with (
        ServerProcess.start(64, BLOCK_LEN) as server,
        TierManager.create(16, BLOCK_LEN, name="join-close") as tier,
    ):
        caller = threading.Thread(target=connect, args=(tier, str(server.address)))
        caller.start()
        assert waiting.wait(timeout=RESULT_TIMEOUT_S), "the join never awaited the snapshot"
        tier.close()
        caller.join(timeout=RESULT_TIMEOUT_S)
    assert [str(exc) for exc in failures] == [TIER_CLOSED]
    assert ends == [True], "the joining host's session was ended twice"
