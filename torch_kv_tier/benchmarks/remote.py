"""The remote host the NIXL systems write to: an embedded ``torch-kv-tier serve`` or ``--remote``.

A remote host serves one block length, so the embedded mode starts one server per block length
of the sweep (on loopback, all at the start, torn down at the end). With ``--remote HOST:PORT``
every system connects to that server; block lengths it does not serve are reported as skipped
with the server's own reason.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch_kv_tier.benchmarks.core import Skip

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Target:
    """Everything a system needs to open itself for one block length.

    ``address`` is the remote host, ``None`` when it could not be started (``problem`` says
    why; systems that need no remote host still run); ``local_slots`` and ``remote_slots`` size
    the local arena and the lease each system asks for.
    """

    address: str | None
    token: str | None
    device: str
    block_len: int
    local_slots: int
    remote_slots: int
    embedded: bool
    problem: str | None = None
    more_addresses: tuple[str, ...] = ()  # further hosts, for the multi-host tier systems
    # Extra lease for systems that place blocks themselves: with several calls in flight they
    # complete (and enter the LRU order) out of submission order, so a lease of exactly the
    # working set could evict a key of the cycle being measured.
    slack_slots: int = 0

    def require_address(self) -> str:
        """The remote host's address; ``RuntimeError`` with the reason when there is none."""
        if self.address is None:
            raise RuntimeError(f"no remote host: {self.problem}")
        return self.address


def read_token(path: str | None) -> str | None:
    """The token in ``path`` (surrounding whitespace stripped), or ``None`` without a path."""
    if path is None:
        return None
    token = Path(path).read_text().strip()
    if not token:
        raise ValueError(f"token file {path} is empty")
    return token


@dataclass(frozen=True)
class Host:
    """The remote host for one block length: ``address``, or ``problem`` when there is none;
    ``pid`` is an embedded host's process (``None`` for ``--remote`` or one that failed)."""

    address: str | None
    embedded: bool
    problem: str | None = None
    pid: int | None = None


def _start(block_len: int, num_blocks: int, extra_args: Sequence[str] = ()) -> tuple[Any, Host]:
    from torch_kv_tier.remote.launch import ServerProcess

    try:
        server = ServerProcess.start(num_blocks, block_len, host="127.0.0.1", extra_args=extra_args)
    except (RuntimeError, TimeoutError, OSError) as exc:
        logger.error("embedded remote host for %d B blocks failed to start: %s", block_len, exc)
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return None, Host(None, True, f"embedded `torch-kv-tier serve` failed to start: {first}")
    logger.info("embedded remote host %s: %d x %d B", server.address, num_blocks, block_len)
    return server, Host(server.address, True, pid=server.proc.pid)


def _stop(server: Any) -> None:
    try:
        server.stop()
    except Exception as exc:  # a stop that fails must not leave the process behind
        logger.warning("embedded remote host did not stop cleanly (%s); killing it", exc)
        server.kill()


@contextlib.contextmanager
def remote_hosts(remote: str | None, pools: dict[int, int]) -> Iterator[dict[int, Host]]:
    """Yield a ``Host`` per block length of ``pools`` (block_len -> blocks in the pool).

    With ``remote`` every block length gets that address. Otherwise one embedded server per
    block length is started on loopback, all at once (each start is mostly a Python and NIXL
    import; idle servers cost nearly nothing), and all are stopped (killed if they do not stop)
    when the block ends.
    """
    if remote is not None:
        yield {block_len: Host(remote, False) for block_len in pools}
        return
    with ThreadPoolExecutor(max_workers=len(pools)) as pool:
        started = dict(zip(pools, pool.map(lambda kv: _start(*kv), pools.items()), strict=True))
    try:
        yield {block_len: host for block_len, (_, host) in started.items()}
    finally:
        servers = [server for server, _ in started.values() if server is not None]
        with ThreadPoolExecutor(max_workers=max(1, len(servers))) as pool:
            list(pool.map(_stop, servers))


@contextlib.contextmanager
def host_group(
    remote: str | None, block_len: int, pools: list[int], extra_args: Sequence[str] = ()
) -> Iterator[list[Host]]:
    """``len(pools)`` hosts for one block length (``pools[i]`` blocks each, ``serve`` options
    ``extra_args``), started side by side and stopped at the end; with ``remote`` just that one
    host."""
    if remote is not None:
        yield [Host(remote, False)]
        return
    with ThreadPoolExecutor(max_workers=len(pools)) as pool:
        started = list(pool.map(lambda n: _start(block_len, n, extra_args), pools))
    try:
        yield [host for _, host in started]
    finally:
        servers = [server for server, _ in started if server is not None]
        with ThreadPoolExecutor(max_workers=max(1, len(servers))) as pool:
            list(pool.map(_stop, servers))


def open_session(
    target: Target, agent_metadata: bytes, base_addr: int, num_blocks: int, mem_type: str
) -> object:
    """Handshake with the remote host for a private lease of ``target.remote_slots`` slots.

    Returns the ``RemoteSession`` (``agent_metadata``, ``base_addr``, ``num_blocks``, ``lease``).
    A rejected handshake (e.g. another block length) raises ``Skip`` with the server's reason;
    a lease shorter than asked for is accepted and the caller sizes its plans by ``lease``.
    """
    from torch_kv_tier.remote.client import HandshakeRejected, Region, RemoteSession

    address = target.require_address()
    region = Region(base_addr, num_blocks, target.block_len, mem_type)
    try:
        return RemoteSession.open(
            address,
            agent_metadata=agent_metadata,
            region=region,
            token=target.token,
            slots=target.remote_slots,
            private=True,
        )
    except HandshakeRejected as exc:
        raise Skip(f"remote host {address} refused: {exc}") from exc
