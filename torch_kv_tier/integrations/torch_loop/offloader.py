"""Offload pages of a paged KV cache to a torch_kv_tier tier and restore prefixes from it.

A custom PyTorch inference loop keeps, per layer, a key and a value page pool shaped
``[num_pages, page_size, heads, head_dim]``. :class:`PagedKVOffloader` packs one page of *every*
layer (keys and values) into one tier block, laid out as ``[layers, 2, page_size, heads,
head_dim]``, stores it under a caller-chosen key (see
:func:`~torch_kv_tier.integrations.torch_loop.keys.prefix_keys`), and scatters stored blocks back
into any pages of the cache later, in this or another process.

Data path: cache pages -> arena slots (one vectorized gather per layer, :mod:`.page_copy`) ->
remote host (NIXL), and back; an offload or restore larger than the arena goes in batches
(:mod:`.arena_batches`), an offload's reported as one future (:mod:`.offload_results`);
:meth:`~PagedKVOffloader.create` (:mod:`.offloader_create`) builds the tier as well. The
arena is the tier's registered memory: on the cache's device (``staging="device"``: a CUDA arena
registered as VRAM, GPUDirect where the NIC allows) or in host memory (``staging="host"``:
pinned when CUDA is present, the cache pages copied through it).

Failure policy: a missing or failed remote never raises from :meth:`~PagedKVOffloader.offload` or
:meth:`~PagedKVOffloader.restore` unless ``strict=True``; offloads report failed keys in their
result and restores return how many pages actually came back (0 means: recompute). Bad arguments
always raise ``ValueError`` before any memory or network is touched.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Literal

import torch

from torch_kv_tier.integrations.torch_loop import offloader_create
from torch_kv_tier.integrations.torch_loop.arena_batches import ArenaBatches
from torch_kv_tier.integrations.torch_loop.offload_results import OffloadError, combine
from torch_kv_tier.integrations.torch_loop.offloader_args import (
    check_caches,
    check_pages,
    check_wait,
    connect_kwargs,
    unavailable,
)
from torch_kv_tier.integrations.torch_loop.page_copy import PageCopier
from torch_kv_tier.keys import Key, check_keys
from torch_kv_tier.manager import TierManager
from torch_kv_tier.remote.quantities import flag, seconds
from torch_kv_tier.results import TransferResult
from torch_kv_tier.tier_threads import on_tier_thread, refused

__all__ = ["OffloadError", "PagedKVOffloader", "Staging"]

log = logging.getLogger(__name__)

Staging = Literal["device", "host"]


class PagedKVOffloader:
    """Moves whole pages (all layers, keys and values) between a paged KV cache and a tier.

    Ownership: the offloader holds references to the cache tensors and reads/writes them only
    inside :meth:`offload` and :meth:`restore`. It uses the arena slots of ``manager`` through
    ``arena.allocate``/``arena.free``, so it must be the arena's only user. It closes ``manager``
    in :meth:`close` only when ``owns_manager`` is true (as with :meth:`create`).

    Threading: call :meth:`connect`, :meth:`offload`, :meth:`restore`, :meth:`flush` and
    :meth:`close` from one thread (the generation loop): ``connect`` may resolve transfers'
    futures on it, and a Ctrl-C there marks the batches' state of that thread to heal. Store
    completions run on the tier's background thread and only return arena slots and retire
    pending offloads (:class:`.ArenaBatches` guards both), as does the tier's word that a
    timed-out read's slots are no longer withheld (``TierManager.withheld_until``).
    """

    def __init__(
        self,
        key_caches: Sequence[torch.Tensor],
        value_caches: Sequence[torch.Tensor],
        manager: TierManager,
        *,
        owns_manager: bool = False,
        timeout: float = 30.0,
        strict: bool = False,
        reconnect_interval_s: float = 5.0,
    ) -> None:
        """Wrap ``manager``, whose arena's ``block_len`` must equal :meth:`block_len_for`.

        ``timeout`` bounds each call's waits in all (a restore's loads, an offload's waits for
        free arena slots, a flush): a finite number of seconds > 0. A host that does not answer
        :meth:`connect` is dialled again by the tier until it joins (``TierManager.connect``'s
        ``redial_if_down``, every 0.5 s doubling to 10 s) unless ``strict`` or
        ``reconnect_interval_s`` is 0; any other value of it only turns that on. Raises
        ``ValueError`` if the caches disagree in shape, dtype or device, do not match the
        arena's block length, or for another ``timeout`` or a negative interval (``TypeError``
        for one that is no int or float, numpy's too: ``quantities.seconds``, and for a
        ``strict`` or ``owns_manager`` that is no ``bool``: ``quantities.flag``).
        """
        self.block_len = self.block_len_for(key_caches, value_caches)
        if manager.arena.block_len != self.block_len:
            raise ValueError(
                f"the tier's arena has block_len {manager.arena.block_len}, but one page of these "
                f"caches across all layers is {self.block_len} bytes: build the tier with "
                "PagedKVOffloader.block_len_for(keys, values)"
            )
        timeout = seconds("timeout", timeout)
        reconnect_interval_s = seconds("reconnect_interval_s", reconnect_interval_s, zero=True)
        flag("strict", strict)
        flag("owns_manager", owns_manager)
        self.key_caches = list(key_caches)
        self.value_caches = list(value_caches)
        self.manager = manager
        self.timeout = timeout
        self.strict = strict
        self._owns_manager = owns_manager
        num_pages, page_size, heads, head_dim = self.key_caches[0].shape
        self.num_pages = num_pages
        self.dtype = self.key_caches[0].dtype
        self.device = self.key_caches[0].device
        self._blocks = manager.arena.view(
            self.dtype, len(self.key_caches), 2, page_size, heads, head_dim
        )
        self._pages = PageCopier(self.key_caches, self.value_caches, self._blocks)
        self._batches = ArenaBatches(manager, self._pages, timeout)
        self._redial = reconnect_interval_s > 0 and not strict  # connect's redial_if_down
        self._dialled: set[str] = set()  # addresses the tier dials for this offloader
        self._dial_owner = object()  # its requests of those dials (``cancel_dial``)
        self._closed = False

    @staticmethod
    def block_len_for(
        key_caches: Sequence[torch.Tensor], value_caches: Sequence[torch.Tensor]
    ) -> int:
        """Bytes of one tier block: ``layers * 2 * page_size * heads * head_dim * itemsize``.

        Raises ``ValueError`` unless the caches are equally many, all 4-D
        ``[num_pages, page_size, heads, head_dim]`` of one shape, floating dtype and device.
        """
        first = check_caches(key_caches, value_caches)
        return len(key_caches) * 2 * first[0].numel() * first.element_size()

    create = classmethod(offloader_create.create)  # the factory: see its module

    def connect(
        self,
        address: str,
        *,
        token: str | None = None,
        private: bool = False,
        slots: int | None = None,
        connect_timeout: float | None = None,
    ) -> str:
        """Connect the tier to a remote host's shared pool (or, ``private``, lease ``slots`` of
        it); returns its peer id, or ``""`` if it failed.

        The handshake waits at most ``connect_timeout`` seconds for the host's answer (so does
        each later re-dial of it, should the host be lost); ``None``: the offloader's
        ``timeout``, but at most the tier's default (``CONNECT_TIMEOUT_S``, 10 s), so that a
        host that is down delays startup no longer than the tier alone would, and at least the
        handshake's floor (0.1 s, ``quantities.CONNECT_TIMEOUT``).

        Failure is logged and swallowed unless ``strict`` (then ``OffloadError``); a host that
        does not answer (down, or not started yet) or is lost while joining is then dialled
        again in the background by the tier until it joins (and whenever the tier loses it
        after), unless ``reconnect_interval_s`` is 0, until :meth:`close`.
        Arguments no host could accept (an address not ``HOST:PORT``, ``slots`` without
        ``private`` or not > 0, an empty ``token``, a ``connect_timeout`` not a finite number
        of at least 0.1 s) raise ``ValueError`` instead; ``RuntimeError`` once closed.
        """
        self._check_open("connect")
        kwargs = connect_kwargs(
            [address],
            self.timeout,
            connect_timeout,
            token=token,
            private=private,
            slots=slots,
            redial_if_down=self._redial,
            dial_owner=self._dial_owner,
        )
        try:
            return self.manager.connect(address, **kwargs)
        except Exception as exc:
            self._unavailable(address, exc)
            return ""
        except BaseException:  # Ctrl-C: it may have stopped the callbacks the tier ran here
            self._batches.interrupted()
            raise

    def lookup(self, keys: Sequence[Key]) -> int:
        """Number of leading ``keys`` stored in the tier (0 if the tier cannot answer).

        ``keys`` are checked as :meth:`restore` checks them: ``TypeError`` for a non-key,
        ``ValueError`` for a repeat or a key out of the limits; ``RuntimeError`` once closed.
        """
        self._check_open("lookup")
        return self._lookup(check_keys(keys))

    def offload(self, page_ids: Sequence[int], keys: Sequence[Key]) -> Future[TransferResult]:
        """Copy pages ``page_ids`` (all layers) into arena slots and store them under ``keys``.

        The pages are copied before this returns, so the caller may overwrite or free them at
        once; the network transfer continues in the background. Returns a future (wait on it
        with ``.result(timeout)``, or call :meth:`flush`) whose result lists, in call order,
        every key that is now stored: keys already in the tier are not copied or sent again.
        ``keys`` must be distinct (``ValueError``), bytes, str or int (``TypeError``).
        Its ``failed`` maps the other keys to a reason ("no peers", "peer lost", "capacity",
        ...). Non-strict, the future never raises; with ``strict`` it raises ``OffloadError``
        when any key failed; it cannot be cancelled (``cancel()`` returns ``False``). Raises
        ``ValueError`` for bad arguments.

        An offload larger than the arena waits for slots its earlier batches hold, ``timeout`` in
        all: pages that find no free slot by then fail with "capacity" at once (on a tier's
        thread, a done-callback, ``RuntimeError`` instead of that wait). With several
        hosts, the stores under way to one host hold at most half the arena (at least one
        slot; less while other hosts hold slots past the timeout), and the pages of a host
        with a store or read under way for longer than ``timeout`` fail at once with "host
        overdue" until it ends, so that a frozen host cannot take the slots the other hosts'
        pages need. A host that joins or leaves meanwhile takes effect from the next batch.

        An offload stopped part-way, after it handed some batches to the tier (on a tier's
        thread, a later batch would wait for slots; a later batch's copy out of the cache
        failed), raises ``OffloadError`` naming the pages it handed over (their stores go on:
        :meth:`flush` waits for them, :meth:`lookup` tells which are stored) and those it did
        not, or whose batch failed at once (no slots in time, an overdue host, the tier's
        refusal): offload them again; the failure is its ``__cause__``. Stopped before it
        handed any, it raises that failure as it is.
        """
        self._check_open("offload")
        keys, pages = check_pages(keys, page_ids, self.num_pages, "offload")
        started = time.perf_counter()
        deadline = time.monotonic() + self.timeout
        todo = {key: page for key, page in zip(keys, pages, strict=True) if not self._contains(key)}
        combined = combine(
            keys, self._batches.store_all(todo, deadline), started, strict=self.strict
        )
        self._batches.track(combined)  # flush() waits for what the caller holds too
        return combined

    def restore(self, keys: Sequence[Key], page_ids: Sequence[int]) -> int:
        """Bring back the longest stored prefix of ``keys`` into ``page_ids``; return its length.

        Page ``page_ids[i]`` receives the block stored under ``keys[i]`` for ``i`` below the
        returned count; later pages are untouched. A missing, slow (over ``timeout``) or failed
        remote shortens the prefix, down to 0, instead of raising (``strict`` raises
        ``OffloadError`` when a key that ``lookup`` reported stored fails to load); a host
        with a read or store under way for longer than ``timeout`` is not read from again
        until it ends (its keys end the prefix at once), and with several hosts holds
        meanwhile at most half the arena slots that other such hosts leave (at least one
        slot). Raises ``ValueError`` for bad arguments; on a tier's thread (a done-callback),
        ``RuntimeError`` instead of waiting for slots or for its reads.
        A failed copy into the cache (out of memory, say) raises ``OffloadError`` in either
        mode, naming the pages written before it and those it may have partly written.
        """
        self._check_open("restore")
        keys, pages = check_pages(keys, page_ids, self.num_pages, "restore", distinct=True)
        wanted = self._lookup(keys)
        restored = self._batches.load_prefix(
            keys[:wanted], pages[:wanted], time.monotonic() + self.timeout
        )
        if self.strict and restored < wanted:
            raise OffloadError(
                f"only {restored} of {wanted} stored pages could be restored (into "
                f"page_ids[0:{restored}]; the later pages are untouched)"
            )
        return restored

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every offload so far has completed (the futures :meth:`offload` returned
        are done); ``False`` if ``timeout`` ran out. ``TypeError``/``ValueError`` unless
        ``timeout`` is a number of seconds >= 0 (or ``None``: the offloader's ``timeout``).
        On a tier's thread (a done-callback), ``RuntimeError`` at once instead of a wait."""
        timeout = check_wait(timeout)
        return self._batches.wait_idle(
            time.monotonic() + (self.timeout if timeout is None else timeout)
        )

    def close(self, timeout: float | None = None) -> None:
        """Wait for pending offloads, then close an owned tier (even when the wait is
        interrupted) with what is left of ``timeout``: the whole close is bounded by it (checked
        as :meth:`flush` checks it; ``None``: the offloader's ``timeout``). A tier it does not
        own stops dialling the hosts this offloader's connects left to it (``cancel_dial`` of
        its own requests: one the user asked for too is still dialled; those that joined stay).
        Idempotent. On a tier's thread (a done-callback), ``RuntimeError`` at once, the
        offloader left open, while offloads are pending (``flush``)."""
        timeout = check_wait(timeout)  # before anything: a refused call leaves the offloader open
        if self._closed:
            return
        if on_tier_thread() and not self.flush(0.0):  # refused before anything closes
            raise refused("PagedKVOffloader.close() with offloads pending")
        self._closed = True
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        try:
            if not self.flush(timeout):
                log.warning("closing with offloads still in flight; they may not be stored")
        finally:
            if self._owns_manager:  # closing the tier ends its dials, and a handshake under way
                self.manager.close(timeout=max(deadline - time.monotonic(), 0.0))
            for address in self._dialled:  # the user's tier: it stops what it dials for us
                self.manager.cancel_dial(address, self._dial_owner)

    def __enter__(self) -> PagedKVOffloader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------------

    def _unavailable(self, address: str, exc: Exception) -> None:
        """``address`` failed to connect (``offloader_args.unavailable``); one the tier dials
        for this offloader is remembered, for ``close`` to stop."""
        if unavailable(address, exc, strict=self.strict, redialled=self._redial):
            self._dialled.add(address)

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"{what} on a closed PagedKVOffloader")

    def _contains(self, key: Key) -> bool:
        try:
            return self.manager.contains(key)
        except Exception:  # the store below reports the tier's failure per key
            return False

    def _lookup(self, keys: list[Key]) -> int:
        try:
            return self.manager.lookup(keys)
        except Exception as exc:
            if self.strict:
                raise OffloadError(f"tier lookup failed: {exc}") from exc
            log.warning("tier lookup failed, treating as a miss: %s", exc)
            return 0
