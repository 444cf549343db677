"""The tier's per-transfer bound (``transfer_timeout_s``): which transfers the transport still
holds past it, and which of them settle then.

A transfer the transport posted and has not reported ``transfer_timeout_s`` after its post (one
queued inside the tier behind ``max_inflight`` is not posted yet) faults its peer as a refused
transfer does (``Poller._expire_overdue``): its stores settle "peer lost" with their remote
slots fenced, a load settles "timed out", yet its read may still land, whenever: its local
blocks are *withheld* (``withheld``: a load into them or a store from them raises) until the
transport reports that transfer (nothing more of it lands) or releases every transfer (the tier
closed: ``DataTransport.on_released``). Only liveness depends on the bound: a transfer past it
is never reported done, so a slow one costs its host a redial, never a wrong byte.

``settle_loads`` False keeps the host's recovery but not the early settling: a load past the
bound stays pending until the transport reports its read (then settles "peer lost", as any load
of a dropped peer), so nothing is withheld: for a caller that hands a failed load's blocks to
other work at once (vLLM's offloading manager, ``PagedKVOffloader``'s arena batches).

Threading: no lock of its own; the manager's lock guards it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from torch_kv_tier.remote.quantities import seconds

if TYPE_CHECKING:
    from torch_kv_tier.records import Op

# The transfers' logger: these lines are about a transfer's life.
logger = logging.getLogger("torch_kv_tier.transfers")

TRANSFER_TIMEOUT_S = 60.0
"""The default bound: about 3,000 times the slowest transfer measured while UCX's connections
were reset under load on a 2-core VM (0.02 s for 4 MiB), so that a healthy host is not dropped
for a slow transfer, while a stalled one holds its host and futures a minute rather than until
the tier closes. It runs from each transfer's post, and transfers posted together share the
link: a pipeline of ``max_inflight`` transfers of the largest size (1,023 blocks each) over a
slow link can need more; raise it there (0: never). vLLM's ``drain_timeout_s`` (120 s by
default) outlasts it, so a stalled store fails before the drain gives up on it; a promotion
stalled on a read does not (``RemoteHostTier`` keeps it pending: ``settle_loads``)."""

_SCAN_S = 1.0  # the longest between two looks for overdue transfers (a quarter of a short bound)


class Overdue:
    """The transfers past ``timeout_s`` (module docstring); ``timeout_s`` 0: never;
    ``settle_loads``: whether a load past it settles then (else it waits for its report).
    ``TypeError``/``ValueError`` naming the tier's argument (``transfer_timeout_s``,
    ``settle_late_loads``) that is out of range."""

    def __init__(self, timeout_s: float, *, settle_loads: bool = True) -> None:
        self.timeout_s = seconds("transfer_timeout_s", timeout_s, zero=True)
        if not isinstance(settle_loads, bool):
            raise TypeError(f"settle_late_loads must be True or False, got {settle_loads!r}")
        self.settle_loads = settle_loads
        self.due = 0.0  # perf_counter time of the next look (``take``)

    def take(self, ops: dict[int, Op], now: float) -> list[tuple[int, Op]]:
        """The transfers of ``ops`` (the tier's in flight) past the bound with something left
        to do (a peer to drop, or a load to settle: ``settles``), each logged; the next look is
        due a quarter of the bound later (at most ``_SCAN_S``)."""
        self.due = now + min(self.timeout_s / 4, _SCAN_S)
        bound = now - self.timeout_s
        overdue = [(t, op) for t, op in ops.items() if op.submitted <= bound and self._acts(op)]
        for _, op in overdue:
            logger.warning(
                "a %s of %d blocks %s %s is not done %g s after its post (transfer_timeout_s)%s",
                op.kind, len(op.keys), "to" if op.kind == "store" else "from", op.peer_id,
                self.timeout_s, "" if op.kind == "store" else
                ": its blocks are withheld until the transport reports it" if self.settles(op)
                else ": its load waits until the transport reports it",
            )  # fmt: skip
        return overdue

    def settles(self, op: Op) -> bool:
        """Whether ``op``, past the bound, settles now: a load not settled so yet, unless
        ``settle_loads`` is off."""
        return op.kind == "load" and self.settle_loads and not op.expired

    def _acts(self, op: Op) -> bool:
        """Whether ``op`` past the bound has a peer to drop (not orphaned) or settles now."""
        return not op.orphaned or self.settles(op)
