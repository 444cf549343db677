"""What ``torch-kv-tier --help`` and a bad ``--log-level`` show a new user: descriptions taken
from docstrings printed reStructuredText's double backquotes (```torch-kv-tier`` command
line``), and ``--log-level foo`` ended in a ``ValueError`` traceback from ``logging``."""

from __future__ import annotations

import argparse
import re

import pytest

from torch_kv_tier.cli import main


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
