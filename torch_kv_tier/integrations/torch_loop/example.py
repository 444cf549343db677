"""Prefix reuse through a remote host: ``python -m torch_kv_tier.integrations.torch_loop.example``.

Request A (shared prefix + its own suffix) is generated with a paged KV cache and its full pages
are offloaded to a ``torch-kv-tier serve`` remote host. Request B shares the prefix: it is run
once by full recompute, and once by restoring the prefix pages from the remote host and computing
only the rest. The two runs' logits must be bit-identical (``torch.equal``); the example prints
the prefix hit, the pages restored and the time saved, and exits 1 if the logits differ.

By default it starts a remote host on loopback for the run; ``--remote HOST:PORT`` uses yours.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from torch_kv_tier.cli_numbers import integer
from torch_kv_tier.integrations.torch_loop.keys import prefix_keys
from torch_kv_tier.integrations.torch_loop.model import DecoderConfig, PagedKVCache, TinyDecoder
from torch_kv_tier.integrations.torch_loop.offloader import OffloadError, PagedKVOffloader, Staging

__all__ = ["DemoResult", "main", "run_demo"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class DemoResult:
    """What :func:`run_demo` measured for request B (times: medians over the repeats)."""

    remote: str
    prompt_tokens: int
    prefix_pages: int  # full pages of B's prompt that A also has (what a perfect cache holds)
    pages_restored: int
    restored_bytes: int
    recompute_s: float  # prefill of the whole prompt (time to first token without the tier)
    restore_s: float  # offloader.restore of the prefix pages
    rest_s: float  # prefill of the positions after the restored prefix
    logits_identical: bool  # every logit of prompt and decode steps, torch.equal
    tokens: list[int]

    @property
    def saved_s(self) -> float:
        """Time to first token saved by restoring instead of recomputing."""
        return self.recompute_s - self.restore_s - self.rest_s


def run_demo(
    remote: str | None = None,
    *,
    token: str | None = None,
    config: DecoderConfig | None = None,
    page_size: int = 16,
    prefix_tokens: int = 512,
    suffix_tokens: int = 24,
    new_tokens: int = 16,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    staging: Staging = "host",
    repeat: int = 3,
) -> DemoResult:
    """Run requests A and B against ``remote`` (``None``: a loopback server started for the run).

    Raises ``OffloadError`` if the remote host cannot be reached or fails a transfer: the demo
    is there to show the tier working, so it runs its offloader with ``strict=True``.
    """
    config = config or DecoderConfig()
    if min(page_size, suffix_tokens, new_tokens, repeat) < 1 or prefix_tokens < page_size:
        raise ValueError(
            "need prefix_tokens >= page_size and positive page_size, suffix, new tokens, repeat"
        )
    gen = torch.Generator().manual_seed(config.seed + 1)
    shared = torch.randint(0, config.vocab_size, (prefix_tokens,), generator=gen)
    prompt_a, prompt_b = (
        torch.cat([shared, torch.randint(0, config.vocab_size, (suffix_tokens,), generator=gen)])
        for _ in range(2)
    )
    per_request = -(-(prompt_b.numel() + new_tokens - 1) // page_size)
    model = TinyDecoder(config, dtype=dtype, device=device)
    cache = PagedKVCache(config, 2 * per_request, page_size, dtype=dtype, device=device)
    namespace = f"tiny-decoder:{config}:{dtype}:page={page_size}".encode()
    keys_a = prefix_keys(prompt_a, page_size, namespace=namespace)
    # At most (len - 1) // page_size pages are worth restoring: the last token must be computed.
    keys_b = prefix_keys(prompt_b, page_size, namespace=namespace)
    keys_b = keys_b[: (prompt_b.numel() - 1) // page_size]

    block_len = PagedKVOffloader.block_len_for(cache.keys, cache.values)
    with contextlib.ExitStack() as stack:
        yours = remote is not None
        if remote is None:
            from torch_kv_tier.remote.launch import ServerProcess

            server = ServerProcess.start(2 * per_request, block_len, host="127.0.0.1")
            remote = str(stack.enter_context(server).address)
        try:
            offloader = PagedKVOffloader.create(
                cache.keys,
                cache.values,
                remote=remote,
                token=token,
                staging=staging,
                arena_blocks=per_request,
                strict=True,
            )
        except OffloadError as exc:
            if not yours:
                raise
            raise OffloadError(
                f"{exc}; with these options the example needs a host started with "
                f"`torch-kv-tier serve --num-blocks {2 * per_request} --block-len {block_len}` "
                "(or more blocks)"
            ) from exc
        stack.enter_context(offloader)
        # Request A: compute it, then offload every full page of its prompt.
        pages = cache.allocate(per_request)
        model.generate(prompt_a, pages, cache, new_tokens)
        offloader.offload(pages[: len(keys_a)], keys_a).result(timeout=offloader.timeout)
        cache.free(pages)

        # Request B, `repeat` times each way: full recompute, then restore + compute the rest.
        identical = True
        times: list[tuple[float, float, float]] = []
        restored = 0
        tokens: list[int] = []
        for _ in range(repeat):
            ref_pages, new_pages = cache.allocate(per_request), cache.allocate(per_request)
            t0 = _now(device)
            first = model.prefill(prompt_b, ref_pages, cache)
            t1 = _now(device)
            _, reference = model.decode(first, prompt_b.numel(), ref_pages, cache, new_tokens)
            t2 = _now(device)
            restored = offloader.restore(keys_b, new_pages[: len(keys_b)])
            t3 = _now(device)
            first = model.prefill(prompt_b, new_pages, cache, start=restored * page_size)
            t4 = _now(device)
            tokens, logits = model.decode(first, prompt_b.numel(), new_pages, cache, new_tokens)
            identical = identical and torch.equal(reference, logits)
            times.append((t1 - t0, t3 - t2, t4 - t3))
            cache.free(ref_pages + new_pages)

    return DemoResult(
        remote=remote,
        prompt_tokens=prompt_b.numel(),
        prefix_pages=sum(1 for a, b in zip(keys_a, keys_b, strict=False) if a == b),
        pages_restored=restored,
        restored_bytes=restored * offloader.block_len,
        recompute_s=statistics.median(t[0] for t in times),
        restore_s=statistics.median(t[1] for t in times),
        rest_s=statistics.median(t[2] for t in times),
        logits_identical=identical,
        tokens=tokens,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m torch_kv_tier.integrations.torch_loop.example",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument(
        "--remote",
        help="HOST:PORT of a running `torch-kv-tier serve` whose --block-len is one page of "
        "every layer, keys and values (layers x 2 x page-size x hidden x the dtype's bytes: "
        "131072 with the defaults; an error names it for other options) (default: start one "
        "on 127.0.0.1 for this run)",
    )
    parser.add_argument("--token-file", type=Path, help="file holding the remote host's token")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--staging",
        choices=["host", "device"],
        default="host",
        help="arena in pinned host memory, or on the GPU (VRAM registration)",
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--prefix-tokens", type=integer, default=512)
    parser.add_argument("--suffix-tokens", type=integer, default=24)
    parser.add_argument("--new-tokens", type=integer, default=16)
    parser.add_argument("--page-size", type=integer, default=16)
    parser.add_argument("--layers", type=integer, default=4)
    parser.add_argument("--hidden", type=integer, default=256)
    parser.add_argument(
        "--repeat", type=integer, default=3, help="timed runs of request B (median)"
    )
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device} but CUDA is not available: run with --device cpu")

    try:
        result = run_demo(
            args.remote,
            token=args.token_file.read_text().strip() if args.token_file else None,
            config=DecoderConfig(hidden=args.hidden, layers=args.layers, ffn=4 * args.hidden),
            page_size=args.page_size,
            prefix_tokens=args.prefix_tokens,
            suffix_tokens=args.suffix_tokens,
            new_tokens=args.new_tokens,
            dtype=DTYPES[args.dtype],
            device=args.device,
            staging=args.staging,
            repeat=args.repeat,
        )
    except (OffloadError, ValueError, OSError) as exc:  # a host, an argument, the token file
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_report(result)
    return 0 if result.logits_identical else 1


def print_report(result: DemoResult) -> None:
    """Print the figures of one :class:`DemoResult` to stdout."""
    r = result
    print(f"request B: {r.prompt_tokens} prompt tokens, {r.prefix_pages} full pages shared with A")
    print(
        f"prefix hit: {r.pages_restored}/{r.prefix_pages} pages restored "
        f"({r.restored_bytes / 2**20:.2f} MiB from {r.remote} in {r.restore_s * 1e3:.1f} ms)"
    )
    print(
        f"time to first token: full recompute {r.recompute_s * 1e3:.1f} ms; restore "
        f"{r.restore_s * 1e3:.1f} ms + compute the rest {r.rest_s * 1e3:.1f} ms; "
        f"time saved {r.saved_s * 1e3:.1f} ms ({100 * r.saved_s / r.recompute_s:.0f}%)"
    )
    verdict = "yes" if r.logits_identical else "NO"
    print(f"logits bit-identical to full recompute (torch.equal, prompt + decode): {verdict}")
    print(f"generated tokens: {r.tokens}")


def _now(device: str) -> float:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


if __name__ == "__main__":
    sys.exit(main())
