"""Loading NIXL and building the agent ``NixlTransport`` runs on: the only module importing nixl.

Passive progress. A target that only lends its memory must still progress its UCX worker, or an
incoming transfer over TCP never completes (shared memory and RDMA hide this). NIXL's progress
thread does that, but the Python bindings start it with a delay of 0, and with delay 0 it
busy-polls a whole core even when idle. With a delay D it progresses the workers, arms them and
blocks in ``poll()`` on their event fds for at most D: traffic wakes it at once, and D is only
NIXL's safety net against a missed UCX wakeup. So every agent here runs NIXL's progress thread
with ``PROGRESS_DELAY_US``, set by ``_progress_thread_delay`` (the bindings do not expose it);
figures in README's transport section.

Threading: ``make_agent`` may be called from any thread; ``_BIND_LOCK`` serializes the short
window in which NIXL's binding module is wrapped.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from torch_kv_tier.transport.nixl_import import import_nixl_api
from torch_kv_tier.transport.ucx_env import apply_ucx_policy, ucx_backend_params

logger = logging.getLogger(__name__)

NOT_INSTALLED = "NIXL is not installed: run `pip install nixl` (it brings the UCX backend)"

# Longest sleep of NIXL's progress thread between two progress rounds without traffic; traffic
# wakes it at once. 100 ms: ~10 idle wake-ups a second. Measured over TCP, 1 ms and 10 ms
# served slower (first-byte median ~1.9 ms) than 100 ms (~0.2 ms), at more idle CPU.
PROGRESS_DELAY_US = 100_000

_BIND_LOCK = threading.Lock()
_api: tuple[Any, Any] | None = None
_unavailable = NOT_INSTALLED  # why the last ``load_nixl`` found no NIXL


def unavailable_reason() -> str:
    """Why ``load_nixl`` returned ``None``, and what to do: NIXL is not installed, or it is
    installed but does not load (a missing shared library, no wheel for this CUDA version)."""
    return _unavailable


def _why(exc: ImportError) -> str:
    if isinstance(exc, ModuleNotFoundError) and exc.name in ("nixl", "nixl._api"):
        return NOT_INSTALLED
    return (
        f"NIXL is installed but does not load ({type(exc).__name__}: {exc}): reinstall it for "
        "this machine (`pip install --force-reinstall nixl`; on a GPU host it brings the "
        "nixl-cuXX wheel of the CUDA major version it detects)"
    )


def load_nixl() -> tuple[Any, Any] | None:
    """``(nixl_agent, nixl_agent_config)``, or ``None`` when NIXL is not installed or does not
    load (``unavailable_reason`` says which).

    Applies the UCX policy first (it must precede UCX's loading). NIXL's Python logger writes
    INFO lines to stdout by default; it is routed through ``logging`` instead, at the
    application's level (unless ``NIXL_LOG_LEVEL`` says otherwise), so stdout stays the
    application's.
    """
    global _api, _unavailable
    if _api is not None:
        return _api
    apply_ucx_policy()
    try:
        # NIXL binds its console handler to sys.stdout at import time and may log right away.
        with contextlib.redirect_stdout(sys.stderr):
            api = import_nixl_api()
    except ImportError as exc:
        _unavailable = _why(exc)
        return None
    nixl_logger = logging.getLogger("nixl")
    for handler in list(nixl_logger.handlers):
        if getattr(handler, "stream", None) in (sys.stdout, sys.stderr):
            nixl_logger.removeHandler(handler)
    nixl_logger.propagate = True
    if "NIXL_LOG_LEVEL" not in os.environ:  # else NIXL's INFO lines pass any handler's level
        nixl_logger.setLevel(logging.NOTSET)
    _api = api.nixl_agent, api.nixl_agent_config
    return _api


def make_agent(
    agent_cls: Any,
    config_cls: Any,
    name: str,
    backends: list[str],
    num_threads: int,
    *,
    progress_thread: bool = True,
) -> Any:
    """A NIXL agent with a cheap passive progress thread (see the module doc), or none.

    Without the thread the agent serves incoming transfers only while its owner polls: right for
    an initiator that never is a target (see ``NixlTransport``'s ``passive_progress``).

    NIXL's own locking is made real (``NIXL_THREAD_SYNC_RW``; the default without a listener
    thread compiles it away): a peer registration runs beside transfers on another thread, and
    under RW only loading a remote agent's metadata excludes them, not the per-block descriptor
    preparation. NIXL versions without ``sync_mode`` keep their default.

    The UCX backend is created explicitly, with ``ucx_backend_params`` (never split a transfer;
    no ``rc_gda`` on GPU hosts), after the other ``backends`` NIXL creates from the config.
    """
    sync = getattr(sys.modules.get(config_cls.__module__), "nixl_thread_sync_t", None)
    config = config_cls(
        enable_prog_thread=progress_thread,
        backends=[b for b in backends if b != "UCX"],
        num_threads=num_threads,
        **({"sync_mode": sync.NIXL_THREAD_SYNC_RW} if sync is not None else {}),
    )
    if progress_thread:
        with _progress_thread_delay(agent_cls, PROGRESS_DELAY_US):
            agent = agent_cls(name, config)
    else:
        agent = agent_cls(name, config)
    if "UCX" in backends:
        agent.create_backend("UCX", ucx_backend_params(num_threads))
    return agent


@contextlib.contextmanager
def _progress_thread_delay(agent_cls: Any, delay_us: int) -> Iterator[None]:
    """While active, agents built by ``agent_cls`` get ``pthrDelay = delay_us``.

    ``nixl_agent.__init__`` fills a binding config with ``pthrDelay = 0`` and hands it to
    ``nixlBind.nixlAgent``; for the duration, that module global is a forwarding wrapper whose
    ``nixlAgent`` sets the delay first. Without that global (other bindings), the agent keeps
    NIXL's default and its progress thread busy-polls a core: logged.
    """
    module = sys.modules.get(getattr(agent_cls, "__module__", ""))
    bind: Any = getattr(module, "nixlBind", None)
    if module is None or not hasattr(bind, "nixlAgent"):
        logger.warning(
            "cannot set NIXL's progress-thread delay on %r: its progress thread will keep a "
            "core busy (report this with your nixl version)",
            agent_cls,
        )
        yield
        return

    class _DelayedBind:
        def __getattr__(self, attr: str) -> Any:
            return getattr(bind, attr)

        @staticmethod
        def nixlAgent(agent_name: str, config: Any) -> Any:  # noqa: N802 (NIXL's name)
            config.pthrDelay = delay_us
            return bind.nixlAgent(agent_name, config)

    with _BIND_LOCK:
        setattr(module, "nixlBind", _DelayedBind())  # noqa: B010 (an attribute mypy cannot see)
        try:
            yield
        finally:
            setattr(module, "nixlBind", bind)  # noqa: B010


def descriptors(base_addr: int, num_blocks: int, block_len: int, device_id: int) -> np.ndarray:
    """An ``N x 3`` array of (address, length, device) rows, one per block."""
    descs = np.empty((num_blocks, 3), dtype=np.int64)
    descs[:, 0] = base_addr + np.arange(num_blocks, dtype=np.int64) * block_len
    descs[:, 1] = block_len
    descs[:, 2] = device_id
    return descs
