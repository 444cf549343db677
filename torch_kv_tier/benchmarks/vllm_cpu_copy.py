"""Bandwidth of ``CPUKVCopyWorker`` (vLLM's offload worker on the CPU) against ``memcpy``.

``python -m torch_kv_tier.benchmarks.vllm_cpu_copy --out copy.json`` copies a job of ``--blocks``
KV blocks between CPU KV cache tensors (one per layer, ``int8 [num_blocks, page]``) and vLLM's
own ``SharedOffloadRegion``, in both directions, for two shapes: the tiny test Llama (2 layers,
16 KiB pages) and a Llama-3-8B-like cache (32 layers, 8 KV heads x 128, bf16, 32-token blocks:
128 KiB pages). The reference is one ``memcpy`` (``ctypes.memmove`` between two contiguous
buffers) of the same total bytes. Block ids are scattered (a random permutation), as a real
cache's are. Samples are interleaved (worker store, worker load, memcpy; the reverse order every
other job) and repeated; the table gives the median GB/s, the min..max, the worker/memcpy ratio
of medians, and the median (min..max) of each job's ratio, its copies paired. The worker moves
each byte twice (a gather into a temporary, then a scatter), so about 0.5 is its ceiling. Needs
vLLM (0.32 or 0.33). Single thread.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch

from torch_kv_tier.benchmarks.options import output_file
from torch_kv_tier.cli_numbers import integer

SHAPES = {"tiny-llama": (2, 16384), "llama3-8b": (32, 131072)}  # layers, page bytes
COPIES = ("store", "load", "memcpy")


def _bench_shape(layers: int, page: int, blocks: int, repeats: int) -> dict[str, Any]:
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        GPULoadStoreSpec,
    )
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

    from torch_kv_tier.integrations.vllm.cpu_worker import CPUKVCopyWorker

    num_blocks = 2 * blocks
    caches = CanonicalKVCaches(
        tensors=[
            CanonicalKVCacheTensor(
                torch.randint(-128, 127, (num_blocks, page), dtype=torch.int8), page
            )
            for _ in range(layers)
        ],
        group_data_refs=[[CanonicalKVCacheRef(i, page) for i in range(layers)]],
    )
    region = SharedOffloadRegion(
        engine_id=f"tkvt-bench-{uuid.uuid4().hex[:8]}",
        num_chunks=num_blocks,
        rank=0,
        kv_bytes_per_chunk=layers * page,
        cpu_page_size=layers * page,
    )
    worker = CPUKVCopyWorker(caches, 1, region)
    nbytes = layers * page * blocks
    src = torch.empty(nbytes, dtype=torch.int8)
    dst = torch.empty(nbytes, dtype=torch.int8)
    src.random_(-128, 127)
    dst.zero_()
    gen = torch.Generator().manual_seed(0)
    engine_ids = torch.randperm(num_blocks, generator=gen)[:blocks].tolist()
    chunk_ids = torch.randperm(num_blocks, generator=gen)[:blocks].tolist()
    engine, chunks = GPULoadStoreSpec(engine_ids, [blocks], [0]), CPULoadStoreSpec(chunk_ids)
    copies: dict[str, Callable[[int], object]] = {
        "store": lambda job: worker.submit_store(2 * job, engine, chunks),
        "load": lambda job: worker.submit_load(2 * job + 1, chunks, engine),
        "memcpy": lambda job: ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes),
    }
    samples: dict[str, list[float]] = {name: [] for name in COPIES}
    try:
        for job in range(repeats + 1):  # the first round warms pages and caches up
            times = {}
            for name in COPIES if job % 2 == 0 else COPIES[::-1]:
                t = time.perf_counter()
                copies[name](job)
                times[name] = time.perf_counter() - t
            worker.get_finished()
            if job:
                for name, seconds in times.items():
                    samples[name].append(nbytes / seconds / 1e9)
    finally:
        worker.shutdown()
    result: dict[str, Any] = {"layers": layers, "page_bytes": page, "blocks": blocks}
    result["job_bytes"] = nbytes
    for name, gbps in samples.items():
        result[name] = {
            "median_gbps": statistics.median(gbps),
            "min_gbps": min(gbps),
            "max_gbps": max(gbps),
        }
    for name in ("store", "load"):
        result[f"{name}_over_memcpy"] = (
            result[name]["median_gbps"] / result["memcpy"]["median_gbps"]
        )
        ratios = [a / b for a, b in zip(samples[name], samples["memcpy"], strict=True)]
        result[f"{name}_over_memcpy_per_job"] = {
            "median": statistics.median(ratios),
            "min": min(ratios),
            "max": max(ratios),
        }
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=integer, default=64, help="KV blocks per job")
    parser.add_argument("--repeats", type=integer, default=20)
    parser.add_argument("--out", type=output_file, help="write JSON here")
    args = parser.parse_args(argv)
    results = []
    print(f"{'shape':>11} {'job MiB':>8} {'store GB/s':>16} {'load GB/s':>16} {'memcpy GB/s':>16}")
    for name, (layers, page) in SHAPES.items():
        r = {"shape": name, **_bench_shape(layers, page, args.blocks, args.repeats)}
        results.append(r)
        cells = [
            f"{r[k]['median_gbps']:5.2f} ({r[k]['min_gbps']:.1f}-{r[k]['max_gbps']:.1f})"
            for k in ("store", "load", "memcpy")
        ]
        print(f"{name:>11} {r['job_bytes'] / 2**20:8.1f} " + " ".join(f"{c:>16}" for c in cells))
        jobs = [r[f"{op}_over_memcpy_per_job"] for op in ("store", "load")]
        print(
            f"{'':>11} worker/memcpy: store {r['store_over_memcpy']:.2f}, "
            f"load {r['load_over_memcpy']:.2f}; per job, median (min-max): store "
            + ", load ".join(f"{j['median']:.2f} ({j['min']:.2f}-{j['max']:.2f})" for j in jobs)
        )
    if args.out:
        meta = {"blocks": args.blocks, "repeats": args.repeats, "threads": torch.get_num_threads()}
        args.out.write_text(json.dumps({"conditions": meta, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
