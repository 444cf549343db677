"""Benchmarks for torch_kv_tier: ``torch-kv-tier bench`` (``bench.py``) and its systems.

Each ``system_*.py`` module drives one system under test through the ``System`` interface of
``core.py``; ``sweep.py`` measures them point by point, ``report.py`` prints, saves and plots.
"""
