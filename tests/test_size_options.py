"""Every byte-size option of every command takes the same sizes (``quantities.byte_count``):
``serve --block-len 64K`` was refused ("invalid int value") while ``--disk-bytes 64G`` was
taken, and the benchmarks' ``--block-len`` took only plain ints where their ``--block-sizes``
took suffixes."""

from __future__ import annotations

import argparse
import importlib

import pytest

from torch_kv_tier.remote.quantities import byte_count
from torch_kv_tier.remote.server_config import ServerConfig

# (command module, option, the other arguments it needs) of every byte-size option
_OPTIONS = [
    ("torch_kv_tier.benchmarks.soak", "--block-len", []),
    ("torch_kv_tier.benchmarks.shared_stress", "--block-len", []),
    ("torch_kv_tier.benchmarks.disk_bench", "--block-len", []),
    ("torch_kv_tier.benchmarks.disk_bench", "--total-bytes", []),
    ("torch_kv_tier.benchmarks.disk_bench", "--capacity-block-len", []),
    ("torch_kv_tier.benchmarks.bench", "--block-sizes", []),
    ("torch_kv_tier.benchmarks.shared_bench", "--block-sizes", []),
    ("torch_kv_tier.benchmarks.thread_cost", "--block-sizes", []),
    ("torch_kv_tier.benchmarks.digest_cost", "--block-sizes", []),
    ("torch_kv_tier.benchmarks.share_cost", "--block-sizes", []),
]


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("4096", 4096),
        ("64K", 64 << 10),
        ("64k", 64 << 10),
        ("64KiB", 64 << 10),
        ("64 KB", 64 << 10),
        ("512MiB", 512 << 20),
        ("1.5G", 3 << 29),
        ("2T", 2 << 40),
        ("1e3", 1000),
    ],
)
def test_a_size_takes_a_number_and_a_binary_suffix(text: str, value: int) -> None:
    assert byte_count("--x", text) == value


@pytest.mark.parametrize(
    "text",
    [
        *("0", "-1", "0.3", "1/2", "0x10", "nan", "inf", "1e300T", "", "9" * 5000),
        *("0." + "0" * 5000, "\uff16\uff14K", "\u0666\u0664K", "1\u0660"),  # (digits past ASCII)
    ],
)
def test_a_size_that_is_no_whole_positive_byte_count_is_refused_naming_the_option(
    text: str,
) -> None:
    with pytest.raises(ValueError, match=r"^--x is not a byte count > 0: .*pass e\.g\. 4096, 64K"):
        byte_count("--x", text)


def test_serve_takes_its_block_len_and_disk_bytes_with_suffixes() -> None:
    """``serve --block-len 64K`` is taken, as ``--disk-bytes 1.5G`` was; a bad one is refused
    naming the option."""
    from torch_kv_tier.remote.server_config import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--num-blocks", "8", "--block-len", "64K", "--disk", "d", "--disk-bytes", "1.5G"]
    )
    config = ServerConfig.from_args(args)
    assert (config.block_len, config.disk_bytes) == (64 << 10, 3 << 29)
    with pytest.raises(ValueError, match="^--block-len is not a byte count"):
        ServerConfig.from_args(parser.parse_args(["--num-blocks", "8", "--block-len", "64Q"]))


@pytest.mark.parametrize(("module", "option", "needs"), _OPTIONS)
def test_every_benchmark_size_option_takes_suffixes(
    module: str, option: str, needs: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    importlib.import_module(module).add_arguments(parser)
    parsed = vars(parser.parse_args([*needs, option, "64K"]))[option[2:].replace("-", "_")]
    assert parsed in (64 << 10, [64 << 10])
    with pytest.raises(SystemExit):
        parser.parse_args([*needs, option, "64Q"])
    assert f"argument {option}: the size is not a byte count > 0: '64Q'" in capsys.readouterr().err
