"""The custom-PyTorch-loop integration: prefix keys, paged-KV decoder, PagedKVOffloader's round
trips, its arguments and its example command.

Tier tests run against a real ``torch-kv-tier serve`` subprocess on loopback (one per module,
the ``remote`` fixture). CUDA tests skip cleanly without a GPU.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from typing import Any

import pytest
import torch
from remote_support import free_port
from torch_loop_support import (
    BLOCK_LEN,
    CONFIG,
    HEAD_BYTES,
    HEADS,
    LAYERS,
    NUM_PAGES,
    PAGE,
    cuda,
    module_host,
    page,
    random_caches,
)

from torch_kv_tier.integrations.torch_loop import (
    OffloadError,
    PagedKVOffloader,
    Staging,
    prefix_keys,
)
from torch_kv_tier.integrations.torch_loop import keys as keys_module
from torch_kv_tier.integrations.torch_loop.example import main as example_main
from torch_kv_tier.integrations.torch_loop.example import run_demo
from torch_kv_tier.integrations.torch_loop.model import PagedKVCache, TinyDecoder
from torch_kv_tier.manager import TierManager

remote = module_host()  # (the tests' ``remote`` host)


def test_prefix_keys_are_chained_per_full_page() -> None:
    tokens = list(range(100, 140))  # 5 full pages of 8
    keys = prefix_keys(tokens, PAGE)
    assert len(keys) == 5 and len(set(keys)) == 5
    assert prefix_keys(tokens + [1, 2, 3], PAGE) == keys  # a partial page adds no key
    assert prefix_keys(tokens[:24], PAGE) == keys[:3]  # a prefix's keys are a prefix
    changed = tokens.copy()
    changed[17] += 1  # inside page 2: pages 0 and 1 keep their keys, every later key changes
    other = prefix_keys(changed, PAGE)
    assert other[:2] == keys[:2] and not set(other[2:]) & set(keys)
    assert not set(prefix_keys(tokens, PAGE, namespace=b"other model")) & set(keys)
    assert prefix_keys(torch.tensor(tokens), PAGE) == keys


def test_prefix_keys_are_stable_across_processes() -> None:
    # Load keys.py alone (no torch import): another interpreter, another hash() salt.
    code = (
        "import importlib.util as u, sys;"
        "s = u.spec_from_file_location('keys', sys.argv[1]); m = u.module_from_spec(s);"
        "s.loader.exec_module(m);"
        "print(' '.join(k.hex() for k in m.prefix_keys(range(40), 8, namespace=b'ns')))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code, keys_module.__file__],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [k.hex() for k in prefix_keys(range(40), 8, namespace=b"ns")]


def test_prefix_keys_reject_bad_input() -> None:
    with pytest.raises(ValueError, match="page_size"):
        prefix_keys([1, 2, 3], 0)
    for not_an_int in (8.0, "8", True):  # struct.error "bad char in struct format" for 8.0
        with pytest.raises(TypeError, match="page_size must be an int"):
            prefix_keys([1, 2, 3], not_an_int)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="integers"):
        prefix_keys([1.5, 2.0], 1)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="int64"):
        prefix_keys([2**63], 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoder_restored_pages_give_identical_logits(dtype: torch.dtype) -> None:
    model = TinyDecoder(CONFIG, dtype=dtype)
    cache = PagedKVCache(CONFIG, 3 * 8, PAGE, dtype=dtype)
    prompt = torch.randint(0, CONFIG.vocab_size, (45,), generator=torch.Generator().manual_seed(1))
    first, second, third = (cache.allocate(8) for _ in range(3))
    tokens, reference = model.generate(prompt, first, cache, 6)
    restored = 4  # copy 4 computed pages into other pages, as a restore does, then compute on
    src, dst = torch.tensor(first[:restored]), torch.tensor(second[:restored])
    for layer in cache.keys + cache.values:
        layer.index_copy_(0, dst, layer.index_select(0, src))
    tokens2, logits = model.generate(prompt, second, cache, 6, start=restored * PAGE)
    assert torch.equal(logits, reference) and tokens2 == tokens
    # The check can fail: a single flipped value in a restored page changes the logits.
    for layer in cache.keys + cache.values:
        layer.index_copy_(0, torch.tensor(third[:restored]), layer.index_select(0, src))
    cache.keys[1][third[2], 3, 0, 0] += 1
    _, corrupted = model.generate(prompt, third, cache, 6, start=restored * PAGE)
    assert not torch.equal(corrupted, reference)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]
)
def test_offload_restore_round_trip_through_few_arena_slots(
    remote: str, dtype: torch.dtype
) -> None:
    keys_c, values_c = random_caches(dtype)
    src = [5, 0, 17, 3, 9, 11, 2, 20, 8, 13]
    keys = [f"rt-{dtype}-{i}".encode() for i in range(len(src))]
    # 3 arena slots for 10 pages: offload and restore go in batches and reuse slots.
    with PagedKVOffloader.create(keys_c, values_c, remote=remote, arena_blocks=3) as off:
        result = off.offload(src, keys).result(timeout=30)
        assert result.ok and result.keys == keys and result.nbytes == len(keys) * BLOCK_LEN
        expected_k = [page(keys_c, p) for p in src]
        expected_v = [page(values_c, p) for p in src]
        for cache in keys_c + values_c:
            cache.zero_()  # the tier holds the only copy now
        dst = [1, 4, 6, 7, 10, 12, 14, 15, 16, 18]
        assert off.restore(keys, dst) == len(keys)
        for i, p in enumerate(dst):
            assert torch.equal(page(keys_c, p), expected_k[i])
            assert torch.equal(page(values_c, p), expected_v[i])
        assert off.manager.arena.num_free == 3  # every slot handed back
        # Storing again sends nothing new but still reports every key stored.
        again = off.offload(src[:2], keys[:2]).result(timeout=30)
        assert again.ok and again.keys == keys[:2] and again.nbytes == 0


def test_restore_brings_back_only_the_stored_prefix(remote: str) -> None:
    keys_c, values_c = random_caches(torch.float32, seed=2)
    keys = prefix_keys(range(6 * PAGE), PAGE, namespace=b"partial")
    with PagedKVOffloader.create(keys_c, values_c, remote=remote) as off:
        # Pages 0, 1, 2 and 4 stored: the prefix stops at the gap.
        off.offload([0, 1, 2, 4], [keys[0], keys[1], keys[2], keys[4]]).result(timeout=30)
        before = [page(keys_c, p) for p in range(NUM_PAGES)]
        dst = [10, 11, 12, 13, 14, 15]
        assert off.lookup(keys) == 3
        assert off.restore(keys, dst) == 3
        for i, p in enumerate(dst):
            expected = before[i] if i < 3 else before[p]  # pages past the prefix untouched
            assert torch.equal(page(keys_c, p), expected)
        assert off.restore(keys[3:], dst[3:]) == 0  # a miss at the first key restores nothing


def test_caches_of_another_dtype_or_layout_never_restore_each_others_pages(remote: str) -> None:
    # float16 and bfloat16 caches of one shape have one block_len, so one host serves both; with
    # the default namespace the same tokens give the same keys. The bfloat16 offloader restored
    # the float16 pages' bits as bfloat16 values (every restored value wrong, no error).
    half_k, half_v = random_caches(torch.float16, seed=8)
    bf16_k, bf16_v = random_caches(torch.bfloat16, seed=9)
    # float16 again, twice the layers of half the page size: the same block_len, other meaning
    deep_k, deep_v = (
        [torch.randn(NUM_PAGES, PAGE // 2, HEADS, 64).half() for _ in range(2 * LAYERS)]
        for _ in range(2)
    )
    keys = prefix_keys(range(2 * PAGE), PAGE)
    with PagedKVOffloader.create(half_k, half_v, remote=remote) as half:
        assert half.offload([0, 1], keys).result(timeout=30).ok
        assert half.restore(keys, [5, 6]) == 2
    for other_k, other_v in ((bf16_k, bf16_v), (deep_k, deep_v)):
        with PagedKVOffloader.create(other_k, other_v, remote=remote) as other:
            assert other.lookup(keys) == 0
            assert other.restore(keys, [5, 6]) == 0


def test_restore_feeds_the_decoder_bit_identical_logits(remote: str) -> None:
    result = run_demo(
        remote,
        config=CONFIG,
        page_size=PAGE,
        prefix_tokens=40,
        suffix_tokens=5,
        new_tokens=4,
        repeat=1,
    )
    assert result.prefix_pages == 5 and result.pages_restored == 5
    assert result.restored_bytes == 5 * BLOCK_LEN
    assert result.logits_identical


def test_missing_remote_falls_back_to_recompute(remote: str) -> None:
    keys_c, values_c = random_caches(torch.float32, seed=3)
    address = f"127.0.0.1:{free_port()}"  # nobody listens here
    keys = [b"gone-0", b"gone-1"]
    before = page(keys_c, 5)
    with PagedKVOffloader.create(keys_c, values_c, remote=address, timeout=5) as off:
        assert off.manager.peers() == []
        result = off.offload([0, 1], keys).result(timeout=30)
        assert not result.ok and set(result.failed) == set(keys) and result.keys == []
        assert off.restore(keys, [5, 6]) == 0
    assert torch.equal(page(keys_c, 5), before)
    # strict=True turns each failure into OffloadError instead.
    with (
        PagedKVOffloader.create(keys_c, values_c, strict=True) as off,
        pytest.raises(OffloadError, match="no peers"),
    ):
        off.offload([0, 1], keys).result(timeout=30)
    half_k, half_v = [k[:, :4] for k in keys_c], [v[:, :4] for v in values_c]  # other block_len
    with pytest.raises(OffloadError, match=remote):
        PagedKVOffloader.create(half_k, half_v, remote=remote, strict=True)


@pytest.mark.parametrize("built_in_inference_mode", ["caches", "offloader"])
def test_offload_restore_work_outside_the_inference_mode_things_were_built_in(
    remote: str, built_in_inference_mode: str
) -> None:
    # A server often builds its KV cache (or everything) under torch.inference_mode(). Tensors
    # made there refuse in-place writes outside it: restore raised once the pages had come
    # back (caches), offload raised and kept its arena slots (offloader: the arena).
    with torch.inference_mode(built_in_inference_mode == "caches"):
        keys_c, values_c = random_caches(torch.float32, seed=7)
    with torch.inference_mode(built_in_inference_mode == "offloader"):
        off = PagedKVOffloader.create(keys_c, values_c, remote=remote, arena_blocks=3)
    keys = [f"inference-{built_in_inference_mode}-{i}".encode() for i in range(4)]
    with off:
        expected = [page(keys_c, p) for p in range(4)]
        assert off.offload(range(4), keys).result(timeout=30).ok
        assert off.restore(keys, [10, 11, 12, 13]) == 4
        for i in range(4):
            assert torch.equal(page(keys_c, 10 + i), expected[i])
        assert off.manager.arena.num_free == 3


def test_bad_arguments_raise_before_any_transfer(remote: str) -> None:
    keys_c, values_c = random_caches(torch.float32)
    with TierManager.create(4, BLOCK_LEN * 2) as manager, pytest.raises(ValueError, match="block_"):
        PagedKVOffloader(keys_c, values_c, manager)
    with pytest.raises(ValueError, match="share shape"):
        PagedKVOffloader.block_len_for(keys_c, [v[:, :4] for v in values_c])
    with pytest.raises(ValueError, match="staging"):
        PagedKVOffloader.create(keys_c, values_c, staging="gpu")  # type: ignore[arg-type]
    # Connection arguments no host could accept: logged as "remote host ... unavailable" before,
    # leaving an offloader without a tier that recomputed everything.
    for kwargs, match in (
        ({"remote": remote, "slots": 8}, "private=True"),
        ({"remote": remote, "private": True, "slots": 0}, "slots must be > 0"),
        ({"remote": "localhost"}, "HOST:PORT"),
        ({"remote": remote, "token": ""}, "token is empty"),
    ):
        with pytest.raises(ValueError, match=match):
            PagedKVOffloader.create(keys_c, values_c, **kwargs)  # type: ignore[arg-type]
    with PagedKVOffloader.create(keys_c, values_c, remote=remote) as off:
        with pytest.raises(ValueError, match="page ids"):
            off.offload([0, 1], [b"a"])
        with pytest.raises(ValueError, match="outside"):
            off.restore([b"a"], [NUM_PAGES])
        with pytest.raises(ValueError, match="distinct"):
            off.restore([b"a", b"b"], [3, 3])
        with pytest.raises(ValueError, match="twice"):
            off.offload([1, 2], [b"a", b"a"])
        with pytest.raises(TypeError, match="keys must be"):
            off.offload([1], [1.5])  # type: ignore[list-item]
        assert off.lookup([b"a"]) == 0
        # lookup checks its keys as restore does, instead of logging a "tier lookup failed"
        # and answering 0 (a miss) for a key the tier could never hold. (Found by review: these
        # checks sat after the raising call in a pytest.raises block, so they never ran.)
        with pytest.raises(TypeError, match="keys must be"):
            off.lookup([1.5])  # type: ignore[list-item]
        with pytest.raises(ValueError, match="at most 64 bytes"):
            off.lookup([b"x" * 65])
        with pytest.raises(ValueError, match="timeout"):
            off.flush(float("nan"))
    # A refused close() timeout leaves the offloader open: close() again closes its tier (a
    # close() that raised used to have marked it closed first, so its tier was never closed).
    off = PagedKVOffloader.create(keys_c, values_c)
    with pytest.raises(ValueError, match="timeout"):
        off.close(timeout=float("inf"))
    off.close()
    with pytest.raises(RuntimeError, match="closed"):
        off.manager.load([b"a"], [0])
    # Found by review: lookup on a closed offloader answered 0 (a miss, with a "tier lookup
    # failed" warning), where offload and restore raise.
    with pytest.raises(RuntimeError, match="lookup on a closed PagedKVOffloader"):
        off.lookup([b"a"])
    # connect, likewise, logged "remote host ... unavailable" and answered "" (no peer).
    with pytest.raises(RuntimeError, match="connect on a closed PagedKVOffloader"):
        off.connect(remote)


def test_create_refuses_a_bad_timeout_before_it_builds_a_tier(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # inf raised OverflowError from the first wait; nan made every wait spin until it ended.
    # Found by review: create() checked its timeout only in __init__, after it had allocated the
    # arena and started a NIXL agent (then closed them again).
    keys_c, values_c = random_caches(torch.float32)

    def built(*args: object, **kwargs: object) -> TierManager:
        raise AssertionError("a tier was built for a call refused anyway")

    monkeypatch.setattr(TierManager, "create", built)
    for bad_timeout in (float("inf"), float("nan"), 0.0):
        with pytest.raises(ValueError, match="timeout"):
            PagedKVOffloader.create(keys_c, values_c, timeout=bad_timeout)


def test_create_builds_its_tier_for_the_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tier ``create`` builds: ``arena_blocks`` blocks of one page of every layer, in host
    memory (``staging="host"``, or the caches' device, here the CPU), fingerprinted by the
    caches' layout unless ``config_fields`` are given, and whose load past
    ``transfer_timeout_s`` waits for its read (its arena slots go back to the batches)."""
    keys_c, values_c = random_caches(torch.float16)
    real = TierManager.create
    built: list[dict[str, Any]] = []

    def create(*args: Any, **kwargs: Any) -> TierManager:
        built.append(inspect.signature(real).bind(*args, **kwargs).arguments)
        raise RuntimeError("not built")

    monkeypatch.setattr(TierManager, "create", create)
    for staging, fields in (("host", None), ("device", {"model": "m"})):
        with pytest.raises(RuntimeError, match="not built"):
            PagedKVOffloader.create(
                keys_c,
                values_c,
                staging=staging,  # type: ignore[arg-type]
                arena_blocks=8,
                name="built",
                config_fields=fields,
                transfer_timeout_s=5,
            )
    layout = {"dtype": "torch.float16", "layers": LAYERS, "page": [PAGE, HEADS, HEAD_BYTES // 2]}
    tier = {
        "num_blocks": 8,
        "block_len": BLOCK_LEN,
        "device": "cpu",
        "name": "built",
        "transfer_timeout_s": 5,
        "settle_late_loads": False,
    }
    assert built == [
        {**tier, "config_fields": {"kv_layout": layout}},
        {**tier, "config_fields": {"model": "m"}},
    ]


def test_a_connect_waits_at_most_the_offloaders_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    # Found by review: create(timeout=...) did not pass its timeout to the tier's connect, which
    # waited its own 10 s for a host that does not answer (create(timeout=1) took 10 s).
    keys_c, values_c = random_caches(torch.float32)
    given: list[float] = []

    def connect(self: TierManager, address: str, **kwargs: Any) -> str:
        given.append(kwargs["timeout_s"])
        raise TimeoutError(f"nothing answered at {address}")

    monkeypatch.setattr(TierManager, "connect", connect)
    address = f"127.0.0.1:{free_port()}"
    for kwargs in ({"timeout": 0.5}, {}, {"timeout": 2.0, "connect_timeout": 20.0}):
        kwargs["reconnect_interval_s"] = 0  # no dialling in the background: only these connects
        with PagedKVOffloader.create(keys_c, values_c, remote=address, **kwargs) as off:  # type: ignore[arg-type]
            assert off.connect(address, connect_timeout=0.25) == ""
    assert given == [0.5, 0.25, 10.0, 0.25, 20.0, 0.25]
    for bad in (0.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="connect_timeout"):
            PagedKVOffloader.create(keys_c, values_c, remote=address, connect_timeout=bad)
    assert len(given) == 6  # refused before it dialled


@cuda
@pytest.mark.parametrize("staging", ["device", "host"])
def test_cuda_offload_restore_round_trip(remote: str, staging: Staging) -> None:
    keys_c, values_c = random_caches(torch.bfloat16, device="cuda")
    keys = [f"cuda-{staging}-{i}".encode() for i in range(6)]
    with PagedKVOffloader.create(
        keys_c,
        values_c,
        remote=remote,
        staging=staging,
        arena_blocks=4,
    ) as off:
        assert off.manager.arena.device.type == ("cuda" if staging == "device" else "cpu")
        assert off.offload([0, 2, 4, 6, 8, 10], keys).result(timeout=30).ok
        expected = [page(keys_c, p) for p in (0, 2, 4, 6, 8, 10)]
        for cache in keys_c + values_c:
            cache.zero_()
        assert off.restore(keys, [1, 3, 5, 7, 9, 11]) == 6
        for want, p in zip(expected, [1, 3, 5, 7, 9, 11], strict=True):
            assert torch.equal(page(keys_c, p), want)


@cuda
@pytest.mark.parametrize("staging", ["device", "host"])
def test_cuda_restore_gives_identical_logits(remote: str, staging: Staging) -> None:
    result = run_demo(
        remote,
        config=CONFIG,
        page_size=PAGE,
        prefix_tokens=40,
        suffix_tokens=5,
        new_tokens=4,
        device="cuda",
        staging=staging,
        repeat=1,
    )
    assert result.pages_restored == 5 and result.logits_identical


def test_example_command_starts_its_own_remote_host(capsys: pytest.CaptureFixture[str]) -> None:
    small = "--layers 2 --hidden 64 --page-size 8 --prefix-tokens 32 --suffix-tokens 4"
    assert example_main([*small.split(), "--new-tokens", "2", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "prefix hit: 4/4 pages restored" in out
    assert "bit-identical to full recompute (torch.equal, prompt + decode): yes" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prefix-tokens", "4"], "need prefix_tokens >= page_size"),
        (["--page-size", "0"], "positive page_size"),
        (["--layers", "0"], "every DecoderConfig size must be >= 1"),
        (["--hidden", "6"], "must be divisible by heads"),
        (["--remote", "localhost"], "HOST:PORT"),
        (["--token-file", "/nonexistent/token"], "/nonexistent/token"),
    ],
)
def test_example_reports_bad_arguments_as_errors(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Found by review: each raised a traceback (ValueError, FileNotFoundError; with
    # --page-size 0 a ZeroDivisionError) instead of saying what is wrong.
    assert example_main(["--layers", "2", "--hidden", "64", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err


@pytest.mark.parametrize(
    "option",
    [
        "--prefix-tokens",
        "--suffix-tokens",
        "--new-tokens",
        "--page-size",
        "--layers",
        "--hidden",
        "--repeat",
    ],
)
@pytest.mark.parametrize("text", ["\uff16\uff14", "\u0666\u0664", "6_4"])
def test_example_refuses_numbers_past_ascii_digits(
    option: str, text: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: the example's counts took ``int()``'s digits of any script and ``_``
    (``--layers ６４`` ran 64 layers) where every ``torch-kv-tier`` command refuses them."""
    ran = "torch_kv_tier.integrations.torch_loop.example.run_demo"
    monkeypatch.setattr(ran, lambda *args, **kwargs: pytest.fail(f"ran with {option} {text}"))
    with pytest.raises(SystemExit) as done:
        example_main([option, text])
    assert done.value.code == 2
    assert f"argument {option}: not a whole number: {text!r}" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA refusal")
def test_example_refuses_a_cuda_device_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        example_main(["--device", "cuda"])
    assert exc.value.code == 2
    assert "CUDA is not available: run with --device cpu" in capsys.readouterr().err
