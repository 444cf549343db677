"""The custom-loop example against a host of your own (``--remote``): a user who started the
host README shows (``--block-len 65536``) got only ``block_len 131072 != 65536``, and neither
``--help`` nor README said what ``--block-len`` the example needs."""

from __future__ import annotations

import pytest
from remote_support import BLOCK_LEN

from torch_kv_tier.integrations.torch_loop import example
from torch_kv_tier.integrations.torch_loop.model import DecoderConfig, PagedKVCache
from torch_kv_tier.integrations.torch_loop.offloader import OffloadError, PagedKVOffloader
from torch_kv_tier.remote import ServerProcess

SMALL = DecoderConfig(vocab_size=64, hidden=32, layers=2, heads=2, ffn=64)


def test_a_host_of_another_block_len_gets_the_serve_command_the_example_needs() -> None:
    cache = PagedKVCache(SMALL, 4, 16)
    needed = PagedKVOffloader.block_len_for(cache.keys, cache.values)
    assert needed != BLOCK_LEN
    with ServerProcess.start(8, BLOCK_LEN) as server, pytest.raises(OffloadError) as failed:
        example.run_demo(
            str(server.address),
            config=SMALL,
            prefix_tokens=16,
            suffix_tokens=1,
            new_tokens=1,
            repeat=1,
        )
    assert f"--block-len {needed}`" in str(failed.value)


def test_help_names_the_block_len_of_the_default_options(
    capsys: pytest.CaptureFixture[str],
) -> None:
    cache = PagedKVCache(DecoderConfig(), 1, 16)
    default = PagedKVOffloader.block_len_for(cache.keys, cache.values)
    with pytest.raises(SystemExit):
        example.main(["--help"])
    assert f"{default} with the defaults" in " ".join(capsys.readouterr().out.split())
