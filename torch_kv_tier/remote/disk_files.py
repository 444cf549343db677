"""The files of one ``--disk`` directory as the operating system sees them (``disk_journal``'s):
a file replaced whole or not at all, durably (``write_durably``); the block file opened O_DIRECT
where it can be (``open_blocks``), its space reserved (``allocate``), whether it is still the
file at its path (``replaced``); its exclusive lock, so that no two hosts use one directory
(``lock``). Pure functions of their arguments; ``DiskError`` is what a directory that cannot be
used raises, saying what to do."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

LOCK_WAIT_S = 5.0  # a host killed just before (its files closed as it exits)


class DiskError(OSError):
    """A disk directory that cannot be used; the message says what to do."""


def write_durably(
    path: Path, *data: bytes | bytearray, before_rename: Callable[[], object] | None = None
) -> int:
    """Replace ``path`` by the parts of ``data`` whole or not at all, durably: a temporary file
    (``path`` with suffix ``.tmp``) written in full and synced, then ``before_rename`` called,
    then the file renamed over ``path``, and the directory synced (``sync_directory``). Returns
    the new file's descriptor, open for appends. Raises ``OSError`` (``before_rename``'s too)
    with ``path`` as it was and the temporary file removed."""
    tmp = path.with_suffix(".tmp")
    fd = -1
    try:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
        for part in data:
            view = memoryview(part)
            while view:  # a short write is no error: write the rest
                view = view[os.write(fd, view) :]
        os.fsync(fd)
        if before_rename is not None:
            before_rename()
        os.replace(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
    sync_directory(path)
    return fd


def sync_directory(path: Path) -> bool:
    """Sync the directory of ``path``, just renamed or removed (an entry of the directory:
    without that sync a power loss may bring the old file back); whether synced, a failure
    logged."""
    try:
        directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
    except OSError as exc:
        logger.warning(
            "disk: %s not synced (%s): a power loss may undo its rename or removal", path, exc
        )
        return False
    return True


def lock(fd: int, path: Path) -> None:
    """Hold ``fd``'s exclusive lock (released as it closes, or as its process dies), waiting at
    most ``LOCK_WAIT_S``; raises ``DiskError`` saying what to do, and which process holds it
    (``_holder``), before any file of ``path`` is written. A file system without locks
    is used unlocked (logged). On NFS, Linux emulates ``flock`` with POSIX record locks, which
    hold against other processes and hosts but never within one process: there a directory
    that one host's ``--disk`` names twice under two spellings is not refused."""
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise DiskError(f"{path} is in use by {_holder(fd)}") from None
            time.sleep(0.05)
        except OSError as exc:
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            logger.warning("disk: %s cannot be locked (%s): used unlocked", path, exc)
            return


def _holder(fd: int) -> str:
    """Who holds the lock of ``fd``'s file, and what to do, for ``lock``'s refusal: the pid
    ``/proc/locks`` names (none where it names none or pid 0: no ``/proc``, a holder in another
    pid namespace, which a kernel before 4.14 prints as 0, an OFD lock's -1, or a holder on
    another NFS client)."""
    pid = None
    st = os.fstat(fd)
    file = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as locks:
            for line in locks:  # "1: FLOCK  ADVISORY  WRITE 442 fe:00:2156583 0 EOF"
                fields = line.split()
                if len(fields) > 5 and fields[1] != "->" and fields[5] == file:  # "->": waiting
                    pid = int(fields[4]) if fields[4].isdigit() and int(fields[4]) else None
                    break
    except OSError:
        pass
    if pid == os.getpid():
        return (
            f"this process, {pid} (--disk naming it twice, maybe under two spellings, or a disk "
            "tier of this process not closed): pass each directory once"
        )
    who = "another disk tier" if pid is None else f"another disk tier, process {pid}"
    return f"{who} (a host still running on it): stop that host, or pass another directory"


def open_blocks(path: Path, block_len: int, direct: bool) -> tuple[int, bool]:
    """The block file and whether it is O_DIRECT (``direct`` asked, blocks of whole pages, and a
    file system that takes it: tmpfs refuses)."""
    flags = os.O_RDWR | os.O_CREAT
    if direct and block_len % 4096 == 0 and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT, 0o600), True
        except OSError:
            pass
    return os.open(path, flags, 0o600), False


def allocate(fd: int, path: Path, size: int) -> None:
    """Reserve the ``size`` bytes of block file ``fd``, of directory ``path``; raises
    ``DiskError`` where they are not free. A file system that cannot reserve (NFSv3: glibc's
    fallback writes single bytes, which an O_DIRECT file refuses) gets a sparse file (logged): a
    write past the free space fails later, a miss."""
    if os.fstat(fd).st_size >= size:
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            logger.warning(
                "disk: %s cannot reserve %d bytes in advance (%s): its block file is sparse, "
                "and a disk that fills up fails copies to it", path, size, exc,
            )  # fmt: skip
            os.ftruncate(fd, size)
            return
        st = os.statvfs(path)
        raise DiskError(
            f"{path} needs {size} bytes for --disk-bytes, only {st.f_bavail * st.f_frsize} free: "
            "pass a smaller --disk-bytes or free space"
        ) from exc


def replaced(path: Path, fd: int) -> bool:
    """Whether file ``path`` is no longer the file open as ``fd``: removed or replaced. An error
    other than its absence (EACCES, EIO) is no sign that it was: False."""
    try:
        st, opened = os.stat(path), os.fstat(fd)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return (st.st_dev, st.st_ino) != (opened.st_dev, opened.st_ino)
