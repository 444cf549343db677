"""The benchmarks' drivers, on fake transports and agents: the poll-scaling driver verifies every
block it wrote, the vLLM NIXL driver yields the core when nothing completed, passive progress
gives up on a target that stops answering or a write that fails, and bare NIXL releases its
agent and registration when a step is refused."""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch
from bench_support import FakePollTransport

from torch_kv_tier.benchmarks.system_nixl_raw import BareNixl


def test_poll_scaling_verifies_every_block_it_wrote() -> None:
    # At 10 in flight the runs write 100 distinct remote blocks (slots 0..99); the read-back
    # once compared the first 10 only, so a wrong block 50 passed as verified.
    from torch_kv_tier.benchmarks.poll_scaling import _REPEATS, _rounds

    slots = 100
    arena = torch.zeros(2 * slots, 64, dtype=torch.uint8)
    [good] = _rounds(FakePollTransport(arena, slots, corrupt=-1), arena, [10], slots, 0, 7)
    assert good["verified"] and good["error"] is None
    [bad] = _rounds(FakePollTransport(arena, slots, corrupt=50), arena, [10], slots, 0, 7)
    assert not bad["verified"]  # each timed run's read-back finds block 50
    assert bad["error"] == f"{_REPEATS} of {100 * _REPEATS} blocks differ"


def test_vllm_nixl_driver_yields_the_core_when_nothing_completed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The method gives every system the same driver: a reap that saw nothing done yields the
    # core (nixl_raw and the tier do; on 2 cores a spinning initiator starves the loopback
    # target). vllm_nixl's reap spun without yielding.
    pytest.importorskip("vllm.v1.kv_offload.tiering.p2p.data")
    import os

    from torch_kv_tier.benchmarks.system_vllm_nixl import VllmNixl

    class Transport:
        done: list[int] = []

        def poll(self, peer: str) -> object:
            return type("Polled", (), {"done": list(self.done), "failed": []})()

    yields: list[int] = []
    monkeypatch.setattr(os, "sched_yield", lambda: yields.append(1))
    system = VllmNixl.__new__(VllmNixl)
    system._transport = Transport()
    assert system.reap(0.5) == [] and yields == [1]
    Transport.done = [7]
    assert [tid for tid, _ in system.reap(0.5)] == [7] and yields == [1]


@pytest.mark.timeout(60)
def test_passive_progress_gives_up_on_a_target_that_stops_answering(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A target that never answers a command (stuck, frozen) fails the run with a
    ``TimeoutError`` saying what it did not send, instead of hanging the benchmark."""
    from torch_kv_tier.benchmarks import passive_progress

    spawn = passive_progress.mp.get_context("spawn")

    class Deaf:  # the parent's end of the pipe; the target never gets its idle command
        def __init__(self, conn: Any) -> None:
            self._conn = conn

        def send(self, obj: Any) -> None:
            if obj is None:  # the end of the run still reaches it: it exits at once
                self._conn.send(obj)

        def __getattr__(self, name: str) -> Any:
            return getattr(self._conn, name)

    class Context:
        Process = spawn.Process

        @staticmethod
        def Pipe() -> tuple[Any, Any]:  # noqa: N802 (multiprocessing's name)
            conn, child = spawn.Pipe()
            return Deaf(conn), child

    monkeypatch.setattr(passive_progress.mp, "get_context", lambda method: Context)
    monkeypatch.setattr(passive_progress, "ANSWER_MARGIN_S", 0.5, raising=False)
    with pytest.raises(TimeoutError, match="did not send its idle CPU, no peer within 0.55 s"):
        passive_progress.measure(None, 0, idle_s=0.05, tries=1, gap_s=0.001)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("outcome", ["failed", "refused"])
def test_passive_progress_write_rate_fails_on_a_write_that_fails(
    monkeypatch: pytest.MonkeyPatch, outcome: str
) -> None:
    """A write the transport refuses or fails ends the write-rate measurement with an error,
    instead of polling forever for a completion that never comes."""
    import torch_kv_tier.transport as transport
    from torch_kv_tier.benchmarks import passive_progress
    from torch_kv_tier.transport.base import PollResult

    class Failing:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def add_remote_peer(self, *args: Any) -> None:
            pass

        def write_blocks(self, *args: Any) -> int | None:
            return 7 if outcome == "failed" else None

        def poll(self) -> PollResult:
            return PollResult(failed=[7])

        def close(self) -> None:
            pass

    monkeypatch.setattr(transport, "NixlTransport", Failing)
    with pytest.raises(RuntimeError, match=f"{'a write' if outcome == 'failed' else 'refused'}"):
        passive_progress._write_rate(b"", 0, passive=True, seconds=0.1)


def _refuse(*args: object, **kwargs: object) -> Any:
    raise RuntimeError("NIXL_ERR_BACKEND")


class _Agent:
    """A ``nixl_agent`` stand-in that records what is released (its refusing step, set per
    instance, holds no reference to the agent: only the ``BareNixl`` under test may)."""

    def __init__(self, name: str, config: object) -> None:
        self.released: list[str] = []

    def register_memory(self, *args: object, **kwargs: object) -> str:
        return "registration"

    def prep_xfer_dlist(self, *args: object, **kwargs: object) -> str:
        return "descriptors"

    def deregister_memory(self, reg: str) -> None:
        self.released.append(reg)

    def release_dlist_handle(self, handle: str) -> None:
        self.released.append(handle)


@pytest.mark.parametrize(
    ("refused", "released"),
    [("register_memory", []), ("prep_xfer_dlist", ["registration"])],
)
def test_bare_nixl_releases_its_agent_and_registration_when_a_step_is_refused(
    monkeypatch: pytest.MonkeyPatch, refused: str, released: list[str]
) -> None:
    """A refused registration left nixl_raw's agent alive (with the registration, when its
    descriptor list was refused) for as long as anything held the error."""
    api = pytest.importorskip("nixl._api")
    agents: list[_Agent] = []

    def make(name: str, config: object) -> _Agent:
        agent = _Agent(name, config)
        setattr(agent, refused, _refuse)
        agents.append(agent)
        return agent

    monkeypatch.setattr(api, "nixl_agent", make)
    with pytest.raises(RuntimeError, match="NIXL_ERR_BACKEND") as error:
        BareNixl("test", torch.zeros(4, 64, dtype=torch.uint8), None)  # type: ignore[arg-type]
    (agent,) = agents
    assert agent.released == released
    gone = weakref.ref(agent)
    del agent, agents[:]
    assert gone() is None, "the agent outlived the failed BareNixl"
    assert error.value.args == ("NIXL_ERR_BACKEND",)


def test_bare_nixl_refuses_an_arena_of_another_shape_before_it_makes_an_agent() -> None:
    with pytest.raises(ValueError, match="blocks, block_len"):
        BareNixl("test", torch.zeros(256, dtype=torch.uint8), None)  # type: ignore[arg-type]
