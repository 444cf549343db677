"""The price of verification in a ``torch-kv-tier bench`` run: the tier with ``verify=True``
(``torch_kv_tier``) and ``verify=False`` (``torch_kv_tier_noverify``), each against ``nixl_raw``.

Both tiers and ``nixl_raw`` are measured in one group, their repeats interleaved (A B C, C B A,
...), so every ratio is paired per repeat: ``on/raw`` and ``off/raw`` come from the bench's
``kind="ratio"`` rows, ``on/off`` from the two tiers' repeats of the same group.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from torch_kv_tier.benchmarks.report import NOVERIFY, TIER, Row, _group_key, _ok, _size, _table


def _cell(ratios: Sequence[float]) -> str:
    if not ratios:
        return "-"
    return f"{statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]"


def verify_table(rows: Sequence[Row]) -> str:
    """One line per point where both tiers ran beside ``nixl_raw``: median [min-max] of the
    paired per-repeat ratios on/raw, off/raw and on/off. Empty when ``NOVERIFY`` did not run."""
    ratios = {
        (r["system"], *_group_key(r)): r["ratio_repeats"]
        for r in rows
        if r["kind"] == "ratio" and r["reference"] == "nixl_raw"
    }
    tput = {
        (r["system"], *_group_key(r)): r
        for r in rows
        if r["kind"] == "throughput" and r.get("group") == "nixl_raw"
    }
    lines = []
    for key in sorted({k[1:] for k in tput if k[0] == NOVERIFY}):
        on, off = tput.get((TIER, *key)), tput.get((NOVERIFY, *key))
        paired = []
        if on is not None and off is not None and _ok(on) and _ok(off):
            paired = [a / b for a, b in zip(on["gbps_repeats"], off["gbps_repeats"]) if b > 0]
        tls, op, pattern, block_len, batch, depth = key
        lines.append(
            [tls, op, pattern, _size(block_len), str(batch), str(depth),
             _cell(ratios.get((TIER, *key), [])), _cell(ratios.get((NOVERIFY, *key), [])),
             _cell(paired)]
        )  # fmt: skip
    if not lines:
        return ""
    header = ["tls", "op", "pattern", "block", "batch", "depth", "on/raw", "off/raw", "on/off"]
    return _table(header, lines)
