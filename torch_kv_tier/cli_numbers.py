"""The argument types of the numbers every ``torch-kv-tier`` command reads (``serve``'s and the
benchmarks'): ``integer`` and ``real``, in place of argparse's ``type=int`` and ``type=float``.

Those took digits of any script and ``_`` between digits (``--num-blocks ６４``, ``٦٤`` or
``6_4`` served 64 slots) where the byte sizes (``quantities.byte_count``) refused ``_``, and a
number that looks like one thing and reads as another is worth refusing: these take ASCII
alone (``quantities.ascii_number``). Each raises ``argparse.ArgumentTypeError`` saying what to
type instead, so the command exits 2 before it starts anything. Pure functions.
"""

from __future__ import annotations

import argparse

from torch_kv_tier.remote.quantities import ascii_number


def integer(text: str) -> int:
    """``text`` as a whole number in ASCII digits (``64``, ``-1``; a range is the option's own
    check)."""
    try:
        return int(ascii_number(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a whole number: {text!r} (write it in ASCII digits 0-9, e.g. 64)"
        ) from None


def real(text: str) -> float:
    """``text`` as a number in ASCII (``10``, ``0.5``, ``1e-3``; ``inf`` and ``nan`` too, which
    the option's own range check refuses where it must)."""
    try:
        return float(ascii_number(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a number: {text!r} (write it in ASCII digits 0-9, e.g. 10 or 0.5)"
        ) from None
