"""Hosts the offloader could not reach yet, dialled again in the background until they join.

A host that does not answer a connect (down, or not started yet) would otherwise never be
dialled again: the tier re-dials only hosts it once connected. :class:`HostDials` gives each such
address a :class:`~torch_kv_tier.membership.Membership` thread over just that address, with the
arguments of the connect that failed; once the host answers it joins the tier, and restores find
its pages from then on. Like a vLLM tier's membership, the thread keeps dialling the host
whenever the tier has lost it, until it is stopped.

Threading: ``unavailable`` and ``stop`` run on the offloader's caller thread; the dialling runs
on one daemon thread per address. Ownership: the tier is the offloader's; this object owns only
its threads, which end at ``stop`` (within its timeout), or at their next dial once the tier is
closed.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from torch_kv_tier.host_sources import StaticHosts
from torch_kv_tier.manager import TierManager
from torch_kv_tier.membership import Membership

logger = logging.getLogger(__name__)


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
        self._dials: dict[str, Membership] = {}

    def unavailable(self, address: str, connect_kwargs: dict[str, Any], exc: Exception) -> None:
        """Log that ``address`` failed to connect with ``exc``; one that did not answer (a
        ``TimeoutError``: down, or not started yet) is dialled every ``interval_s`` with
        ``connect_kwargs`` (``TierManager.connect``'s) from now on, unless it is already."""
        later = isinstance(exc, TimeoutError) and self.interval_s > 0
        logger.warning(
            "remote host %s unavailable, KV pages will be recomputed%s: %s",
            address,
            f" until it joins (dialled every {self.interval_s}s)" if later else "",
            exc,
        )
        if later and address not in self._dials:
            dial = Membership(
                self._manager,
                StaticHosts([address]),
                interval_s=self.interval_s,
                connect_kwargs=connect_kwargs,
                known={address: None},
            )
            self._dials[address] = dial
            dial.start()

    def stop(self, deadline: float) -> None:
        """Stop every dialler, waiting for each until the ``time.monotonic()`` ``deadline`` (a
        handshake under way lasts up to its ``timeout_s``, less once the tier is closed)."""
        for dial in self._dials.values():
            dial.stop(max(deadline - time.monotonic(), 0.0))
        self._dials.clear()
