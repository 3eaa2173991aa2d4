"""`kvpush up --discover`: the local cluster through an etcd it starts itself; from
another "terminal", `kvpush up --add-decode` and `--remove NAME` change it while it
serves, and the router follows. No process is left behind."""

from __future__ import annotations

import signal
import subprocess
import sys

import httpx
import pytest

from etcd_helpers import require_etcd
from test_up import ENGINE, STOP_S, _children_gone, up_factory, wait_until  # noqa: F401

require_etcd()

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc")]

BODY = {"prompt": "hello world " * 5, "max_tokens": 6, "temperature": 0}


def _control(up, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvpush", "up", *args, "--log-dir",
                           str(up.log_dir)], capture_output=True, text=True, timeout=120)


def _decodes(up) -> set[str]:
    inst = httpx.get(up.url + "/router/instances", timeout=5).json()["instances"]
    return {i["url"] for i in inst if i["role"] == "decode" and i["healthy"]}


def test_up_discover_add_and_remove_live(tiny_llama, up_factory):  # noqa: F811
    up = up_factory("--discover", *ENGINE, model=tiny_llama)
    up.wait_ready()
    assert "etcd at http://127.0.0.1:" in up.out and "--add-decode" in up.out
    with httpx.Client(base_url=up.url, timeout=60) as c:
        assert c.post("/v1/completions", json=BODY).status_code == 200
        (first,) = _decodes(up)
        r = _control(up, "--add-decode")
        assert r.returncode == 0 and r.stdout.startswith("ok: added decode-1"), r
        wait_until(lambda: len(_decodes(up)) == 2, 10, "the router takes decode-1 in")
        up.snapshot()
        for _ in range(4):
            assert c.post("/v1/completions", json=BODY).status_code == 200
        r = _control(up, "--remove", "decode-0")
        assert r.returncode == 0 and "removed decode-0: drained" in r.stdout, r
        wait_until(lambda: _decodes(up) and first not in _decodes(up), 5, "decode-0 gone")
        assert c.post("/v1/completions", json=BODY).status_code == 200
        r = _control(up, "--remove", "nobody")
        assert r.returncode == 1 and "no instance 'nobody'" in r.stdout
    assert up.proc.poll() is None  # a removed instance does not stop the cluster
    up.proc.send_signal(signal.SIGTERM)
    assert up.wait_exit(STOP_S) == 0, up.err
    _children_gone(up)
