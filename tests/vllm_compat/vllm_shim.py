"""Pytest plugin: run vLLM 0.33.0's own ``test_data_transport.py`` against our ``NixlTransport``.

Loaded by ``.ci/vllm_transport_suite.sh`` (``-p vllm_shim``), which fetches the vLLM sdist and
runs that one file unchanged. Their tests import ``vllm.v1.kv_offload.tiering.p2p.data.{base,nixl}``
and patch NIXL at ``nixl._NixlAgent`` / ``nixl._NixlAgentConfig``; this plugin installs stub
modules under those names (the real vLLM is never imported) that map onto ours:

- ``data.base``: our ``PollResult``, ``DataTransport`` and ``CancelMode``;
- ``data.nixl``: ``NixlTransport`` is ``VllmNamedNixlTransport`` below (ours, built with
  vLLM's failure semantics: ``fence_failures=False``), ``logger`` is our
  transport's logger, and ``_NixlAgent``/``_NixlAgentConfig`` are the agent classes our
  transport is built with (the real NIXL ones unless a test patches them; ``None`` means
  NIXL is not installed).

``NOT_APPLICABLE`` lists the cases skipped, each with its reason; nothing else is changed.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from torch_kv_tier.transport import base as our_base
from torch_kv_tier.transport import nixl as our_nixl
from torch_kv_tier.transport.nixl_agent import load_nixl

_PKG = "vllm.v1.kv_offload.tiering.p2p.data"

# Only tests of vLLM's exact NIXL agent configuration: ours differs on purpose (NIXL's
# progress thread with a delay so that passive targets serve, see transport/nixl_agent.py).
NOT_APPLICABLE = {
    "TestNixlAgentConfigSelection::test_non_ucx_backends_passes_backends_kwarg": (
        "asserts vLLM's exact nixl_agent_config(...) call; ours also sets the progress thread "
        "and num_threads"
    ),
    "TestNixlAgentConfigSelection::test_ucx_only_creates_backend_without_rc_gda": (
        "asserts vLLM's exact agent configuration; ours also never lets NIXL split a "
        "transfer and drops rc_gda only on GPU hosts (ucx_env.ucx_backend_params, tested in "
        "tests/test_transport.py)"
    ),
    "TestNixlAgentConfigSelection::test_default_backends_is_ucx_only": (
        "asserts vLLM's exact nixl_agent_config(backends=[], capture_telemetry=True) call"
    ),
}


def _module(name: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    if name != _PKG + ".base" and name != _PKG + ".nixl":
        module.__path__ = []  # a package, so submodule imports resolve through sys.modules
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, module)
    return module


def _install() -> types.ModuleType:
    for name in ("vllm", "vllm.v1", "vllm.v1.kv_offload", "vllm.v1.kv_offload.tiering"):
        _module(name)
    _module("vllm.v1.kv_offload.tiering.p2p")
    _module(_PKG)
    _module(
        _PKG + ".base",
        PollResult=our_base.PollResult,
        DataTransport=our_base.DataTransport,
        CancelMode=our_base.CancelMode,
    )
    api = load_nixl()
    return _module(
        _PKG + ".nixl",
        logger=our_nixl.logger,
        _NixlAgent=api[0] if api else None,
        _NixlAgentConfig=api[1] if api else None,
    )


_proxy = _install()


class VllmNamedNixlTransport(our_nixl.NixlTransport):
    """Ours with vLLM 0.33's failure semantics (``fence_failures=False``: a failed post refused
    with ``None``, a state ``ERR`` failed at once, which their tests assert; the tier's default,
    fenced failures, is tested in tests/test_transport.py), plus read-only views of our tables
    under the names their tests read."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, fence_failures=False, **kwargs)

    @staticmethod
    def _nixl_api() -> tuple[Any, Any] | None:
        if _proxy._NixlAgent is None:
            return None
        return _proxy._NixlAgent, _proxy._NixlAgentConfig

    @property
    def _remote_dlists(self) -> dict[str, Any]:
        return {peer_id: peer.dlist for peer_id, peer in self._peers._published.items()}

    @property
    def _inflight(self) -> dict[int, None]:
        return dict.fromkeys(self._transfers)

    @property
    def _peer_strikes(self) -> dict[str, int]:
        return self._health.strikes


_proxy.NixlTransport = VllmNamedNixlTransport


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    seen = set()
    for item in items:
        for case, reason in NOT_APPLICABLE.items():
            if item.nodeid.split("::", 1)[-1].split("[")[0] == case:
                item.add_marker(pytest.mark.skip(reason=f"not applicable: {reason}"))
                seen.add(case)
    missing = set(NOT_APPLICABLE) - seen
    if missing:
        raise pytest.UsageError(f"not-applicable cases no longer in the suite: {sorted(missing)}")
