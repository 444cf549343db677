"""The host processes of ``torch-kv-tier chaos``: each a ``torch-kv-tier serve`` child on a
fixed port across restarts, SIGKILLed and restarted by the harness, and watched for exits of
its own (``HostExit``), which are recorded and restarted too.

An exit of its own is *known* when it is the upstream UCX abort the README documents ("Known
upstream issue", TCP transport only): the run is over TCP, the host died of SIGABRT (exit code
-6), and its stderr carries UCX's message (``UCX_ABORT_SIGNS``). A known exit is reported and
costs the run nothing but the host's keys (its loads in flight settle as misses); any other exit
fails the run (``chaos.Chaos.report``).

Threading: the harness's thread only, but for one daemon thread per host process that waits for
its exit and notes when (an exit is found between two faults, some seconds later); it ends with
the process, and ``close`` ends every process. Each restart and ``close`` waits for the host
(bounded by ``ServerProcess``'s timeouts).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from torch_kv_tier.benchmarks import chaos_worker as cw
from torch_kv_tier.remote import ServerProcess

POOL_BLOCKS = 2048  # per host: more than the key space, so nothing is evicted (without --disk)
RESTART_S = 30.0  # the longest a host's port stays busy after its death
# What UCX writes when it aborts a host over TCP (README, "Known upstream issue")
UCX_ABORT_SIGNS = ("ucp_request", "Endpoint timeout", "stubs.c:107 Assertion '0' failed")
STDERR_LINES = 20  # of a host's stderr, kept with its exit (its last 200 lines are searched)


@dataclass(frozen=True)
class HostExit:
    """A host that exited without the harness killing it: which, when (seconds into the run),
    how (``returncode``: negative for a signal, named by ``signal``), whether it is the known
    UCX abort, and the last lines of its stderr."""

    host: str
    at_s: float
    returncode: int
    signal: str | None
    known: bool
    stderr: str


def is_known_ucx_abort(returncode: int, stderr: str, *, tcp: bool) -> bool:
    """Whether an exit is the documented UCX abort: over TCP, SIGABRT, UCX's message."""
    return tcp and returncode == -signal.SIGABRT and any(s in stderr for s in UCX_ABORT_SIGNS)


def host_exit(host: str, at_s: float, returncode: int, stderr: str, *, tcp: bool) -> HostExit:
    """The ``HostExit`` of ``host``, judged on all of ``stderr`` (UCX's message may be followed
    by its backtrace), which it keeps the last ``STDERR_LINES`` lines of."""
    known = is_known_ucx_abort(returncode, stderr, tcp=tcp)
    tail = "\n".join(stderr.splitlines()[-STDERR_LINES:])
    return HostExit(host, round(at_s, 1), returncode, _signal_name(returncode), known, tail)


class Hosts:
    """The host processes. With ``disk``, each host keeps a disk tier in its own directory
    under it (every block admitted) behind a pool of a quarter of the key space, so keys go to
    disk and come back, and a restart after SIGKILL recovers that directory. ``tcp``: the run
    is over UCX's TCP transport (what ``is_known_ucx_abort`` needs). ``exits`` lists the exits
    of their own found so far, times counted from ``started`` (``time.monotonic()``)."""

    def __init__(
        self, count: int, disk: Path | None, keys: int, *, tcp: bool, started: float
    ) -> None:
        def options(i: int) -> list[str]:
            if disk is None:
                return []
            size = str(2 * keys * cw.BLOCK_LEN)
            return ["--disk", str(disk / f"host-{i}"), "--disk-bytes", size, "--disk-admit", "1"]

        pool = POOL_BLOCKS if disk is None else max(64, keys // 4)
        self._start = lambda i, port: self._watched(
            ServerProcess.start(pool, cw.BLOCK_LEN, extra_args=["--port", str(port), *options(i)])
        )
        self._tcp, self._started = tcp, started
        self._ends: dict[int, tuple[threading.Thread, list[float]]] = {}  # pid: its ``_watch``
        self.servers = [self._start(i, 0) for i in range(count)]
        self.restarts = 0
        self.exits: list[HostExit] = []

    @property
    def addresses(self) -> list[str]:
        return [s.address for s in self.servers]

    def exited(self) -> list[int]:
        """The hosts whose process exited on its own (``restart`` them; it records how)."""
        return [i for i, s in enumerate(self.servers) if s.proc.poll() is not None]

    def restart(self, i: int) -> None:
        """SIGKILL host ``i`` (recording its exit if it had already exited on its own) and
        start a new one on its port (retried while it is busy, for up to ``RESTART_S``). An
        exit the kill's look missed (``poll`` says "running" while the watch thread reaps the
        process) is told by its code: any but SIGKILL's is the host's own."""
        port = int(self.servers[i].address.rsplit(":", 1)[1])
        self._record_exit(i)
        self.servers[i].kill()
        if self.servers[i].proc.returncode != -signal.SIGKILL:  # exited unseen by the look
            self._record_exit(i)
        self._ends.pop(self.servers[i].proc.pid, None)  # (its watch ends with it)
        deadline = time.monotonic() + RESTART_S
        while True:
            try:
                self.servers[i] = self._start(i, port)
                break
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        self.restarts += 1

    def close(self) -> None:
        """Stop every host (resumed first), recording the exits of their own found now."""
        for i, server in enumerate(self.servers):
            self._record_exit(i)
            with contextlib.suppress(ProcessLookupError):
                os.kill(server.proc.pid, signal.SIGCONT)
            server.stop()

    def _watched(self, server: ServerProcess) -> ServerProcess:
        """``server``, with a thread noting when its process exits (``_watch``)."""
        ended: list[float] = []
        watch = threading.Thread(
            target=_watch, args=(server, ended), name=f"chaos-host-{server.proc.pid}", daemon=True
        )
        watch.start()
        self._ends[server.proc.pid] = (watch, ended)
        return server

    def _record_exit(self, i: int) -> None:
        """Add host ``i``'s exit to ``exits`` if its process exited (the harness has not
        killed it yet: it records before each kill, and after it an exit whose code is not the
        kill's), once."""
        server = self.servers[i]
        if server.proc.poll() is None or server.proc.pid not in self._ends:
            return  # running, or recorded already
        watch, ended = self._ends.pop(server.proc.pid)
        watch.join(timeout=RESTART_S)  # it returns as the process is reaped
        at_s = (ended[0] if ended else time.monotonic()) - self._started
        code = server.stop()  # already exited: reaps it and reads its stderr to the end
        self.exits.append(host_exit(server.address, at_s, code, server.stderr, tcp=self._tcp))


def _watch(server: ServerProcess, ended: list[float]) -> None:
    """Append to ``ended`` when ``server``'s process exits (waiting as long as it runs)."""
    server.proc.wait()
    ended.append(time.monotonic())


def _signal_name(returncode: int) -> str | None:
    """``SIGABRT`` for -6; ``None`` for an exit code, or a signal Python has no name for."""
    try:
        return signal.Signals(-returncode).name if returncode < 0 else None
    except ValueError:
        return None
