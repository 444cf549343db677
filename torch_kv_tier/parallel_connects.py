"""A tier's connects to several remote hosts, made side by side: hosts that do not answer cost
one handshake timeout in all, not one each (a tier's startup with 4 hosts down waited
4 x ``connect_timeout``; so did each membership round). Only the handshakes overlap: the
tier's joins after them go one at a time (``ConnectedHosts._join``).

Threading: :class:`ParallelConnects` starts one daemon thread per address, each calling
``tier.connect`` once (``TierManager.connect`` is thread-safe); ``outcomes`` and ``join`` run on
the caller's thread. Ownership: the tier is the caller's; this object owns only its threads. A
caller that gives up before every connect ended closes the tier (which ends the handshakes still
awaiting an answer), then calls ``join``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch_kv_tier.membership import Tier

logger = logging.getLogger(__name__)


class ParallelConnects:
    """``tier.connect(address, **connect_kwargs)`` for each of ``addresses``, side by side."""

    def __init__(
        self, tier: Tier, addresses: Sequence[str], connect_kwargs: Mapping[str, Any]
    ) -> None:
        self._outcomes: dict[int, str | BaseException] = {}
        self._threads = [
            threading.Thread(
                target=self._connect,
                args=(i, tier, address, connect_kwargs),
                name=f"tkvt-connect-{address}",
                daemon=True,
            )
            for i, address in enumerate(addresses)
        ]
        self._addresses = list(addresses)
        for thread in self._threads:
            thread.start()

    def _connect(self, i: int, tier: Tier, address: str, kwargs: Mapping[str, Any]) -> None:
        try:
            self._outcomes[i] = tier.connect(address, **kwargs)
        except BaseException as exc:
            self._outcomes[i] = exc

    def outcomes(self) -> Iterator[tuple[str, str | Exception]]:
        """Each address, in the order given, with its peer id or the exception its connect
        raised; each waits for its connect to end, as long as the connect's own timeouts let it
        (the handshake's ``timeout_s``). An exception that is not an ``Exception`` is raised."""
        for i, (address, thread) in enumerate(zip(self._addresses, self._threads, strict=True)):
            thread.join()
            outcome = self._outcomes[i]
            if not isinstance(outcome, str | Exception):
                raise outcome
            yield address, outcome

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` s in all for every connect to end; one still running then is
        logged and left to end on its own (its daemon thread)."""
        deadline = time.monotonic() + timeout
        for address, thread in zip(self._addresses, self._threads, strict=True):
            thread.join(max(deadline - time.monotonic(), 0.0))
            if thread.is_alive():
                logger.warning("a connect of %s did not end within %.1fs", address, timeout)


__all__ = ["ParallelConnects"]
