"""vLLM integration (vLLM 0.32 and 0.33): ``RemoteHostTier``, a secondary offload tier for
vLLM's ``TieringOffloadingManager`` on ``torch-kv-tier serve`` remote hosts
(``remote_tier``); ``CPUTieringOffloadingSpec``, tiered offloading for an engine on vLLM's
CPU platform (``cpu_spec``, ``cpu_worker``); a tiny offline test model (``tiny_model``).

vLLM loads it by module path (``torch_kv_tier.integrations.vllm.remote_tier``); this package
imports nothing from vLLM itself, so it stays importable without vLLM installed.
"""
