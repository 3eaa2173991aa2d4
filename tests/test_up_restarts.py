"""`kvpush up`'s restart policy (kvpush.cluster.supervision.Keeper) on stand-in children
and a stepped clock: back-off, bounded tries, tries back after a stable run, an
instance out for good, and what stops the cluster (the router's exit, every instance
of a role out). The real cluster's restart: tests/test_up.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvpush.cluster.launcher import ChildSpec
from kvpush.cluster.supervision import Keeper, RestartPolicy


@dataclass
class FakeProc:
    code: int | None = None
    pid: int = 1

    def wait(self, timeout=None):
        return self.code


@dataclass
class FakeChild:
    spec: ChildSpec
    proc: FakeProc = field(default_factory=FakeProc)
    healthy: bool = True
    answers: bool = True  # /health
    log_path: Path = Path("/nonexistent.log")

    @property
    def name(self):
        return self.spec.name

    @property
    def url(self):
        return self.spec.url

    @property
    def pid(self):
        return self.proc.pid

    def poll(self):
        return self.proc.code

    def probe(self):
        return self.answers

    def signal_group(self, sig):
        self.proc.code = -int(sig)


class FakeSup:
    def __init__(self, *roles: str):
        self.children = [FakeChild(ChildSpec(f"{r}-{i}", r, [], 1000 + i))
                         for i, r in enumerate(roles)]
        self.spawned: list[str] = []

    def respawn(self, child):
        new = FakeChild(child.spec, healthy=False)
        self.children[self.children.index(child)] = new
        self.spawned.append(child.name)
        return new

    def get(self, name):
        return next(c for c in self.children if c.name == name)


class Clock:
    t = 0.0

    def __call__(self):
        return self.t


def keeper(sup, **kw):
    clock, said = Clock(), []
    k = Keeper(sup, RestartPolicy(**{"tries": 2, "first_delay_s": 1.0, "max_delay_s": 4.0,
                                     "stable_s": 60.0, "startup_timeout_s": 30.0, **kw}),
               said.append, clock)
    return k, clock, said


def test_backoff_doubles_up_to_its_cap():
    p = RestartPolicy(first_delay_s=1.0, max_delay_s=5.0)
    assert [p.delay(i) for i in (1, 2, 3, 4)] == [1.0, 2.0, 4.0, 5.0]


def test_an_exited_decode_is_restarted_after_its_delay_and_serves_again():
    sup = FakeSup("prefill", "decode", "decode", "router")
    k, clock, said = keeper(sup)
    sup.get("decode-1").proc.code = -9
    assert k.tick() is None and k.states()["decode-1"] == "waiting"
    assert "decode-1 was killed by SIGKILL while serving" in said[-1]
    clock.t = 0.5
    assert k.tick() is None and sup.spawned == []  # not yet: 1 s back-off
    clock.t = 1.0
    assert k.tick() is None and sup.spawned == ["decode-1"]
    assert k.states()["decode-1"] == "starting" and "restart 1 of 2" in said[-1]
    clock.t = 1.5
    assert k.tick() is None and k.states()["decode-1"] == "serving"
    assert "decode-1 serves again" in said[-1] and sup.get("decode-1").healthy


def test_past_its_tries_it_stays_out_and_the_other_decode_serves_on():
    sup = FakeSup("prefill", "decode", "decode", "router")
    k, clock, said = keeper(sup)
    for attempt in (1, 2):
        sup.get("decode-1").proc.code = 1
        assert k.tick() is None
        clock.t += k.policy.delay(attempt)
        assert k.tick() is None and k.states()["decode-1"] == "starting"
    sup.get("decode-1").proc.code = 1  # exits while starting, out of tries
    assert k.tick() is None
    assert k.states()["decode-1"] == "out" and "it stays out: 2 restart(s)" in said[-1]
    clock.t += 100
    assert k.tick() is None and sup.spawned == ["decode-1", "decode-1"]


def test_every_instance_of_a_role_out_stops_the_cluster():
    sup = FakeSup("prefill", "decode", "router")
    k, clock, said = keeper(sup, tries=1)
    sup.get("decode-1").proc.code = 1
    k.tick()
    clock.t += 1
    k.tick()  # restarted
    sup.get("decode-1").answers = False
    clock.t += 31  # never healthy: killed, out of tries
    stop = k.tick()
    assert stop is not None and stop.why == "every decode instance is out past its restarts"
    assert "was not healthy after 30 s" in stop.detail and stop.child.name == "decode-1"


def test_a_stable_run_gives_its_tries_back():
    sup = FakeSup("prefill", "decode", "router")
    k, clock, said = keeper(sup, tries=1)
    sup.get("decode-1").proc.code = 1
    k.tick()
    clock.t += 1
    k.tick()
    k.tick()  # healthy: serving, 1 try used
    clock.t += 61
    k.tick()  # served 60 s: its try back
    sup.get("decode-1").proc.code = 1
    assert k.tick() is None and k.states()["decode-1"] == "waiting"


def test_the_router_exiting_stops_the_cluster_and_no_tries_means_any_exit_does():
    sup = FakeSup("prefill", "decode", "router")
    k, _, _ = keeper(sup)
    sup.get("router-2").proc.code = 1
    stop = k.tick()
    assert stop.why == "the router exited" and "exited with code 1" in stop.detail
    sup = FakeSup("prefill", "decode", "router")
    k, _, _ = keeper(sup, tries=0)
    sup.get("prefill-0").proc.code = 1
    stop = k.tick()
    assert stop.why == "a child exited (--restart-tries 0)" and stop.child.name == "prefill-0"


def test_a_retired_instance_is_forgotten_and_one_being_added_waits_for_its_health():
    sup = FakeSup("prefill", "decode", "decode", "router")
    k, _, _ = keeper(sup)
    sup.children.remove(sup.get("decode-2"))  # --remove
    sup.children.append(FakeChild(ChildSpec("decode-3", "decode", [], 2000), healthy=False))
    assert k.tick() is None and set(k.states()) == {"prefill-0", "decode-1"}
    sup.get("decode-3").healthy = True
    assert k.tick() is None and k.states()["decode-3"] == "serving"
