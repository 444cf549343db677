"""The numbers every command reads are ASCII digits alone: ``int()`` and ``float()`` took
digits of any script and ``_`` between digits (``serve --num-blocks ６４``, ``٦٤`` or ``6_4``
served 64 slots, and ``--block-len ６４K`` was 64 KiB) where ``6_4K`` was refused; each is now
refused with exit code 2 saying to write it in ASCII digits, before anything starts."""

from __future__ import annotations

import argparse

import pytest

from torch_kv_tier.benchmarks import bench, options
from torch_kv_tier.cli import _COMMANDS, build_parser
from torch_kv_tier.cli_numbers import integer, real
from torch_kv_tier.remote.connect_args import parse_address

# 64 as fullwidth digits, as Arabic-Indic digits, and with an underscore
_ODD_64 = ["\uff16\uff14", "\u0666\u0664", "6_4"]
_NUMBER_TYPES = {
    integer,
    real,
    options.positive,
    options.duration,
    options.pause,
    options.heartbeat_timeout,
    options.size,
}


def _number_options(command: str) -> list[str]:
    """The options of ``command`` that take one number (of a type in ``_NUMBER_TYPES``)."""
    parser = build_parser(command)
    [commands] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    found = [
        action.option_strings[-1]
        for action in commands.choices[command]._actions
        if action.type in _NUMBER_TYPES
    ]
    return found


@pytest.mark.parametrize("command", list(_COMMANDS))
def test_every_number_option_refuses_digits_past_ascii(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    numbers = _number_options(command)
    assert numbers or command in ("digest-cost",), f"{command}: no number option found"
    for option in numbers:
        for text in _ODD_64:
            with pytest.raises(SystemExit) as done:  # (parsed only: a bug must not run it)
                build_parser(command).parse_args([command, option, text])
            assert done.value.code == 2, (command, option, text)
            err = capsys.readouterr().err
            assert f"argument {option}: " in err and "ASCII digits 0-9" in err, err


@pytest.mark.parametrize("text", _ODD_64)
def test_serve_refuses_a_slot_count_in_other_digits_before_it_starts(
    text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as done:  # (parsed only: it served 64 slots)
        build_parser("serve").parse_args(["serve", "--num-blocks", text, "--block-len", "64K"])
    assert done.value.code == 2
    assert f"argument --num-blocks: not a whole number: {text!r} (write it in ASCII" in (
        capsys.readouterr().err
    )


def test_ascii_numbers_read_as_before() -> None:
    assert (integer(" 64 "), integer("-1"), real("0.5"), real("1e-3")) == (64, -1, 0.5, 1e-3)
    assert options.positive("64") == 64 and options.duration("2.5") == 2.5


@pytest.mark.parametrize("port", ["\u0665\u0666\u0660\u0660", "\u00b2"])
def test_an_address_whose_port_is_not_ascii_digits_says_host_port(port: str) -> None:
    """``host:²`` raised int()'s "invalid literal" (no word of the address); ``host:٥٦٠٠``
    dialled port 5600."""
    with pytest.raises(ValueError, match="server address must be HOST:PORT"):
        parse_address(f"host:{port}")


@pytest.mark.parametrize("index", ["\u0663", "\uff13", "\u00b2"])
def test_bench_refuses_a_cuda_index_past_ascii_digits_before_it_starts(
    index: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: ``bench --device cuda:٣`` passed the check (``isdigit()``), and with
    CUDA the run failed later in ``torch.device`` with a traceback."""
    monkeypatch.setattr(bench, "quiet_nixl", lambda: pytest.fail("the run started"))
    args = build_parser("bench").parse_args(["bench", "--device", f"cuda:{index}"])
    assert bench.run(args) == 2
    assert f"--device must be cpu or cuda[:n], got 'cuda:{index}'" in capsys.readouterr().err
