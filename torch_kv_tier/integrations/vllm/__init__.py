"""vLLM integration: ``RemoteHostTier``, a secondary offload tier for vLLM 0.33's
``TieringOffloadingManager`` on ``torch-kv-tier serve`` remote hosts.

vLLM loads it by module path (``torch_kv_tier.integrations.vllm.remote_tier``); this package
imports nothing from vLLM itself, so it stays importable without vLLM installed.
"""
