"""Hosts the offloader could not reach yet, dialled again in the background until they join.

A host that does not answer a connect (down, or not started yet), or whose session is lost
while it joins (its control connection reset, or it died answering), would otherwise never be
dialled again: the tier re-dials only hosts it once connected. :class:`HostDials` gives each such
address a daemon thread that connects it every ``interval_s``, with the arguments of the connect
that failed, until it joins; restores find its pages from then on. The thread then ends: the
host is the tier's like one connected at once (dialled again by the tier should it be lost, not
after ``disconnect``). A failed dial is logged once per kind of failure. A host that answers the
offloader's connect and refuses (``HandshakeRejected``: a token, block length or fingerprint
of another tier) is not dialled.

A failed connect of a ``strict`` offloader raises instead (``unavailable``).

Threading: ``unavailable`` and ``stop`` run on the offloader's caller thread; the dialling runs
on one daemon thread per address. Ownership: the tier is the offloader's; this object owns only
its threads, which end once their host joined, at ``stop`` (within its timeout), or at their
next dial once the tier is closed.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any

from torch_kv_tier.integrations.torch_loop.offload_results import OffloadError
from torch_kv_tier.manager import TierManager

logger = logging.getLogger(__name__)

DIAL_THREAD = "tkvt-host-dial"


class HostDials:
    """One background dialler per address the offloader is waiting for."""

    def __init__(self, manager: TierManager, interval_s: float) -> None:
        """``ValueError`` unless ``interval_s`` is a finite number of seconds >= 0 (0: never
        dial)."""
        if not 0 <= interval_s < math.inf:
            raise ValueError(
                "reconnect_interval_s must be a finite number of seconds >= 0 (0: never), "
                f"got {interval_s}"
            )
        self._manager = manager
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._dials: dict[str, threading.Thread] = {}

    def unavailable(
        self, address: str, connect_kwargs: dict[str, Any], exc: Exception, *, strict: bool
    ) -> None:
        """``address`` failed to connect with ``exc``: ``strict``, raise ``OffloadError`` naming
        it; else log it, and dial one that did not answer (a ``TimeoutError``: down, or not
        started yet) or was lost while joining (a ``ConnectionError``) every ``interval_s``
        with ``connect_kwargs`` (``TierManager.connect``'s) from now on, unless it is already."""
        if strict:
            raise OffloadError(f"cannot connect to remote host {address}: {exc}") from exc
        later = isinstance(exc, TimeoutError | ConnectionError) and self.interval_s > 0
        logger.warning(
            "remote host %s unavailable, KV pages will be recomputed%s: %s",
            address,
            f" until it joins (dialled every {self.interval_s}s)" if later else "",
            exc,
        )
        dial = self._dials.get(address)
        if later and (dial is None or not dial.is_alive()):
            self._dials[address] = dial = threading.Thread(
                target=self._dial,
                args=(address, connect_kwargs, type(exc)),
                name=DIAL_THREAD,
                daemon=True,
            )
            dial.start()

    def stop(self, deadline: float) -> None:
        """Stop every dialler, waiting for each until the ``time.monotonic()`` ``deadline`` (a
        handshake under way lasts up to its ``timeout_s``, less once the tier is closed)."""
        self._stop.set()
        for dial in self._dials.values():
            dial.join(max(deadline - time.monotonic(), 0.0))
            if dial.is_alive():
                logger.warning("a dialler of a remote host did not stop in time")
        self._dials.clear()

    def _dial(self, address: str, connect_kwargs: dict[str, Any], logged: type[Exception]) -> None:
        """Connect ``address`` every ``interval_s`` until it joins, ``stop``, or the tier is
        closed (module docstring); a failure of a kind other than ``logged`` is logged once."""
        failures: set[type[Exception]] = {logged}
        while not self._stop.wait(self.interval_s):
            try:
                peer_id = self._manager.connect(address, **connect_kwargs)
            except Exception as exc:
                if self._manager.closed:
                    return
                if type(exc) not in failures:
                    failures.add(type(exc))
                    logger.warning(
                        "remote host %s cannot be connected; retrying every %ss: %s",
                        address,
                        self.interval_s,
                        exc,
                    )
                continue
            logger.info("remote host %s joined (peer %s)", address, peer_id)
            return
