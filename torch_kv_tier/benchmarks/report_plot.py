"""``torch-kv-tier bench --plot``: GB/s against block size, one line per system (matplotlib).

Reads the rows :mod:`torch_kv_tier.benchmarks.report` renders; matplotlib is imported only when
a plot is asked for (it is not a dependency of the package).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch_kv_tier.benchmarks.report import Row, _grouped, _size


def plot(rows: list[Row], path: str | Path) -> None:
    """GB/s against block size, one line per system, write and read panels (matplotlib Agg).

    Shown: the largest requested depth and, among batches, 16 when measured (else the largest);
    solid lines are the contiguous pattern, dashed the scattered one.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tput = [r for by in _grouped(rows)[1].values() for r in by.values()]
    if not tput:
        raise ValueError("no throughput rows to plot")
    batches = sorted({r["batch"] for r in tput})
    batch = 16 if 16 in batches else batches[-1]
    depth = max(r["inflight_requested"] for r in tput)
    transports = list(dict.fromkeys(r.get("transport", "shm") for r in tput))
    fig, axes = plt.subplots(
        len(transports), 2, figsize=(12, 4.4 * len(transports)), sharey="row", squeeze=False
    )
    systems = list(dict.fromkeys(r["system"] for r in tput))
    colors = {s: f"C{i}" for i, s in enumerate(systems)}
    ticks = sorted({r["block_len"] for r in tput})
    for row_axes, transport in zip(axes, transports, strict=True):
        for ax, op in zip(row_axes, ("write", "read"), strict=True):
            for system in systems:
                for pattern, style in (("contiguous", "-"), ("scattered", "--")):
                    pts = sorted(
                        (r["block_len"], r["gbps"])
                        for r in tput
                        if r["system"] == system
                        and r.get("transport", "shm") == transport
                        and r["op"] == op
                        and r["pattern"] == pattern
                        and r["batch"] == batch
                        and r["inflight_requested"] == depth
                        and r.get("verified")
                    )
                    if pts:
                        xs, ys = zip(*pts, strict=True)
                        ax.plot(
                            xs,
                            ys,
                            style,
                            marker="o",
                            color=colors[system],
                            label=f"{system} ({pattern})",
                        )
            ax.set_xscale("log", base=2)
            ax.set_xticks(ticks, [_size(t) for t in ticks])
            ax.set_title(f"{transport}: {op} ({'offload' if op == 'write' else 'load back'})")
            ax.set_xlabel("block size")
            ax.grid(True, alpha=0.3)
        row_axes[0].set_ylabel("GB/s")
    labelled: dict[str, Any] = {}
    for ax in axes.flat:  # systems without a read path appear in the write panel only
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            labelled.setdefault(label, handle)
    axes[0][1].legend(list(labelled.values()), list(labelled), fontsize=7, loc="best")
    device = tput[0]["device"]
    fig.suptitle(f"torch-kv-tier bench: {device}, {batch} blocks per call, depth {depth}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
