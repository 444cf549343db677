"""Re-connect remote hosts that a ``TierManager`` dropped (host restarted, network blip).

The tier manager forgets a peer whose transfers fail or whose heartbeats stop, and never dials
it again. A vLLM server outlives its remote hosts' restarts, and may start before them, so its
tier (re-)connects them in the background instead of running without them until vLLM restarts.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping

from torch_kv_tier.manager import TierManager

logger = logging.getLogger(__name__)


class Reconnector:
    """A daemon thread that re-connects, every ``interval_s``, each configured address whose
    peer the manager no longer has, or never had (``peers[address]`` is ``None``: the host was
    down at startup, and that was already logged).

    ``connect(address) -> peer_id`` performs the (blocking) handshake; it runs on this thread
    only, never on vLLM's scheduler thread. Thread-safety: ``_peers`` (address -> current peer
    id) is touched only by this thread after ``start``; the manager is thread-safe.
    """

    def __init__(
        self,
        manager: TierManager,
        peers: Mapping[str, str | None],
        connect: Callable[[str], str],
        interval_s: float,
    ) -> None:
        self._manager = manager
        self._peers = dict(peers)
        self._connect = connect
        self._interval_s = interval_s
        self._stop = threading.Event()
        # addresses whose outage was already logged
        self._down: set[str] = {address for address, peer in peers.items() if peer is None}
        self._thread = threading.Thread(target=self._run, name="tkvt-reconnect", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float) -> None:
        """Stop the thread; wait up to ``timeout`` s (a handshake in progress may take that)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout)
            if self._thread.is_alive():
                logger.warning("remote-host reconnect thread did not stop within %.0fs", timeout)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                live = set(self._manager.peers())
            except RuntimeError:  # the manager closed under us
                return
            for address, peer_id in list(self._peers.items()):
                if peer_id in live or self._stop.is_set():
                    continue
                self._retry(address)

    def _retry(self, address: str) -> None:
        try:
            self._peers[address] = self._connect(address)
        except Exception as exc:
            if address not in self._down:
                self._down.add(address)
                logger.warning(
                    "remote host %s is down; retrying every %.1fs: %s",
                    address,
                    self._interval_s,
                    exc,
                )
            return
        self._down.discard(address)
        logger.info("re-connected remote host %s", address)
