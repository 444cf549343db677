"""What a ``RemoteHostTier`` owns: its view of vLLM's primary region, the ``TierManager`` (and
with it the NIXL registration) over that region, the remote hosts it joined at startup and the
membership thread that dials the rest; built together, released in order.

Threading: built and closed on the thread that builds or shuts down the tier (vLLM's), except
that the view of the primary region may be released later on NIXL's registration thread
(``close``); the membership thread is its own (``membership``). The startup connects run side
by side, one thread per host (``parallel_connects``), joined before the constructor returns (a
failed startup waits ``close_timeout_s`` at most for them, after closing the manager).

Failure model: a host not ready at startup (it does not answer: about one ``connect_timeout_s``,
however many do not; or it refuses for now, at its ``--max-sessions`` or with no free slot) is
left to the membership thread when reconnecting is on; any other startup failure (a refusal of
this client: token, block length, namespace) raises ``RuntimeError`` with what to check, after
everything built so far is released. Closing
never leaves NIXL able to write into memory vLLM unmapped: the primary region stays mapped until
the transport released its agent, and for good when the manager fails to close.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from torch_kv_tier.arena import BlockArena
from torch_kv_tier.integrations.vllm.tier_config import (
    RemoteHostTierConfig,
    default_config_fields,
)
from torch_kv_tier.manager import TierManager
from torch_kv_tier.membership import Membership, first_hosts
from torch_kv_tier.parallel_connects import ParallelConnects
from torch_kv_tier.remote.handshake_errors import not_ready
from torch_kv_tier.transport import NixlTransport

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec

logger = logging.getLogger(__name__)

_MIN_CLOSE_S = 0.5  # the least each of the manager and the membership thread gets to close


class TierResources:
    """The primary region's view, the ``TierManager`` over it, and the hosts it follows.

    Raises ``ValueError`` for a bad ``primary_kv_view`` (nothing is built then), and
    ``RuntimeError`` when a remote host refused this client at startup, or was not ready with
    reconnecting off (everything built is released first).
    """

    def __init__(
        self,
        primary_kv_view: memoryview,
        spec: OffloadingSpec,
        config: RemoteHostTierConfig,
        agent_name: str,
        *,
        block_bytes: int,
        events: bool,
    ) -> None:
        self._config = config
        self._block_bytes = block_bytes
        self._flat_view: memoryview | None
        self._flat_view, region = adopt_primary_view(primary_kv_view)
        self.manager: TierManager | None = None
        self._membership: Membership | None = None
        connects: ParallelConnects | None = None
        try:
            self.manager = _build_manager(region, spec, config, agent_name, events)
            connects = ParallelConnects(
                self.manager, first_hosts(config.source), config.connect_kwargs()
            )
            peers = {address: self._joined(address, got) for address, got in connects.outcomes()}
            if config.reconnect_interval_s > 0:
                self._membership = Membership(
                    self.manager,
                    config.source,
                    interval_s=config.reconnect_interval_s,
                    connect_kwargs=config.connect_kwargs(),
                    known=peers,
                )
                self._membership.start()
        except BaseException:
            self.close()  # first: closing the manager ends the handshakes still under way
            raise
        finally:
            if connects is not None:
                connects.join(timeout=config.close_timeout_s)

    def _joined(self, address: str, outcome: str | Exception) -> str | None:
        """The peer id of ``address``, joined at startup (``outcome``: its connect's peer id or
        exception; the hosts are dialled side by side, and judged in the order listed).

        A host not ready (``handshake_errors.not_ready``, as ``connect(...,
        redial_if_down=True)`` judges it: it does not answer, is lost while it joins, or
        refuses for now, e.g. at its ``--max-sessions`` or with no free slot) is left to the
        membership thread when there is one: vLLM starts without it and gains it once it can
        serve (``None``). Any other failure, and a host not ready when reconnecting is off,
        raises with what the user should check (a host that refuses this client, say for its
        token or block length, is misconfigured, not down).
        """
        if isinstance(outcome, str):
            return outcome
        if not not_ready(outcome) or self._config.reconnect_interval_s <= 0:
            raise self._startup_error(address, outcome) from outcome
        logger.warning(
            "RemoteHostTier: remote host %s is not ready at startup (%s); starting "
            "without it and dialling it every %.1fs",
            address,
            outcome,
            self._config.reconnect_interval_s,
        )
        return None

    def _startup_error(self, address: str, exc: Exception) -> RuntimeError:
        """What a user must check when ``address`` cannot be used at startup."""
        if not_ready(exc):  # (reconnecting is off)
            check = (
                "Start it (or free its sessions or slots), or set reconnect_interval_s > 0 "
                "for vLLM to start without it and dial it until it can serve."
            )
        else:
            n = self._block_bytes
            check = (
                f"The host must run `torch-kv-tier serve --block-len {n} ...` (vLLM's chunk "
                f"size here is {n} bytes), be reachable from this host, and agree with this "
                "tier's token_file and config_fields."
            )
        return RuntimeError(
            f"RemoteHostTier could not connect to remote host {address}: {exc}\n{check}"
        )

    def close(self) -> None:
        """Close the tier manager (and with it the NIXL registration), stop the membership
        thread, then release the view of the primary region so vLLM can unmap it; within
        ``close_timeout_s``. Idempotent.

        The manager goes first: closing it ends a handshake in progress on any thread (a host
        that does not answer would hold one for ``connect_timeout_s``, 10 s, past vLLM's 5 s
        shutdown grace), and the membership thread, finding it closed, ends. The view is what
        keeps vLLM's shared memory mapped (the tensor over it does not pin it), so it is
        released only once nothing can transfer into that memory any more: when the transport
        reports it released its agent (``on_released``: at once, or later, on NIXL's
        registration thread, when a registration stuck past the close still holds it); if
        closing fails, or NIXL's agent outlives it with transfers it may still run
        (``agent_lifetime``), never, rather than let the NIC write into freed memory.
        """
        deadline = time.monotonic() + self._config.close_timeout_s
        manager, self.manager = self.manager, None
        membership, self._membership = self._membership, None
        try:
            if manager is not None:
                manager.close(timeout=max(deadline - time.monotonic(), _MIN_CLOSE_S))
        except Exception:
            logger.exception(
                "RemoteHostTier: closing the tier manager failed; keeping vLLM's primary "
                "region mapped since NIXL may still have it registered"
            )
            return
        finally:
            if membership is not None:
                membership.stop(timeout=max(deadline - time.monotonic(), _MIN_CLOSE_S))
        flat, self._flat_view = self._flat_view, None
        if flat is None:
            return
        if manager is None:
            flat.release()
        else:  # at once, or later on NIXL's thread when a stuck registration holds the agent
            manager.transport.on_released(flat.release)


def _build_manager(
    region: torch.Tensor,
    spec: OffloadingSpec,
    config: RemoteHostTierConfig,
    agent_name: str,
    events: bool,
) -> TierManager:
    """Register vLLM's primary region with NIXL (no copy) and wrap it in a TierManager."""
    fields = config.config_fields
    transport = NixlTransport(
        agent_name,
        region,
        default_config_fields(spec, region.shape[1]) if fields is None else fields,
        backends=list(config.backends) if config.backends else None,
        num_threads=config.num_threads,
        passive_progress=False,  # an initiator only: the tier's poller progresses it
    )
    try:
        return TierManager(
            BlockArena.wrap(region),
            transport,
            max_inflight=config.max_inflight,
            events=events,
            # a load past the bound waits for its read (``overdue``): vLLM hands a failed job's
            # chunks to other requests at once, and a late read could still land in them
            transfer_timeout_s=config.transfer_timeout_s,
            settle_late_loads=False,
        )
    except BaseException:
        transport.close()
        raise


def adopt_primary_view(view: memoryview) -> tuple[memoryview, torch.Tensor]:
    """A flat byte view of vLLM's primary region and a ``uint8 [rows, row_bytes]`` tensor over
    it, sharing its memory (no copy).

    The view keeps vLLM's mapping alive; the tensor does not (``torch.frombuffer`` holds no
    buffer export), so release the view only after the tensor's last user is gone.
    """
    if view.ndim != 2 or not view.shape or not view.strides:
        raise ValueError(f"primary_kv_view must be 2-D (num_chunks x chunk_bytes), got {view!r}")
    if view.itemsize != 1 or not view.c_contiguous or view.readonly:
        raise ValueError(
            "primary_kv_view must be a writable, C-contiguous byte region "
            f"(format {view.format!r}, c_contiguous={view.c_contiguous}, "
            f"readonly={view.readonly})"
        )
    rows, row_bytes = view.shape
    flat = view.cast("B")
    tensor = torch.frombuffer(flat, dtype=torch.uint8).view(rows, row_bytes)
    return flat, tensor


__all__ = ["TierResources", "adopt_primary_view"]
