"""``torch-kv-tier serve``: parse the options, start a ``server.Server``, print ``ready
HOST:PORT`` once it listens, and serve until SIGINT or SIGTERM.

Threading: ``run`` blocks the calling thread in ``Server.serve``; signal handlers are installed,
and the host's index frozen out of the collector (``Server.serve``'s ``freeze_index``: at the
loop's start and once a namespace is made), only on the main thread (elsewhere the caller stops
the server by other means and owns its process).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Callable

from torch_kv_tier.remote.server import Server
from torch_kv_tier.remote.server_config import ServerConfig, add_arguments

logger = logging.getLogger(__name__)

__all__ = ["add_arguments", "run"]


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM; print ``ready HOST:PORT`` once listening. Returns 0, or
    2 for bad options and 1 when the pool or the port cannot be set up."""
    try:
        config = ServerConfig.from_args(args)
    except ValueError as exc:
        print(f"torch-kv-tier serve: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    restore = _install_signal_handlers(stop)
    try:
        try:
            server = Server(config)
        except (OSError, RuntimeError, MemoryError) as exc:
            logger.error("cannot start: %s", exc)
            return 1
        try:
            logger.info(
                "serving %d x %d B (%s) as %s, lease timeout %.1f s%s",
                config.num_blocks,
                config.block_len,
                server.transport.mem_type,
                server.name,
                config.lease_timeout_s,
                f", metrics on port {server.stats()['metrics_port']}"
                if config.metrics_port is not None
                else "",
            )
            print(f"ready {server.address}", flush=True)
            # The process is ours (not a program embedding the host): what exists when the
            # loop starts (NIXL's import graph, the server, a recovered disk index) and each
            # namespace's entries once made are frozen out of the collector's walks, which
            # took ~0.3 s of CPU with torch imported and a second at 4 M keys (``Server``).
            server.serve(stop, freeze_index=threading.current_thread() is threading.main_thread())
            logger.info("stopping: releasing %d leases", len(server.stats()["sessions"]))
        finally:
            server.close()
    finally:
        restore()
    logger.info("stopped")
    return 0


def _install_signal_handlers(stop: threading.Event) -> Callable[[], None]:
    """SIGINT/SIGTERM set ``stop`` (main thread only); returns a function restoring the old
    handlers."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    signals = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.getsignal(s) for s in signals}
    for s in signals:
        signal.signal(s, lambda signum, frame: stop.set())

    def restore() -> None:
        for s, handler in previous.items():
            signal.signal(s, handler)

    return restore
