"""``ServerProcess``: run ``torch-kv-tier serve`` as a child process (tests, benchmarks).

The child's stdout and stderr are drained by daemon threads (so it can never block on a full
pipe); the last lines of stderr are kept for error messages.
"""

from __future__ import annotations

import collections
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import IO, Any

from torch_kv_tier.remote.quantities import count, seconds

_STDERR_LINES_KEPT = 200


class ServerProcess:
    """A running ``python -m torch_kv_tier serve`` child; a context manager that stops it.

    ``address`` is the ``HOST:PORT`` from its ``ready`` line, ``proc`` the ``Popen``.
    """

    def __init__(self, proc: subprocess.Popen[str], address: str, stderr: _Tail) -> None:
        self.proc = proc
        self.address = address
        self._stderr = stderr

    @classmethod
    def start(
        cls,
        num_blocks: int,
        block_len: int,
        *,
        host: str = "127.0.0.1",
        token_file: str | None = None,
        config_fields: dict[str, Any] | None = None,
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        timeout_s: float = 60.0,
        prefix: Sequence[str] = (),
    ) -> ServerProcess:
        """Start a server and wait until it prints ``ready HOST:PORT``.

        ``env`` entries are added to this process's environment; ``prefix`` is a command the
        server runs under (it must exec it), e.g. ``["ip", "netns", "exec", "ns1"]``. Raises
        ``RuntimeError`` with the server's stderr when it exits first, ``TimeoutError`` (after
        killing it) when it is not ready within ``timeout_s``; ``TypeError``/``ValueError`` for
        a ``timeout_s`` that is no number of seconds (``quantities.seconds``), or a
        ``num_blocks``/``block_len`` that is no whole number > 0 (``quantities.count``), before
        it starts.
        """
        timeout_s = seconds("timeout_s", timeout_s)
        num_blocks = count("num_blocks", num_blocks)
        block_len = count("block_len", block_len)
        cmd = [
            *prefix, sys.executable, "-m", "torch_kv_tier", "serve",
            "--num-blocks", str(num_blocks), "--block-len", str(block_len), "--host", host,
        ]  # fmt: skip
        if token_file is not None:
            cmd += ["--token-file", token_file]
        if config_fields is not None:
            cmd += ["--config-fields", json.dumps(config_fields)]
        cmd += list(extra_args)
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        stderr = _Tail(proc.stderr)
        lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()
        try:
            line = lines.get(timeout=timeout_s)
        except queue.Empty:
            _kill(proc)
            raise TimeoutError(
                f"server not ready within {timeout_s} s; stderr:\n{stderr.text()}"
            ) from None
        if line is None or not line.startswith("ready "):
            try:
                code = proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # it printed something else and kept running
                _kill(proc)
                code = proc.returncode
            stderr.wait()
            raise RuntimeError(
                f"server exited with code {code} before `ready` (first stdout line "
                f"{line!r}); stderr:\n{stderr.text()}"
            )
        return cls(proc, line.split()[1], stderr)

    @property
    def stderr(self) -> str:
        """The last lines the server wrote to stderr."""
        return self._stderr.text()

    def stop(self, timeout: float = 5.0) -> int:
        """SIGTERM, wait up to ``timeout`` s (then SIGKILL); return the exit code.
        ``TypeError``/``ValueError`` for a ``timeout`` that is no number of seconds >= 0, before
        the signal."""
        timeout = seconds("timeout", timeout, zero=True)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill(self.proc)
        self._stderr.wait()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL the server and reap it."""
        _kill(self.proc)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _kill(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


def _pump(stream: IO[str] | None, lines: queue.SimpleQueue[str | None]) -> None:
    """Forward stdout lines, then ``None`` at end of file (the server prints one line)."""
    assert stream is not None
    for line in stream:
        lines.put(line.rstrip("\n"))
    lines.put(None)


class _Tail:
    """Drains a text stream in a daemon thread, keeping its last lines."""

    def __init__(self, stream: IO[str] | None) -> None:
        assert stream is not None
        self._lines: collections.deque[str] = collections.deque(maxlen=_STDERR_LINES_KEPT)
        self._lock = threading.Lock()  # guards _lines
        self._thread = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self._thread.start()

    def _pump(self, stream: IO[str]) -> None:
        for line in stream:
            with self._lock:
                self._lines.append(line.rstrip("\n"))

    def wait(self, timeout: float = 2.0) -> None:
        """Wait for end of file (after the process exited)."""
        self._thread.join(timeout)

    def text(self) -> str:
        with self._lock:
            return "\n".join(self._lines)
