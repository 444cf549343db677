"""Which process a directory in use names (``disk_files._holder``, found by review):
``/proc/locks`` lines as kernels print them, devices of any major and minor in hex, OFD locks
(pid -1), a waiter's line, and a holder whose pid this namespace cannot see (an old kernel
prints 0): never a crash, never a pid that is not the holder's."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

from torch_kv_tier.remote import disk_files

INODE = 2156583


def holder_named(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, device: tuple[int, int], locks: str
) -> str:
    """``_holder``'s words for a file on ``device`` (major, minor), inode ``INODE``, where
    ``/proc/locks`` reads ``locks``."""
    real_stat = os.stat(tmp_path)
    fields = list(real_stat)
    fields[1], fields[2] = INODE, os.makedev(*device)  # st_ino, st_dev
    monkeypatch.setattr(disk_files.os, "fstat", lambda fd: os.stat_result(fields))
    real_open = open

    def fake_open(name: str, *args: object) -> object:
        return io.StringIO(locks) if name == "/proc/locks" else real_open(name, *args)

    monkeypatch.setattr(disk_files, "open", fake_open, raising=False)
    return disk_files._holder(-1)


@pytest.mark.parametrize(
    ("device", "printed"),
    [((0xFD, 1), "fd:01"), ((0, 0x2F), "00:2f"), ((259, 3), "103:03"), ((8, 0x100), "08:100")],
)
def test_the_holder_of_a_file_on_any_device_is_named(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, device: tuple[int, int], printed: str
) -> None:
    locks = (
        f"1: POSIX  ADVISORY  WRITE 77 {printed}:{INODE + 1} 0 EOF\n"
        f"2: FLOCK  ADVISORY  WRITE 442 {printed}:{INODE} 0 EOF\n"
        f"2: -> FLOCK  ADVISORY  WRITE 443 {printed}:{INODE} 0 EOF\n"
    )
    said = holder_named(monkeypatch, tmp_path, device, locks)
    assert said.startswith("another disk tier, process 442 ")


@pytest.mark.parametrize(
    "line",
    [
        "1: OFDLCK ADVISORY  WRITE -1 fd:01:{ino} 0 EOF",  # an OFD lock: no process
        "1: FLOCK  ADVISORY  WRITE 0 fd:01:{ino} 0 EOF",  # a pid this namespace cannot see
        "1: -> FLOCK  ADVISORY  WRITE 443 fd:01:{ino} 0 EOF",  # a waiter, not the holder
        "1: FLOCK  ADVISORY",  # cut
        "",
    ],
)
def test_no_pid_is_named_where_proc_locks_names_no_holder(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, line: str
) -> None:
    said = holder_named(monkeypatch, tmp_path, (0xFD, 1), line.format(ino=INODE) + "\n")
    assert said.startswith("another disk tier (a host still running on it)")
