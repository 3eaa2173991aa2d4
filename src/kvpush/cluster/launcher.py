"""Process supervision for `kvpush up`: start children, wait for their /health, watch
them, and stop them all.

Every child runs in its own session (so its own process group: a terminal's Ctrl-C
reaches only the supervisor, which then stops the children in order) and, on Linux, with
``PR_SET_PDEATHSIG = SIGKILL``, so the kernel kills it if the supervisor dies without
cleaning up (SIGKILL, OOM killer; :mod:`kvpush.procs`). PDEATHSIG fires when the *thread*
that forked the child exits, so children must be spawned from a thread that lives as long
as the supervisor (the main thread, here). It covers the direct child only; ``stop()``
signals whole process groups, so helpers a child may start are stopped too.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import httpx

from kvpush.logs import is_probe_line
from kvpush.procs import describe_exit, pdeathsig_preexec

#: Lines of a child's log shown when it fails.
LOG_TAIL_LINES = 40
#: Seconds between liveness checks of the children while serving.
WATCH_INTERVAL_S = 0.25
#: Seconds one /health probe may take.
PROBE_TIMEOUT_S = 1.0


class ChildFailed(Exception):
    """A child exited, or did not become healthy in time."""

    def __init__(self, child: Child, reason: str):
        super().__init__(f"{child.name} {reason}")
        self.child = child
        self.reason = reason


class StopRequested(Exception):
    """A stop signal (Ctrl-C, SIGTERM, SIGHUP) arrived while waiting."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS's pick)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


@dataclass
class ChildSpec:
    """What to run: ``argv``, serving HTTP on ``port`` of 127.0.0.1 once started."""

    name: str
    role: str
    argv: list[str]
    port: int
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass
class Child:
    """A running child process, its log file and what it serves."""

    spec: ChildSpec
    log_path: Path
    proc: subprocess.Popen
    healthy: bool = False
    info: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def probe(self) -> bool:
        """True if GET /health answers 200 now."""
        try:
            r = httpx.get(f"{self.url}/health", timeout=PROBE_TIMEOUT_S)
        except httpx.HTTPError:
            return False
        return r.status_code == 200

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last ``lines`` lines of its log, the probes' access lines left out."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as e:
            return f"(cannot read {self.log_path}: {e})"
        kept = [line for line in text.splitlines() if not is_probe_line(line)]
        return "\n".join(kept[-lines:])

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the child's process group (the child and anything it started)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)


