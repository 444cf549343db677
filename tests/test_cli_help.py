"""What ``torch-kv-tier --help`` and a bad ``--log-level`` show a new user: descriptions taken
from docstrings printed reStructuredText's double backquotes (```torch-kv-tier`` command
line``), and ``--log-level foo`` ended in a ``ValueError`` traceback from ``logging``."""

from __future__ import annotations

import argparse
import re
from argparse import _SubParsersAction

import pytest

from torch_kv_tier.cli import _COMMANDS, build_parser, main


@pytest.mark.parametrize("argv", [["--help"], ["digest-cost", "--help"]])
def test_help_prints_no_double_backquotes(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "`torch-kv-tier" in out and "``" not in out


def test_an_unknown_log_level_exits_2_naming_the_levels(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--log-level", "foo", "serve", "--num-blocks", "0", "--block-len", "4096"])
    assert done.value.code == 2
    assert "--log-level: invalid choice: 'FOO'" in capsys.readouterr().err


def test_serve_help_says_how_often_tiers_heartbeat(capsys: pytest.CaptureFixture[str]) -> None:
    """``--lease-timeout``'s help said tiers heartbeat every third of it: at the default 30 s
    that read as every 10 s, where a tier heartbeats every second (``RemoteSession.open``)."""
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "tiers heartbeat every second, or every third of it if that is shorter" in out


def test_every_serve_option_states_its_default_or_that_it_is_required() -> None:
    """``serve --help`` left out ``--port``'s default (0: any free port), and that of
    ``--token-file``, ``--config-fields``, ``--metrics-port``, ``--disk`` and ``--disk-bytes``."""
    from torch_kv_tier.remote.server_config import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    options = [action for action in parser._actions if action.help != argparse.SUPPRESS]
    unstated = [
        action.option_strings[-1]
        for action in options[1:]  # (--help)
        if not re.search(r"\((?:no )?default|\(required\)|default[: ]", action.help or "")
    ]
    assert unstated == []
    assert "--port PORT control port (default 0: any free port)" in " ".join(
        parser.format_help().split()
    )


@pytest.mark.parametrize("command", list(_COMMANDS))
def test_every_option_of_every_command_states_its_default(command: str) -> None:
    """Past ``serve``, ``--help`` left out most defaults: ``bench --repeats`` said "timed
    repeats per point (median)" (7, or 3 with ``--quick``), ``chaos --pause`` "s between a
    tier's calls", ``serve-bench --input-len`` nothing at all. Each option now states its
    default (taken from the command's presets where ``--quick`` changes it), or that it is
    required; a switch is off unless given."""
    [commands] = [a for a in build_parser(command)._actions if isinstance(a, _SubParsersAction)]
    parser = commands.choices[command]
    parser.format_help()  # (each help's %(default)s expands)
    formatter = parser._get_formatter()
    unstated = [
        action.option_strings[-1]
        for action in parser._actions
        if action.option_strings
        and action.nargs != 0  # (--help and the switches)
        and not re.search(
            r"\((?:no )?default|\(required\)|default[: ]", formatter._expand_help(action)
        )
    ]
    assert unstated == []


def test_a_preset_default_is_the_one_a_run_takes(capsys: pytest.CaptureFixture[str]) -> None:
    """``bench``'s defaults come from its presets, ``--quick``'s too."""
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "timed repeats per point (median) (default 7; --quick: 3)" in out
    assert "bytes per block (default 16K,64K,256K,2M; --quick: 16K,64K,256K)" in out


def test_stress_quick_keeps_the_sizes_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """``stress --quick --trials 7`` ran 2 trials: ``--quick`` overwrote every size, given or
    not, where ``bench --quick`` and ``shared-bench --quick`` keep what is given."""
    from torch_kv_tier.benchmarks import soak

    class Ran(Exception):
        pass

    seen: list[argparse.Namespace] = []
    monkeypatch.setattr(soak, "_scenario", lambda name, args: seen.append(args))
    monkeypatch.setattr(soak, "_run_one", lambda name, scenario: (_ for _ in ()).throw(Ran()))
    for quick, taken in ((["--quick"], (7, 1, 3000)), ([], (7, 3, 100_000))):
        with pytest.raises(Ran):
            main(["stress", *quick, "--trials", "7", "--scenarios", "peer-death"])
        args = seen.pop()
        assert (args.trials, args.frozen_trials, args.transfers) == taken
