"""The checks of ``PagedKVOffloader``'s timeouts, and the keyword arguments of its connects.

Each raises ``ValueError`` naming a bad argument, before the offloader touches memory or the
network; none has state (any thread).
"""

from __future__ import annotations

import math
from typing import Any

from torch_kv_tier.connected_hosts import CONNECT_TIMEOUT_S

__all__ = ["check_timeout", "check_wait", "connect_kwargs"]


def connect_kwargs(timeout: float, connect_timeout: float | None, **kwargs: Any) -> dict[str, Any]:
    """``TierManager.connect``'s keyword arguments: ``kwargs``, and the handshake's
    ``connect_timeout`` (``None``: the offloader's ``timeout``, at most ``CONNECT_TIMEOUT_S``;
    ``ValueError`` unless a finite number > 0)."""
    if connect_timeout is None:
        connect_timeout = min(timeout, CONNECT_TIMEOUT_S)
    check_timeout("connect_timeout", connect_timeout)
    return {**kwargs, "timeout_s": connect_timeout}


def check_timeout(name: str, seconds: float) -> None:
    """``ValueError`` unless ``seconds`` is a finite number > 0 (nan too: a wait for nan seconds
    returns at once)."""
    if not 0 < seconds < math.inf:
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {seconds}")


def check_wait(timeout: float | None) -> None:
    """``ValueError`` unless ``timeout`` is ``None`` or a finite number of seconds >= 0."""
    if timeout is not None and not 0 <= timeout < math.inf:
        raise ValueError(f"timeout must be a finite number of seconds >= 0, got {timeout}")
