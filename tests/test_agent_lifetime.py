"""NIXL agents are destroyed by ``close()``, except those UCX cannot destroy safely (issue 13)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import weakref
from pathlib import Path

import pytest
import torch

from torch_kv_tier.manager import TierManager
from torch_kv_tier.remote.launch import ServerProcess
from torch_kv_tier.session_ends import ENDS_THREAD
from torch_kv_tier.transport import NixlTransport, agent_lifetime
from torch_kv_tier.transport import nixl as nixl_module

BLOCK_LEN = 4096
LOOP = Path(__file__).with_name("gc_user_loop.py")


def test_close_destroys_the_agent_at_once(no_gc: None) -> None:
    blocks = torch.zeros((8, BLOCK_LEN), dtype=torch.uint8)
    transport = NixlTransport("lifetime", blocks)
    agent = weakref.ref(transport._agent)
    native = weakref.ref(transport._agent.agent)
    transport.close()
    assert agent() is None and native() is None  # the transport object itself still exists


@pytest.mark.parametrize("refused", ["register_memory", "prep_xfer_dlist"])
def test_a_region_nixl_refuses_leaves_no_agent_behind(
    no_gc: None, monkeypatch: pytest.MonkeyPatch, refused: str
) -> None:
    """A region NIXL refused left the transport's agent (with the registration, when the
    descriptor list was refused) alive for as long as anything held the error."""
    made: list[weakref.ref[object]] = []
    real_make_agent = nixl_module.make_agent

    def make_agent(*args: object, **kwargs: object) -> object:
        agent = real_make_agent(*args, **kwargs)
        setattr(agent, refused, _refuse)  # holds no reference to the agent
        made.append(weakref.ref(agent))
        made.append(weakref.ref(agent.agent))
        return agent

    monkeypatch.setattr(nixl_module, "make_agent", make_agent)
    with pytest.raises(RuntimeError, match="NIXL_ERR_BACKEND") as error:
        NixlTransport("refused", torch.zeros((8, BLOCK_LEN), dtype=torch.uint8))
    assert made and all(agent() is None for agent in made), "the agent outlived the failure"
    assert error.value.args == ("NIXL_ERR_BACKEND",)


@pytest.mark.parametrize("refused", [ENDS_THREAD, "tkvt-poller"])
def test_a_tier_whose_thread_cannot_start_leaves_no_agent_behind(
    no_gc: None, monkeypatch: pytest.MonkeyPatch, refused: str
) -> None:
    """Found by review: ``create`` at the process's thread limit (its ``session_ends`` thread
    or its poller refused) raised with its NIXL agent, the arena's registration and UCX worker,
    never closed and alive for as long as anything held the error (then until the collector
    ran). It closes its transport, and leaves no thread of its own running."""
    made: list[weakref.ref[object]] = []
    real_make_agent = nixl_module.make_agent

    def make_agent(*args: object, **kwargs: object) -> object:
        agent = real_make_agent(*args, **kwargs)
        made.append(weakref.ref(agent))
        made.append(weakref.ref(agent.agent))
        return agent

    start = threading.Thread.start

    def refuse(thread: threading.Thread) -> None:
        if thread.name == refused:
            raise RuntimeError("can't start new thread")
        start(thread)

    before = set(threading.enumerate())
    monkeypatch.setattr(nixl_module, "make_agent", make_agent)
    monkeypatch.setattr(threading.Thread, "start", refuse)
    with pytest.raises(RuntimeError, match="can't start new thread") as error:
        TierManager.create(8, BLOCK_LEN, name="no-thread")
    assert made and all(agent() is None for agent in made), "the agent outlived the failure"
    left = [t.name for t in set(threading.enumerate()) - before if t.name.startswith("tkvt")]
    assert left == [], "a thread of the tier outlived the failure"
    assert error.value.args == ("can't start new thread",)


def _refuse(*args: object, **kwargs: object) -> None:
    raise RuntimeError("NIXL_ERR_BACKEND")


def test_closed_manager_is_freed_without_the_collector(no_gc: None) -> None:
    with ServerProcess.start(16, BLOCK_LEN, host="127.0.0.1") as server:
        manager = TierManager.create(8, BLOCK_LEN, name="lifetime")
        transport = weakref.ref(manager.transport)
        manager.connect(str(server.address))
        manager.close()
        owner = weakref.ref(manager)
        del manager
        assert owner() is None, "TierManager is kept alive by a cycle (session loss callback?)"
        assert transport() is None


def test_close_at_the_thread_limit_ends_its_sessions_and_destroys_the_agent(
    no_gc: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: ``close`` at the process's thread limit raised ``RuntimeError`` out of
    its last word to its hosts (a thread per host) before it closed its transport: the NIXL
    agent and its registrations lived on, the host's session was never ended (the host kept
    its slots until its lease ran out) and a load ``close`` cancelled never resolved. A last
    word whose thread cannot start runs on the closing thread."""
    with ServerProcess.start(16, BLOCK_LEN, host="127.0.0.1") as server:
        tier = TierManager.create(8, BLOCK_LEN, name="close-limit")
        agent = weakref.ref(tier.transport._agent)  # type: ignore[attr-defined]
        session = tier._peers[tier.connect(str(server.address))].session
        assert session is not None
        monkeypatch.setattr(threading.Thread, "start", _no_thread)
        try:
            tier.close()
        finally:
            monkeypatch.undo()
        assert agent() is None, "the agent outlived close"
        assert session.ended_clean, "close did not end the host's session"


def test_a_full_process_refuses_new_agents(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agent_lifetime, "MAX_KEPT_AGENTS", agent_lifetime.kept_count())
    with pytest.raises(RuntimeError, match="restart the process"):
        NixlTransport("lifetime", torch.zeros((8, BLOCK_LEN), dtype=torch.uint8))


def test_user_loop_with_dead_servers_survives_the_collector() -> None:
    """Used to abort (UCX arbiter assertion in ~nixlAgentData) or warn about leaked requests."""
    cycles = 6
    proc = subprocess.run(
        [sys.executable, str(LOOP), str(cycles)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONFAULTHANDLER": "1"},
    )
    output = proc.stdout + proc.stderr  # UCX logs to stdout
    tail = output[-4000:]
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{tail}"
    assert "not returned to mpool" not in output, tail
    assert "done" in proc.stdout.splitlines()
    kept = int(proc.stdout.split("kept=")[1].split()[0])
    assert kept >= 1, "no restore was refused: the test did not reach the leaking path"
    assert proc.stderr.count("kept alive until the process exits") == 1, tail


def _no_thread(thread: threading.Thread) -> None:
    raise RuntimeError("can't start new thread")
