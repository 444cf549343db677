"""NIXL agents that UCX cannot safely destroy are kept alive until the process exits.

Why: when a transfer is posted to a peer on the same host that has just died, NIXL (1.5.1, UCX
backend) reports ``postXferReq: remote agent ... was disconnected after transfer request
creation`` and frees its side of the request while UCX still holds the operation: the request
stays queued on the shared-memory (CMA) endpoint. Destroying that agent later destroys its UCX
worker, which prints ``... was not returned to mpool ucp_requests`` every time and, now and then,
aborts the whole process with ``arbiter.c:36 Assertion 'ucs_arbiter_group_is_empty(group)'
failed`` (``uct_cma_ep_t_delete <- ucp_worker_destroy <- nixlAgentData::~nixlAgentData``). This
is an upstream NIXL bug; the only safe thing to do with such an agent is never to destroy it.

Policy: ``NixlTransport`` marks its agent unsafe when a post fails with a remote disconnect after
the request was created (see :func:`is_post_disconnect`), whatever the UCX transport (we cannot
tell from Python which one UCX picked; over TCP this keeps an agent that could have been freed,
which costs memory, never correctness) and hands it to :func:`keep_until_exit` at once, so it holds
whether or not the transport is ever closed: the agent's reference count is raised once more, so
neither ``close()``, the collector nor interpreter shutdown ever destroys it (the process exits
without running its destructor; agents merely held in a module-level list were destroyed at
interpreter shutdown and aborted there too, 1 run in 3). Every other agent is destroyed by
``close()``. A kept agent's UCX worker lives on, and with it any transfer released while it ran
(cancelled, or in flight at close): that transport never reports its region released
(``NixlTransport.on_released``). The first kept agent logs one warning. The leak is bounded: once
:data:`MAX_KEPT_AGENTS` agents are kept, :func:`check_room` makes new transports fail with an error
that says to restart the process, instead of growing without bound.

Threading: ``_lock`` guards the counter; every function may be called from any thread.
"""

from __future__ import annotations

import ctypes
import logging
import threading

logger = logging.getLogger(__name__)

MAX_KEPT_AGENTS = 64
"""How many unsafe agents one process keeps before refusing to create new transports."""

_lock = threading.Lock()
_kept = 0


def is_post_disconnect(exc: BaseException) -> bool:
    """True when posting a created request failed because the remote agent disconnected."""
    return type(exc).__name__ == "nixlRemoteDisconnectError" or (
        "NIXL_ERR_REMOTE_DISCONNECT" in str(exc)
    )


def kept_count() -> int:
    """How many agents this process keeps alive until it exits."""
    with _lock:
        return _kept


def check_room() -> None:
    """Raise ``RuntimeError`` when the cap of kept agents is reached (call before a new agent)."""
    with _lock:
        full = _kept >= MAX_KEPT_AGENTS
    if full:
        raise RuntimeError(
            f"{MAX_KEPT_AGENTS} NIXL agents are kept alive in this process because UCX cannot "
            "destroy them safely after posts to peers that died (see torch_kv_tier.transport."
            "agent_lifetime): restart the process to reclaim their memory"
        )


def keep_until_exit(agent: object, name: str) -> None:
    """Never destroy ``agent`` (a ``nixl_agent``): not by the collector, not at shutdown."""
    global _kept
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(agent))
    with _lock:
        _kept += 1
        first = _kept == 1
    if first:
        logger.warning(
            "NIXL agent %s had a transfer refused by a peer that died after the request was "
            "created; NIXL leaks that UCX request and destroying the agent can abort the process "
            "(upstream NIXL bug), so the agent is kept alive until the process exits (at most %d "
            "such agents; this warning is shown once)",
            name,
            MAX_KEPT_AGENTS,
        )
    else:
        logger.debug("keeping unsafe NIXL agent %s alive (%d kept)", name, _kept)
