"""The reads that may still land in local blocks their loads no longer guard: those blocks are
*withheld*, refused to loads and stores (``WithheldReads.refuse``), so that a stray read never
overwrites a later load's verified bytes, nor a store's (which would publish them under its
digest). Two kinds:

- *stranded*: a read that failed (or was refused once sent) on a transport whose failures are
  not final (``Transfers._stranded``): part of it may land, whenever, and nothing will say when
  it no longer can; its load settles only when the tier closes (``stats().stranded_reads``).
- *late*: a read past ``transfer_timeout_s`` whose load settled "timed out" then (``overdue``):
  withheld until the transport reports it (``stats().late_reads``).

Both end when the transport releases every transfer (the tier closed). Every such read withholds
blocks of its own, so there are never more of them than local blocks. A caller that must know
when some blocks are no longer withheld asks once (``until_free``) and is told then
(``cleared``, whose futures the manager resolves outside its lock).

Threading: no lock of its own; the manager's lock guards it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch_kv_tier.records import Request

if TYPE_CHECKING:
    from torch_kv_tier.records import Op


class WithheldReads:
    """The stranded and late reads of a tier (module docstring)."""

    def __init__(self) -> None:
        self.stranded: list[Op] = []  # failed loads that may still land: settled at close
        self._late: dict[int, Op] = {}  # transfer id -> settled load the transport still holds
        self._waiting: list[tuple[list[int], Request]] = []  # blocks asked about, withheld then
        self._cleared: list[Request] = []  # those no longer withheld: to resolve, unlocked

    @property
    def late(self) -> int:
        """How many settled loads' reads the transport still holds (``stats().late_reads``)."""
        return len(self._late)

    def strand(self, op: Op) -> None:
        """Withhold the blocks of failed load ``op`` until the tier closes (``released``)."""
        self.stranded.append(op)

    def hold_late(self, tid: int, op: Op) -> None:
        """Withhold the local blocks of settled load ``op`` until transfer ``tid`` is reported."""
        self._late[tid] = op

    def reported(self, tid: int) -> None:
        """The transport reported transfer ``tid``: nothing more of it lands."""
        if self._late.pop(tid, None) is not None and self._waiting:
            withheld = self._blocks()
            waiting, self._waiting = self._waiting, []
            for local, request in waiting:
                if withheld.isdisjoint(local):
                    self._cleared.append(request)
                else:
                    self._waiting.append((local, request))

    def released(self) -> list[Op]:
        """The transport released every transfer (the tier closed): nothing more lands. Returns
        the stranded loads, for the caller to settle."""
        self._late.clear()
        self._cleared.extend(request for _, request in self._waiting)
        self._waiting = []
        stranded, self.stranded = self.stranded, []
        return stranded

    def until_free(self, local: list[int]) -> Request | None:
        """A request (no keys) that :meth:`cleared` hands out once no stranded or late read
        may write any of ``local`` any more; ``None`` if none may now (one pass over the
        withheld reads' blocks: per call, not per block asked about)."""
        if self._blocks().isdisjoint(local):
            return None
        request = Request([])
        self._waiting.append((local, request))
        return request

    def cleared(self) -> list[Request]:
        """The requests of :meth:`until_free` whose blocks are no longer withheld, each once:
        for the caller to resolve without the lock (their callbacks may call the tier)."""
        cleared, self._cleared = self._cleared, []
        return cleared

    def _blocks(self) -> set[int]:
        return {i for op in [*self.stranded, *self._late.values()] for i in op.local}

    def refuse(self, local: list[int], use: str) -> None:
        """Raise ``ValueError`` when a load would read into (``use`` "load into") or a store copy
        from ("store from") a local block that a stranded or late read may still write."""
        withheld = sorted(self._blocks().intersection(local))
        if withheld:
            raise ValueError(
                f"local blocks {withheld[:8]} are still the target of a read that failed or "
                "timed out and may still land (stats().stranded_reads, stats().late_reads): "
                f"{use} other blocks; these are released when the transport reports that read "
                "or the tier closes"
            )
