"""Benchmarks and long runs for torch_kv_tier.

``bench.py`` is ``torch-kv-tier bench`` (its options and report; ``bench_sweep.py`` runs the
sweep): each ``system_*.py`` module drives one system under test through the ``System``
interface of ``core.py``, ``sweep.py`` measures them point by point and ``report.py`` prints,
saves and plots. ``soak.py`` (``torch-kv-tier stress``) and the
``reliability_*`` modules are the long reliability runs.
"""
