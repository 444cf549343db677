"""Every benchmark command refuses bad arguments as its command line is parsed, before anything
runs: output files that cannot be written, durations no wait takes, counts below one."""

from __future__ import annotations

import argparse
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from torch_kv_tier import cli


def _python_m(module: str) -> Callable[[list[str]], int]:
    main: Callable[[list[str]], int] = importlib.import_module(
        f"torch_kv_tier.benchmarks.{module}"
    ).main
    return main


def _command(name: str) -> Callable[[list[str]], int]:
    return lambda argv: cli.main([name, *argv])


# every command that writes its figures to a file it is given
WRITERS = {
    **{name: (_command(name), "--json") for name in (
        "shared-stress", "chaos", "shared-bench", "digest-cost", "share-cost", "thread-cost",
        "fleet-bench", "disk-bench",
    )},
    **{name: (_command(name), "--out") for name in ("bench", "stress", "serve-bench")},
    **{name: (_python_m(name), "--json") for name in ("passive_progress", "split_cost")},
    **{name: (_python_m(name), "--out") for name in (
        "promotion_trace", "engine_ttft", "vllm_cpu_copy",
    )},
}  # fmt: skip


class _Parsed(Exception):
    """Raised once the arguments parsed: the command would run now."""


@pytest.fixture
def parse_only(monkeypatch: pytest.MonkeyPatch) -> None:
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        parse(self, *args, **kwargs)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)


@pytest.mark.parametrize("name", list(WRITERS))
@pytest.mark.usefixtures("parse_only")
def test_an_output_file_that_cannot_be_written_is_refused_before_the_run(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A --json (or --out) path in a missing or unwritable directory failed only once the
    whole run was over, its figures lost."""
    main, option = WRITERS[name]
    (tmp_path / "file").write_text("")
    for bad, said in [(tmp_path / "file" / "x.json", "cannot create"), (tmp_path, "directory")]:
        with pytest.raises(SystemExit) as exited:
            main([option, str(bad)])
        assert exited.value.code == 2
        assert said in capsys.readouterr().err
    with pytest.raises(_Parsed):  # a missing directory is made, as mkdir -p would
        main([option, str(tmp_path / "new" / "x.json")])
    assert (tmp_path / "new").is_dir()


# every benchmark option that is a number of seconds (> 0; --pause >= 0)
DURATIONS = [
    ("bench", "--min-time"), ("bench", "--mean-run"), ("stress", "--lease-timeout"),
    ("stress", "--close-timeout"), ("shared-stress", "--seconds"),
    ("shared-stress", "--lease-timeout"), ("chaos", "--seconds"), ("chaos", "--pause"),
    ("shared-bench", "--min-time"), ("shared-bench", "--heartbeat-s"),
    ("digest-cost", "--min-time"), ("thread-cost", "--seconds"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "option"), DURATIONS)
@pytest.mark.parametrize("bad", ["nan", "inf", "-1", "1e7"])
@pytest.mark.usefixtures("parse_only")
def test_a_duration_no_wait_takes_is_refused_as_the_command_line_is_parsed(
    name: str, option: str, bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by review: ``type=float`` took ``nan``, ``inf`` and negatives, and the commands'
    own ``<= 0`` checks let ``nan`` through: ``chaos --seconds nan`` started its hosts, and
    ``chaos --pause -1`` failed in each tier's ``time.sleep``. Refused as the command line is
    parsed (exit 2), saying what to pass; a plain number is taken."""
    with pytest.raises(SystemExit) as exited:
        cli.main([name, option, bad])
    assert exited.value.code == 2
    assert f"argument {option}: not a number of seconds" in capsys.readouterr().err
    with pytest.raises(_Parsed):
        cli.main([name, option, "10"])


@pytest.mark.usefixtures("parse_only")
def test_a_shared_stress_max_grant_below_one_is_refused_before_its_host_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Found by review: ``shared-stress --max-grant 0`` (its own checks skip it) reached the
    host's command line, refused only once the host process ran. Refused as it is parsed."""
    with pytest.raises(SystemExit):
        cli.main(["shared-stress", "--max-grant", "0"])
    assert "argument --max-grant: must be > 0, got 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    "option", ["--concurrency", "--num-prompts", "--repeats", "--input-len", "--output-len"]
)
@pytest.mark.parametrize("bad", ["0", "-1"])
@pytest.mark.usefixtures("parse_only")
def test_a_serve_bench_count_below_one_is_refused_before_vllm_starts(
    option: str, bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by review: ``serve-bench --num-prompts 0`` (or ``--concurrency -1``, any of its
    counts) was taken with no check of its own: the run built its model and started a host
    (``--num-prompts 0`` asked it for 0 blocks) before anything refused it. Refused as the
    command line is parsed."""
    with pytest.raises(SystemExit):
        cli.main(["serve-bench", option, bad])
    assert f"argument {option}: must be > 0, got {bad}" in capsys.readouterr().err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to any directory")
@pytest.mark.usefixtures("parse_only")
def test_an_output_file_in_a_read_only_directory_is_refused_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(SystemExit) as exited:
            cli.main(["chaos", "--json", str(tmp_path / "x.json")])
    finally:
        tmp_path.chmod(0o700)
    assert exited.value.code == 2 and "permission denied" in capsys.readouterr().err
