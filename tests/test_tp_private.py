"""Tensor-parallel ranks are private to the instance's uid (issue 67, point 1).

The ranks' sockets and store live in a 0700 folder (no abstract-namespace names); a
probe as another uid can list, connect to and read none of it, and the instance serves
on; a second peer on a rank socket gets no plan; a rank whose token is wrong is refused
at start; a rank that misses a plan or stops fails the step within the collective
timeout (seconds), not the old 600 s.
"""

from __future__ import annotations

import json
import os
import pwd
import signal
import stat
import subprocess
import sys
import time

import pytest
import zmq

from engine_helpers import assert_all_blocks_free, greedy, make_engine, run_to_completion
from kvpush.config import ConfigError
from kvpush.engine.tp import group as tp_group
from kvpush.engine.tp.group import RankDied
from server_helpers import all_child_pids

pytestmark = pytest.mark.timeout(60)
COLLECTIVE_TIMEOUT_S = 3.0

PROMPT = {"a": [11, 12, 13, 14, 15]}

# run as another uid: try everything a local user could; print what each try got
PROBE = r"""
import json, os, socket, sys
folder, uid = sys.argv[1], int(sys.argv[2])
os.setgid(uid); os.setuid(uid)
got = {}
def attempt(name, f):
    try:
        got[name] = "ok: " + repr(f())[:80]
    except OSError as e:
        got[name] = type(e).__name__
attempt("list", lambda: os.listdir(folder))
for name in ("plan-1", "kv-1"):
    def connect(path=os.path.join(folder, name)):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        return s.recv(1)
    attempt("connect " + name, connect)
attempt("read store", lambda: open(os.path.join(folder, "store"), "rb").read())
attempt("write store", lambda: open(os.path.join(folder, "store"), "ab").write(b"x"))
print(json.dumps(got))
"""


def _abstract_tp_names() -> list[str]:
    with open("/proc/net/unix") as f:
        return [line for line in f if "kvpush-tp" in line]


def test_rank_sockets_and_store_are_private_to_the_uid(tiny_llama):
    if os.getuid() != 0:
        pytest.fail("this test drops to another uid: run it as root (CI does)")
    nobody = pwd.getpwnam("nobody").pw_uid
    engine = make_engine(tiny_llama, tensor_parallel_size=2)
    try:
        folder = engine.runner.group.folder
        st = os.stat(folder)
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
        assert {"plan-1", "store"} <= set(os.listdir(folder))
        assert stat.S_ISSOCK(os.stat(os.path.join(folder, "plan-1")).st_mode)
        assert _abstract_tp_names() == []  # nothing in the abstract namespace
        probe = subprocess.run([sys.executable, "-c", PROBE, folder, str(nobody)],
                               capture_output=True, text=True, timeout=20)
        assert probe.returncode == 0, probe.stderr
        got = json.loads(probe.stdout)
        assert got["list"] == "PermissionError", got
        for name in ("connect plan-1", "connect kv-1", "read store", "write store"):
            assert got[name] == "PermissionError", got
        # and the instance serves on: both ranks got the plan
        out = run_to_completion(engine, PROMPT, greedy(8))
        assert len(out["a"]) == 8
        assert_all_blocks_free(engine)
    finally:
        engine.shutdown()
    assert not os.path.exists(folder)  # removed at close


def test_a_second_peer_on_a_rank_socket_gets_no_plan(tiny_llama):
    """Same uid (which could do anything anyway): the PAIR keeps its one peer, the rank;
    a second connection gets nothing and the steps go on."""
    engine = make_engine(tiny_llama, tensor_parallel_size=2)
    ctx = zmq.Context()
    thieves = []
    try:
        address = f"ipc://{engine.runner.group.folder}/plan-1"
        for kind in (zmq.PULL, zmq.PAIR):
            s = ctx.socket(kind)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(address)
            thieves.append(s)
        out = run_to_completion(engine, PROMPT, greedy(8))
        assert len(out["a"]) == 8
        for s in thieves:  # every plan went to the rank: nothing is queued for them
            assert s.poll(200) == 0
    finally:
        for s in thieves:
            s.close(linger=0)
        ctx.term()
        engine.shutdown()


def test_a_rank_with_the_wrong_token_is_refused(tiny_llama, monkeypatch):
    real = tp_group.RankSetup

    def forged(*a, **kw):
        a = list(a)
        a[4] = b"not the token"  # (config, rank, store_path, plan_address, token, ...)
        return real(*a, **kw)

    closing: list[float] = []
    real_close = tp_group.RankGroup.close

    def timed_close(self):
        t0 = time.monotonic()
        real_close(self)
        closing.append(time.monotonic() - t0)

    monkeypatch.setattr(tp_group, "RankSetup", forged)
    monkeypatch.setattr(tp_group.RankGroup, "close", timed_close)
    before = set(all_child_pids(os.getpid()))
    with pytest.raises(ConfigError, match="its peer is not the rank this instance "
                                          "started"):
        make_engine(tiny_llama, tensor_parallel_size=2)
    # the rank, waiting in a rendezvous rank 0 never joins, is killed at once (not
    # asked to stop, then killed after STOP_TIMEOUT_S)
    assert len(closing) == 1 and closing[0] < tp_group.STOP_TIMEOUT_S / 2, closing
    assert set(all_child_pids(os.getpid())) <= before


@pytest.mark.parametrize("fault", [
    "missed plan",
    pytest.param("stopped rank", marks=pytest.mark.slow),  # the same timeout
])
def test_a_rank_out_of_step_fails_the_step_in_seconds(tiny_llama, monkeypatch, fault):
    # a short collective timeout, by configuration (the default is 10 s)
    engine = make_engine(tiny_llama, tensor_parallel_size=2,
                         tp_collective_timeout_s=COLLECTIVE_TIMEOUT_S)
    group = engine.runner.group
    rank1 = group._procs[0]
    try:
        if fault == "missed plan":
            monkeypatch.setattr(group, "send_step", lambda chunks: None)
        else:
            os.kill(rank1.pid, signal.SIGSTOP)
        engine.add_request("a", PROMPT["a"], greedy(4))
        t0 = time.monotonic()
        with pytest.raises(RankDied, match="tensor-parallel step failed"):
            engine.step()
        took = time.monotonic() - t0
        assert took < COLLECTIVE_TIMEOUT_S + 3, took
    finally:
        if rank1.poll() is None:
            os.kill(rank1.pid, signal.SIGKILL)
        engine.shutdown()
