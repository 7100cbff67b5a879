"""This Python, made to lack what macOS's Python lacks (tests/test_macos_python.py).

A directory put first on PYTHONPATH: Python imports this module at start, before any of
smoltorrent, Celery or the test's code, in every process that inherits the environment
(the CLI, the worker and its pool children, the nodes). It removes the Linux-only
functions and constants from os, socket, fcntl and select, and makes /proc and /sys
absent, so code that calls one without a fallback fails here as it would on a Mac.
What a Mac does have (os.sendfile, SO_REUSEPORT, O_DIRECTORY, statvfs, flock) stays;
sys.platform stays "linux", so platform branches still take their Linux side.
"""

from __future__ import annotations

import select

# First, before socket imports selectors: its DefaultSelector is chosen at import.
for _name in [n for n in vars(select) if n.startswith(("epoll", "EPOLL"))]:
    delattr(select, _name)  # a Mac has kqueue instead

import builtins  # noqa: E402
import contextlib  # noqa: E402
import fcntl  # noqa: E402
import io  # noqa: E402
import os  # noqa: E402
import posix  # noqa: E402
import socket  # noqa: E402

# A library that picks its platform module by sys.platform (still "linux" here) takes its
# Linux side, which a Mac never runs (psutil's _pslinux, imported by Celery's worker):
# imported before the strip.
with contextlib.suppress(ImportError):
    import psutil  # noqa: F401

# Functions and flags of Linux (or of glibc) that CPython does not build on macOS.
OS_MISSING = (
    "posix_fallocate",
    "posix_fadvise",
    "sched_getaffinity",
    "sched_setaffinity",
    "pipe2",
    "splice",
    "copy_file_range",
    "memfd_create",
    "eventfd",
    "eventfd_read",
    "eventfd_write",
    "fdatasync",
    "getxattr",
    "setxattr",
    "listxattr",
    "removexattr",
    "pidfd_open",
    "getrandom",
    "O_DIRECT",
    "O_NOATIME",
    "O_PATH",
    "O_TMPFILE",
    "O_LARGEFILE",
)
OS_MISSING_PREFIXES = ("POSIX_FADV_", "SPLICE_F_", "RWF_", "MFD_", "EFD_", "XATTR_", "GRND_")
SOCKET_MISSING = (
    "TCP_INFO",
    "TCP_USER_TIMEOUT",
    "TCP_QUICKACK",
    "TCP_CORK",
    "TCP_CONGESTION",
    "TCP_DEFER_ACCEPT",
    "TCP_SYNCNT",
    "TCP_LINGER2",
    "TCP_WINDOW_CLAMP",
    "TCP_THIN_LINEAR_TIMEOUTS",
    "TCP_THIN_DUPACK",
    "SO_BINDTODEVICE",
    "SO_PRIORITY",
    "SO_MARK",
    "SO_PASSCRED",
    "SO_PEERCRED",
    "SO_INCOMING_CPU",
    "SOCK_NONBLOCK",
    "SOCK_CLOEXEC",
    "AF_PACKET",
    "AF_NETLINK",
    "MSG_CONFIRM",
    "MSG_MORE",
)
FCNTL_MISSING_PREFIXES = ("F_OFD_", "F_SEAL_", "DN_")
FCNTL_MISSING = (
    "F_SETPIPE_SZ",
    "F_GETPIPE_SZ",
    "F_ADD_SEALS",
    "F_GET_SEALS",
    "F_NOTIFY",
    "F_SETLEASE",
    "F_GETLEASE",
    "F_SETSIG",
    "F_GETSIG",
    "FICLONE",
    "FICLONERANGE",
)


def _strip(module: object, names: tuple[str, ...], prefixes: tuple[str, ...] = ()) -> None:
    for name in list(vars(module)):
        if name in names or name.startswith(prefixes):
            delattr(module, name)


_strip(os, OS_MISSING, OS_MISSING_PREFIXES)
_strip(posix, OS_MISSING, OS_MISSING_PREFIXES)
_strip(socket, SOCKET_MISSING)
_strip(fcntl, FCNTL_MISSING, FCNTL_MISSING_PREFIXES)

# No /proc and no /sys: opening anything there fails as a missing file does.
_LINUX_TREES = ("/proc/", "/sys/")


def _refuse(path: object) -> None:
    if isinstance(path, (str, bytes, os.PathLike)):
        text = os.fsdecode(path)
        if text.startswith(_LINUX_TREES) or text in ("/proc", "/sys"):
            raise FileNotFoundError(2, "No such file or directory (macOS has no /proc)", text)


_open, _os_open = builtins.open, os.open


def _no_proc_open(file, *args, **kwargs):
    _refuse(file)
    return _open(file, *args, **kwargs)


def _no_proc_os_open(path, *args, **kwargs):
    _refuse(path)
    return _os_open(path, *args, **kwargs)


builtins.open = io.open = _no_proc_open
os.open = _no_proc_os_open

# A Mac's Python has fcntl.F_FULLFSYNC, and needs it: fsync(2) there leaves the data in
# the drive's cache. Here it is given, done by fsync(2), and every fsync is written to
# SMOLTORRENT_TEST_FSYNC_LOG (when set) as "full" or "plain", so a test finds a durable
# write that skipped it.
F_FULLFSYNC = 51  # <sys/fcntl.h> on macOS
_fcntl, _fsync = fcntl.fcntl, os.fsync
_FSYNC_LOG = os.environ.get("SMOLTORRENT_TEST_FSYNC_LOG")


def _note(kind: str) -> None:
    if _FSYNC_LOG:
        with _open(_FSYNC_LOG, "a") as log:
            log.write(f"{os.getpid()} {kind}\n")


def _mac_fcntl(fd, cmd, arg=0):
    if cmd == F_FULLFSYNC:
        _note("full")
        _fsync(fd)
        return 0
    return _fcntl(fd, cmd, arg)


def _plain_fsync(fd) -> None:
    _note("plain")
    _fsync(fd)


fcntl.F_FULLFSYNC = F_FULLFSYNC
fcntl.fcntl = _mac_fcntl
os.fsync = _plain_fsync