class StopSignals:
    """Turns SIGINT, SIGTERM and SIGHUP into a flag (and a count: a second signal while
    stopping means "do not wait") for as long as it is installed."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.count = 0
        self.last: str | None = None
        self._old: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        self.last = signal.Signals(signum).name

    @property
    def requested(self) -> bool:
        return self.count > 0

    def install(self) -> StopSignals:
        for sig in self.SIGNALS:
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)  # type: ignore[arg-type]
        self._old.clear()


class Supervisor:
    """Starts children with logs in ``log_dir``, waits for them, watches them, stops them.

    Use as a context manager: leaving it stops (and reaps) every child it started,
    whatever happened.
    """

    def __init__(self, log_dir: Path, env: dict[str, str] | None = None,
                 stop_signals: StopSignals | None = None, stop_timeout: float = 20.0):
        self.log_dir = log_dir
        self.env = env if env is not None else dict(os.environ)
        self.signals = stop_signals or StopSignals()
        self.stop_timeout = stop_timeout
        self.children: list[Child] = []
        self._preexec = pdeathsig_preexec()
        self._codes: dict[str, int] | None = None
        #: Children that were still running when the stop timeout ran out (SIGKILLed).
        self.killed: list[str] = []

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- start ---------------------------------------------------------------------
    def spawn(self, spec: ChildSpec, append: bool = False) -> Child:
        """Start ``spec`` (stdout and stderr to ``<log_dir>/<name>.log``; ``append``:
        after what an earlier process of that name wrote there)."""
        log_path = self.log_dir / f"{spec.name}.log"
        with open(log_path, "ab" if append else "wb") as log:  # the child keeps its own
            proc = subprocess.Popen(
                spec.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=self.env, start_new_session=True, preexec_fn=self._preexec,
                close_fds=True,
            )
        child = Child(spec, log_path, proc)
        self.children.append(child)
        return child

    def respawn(self, child: Child) -> Child:
        """Start an exited ``child`` again on its own command line, in its place in
        :attr:`children`, its log continued; the old process's group is SIGKILLed first
        (helpers it may have left behind)."""
        child.signal_group(signal.SIGKILL)
        with open(child.log_path, "ab") as log:
            log.write(f"---- kvpush up: {child.name} started again ----\n".encode())
        new = self.spawn(child.spec, append=True)
        self.children.remove(new)
        try:
            self.children[self.children.index(child)] = new
        except ValueError:  # retired meanwhile: watched anyway, stopped with the rest
            self.children.append(new)
        return new

    def wait_healthy(self, children: Sequence[Child], timeout: float) -> None:
        """Return once every child answers /health with 200.

        Raises :class:`ChildFailed` if one exits first or ``timeout`` seconds pass, and
        :class:`StopRequested` if a stop signal arrives.
        """
        deadline = time.monotonic() + timeout
        pending = [c for c in children if not c.healthy]
        while pending:
            for child in list(pending):
                self._check_stop()
                code = child.poll()
                if code is not None:
                    raise ChildFailed(child, f"{describe_exit(code)} while starting")
                if child.probe():
                    child.healthy = True
                    pending.remove(child)
            if not pending:
                return
            if time.monotonic() > deadline:
                raise ChildFailed(pending[0], f"was not healthy after {timeout:.0f} s")
            self._sleep(0.2)

    # ---- serve (kvpush.cluster.supervision watches and restarts) --------------------
    def retire(self, child: Child) -> str:
        """Stop one child on purpose (`kvpush up --remove`): no longer watched, SIGTERM
        to its group, up to ``stop_timeout`` seconds to exit, then SIGKILL; reaped."""
        with contextlib.suppress(ValueError):
            self.children.remove(child)
        child.signal_group(signal.SIGTERM)
        try:
            code = child.proc.wait(timeout=self.stop_timeout)
            how = f"drained ({describe_exit(code)})"
        except subprocess.TimeoutExpired:
            child.signal_group(signal.SIGKILL)
            child.proc.wait(timeout=10)
            how = f"SIGKILLed after {self.stop_timeout:g} s"
        child.signal_group(signal.SIGKILL)  # helpers it may have left behind
        return how

    # ---- stop ----------------------------------------------------------------------
    def stop(self) -> dict[str, int]:
        """SIGTERM every child's process group, wait up to ``stop_timeout`` seconds
        (less if another stop signal arrives), SIGKILL what is left, reap all.

        Returns each child's exit code by name. Idempotent.
        """
        if self._codes is not None:
            return self._codes
        signals_before = self.signals.count
        for child in self.children:
            if child.poll() is None:
                child.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout
        while any(c.poll() is None for c in self.children):
            if time.monotonic() > deadline or self.signals.count > signals_before:
                break
            time.sleep(0.05)
        for child in self.children:
            if child.poll() is None:
                self.killed.append(child.name)
            # SIGKILL the group even if its leader exited: it may have left helpers behind.
            child.signal_group(signal.SIGKILL)
        codes: dict[str, int] = {}
        for child in self.children:
            try:
                codes[child.name] = child.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # unkillable (D state): report, do not hang
                codes[child.name] = -int(signal.SIGKILL)
        self._codes = codes
        return codes

    def _check_stop(self) -> None:
        if self.signals.requested:
            raise StopRequested(self.signals.last or "stop")

    def _sleep(self, seconds: float) -> None:
        self._check_stop()
        time.sleep(seconds)
        self._check_stop()


# ---- process-tree inspection (Linux /proc; used by tests and the demo) --------------
def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, parent pid) of ``pid`` from /proc, or None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()  # the command name may hold spaces
    return fields[0], int(fields[1])


def descendant_pids(pid: int) -> list[int]:
    """The pids of every live process below ``pid`` in the process tree."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            st = _stat(int(entry.name))
            if st is not None and st[0] not in "ZX":
                parents.setdefault(st[1], []).append(int(entry.name))
    out: list[int] = []
    todo = [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting to be reaped counts as dead)."""
    st = _stat(pid)
    return st is not None and st[0] not in "ZX"


def alive(pids: Iterable[int]) -> list[int]:
    return [p for p in pids if pid_alive(p)]
