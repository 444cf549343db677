"""``NixlTransport``: vLLM 0.33's ``DataTransport`` contract over a real NIXL agent.

Threading. ``_lock`` guards every table and every agent call that touches transfers (submit,
state checks, releases): any method may be called from any thread, one thread may submit while
another polls. Peer registration (``add_remote_agent`` plus one descriptor per remote block,
seconds for a big region) runs on a single daemon thread (``registrar``: exit waits for it at
most ``EXIT_WAIT_S``), off the caller's thread and outside ``_lock``; only its final publish
takes ``_lock``. NIXL's own locking covers that overlap: the agent runs with
``NIXL_THREAD_SYNC_RW`` and NIXL's progress thread, so its tables and its UCX backend are
multi-threaded (see ``nixl_agent.make_agent``). A passive target needs no calls at all: that
progress thread serves incoming transfers and sleeps in ``poll()`` when idle.

Registrations (``nixl_registration``, the base class adding and removing peers, over
``nixl_peers``): a removal during a registration wins, a failed re-registration leaves the
working one published.

Failure model (see ``base.py``, ``faults.py`` and ``nixl_inflight``, which owns the transfers
in flight). A transfer that stays in flight keeps its handle and, after ``remove_remote_peer``,
keeps its peer's descriptors and remote agent too: they are released when its last transfer
resolves (or by ``cancel``/``close``), so its state check stays meaningful and a re-added peer
id never shares a destination that may still be written. Every failure it reports is final
(``failures_are_final``) unless built with ``fence_failures=False``: a transfer that failed
without a disconnect is reported only once a fence proved that nothing more of it lands.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from torch_kv_tier.transport import agent_lifetime
from torch_kv_tier.transport.base import CancelMode, DataTransport, PollResult, block_indices
from torch_kv_tier.transport.faults import PeerHealth
from torch_kv_tier.transport.nixl_agent import (
    descriptors,
    load_nixl,
    make_agent,
    unavailable_reason,
)
from torch_kv_tier.transport.nixl_inflight import NixlInflight
from torch_kv_tier.transport.nixl_peers import NixlPeers
from torch_kv_tier.transport.nixl_registration import NixlRegistration
from torch_kv_tier.transport.registrar import Registrar

logger = logging.getLogger(__name__)

# How long ``close`` waits for a registration still running before it leaves the release to it.
CLOSE_REGISTRATION_WAIT_S = 5.0


class NixlTransport(NixlRegistration, DataTransport):
    """A NIXL agent with one registration over the local region and prepared block lists.

    Args:
        local_id: Human-readable prefix of the NIXL agent name; a random suffix makes the agent
            name unique, so two transports with the same ``local_id`` never collide.
        region: 2-D memoryview or contiguous 2-D ``torch.uint8`` tensor (CPU: DRAM, CUDA: VRAM).
        config_fields: model config values hashed into ``config_fingerprint``.
        backends: NIXL backends (default ``["UCX"]``).
        num_threads: NIXL's worker threads for multi-threaded backends (UCX); 0 (the default,
            unlike vLLM's 4): none. NIXL's UCX backend uses them only to split a transfer of
            1,024 blocks or more, which the tier never lets it do (``ucx_env``), yet each costs
            a thread, a UCX worker and that worker's connection to every peer.
        fence_failures: report a transfer that failed without a disconnect only once a fence
            proved that nothing more of it lands (``nixl_inflight``; ``failures_are_final`` is
            then True). False gives vLLM 0.33's failure semantics exactly (a failed post refused
            with ``None``, a state ``ERR`` failed at once), which its own test suite asserts.
        passive_progress: run NIXL's progress thread (with a delay, see ``nixl_agent``), so the
            transport serves transfers aimed at it with nothing called on it. An initiator that
            is never a target (a tier client) may pass False: it progresses its own transfers
            in ``poll``, and over TCP measured about 2x the throughput without the thread.

    Without a loadable NIXL the transport is constructed unavailable (``available`` is False)
    and every NIXL-backed method raises ``RuntimeError`` saying why (not installed, or installed
    but failing to load, with the import error) and what to do.
    """

    def __init__(
        self,
        local_id: str,
        region: memoryview | torch.Tensor,
        config_fields: dict[str, Any] | None = None,
        backends: list[str] | None = None,
        num_threads: int = 0,
        *,
        fence_failures: bool = True,
        passive_progress: bool = True,
    ) -> None:
        super().__init__(region, config_fields)
        self._local_id = local_id
        self._name = f"{local_id}-{uuid.uuid4().hex[:12]}"
        self._lock = threading.Lock()
        self._peers = NixlPeers(self._name, self.block_len, self._lock)
        self._health = PeerHealth(self._name)
        self._transfers = NixlInflight(self._name, self._peers, self._health, fence=fence_failures)
        self.failures_are_final = fence_failures
        self._closed = False
        self._registrar = Registrar(f"kv-tier-nixl-reg-{self._name}")
        self._last_registration: Future[None] | None = None  # the registrar runs them in order
        self._released = False  # close's release ran (``on_released``)
        self._on_released: list[Callable[[], None]] = []
        self._local_dlist: Any = None
        self._reg: Any = None
        api = self._nixl_api()
        if api is None:
            logger.warning("NixlTransport %s: unavailable: %s", self._name, unavailable_reason())
            return
        agent_lifetime.check_room()
        agent = make_agent(
            *api,
            self._name,
            list(backends) if backends else ["UCX"],
            num_threads,
            progress_thread=passive_progress,
        )
        self._agent = agent
        del agent  # (a raised error's frame would hold it)
        r = self.region
        try:
            self._reg = self._agent.register_memory(
                [(r.base_addr, r.nbytes, r.device_id, "")], mem_type=r.mem_type
            )
            xfer_descs = self._agent.get_xfer_descs(
                descriptors(r.base_addr, r.num_blocks, r.block_len, r.device_id),
                mem_type=r.mem_type,
            )
            self._local_dlist = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", xfer_descs)
        except BaseException:  # NIXL refused the region: release what it took, agent included
            self.close()
            raise
        logger.info(
            "NixlTransport %s: registered %d x %d B (%s, device %d)",
            self._name,
            r.num_blocks,
            r.block_len,
            r.mem_type,
            r.device_id,
        )

    @property
    def _agent(self) -> Any:
        """The NIXL agent (``None`` without NIXL or once closed); the registrations hold it."""
        return self._peers.agent

    @_agent.setter
    def _agent(self, agent: Any) -> None:
        self._peers.agent = agent

    @staticmethod
    def _nixl_api() -> tuple[Any, Any] | None:
        """``(agent class, agent config class)`` or ``None`` without NIXL (a test seam)."""
        return load_nixl()

    @staticmethod
    def is_available() -> bool:
        """True when NIXL can be loaded (a transport built now would be ``available``)."""
        return load_nixl() is not None

    @property
    def available(self) -> bool:
        """True while the transport has a NIXL agent: NIXL installed and not closed."""
        return self._agent is not None and not self._closed

    @property
    def agent_name(self) -> str:
        """The unique NIXL agent name (``local_id`` plus a random suffix)."""
        return self._name

    def get_agent_metadata(self) -> bytes:
        with self._lock:
            self._check_open()
            return bytes(self._agent.get_agent_metadata())

    # -- peers (``nixl_registration``: adding, removing, dropping) ------------------------------

    def faulted_peers(self) -> dict[str, str]:
        with self._lock:
            return dict(self._health.faults)

    # -- transfers -----------------------------------------------------------------------------

    def write_blocks(
        self, peer_id: str, local_idxs: Sequence[int], remote_idxs: Sequence[int]
    ) -> int | None:
        return self._submit("WRITE", peer_id, local_idxs, remote_idxs)

    def read_blocks(
        self, peer_id: str, local_idxs: Sequence[int], remote_idxs: Sequence[int]
    ) -> int | None:
        return self._submit("READ", peer_id, local_idxs, remote_idxs)

    def poll(self, peer_id: str | None = None) -> PollResult:
        """See ``DataTransport.poll``; ``peer_fault`` is set on a faulted peer's scoped poll.
        A state check that raises faults the peer and keeps the transfer unless the error is a
        remote disconnect (``nixl_inflight``)."""
        with self._lock:
            self._check_open()
            return self._transfers.poll(peer_id)

    def cancel(self, transfer_ids: Iterable[int], mode: CancelMode = "immediate") -> list[int]:
        """See ``DataTransport.cancel``. ``"wait"`` never releases a transfer still running
        (UCX frees a handle even while its WRITE runs) and returns its id (``nixl_inflight``)."""
        if mode not in ("immediate", "wait"):
            raise ValueError(f"cancel mode must be 'immediate' or 'wait', got {mode!r}")
        with self._lock:
            self._check_open()
            return self._transfers.cancel(transfer_ids, mode)

    def inflight_count(self) -> int:
        """Transfers submitted and not yet reported by ``poll`` (for stats and leak checks)."""
        with self._lock:
            return len(self._transfers)

    def close(self) -> None:
        """See ``DataTransport.close``. A registration still running is waited for at most
        ``CLOSE_REGISTRATION_WAIT_S`` (releasing the agent under it would free what it uses);
        past that, close returns without calling into the agent (a stuck metadata load may hold
        NIXL's lock), logs what stays held, and the release runs on the registration's thread
        once it returns. The superseded registration never publishes. A Ctrl-C as it waits
        leaves the release to the registration's thread likewise, then is raised."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._peers.supersede_all()
            last = self._last_registration
        self._registrar.shutdown()  # registrations still queued fail ("closed")
        if last is not None and not self._returned(last):
            with self._lock:
                transfers = len(self._transfers)
            logger.warning(
                "NixlTransport %s: closed with a peer registration still running after %g s "
                "(NIXL's add_remote_agent or prep_xfer_dlist did not return): its agent, memory "
                "registration, peers and %d transfers in flight are released once it returns",
                self._name,
                CLOSE_REGISTRATION_WAIT_S,
                transfers,
            )
            return
        self._release_agent()

    def _returned(self, last: Future[None]) -> bool:
        """``close``'s wait for the last registration: whether it returned within
        ``CLOSE_REGISTRATION_WAIT_S``. When not, or when a Ctrl-C cuts the wait short (then
        raised), the release is left to it: it runs once the registration returns."""
        returned = False
        try:
            returned = not wait_futures([last], CLOSE_REGISTRATION_WAIT_S).not_done
        finally:
            if not returned:
                last.add_done_callback(lambda _: self._release_agent())
        return returned

    def on_released(self, callback: Callable[[], None]) -> None:
        """See ``DataTransport.on_released``: at once when close released the agent, else when
        it does (on the thread of the registration that held it up). Never when the agent is
        kept until the process exits (``agent_lifetime``) and a transfer was released before it
        was seen over (cancelled, or in flight at close): its UCX worker lives on, and may still
        write that transfer into the region; a warning says so."""
        with self._lock:
            if not self._released:
                self._on_released.append(callback)
                return
            quiet = self._transfers.quiet
        if not quiet:
            self._withhold(1)
            return
        callback()

    def _release_agent(self) -> None:
        """Release every transfer, peer and registration, then the agent (close's second half,
        run once no registration uses the agent), then run the ``on_released`` callbacks
        (unless nothing proves the region quiet: ``on_released``)."""
        with self._lock:
            callbacks, self._on_released = self._on_released, []
            self._released = True
            if self._agent is not None:
                self._release_nixl()
            quiet = self._transfers.quiet
        if not quiet:
            if callbacks:
                self._withhold(len(callbacks))
            return
        for callback in callbacks:
            try:
                callback()
            except Exception:
                logger.exception("NixlTransport %s: an on_released callback raised", self._name)

    def _withhold(self, callbacks: int) -> None:
        """Say that ``callbacks`` ``on_released`` callbacks never run (``on_released``)."""
        logger.warning(
            "NixlTransport %s: closed with transfers released while they may still run, on a "
            "NIXL agent kept until the process exits (a post to a peer that disconnected, see "
            "agent_lifetime): its UCX worker may still write them into the region, so %d release "
            "callback(s) never run (the loads cancelled at close stay unresolved, the region "
            "stays mapped); restart the process to reclaim them",
            self._name,
            callbacks,
        )

    def _release_nixl(self) -> None:
        """Release what the agent holds, then the agent (the caller holds ``_lock``)."""
        self._transfers.release_all()
        self._peers.remove_all()
        for what, handle, step in (
            ("local descriptor list", self._local_dlist, self._agent.release_dlist_handle),
            ("memory registration", self._reg, self._agent.deregister_memory),
        ):
            if handle is None:  # (a start that NIXL refused made none)
                continue
            try:
                step(handle)
            except Exception as exc:
                logger.warning("NixlTransport %s: releasing %s failed: %s", self._name, what, exc)
        # Every handle wrapper references the agent, released or not: drop them all, so the
        # agent is destroyed here, on this thread, not later by the collector.
        self._local_dlist = self._reg = None
        self._agent = None
        logger.info("NixlTransport %s: closed", self._name)

    # -- internals -----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"NixlTransport {self._name} is closed")
        if self._agent is None:
            raise RuntimeError(f"NixlTransport {self._name} is unavailable: {unavailable_reason()}")

    def _submit(
        self, op: str, peer_id: str, local_idxs: Sequence[int], remote_idxs: Sequence[int]
    ) -> int | None:
        local = block_indices(local_idxs, self.num_blocks, "local")
        if len(local) != len(remote_idxs):
            raise ValueError(
                f"{len(local)} local indices but {len(remote_idxs)} remote indices: "
                "they must pair up one to one"
            )
        if len(local) == 0:
            raise ValueError("no blocks to transfer: pass at least one index pair")
        with self._lock:
            self._check_open()
            peer = self._peers.get(peer_id)
            if peer is None:
                logger.warning("NixlTransport %s: %s to unknown peer %r", self._name, op, peer_id)
                return None
            remote = block_indices(remote_idxs, peer.num_blocks, "remote")
            dest = remote if op == "WRITE" else local
            if len(set(dest)) != len(dest):
                raise ValueError(f"{op} destination indices repeat: each block may be written once")
            return self._transfers.post(op, self._local_dlist, local, peer, remote)
