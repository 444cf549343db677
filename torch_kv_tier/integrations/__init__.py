"""Integrations of torch_kv_tier with inference engines and custom PyTorch loops."""
