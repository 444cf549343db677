"""The records ``TierManager`` keeps: one per call (``Request``), per transfer (``Op``) and per
tier-owned peer registration (``Peer``; a shared host's is ``shared_host.SharedHost``).

Plain state, no locking of their own: the manager mutates them under its lock, except
``resolve``, which it calls without the lock so that a future's callbacks may call back into it.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future
from typing import Any, Literal

from torch_kv_tier.index import AnyPeer, BlockIndex
from torch_kv_tier.keys import Key
from torch_kv_tier.results import TransferResult
from torch_kv_tier.tier_threads import TierFuture


class Request:
    """One ``store``/``load`` call: its future and how many of its keys are still unsettled.

    The future is running from the start, so ``cancel()`` refuses: a transfer cannot be called
    back, and a load's future must not report done while its read may still land. It is a
    ``tier_threads.TierFuture``: a wait for it not yet done raises on the tier's threads."""

    __slots__ = ("failed", "future", "keys", "nbytes", "pending", "queued", "started")

    def __init__(self, keys: list[Key]) -> None:
        self.future: Future[TransferResult] = TierFuture()
        self.future.set_running_or_notify_cancel()
        self.keys = keys
        self.pending = len(keys)
        self.failed: dict[Key, str] = {}
        self.nbytes = 0
        self.queued = False  # in the manager's ready list (its future is resolved once)
        self.started = time.perf_counter()

    def settle(self, keys: list[Key], reason: str | None) -> None:
        self.pending -= len(keys)
        if reason is not None:
            self.failed.update(dict.fromkeys(keys, reason))

    def result(self) -> TransferResult:
        failed = self.failed
        return TransferResult(
            ok=not failed,
            keys=[k for k in self.keys if k not in failed] if failed else self.keys,
            failed=failed,
            nbytes=self.nbytes,
            seconds=time.perf_counter() - self.started,
        )


class Peer:
    """A tier-owned peer registration (``add_peer``, or a private lease) as the manager drives
    it: its transfers in flight and queued, its session, and what its slots are (they live in
    the index). A shared host is a ``shared_host.SharedHost``.

    ``verifies``: whether its loads check their digests (a private peer: the tier's
    ``verify``; a shared host always).
    """

    __slots__ = (
        "inflight",
        "lost_writes",
        "queue",
        "read",
        "session",
        "slots",
        "verifies",
        "written",
    )

    def __init__(self, slots: AnyPeer, *, verifies: bool, session: Any = None) -> None:
        self.slots = slots
        self.verifies = verifies
        self.inflight = 0  # this registration's ops submitted to the transport
        self.lost_writes = 0  # writes that failed: part of them may land any time
        self.queue: deque[Op] = deque()  # ops waiting for an in-flight slot, in order
        self.session: Any = session  # RemoteSession when the peer came from connect()
        self.written = self.read = 0  # bytes moved not yet reported to the session

    def take_slots(self, index: BlockIndex, n: int) -> list[int]:
        """Up to ``n`` slots for new keys (evicting the least recently used)."""
        return index.reserve(self.slots, n)  # type: ignore[arg-type]

    def return_slots(self, slots: list[int]) -> None:
        """Slots taken for writes that were not published (failed or discarded)."""
        self.slots.pool.free(slots)  # type: ignore[union-attr]

    def report_usage(self) -> None:
        """Hand the bytes moved since the last report to the session (if any)."""
        if self.session is not None and (self.written or self.read):
            self.session.report_usage(
                written=self.written, read=self.read, slots_used=self.slots.used
            )
        self.written = self.read = 0


class Op:
    """One transfer to one peer: keys of its owner request and of requests that joined it."""

    __slots__ = (
        "digests",
        "discarded",
        "expired",
        "joined",
        "keys",
        "kind",
        "local",
        "orphaned",
        "owner",
        "peer",
        "peer_id",
        "remote",
        "submitted",
    )

    def __init__(
        self,
        kind: Literal["store", "load"],
        peer_id: str,
        peer: Peer,
        keys: list[Key],
        local: list[int],
        remote: list[int],
        owner: Request,
        digests: list[int],
    ) -> None:
        self.kind = kind
        self.peer_id = peer_id
        self.peer = peer  # the registration this op was made for (a re-added id is another)
        self.keys = keys
        self.local = local
        self.remote = remote
        self.owner = owner
        self.digests = digests  # a store's computed digests; a load's expected ones
        self.joined: dict[Request, list[Key]] = {}
        self.discarded: set[Key] = set()
        self.submitted = 0.0
        self.orphaned = False  # its peer was dropped while the transport still holds it
        # outlived the tier's ``transfer_timeout_s``: its keys settled then (``overdue``)
        self.expired = False

    def split(self, n: int) -> Op:
        """Cut off and return the keys after the first ``n`` as an op of their own (a store
        waiting for granted slots that came only for its first ``n`` keys)."""
        tail = Op(
            self.kind,
            self.peer_id,
            self.peer,
            self.keys[n:],
            self.local[n:],
            self.remote[n:],
            self.owner,
            self.digests[n:],
        )
        del self.keys[n:], self.local[n:], self.remote[n:], self.digests[n:]
        if self.joined or self.discarded:
            moved = set(tail.keys)
            for request, keys in self.joined.items():
                tail.joined[request] = [k for k in keys if k in moved]
                self.joined[request] = [k for k in keys if k not in moved]
            tail.discarded, self.discarded = self.discarded & moved, self.discarded - moved
        return tail


def resolve(ready: list[Request]) -> None:
    """Resolve settled requests' futures (their callbacks run here: never under the lock).

    Every one of them is resolved even when something raises past ``Future``'s own handling of
    its callbacks (a ``KeyboardInterrupt`` in a callback, or as a result is built): the others'
    waiters must not wait for a future that nothing resolves. The first such exception is
    raised once all are resolved (a second one while one is resolved again ends it early)."""
    raised: BaseException | None = None
    for request in ready:
        try:
            request.future.set_result(request.result())
        except BaseException as exc:
            raised = raised or exc
            if not request.future.done():  # it landed before the result was set
                request.future.set_result(request.result())
    if raised is not None:
        raise raised


def split_new(
    index: BlockIndex,
    storing: dict[Key, Op],
    request: Request,
    keys: list[Key],
    local: list[int],
    digests: list[int],
) -> tuple[list[Key], list[int], list[int], list[Key]]:
    """Which of a store's ``keys`` need a transfer: ``(new keys, their local blocks, their
    digests, keys already stored)``. A key whose store is in flight (``storing``) joins that
    store for ``request`` instead; the stored ones are the caller's to settle."""
    if index.none_stored(keys) and storing.keys().isdisjoint(keys):
        return keys, local, digests, []
    new_keys, new_local, new_digests, stored = [], [], [], []
    for key, idx, digest, holder in zip(keys, local, digests, index.holders(keys)):
        if holder is not None:
            stored.append(key)
        elif key in storing:
            storing[key].joined.setdefault(request, []).append(key)
        else:
            new_keys.append(key)
            new_local.append(idx)
            new_digests.append(digest)
    return new_keys, new_local, new_digests, stored


def joined_peers(storing: dict[Key, Op], request: Request, keys: list[Key]) -> list[str]:
    """The peers of the stores in flight (``storing``) that ``keys`` of ``request`` joined
    (``split_new``), each once."""
    ops = (storing.get(key) for key in keys)
    return list(dict.fromkeys(op.peer_id for op in ops if op is not None and request in op.joined))
