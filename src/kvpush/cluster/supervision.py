"""What `kvpush up` does when one of its children exits while the cluster serves.

An instance (prefill, decode or both) that exits is started again on the same command
line, so on the same port (the router's static list and etcd both find it there), after
a back-off that doubles from try to try; a restart counts as done once the new process
answers /health, and an instance that then serves ``stable_s`` seconds has its tries
back. Past ``tries`` failed restarts it stays out, and `up` says why. The cluster stops
when the router (or etcd) exits, or when every instance of a role is out.

:class:`Keeper` holds one :class:`Life` per instance and is driven by `up`'s watch loop
(:meth:`Keeper.tick`, from the main thread: PDEATHSIG follows the forking thread).
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from kvpush.cluster.launcher import Child, Supervisor
from kvpush.procs import describe_exit

#: children whose exit stops the cluster whatever the restart policy
FATAL_ROLES = ("router", "etcd")
INSTANCE_ROLES = ("prefill", "decode", "both")


@dataclass(frozen=True)
class RestartPolicy:
    """``tries`` restarts per instance (0: an exit stops the cluster), the first after
    ``first_delay_s``, each next one twice as late up to ``max_delay_s``; a restarted
    instance healthy for ``stable_s`` seconds gets its tries back."""

    tries: int = 3
    first_delay_s: float = 1.0
    max_delay_s: float = 30.0
    stable_s: float = 60.0
    startup_timeout_s: float = 300.0

    def delay(self, attempt: int) -> float:
        """Seconds before restart number ``attempt`` (1-based)."""
        return min(self.max_delay_s, self.first_delay_s * 2 ** max(0, attempt - 1))


class Phase(Enum):
    SERVING = "serving"
    WAITING = "waiting"  # exited; its restart is due at ``due``
    STARTING = "starting"  # restarted; not healthy yet
    OUT = "out"  # past its tries: stays out


@dataclass
class Life:
    """One instance's restart state."""

    name: str
    role: str
    phase: Phase = Phase.SERVING
    used: int = 0  # restarts since it last served ``stable_s`` seconds
    due: float = 0.0
    since: float = 0.0  # when the current phase began
    last_exit: str = ""


@dataclass(frozen=True)
class Stop:
    """The cluster must stop, ``why``; ``child`` is the one whose log explains it,
    ``detail`` what happened to it."""

    why: str
    child: Child
    detail: str


class Keeper:
    """Restarts `up`'s instances under a :class:`RestartPolicy`; see the module doc."""

    def __init__(self, sup: Supervisor, policy: RestartPolicy,
                 say: Callable[[str], None], clock: Callable[[], float] = time.monotonic):
        self.sup = sup
        self.policy = policy
        self.say = say
        self.clock = clock
        self.lives: dict[str, Life] = {}
        now = clock()
        for child in sup.children:
            if child.spec.role in INSTANCE_ROLES:
                self.lives[child.name] = Life(child.name, child.spec.role, since=now)

    def tick(self) -> Stop | None:
        """Look at every child once: restart what is due, say what changed; a
        :class:`Stop` when the cluster cannot go on."""
        now = self.clock()
        present = {c.name for c in self.sup.children}
        for name in [n for n in self.lives if n not in present]:  # retired (--remove)
            del self.lives[name]
        for child in list(self.sup.children):
            role = child.spec.role
            if role in FATAL_ROLES:
                if child.poll() is not None:
                    return Stop(f"the {role} exited", child,
                                f"{describe_exit(child.poll() or 0)} while serving")
                continue
            life = self.lives.get(child.name)
            if life is None:
                if not child.healthy:  # being added from the control socket
                    continue
                life = self.lives[child.name] = Life(child.name, role, since=now)
            stop = self._step(child, life, now)
            if stop is not None:
                return stop
        return self._role_lost()

    def _step(self, child: Child, life: Life, now: float) -> Stop | None:
        if life.phase is Phase.SERVING:
            code = child.poll()
            if code is not None:
                return self._exited(child, life, f"{describe_exit(code)} while serving", now)
            if life.used and now - life.since >= self.policy.stable_s:
                life.used = 0
        elif life.phase is Phase.WAITING and now >= life.due:
            new = self.sup.respawn(child)
            life.used += 1
            life.phase, life.since = Phase.STARTING, now
            self.say(f"kvpush up: {life.name}: restart {life.used} of {self.policy.tries} "
                     f"(pid {new.pid}, {new.url})")
        elif life.phase is Phase.STARTING:
            code = child.poll()
            if code is not None:
                return self._exited(child, life, f"{describe_exit(code)} while starting",
                                    now)
            if child.probe():
                child.healthy = True
                life.phase, life.since = Phase.SERVING, now
                self.say(f"kvpush up: {life.name} serves again ({child.url}); the router "
                         "takes it back at its next health check")
            elif now - life.since > self.policy.startup_timeout_s:
                self._kill(child)
                return self._exited(child, life, "was not healthy after "
                                    f"{self.policy.startup_timeout_s:.0f} s", now)
        return None

    def _exited(self, child: Child, life: Life, why: str, now: float) -> Stop | None:
        child.healthy = False
        life.last_exit = why
        if self.policy.tries == 0:
            return Stop("a child exited (--restart-tries 0)", child, why)
        if life.used >= self.policy.tries:
            life.phase, life.since = Phase.OUT, now
            self.say(f"kvpush up: {life.name} {why}; it stays out: {life.used} restart(s) "
                     f"did not keep it up (--restart-tries {self.policy.tries}); its log: "
                     f"{child.log_path}")
            return None
        delay = self.policy.delay(life.used + 1)
        life.phase, life.since, life.due = Phase.WAITING, now, now + delay
        self.say(f"kvpush up: {life.name} {why}; the router takes it out of rotation; "
                 f"restarting it in {delay:g} s (log: {child.log_path})")
        return None

    def _role_lost(self) -> Stop | None:
        roles = {life.role for life in self.lives.values()}
        for role in sorted(roles):
            mine = [life for life in self.lives.values() if life.role == role]
            if all(life.phase is Phase.OUT for life in mine):
                child = next(c for c in self.sup.children if c.name == mine[-1].name)
                return Stop(f"every {role} instance is out past its restarts", child,
                            f"{mine[-1].last_exit} after {mine[-1].used} restart(s)")
        return None

    @staticmethod
    def _kill(child: Child) -> None:
        child.signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):  # unkillable (D state)
            child.proc.wait(timeout=10)

    def states(self) -> dict[str, str]:
        """Each instance's phase by name (tests, logs)."""
        return {name: life.phase.value for name, life in self.lives.items()}
