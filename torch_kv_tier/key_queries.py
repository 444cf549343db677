"""The calls that ask about keys, or change how they are kept, without moving a block:
``lookup``, ``contains``, ``holders``, ``prefetch``, ``touch`` and ``discard``.

``KeyQueries`` is a part of ``TierManager`` (a base class, beside ``Closing``, ``Transfers``,
``SharedHosts`` and ``ConnectedHosts``). Each call checks its keys before taking the lock
(``keys.plain_keys``: ``TypeError`` for one key in place of keys, a bool or another non-key,
as ``store`` refuses them), then answers from the index under the manager's lock; none waits
on the network.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from torch_kv_tier.deferring_lock import DeferringLock
from torch_kv_tier.index import BlockIndex
from torch_kv_tier.keys import Key, plain_key, plain_keys
from torch_kv_tier.records import Op

if TYPE_CHECKING:
    from torch_kv_tier.shared_host import SharedHost
    from torch_kv_tier.slot_maps import SharedSlots


class KeyQueries:
    """``TierManager``'s calls on keys that move no block (module docstring)."""

    # The manager's state this part uses (set by ``TierManager.__init__``).
    _lock: DeferringLock
    _index: BlockIndex
    _storing: dict[Key, Op]

    if TYPE_CHECKING:  # implemented by SharedHosts

        def _touch_shared(self, groups: dict[SharedSlots, list[Key]]) -> None: ...
        def _promote(self, keys: list[Key]) -> dict[SharedHost, list[Key]]: ...

    def lookup(self, keys: Sequence[Key]) -> int:
        """How many leading ``keys`` are stored (the prefix a scheduler can load), counting
        keys a host holds on its disk (``load`` promotes them first). Like every call taking
        keys, raises ``TypeError`` for one key passed in place of them or a bool, as ``store``
        does (``keys.plain_keys``)."""
        keys = plain_keys(keys, ordered=True)
        with self._lock:
            return self._index.lookup(keys)

    def contains(self, key: Key) -> bool:
        """Whether ``key`` is stored in a peer's memory (ready to read at once)."""
        key = plain_key(key)
        with self._lock:
            return self._index.holder(key) is not None

    def holders(self, keys: Sequence[Key]) -> list[str | None]:
        """The peer id each of ``keys`` is read from now: the peer holding it in memory, else
        the host holding it on its disk only (``load`` promotes it there first); ``None``: in
        neither."""
        keys = plain_keys(keys, ordered=True)
        with self._lock:
            ids = [None if p is None else p.peer_id for p in self._index.holders(keys)]
            if None in ids and self._index.has_disk_keys():
                for host, positions in self._index.on_disk(keys).items():
                    for i in positions:
                        ids[i] = ids[i] or host.peer_id
            return ids

    def prefetch(self, keys: Iterable[Key]) -> int:
        """Ask the hosts holding any of ``keys`` on their disk to bring them into DRAM (no
        wait); returns how many of ``keys`` are on a disk with their promotion awaited (a key
        the host did not promote within ``promotion_timeout_s`` is not counted)."""
        keys = plain_keys(keys, ordered=False)
        with self._lock:
            if not self._index.has_disk_keys():
                return 0
            return sum(map(len, self._promote(list(keys)).values()))

    def touch(self, keys: Iterable[Key]) -> None:
        """Mark stored ``keys`` as recently used, so a full peer evicts them last (unknown keys
        are ignored)."""
        keys = plain_keys(keys, ordered=False)
        with self._lock:
            self._touch_shared(self._index.touch(keys))

    def discard(self, keys: Iterable[Key]) -> None:
        """Forget ``keys`` (unknown ones are ignored); a store in flight will not publish them."""
        keys = plain_keys(keys, ordered=False)  # a sequence: walked twice
        with self._lock:
            for key in keys:
                op = self._storing.pop(key, None)  # a later store of key starts afresh
                if op is not None:
                    op.discarded.add(key)
            self._index.discard(keys)
