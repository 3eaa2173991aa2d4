"""Child-process helpers shared by the `kvpush up` launcher (kvpush.cluster.launcher) and
the engine core's parent (kvpush.engine.core_client): tying a child's life to its
parent's (PR_SET_PDEATHSIG), naming how a child ended, and the fd limit a server and
its children run with. Standard library only.

PDEATHSIG fires when the *thread* that forked the child exits, so a child must be
spawned from a thread that lives as long as its parent should (the main thread, or the
thread that owns the child). It covers the direct child only.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


def pdeathsig_preexec() -> Callable[[], None] | None:
    """A preexec_fn that makes the child get SIGKILL when this process dies (Linux), or
    None where prctl is not available."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here, not after fork
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


def raise_fd_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (children inherit it):
    connections that never finish a handshake hold an fd each until dropped
    (kvpush.crypto.curve), and the default soft limit (1,024) is soon full. Returns the
    soft limit now."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def describe_exit(code: int) -> str:
    """How a child with return code ``code`` ended (``Popen.returncode``: negative for a
    signal), as the end of a sentence: "was killed by SIGKILL", "exited with code 1"."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"
