"""The private folders of an instance's ``ipc://`` sockets, and the removal of dead ones.

Each API process makes ``<tmp>/kvpush-core-<its pid>-<random>`` (mode 0700: another user
cannot reach the sockets) for its engine core's sockets, and rank 0 of a tensor-parallel
instance makes one for its ranks' sockets and store (kvpush.engine.tp.group); each
removes its own when it closes. A process that is SIGKILLed
cannot, so each new one first removes the folders of dead ones: those of our uid, named
for a pid that no longer runs, whose sockets nobody listens on (both checks, so that a
live process of another pid namespace sharing the folder keeps its own: any socket in
it still listened on keeps the folder). Abstract
``ipc://@name`` sockets would leave nothing behind but have no permissions: any local
user could connect to them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import stat
import tempfile

PREFIX = "kvpush-core-"


def make_core_dir() -> str:
    """A fresh private folder (0700) for this process's sockets, after removing the
    folders that dead processes left."""
    remove_stale()
    return tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")


def remove_stale(base: str | None = None) -> list[str]:
    """Remove the engine-core folders in ``base`` (the temp folder) left by dead
    processes (see module docs); returns their paths."""
    base = base or tempfile.gettempdir()
    try:
        names = os.listdir(base)
    except OSError:
        return []
    removed = []
    for name in names:
        pid = name[len(PREFIX):].split("-", 1)[0] if name.startswith(PREFIX) else ""
        if not pid.isdigit():
            continue
        path = os.path.join(base, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if (not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or _runs(int(pid))
                or _any_listened(path)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _runs(pid: int) -> bool:
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # runs, as another user
        return True
    return True


def _any_listened(folder: str) -> bool:
    """Whether a process listens on any unix socket in ``folder``."""
    try:
        names = os.listdir(folder)
    except OSError:
        return False
    return any(_listened(os.path.join(folder, n)) for n in names)


def _listened(path: str) -> bool:
    """Whether a process listens on the unix socket ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(path)
        except (FileNotFoundError, ConnectionRefusedError, NotADirectoryError):
            return False
        except OSError:  # anything else: keep the folder
            return True
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
        return True
