"""What every benchmark command shares: argument types for its options (sizes such as ``64K``,
comma-separated lists, positive counts, durations, the files it writes), quieting NIXL's own
logging, and the number of CPUs a report states.

Each type raises ``argparse.ArgumentTypeError`` with what to type instead, so a bad option is
refused before anything starts.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from torch_kv_tier.cli_numbers import integer, real
from torch_kv_tier.remote.quantities import (
    HEARTBEAT_TIMEOUT,
    MAX_WAIT_S,
    ascii_number,
    byte_count,
    seconds,
)

logger = logging.getLogger(__name__)


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity: fewer than the machine's under
    ``taskset``), which is what a benchmark's figures depend on."""
    return len(os.sched_getaffinity(0))


def size(text: str) -> int:
    """A byte count > 0 such as ``16K``, ``2M``, ``1.5GiB`` or ``4096``: as every command's
    size options take it (``quantities.byte_count``, ``serve --block-len`` too)."""
    try:
        return byte_count("the size", text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# an option whose default comes from a command's presets: (option, type, what it is, unit)
PresetOption = tuple[str, Callable[[str], Any], str, str]


def add_preset_options(
    parser: argparse.ArgumentParser,
    options: Sequence[PresetOption],
    full: Mapping[str, Any],
    quick: Mapping[str, Any] | None = None,
) -> None:
    """Add each of ``options`` to ``parser`` with no default of its own: a run takes
    ``full[key]`` (``quick[key]`` with ``--quick``) where it is not given, ``key`` being the
    option's name as an attribute; its help says which (``with_default``)."""
    for option, kind, text, unit in options:
        key = option[2:].replace("-", "_")
        shown = with_default(text, full[key], None if quick is None else quick[key], unit=unit)
        parser.add_argument(option, type=kind, help=shown)


def add_output_option(parser: argparse.ArgumentParser, option: str, what: str) -> None:
    """Add ``option``, a JSON file the run writes ``what`` to (``output_file``; none unless
    given)."""
    parser.add_argument(
        option, type=output_file, help=f"write {what} to this JSON file (default: none)"
    )


def with_default(text: str, full: Any, quick: Any = None, *, unit: str = "") -> str:
    """``text`` and the default a run takes, from the command's own presets (so that ``--help``
    stays true): ``full``'s value, and ``quick``'s for ``--quick`` when it differs, in ``unit``
    (``"B"``: a byte size, shown as ``64K``); lists comma-separated, as the option takes them.
    ``full`` may be ``"%(default)s"``: the option's ``default=``, which argparse fills in."""
    shown = f"default {_shown(full, unit)}"
    if quick is not None and quick != full:
        shown += f"; --quick: {_shown(quick, unit)}"
    return f"{text} ({shown})"


def _shown(value: Any, unit: str) -> str:
    """``value`` as an option takes it, in ``unit``."""
    if isinstance(value, list | tuple):
        return ",".join(_shown(v, "B" if unit == "B" else "") for v in value) + (
            "" if unit in ("", "B") else f" {unit}"
        )
    if unit == "B":
        for suffix, shift in (("T", 40), ("G", 30), ("M", 20), ("K", 10)):
            if value >= 1 << shift and value % (1 << shift) == 0:
                return f"{value >> shift}{suffix}"
        return str(value)
    number = f"{value:g}" if isinstance(value, float) else str(value)
    return f"{number} {unit}" if unit else number


def list_of(
    parse: Callable[[str], Any], choices: Sequence[str] | None = None
) -> Callable[[str], list[Any]]:
    """A type for a comma-separated list of ``parse``'s values (only ``choices``, if given)."""

    def parse_list(text: str) -> list[Any]:
        items = [parse(x) for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError("empty list")
        if choices is not None:
            bad = [x for x in items if x not in choices]
            if bad:
                raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {list(choices)}")
        return items

    return parse_list


def heartbeat_timeout(text: str) -> float:
    """A tier's ``--heartbeat-timeout`` in seconds, at least its floor (1 s: the tier's sessions
    are lost at once below it, ``quantities.HEARTBEAT_TIMEOUT``), checked before any host
    starts."""
    try:
        return seconds("--heartbeat-timeout", real(text), floor=HEARTBEAT_TIMEOUT)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def duration(text: str) -> float:
    """A number of seconds > 0 (a run's length, a timeout), finite and at most
    ``quantities.MAX_WAIT_S``: ``type=float`` took ``nan``, ``inf`` and negatives, which the
    commands' own ``<= 0`` checks let through (``chaos --seconds nan`` started its hosts)."""
    return _seconds(text, zero=False)


def pause(text: str) -> float:
    """A number of seconds >= 0 (0: none), finite and at most ``quantities.MAX_WAIT_S``:
    ``chaos --pause -1`` (or ``nan``) started the run, then each tier's ``time.sleep`` raised."""
    return _seconds(text, zero=True)


def _seconds(text: str, *, zero: bool) -> float:
    """``text`` as ``quantities.seconds`` takes it; ``ArgumentTypeError`` saying what to pass."""
    try:
        return seconds("value", float(ascii_number(text)), zero=zero)
    except ValueError:  # (not a number in ASCII, too)
        bound = ">= 0" if zero else "> 0"
        raise argparse.ArgumentTypeError(
            f"not a number of seconds {bound} in ASCII digits 0-9 (finite, at most "
            f"{MAX_WAIT_S:g}): {text!r}; "
            "pass e.g. 10 or 0.5"
        ) from None


def positive(text: str) -> int:
    """An integer > 0 (in ASCII digits: ``cli_numbers.integer``)."""
    value = integer(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def output_file(text: str) -> Path:
    """A file a command writes at the end of its run (``--json``, ``--out``, ``--plot``),
    checked now rather than after the run: its directory is created when missing (as
    ``mkdir -p``), and ``ArgumentTypeError`` says what to do when it cannot be, when the
    directory or an existing file there is not writable, or when the path names a directory."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(
            f"{text} is a directory: name a file in it (e.g. {path / 'results.json'})"
        )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise argparse.ArgumentTypeError(
            f"cannot create the directory of {text} ({exc.strerror}): pick a path in a "
            "writable directory"
        ) from None
    writable = os.access(path.parent, os.W_OK | os.X_OK)
    if not writable or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(
            f"{text} cannot be written (permission denied): pick a path in a writable directory"
        )
    return path


def plot_file(text: str) -> Path:
    """A PNG path for ``--plot`` (an ``output_file``), refused at once when matplotlib is not
    installed (rather than after the whole run, when the figures are drawn)."""
    if importlib.util.find_spec("matplotlib") is None:
        raise argparse.ArgumentTypeError(
            "--plot needs matplotlib, which is not installed: pip install matplotlib "
            "(or leave --plot out; the JSON has every figure)"
        )
    return output_file(text)


def quiet_nixl() -> None:
    """Apply the UCX policy and keep NIXL's INFO line per agent out of a benchmark's output
    (after NIXL's import, which installs its own logging configuration), unless this module
    logs at DEBUG."""
    from torch_kv_tier.transport.ucx_env import apply_ucx_policy

    apply_ucx_policy()
    try:
        import nixl._api  # noqa: F401
    except ImportError:
        return  # reported per system
    nixl_logger = logging.getLogger("nixl")
    if nixl_logger.getEffectiveLevel() < logging.WARNING and not logger.isEnabledFor(logging.DEBUG):
        nixl_logger.setLevel(logging.WARNING)
