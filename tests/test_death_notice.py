"""A transfer thread that dies in a real ``kvpush serve`` (issue 50, point 3), as its
clients and its peer notice it: the instance's streams fail with the reason, its log
says why in one line, its API process exits 1 with its engine core; the peer decode
instance, whose receive waited on it, fails that request at its lease (the connection
to the vanished prefill is down) and has every block back, serving on.

Prefill runs as ``python -m kvpush_testing.serve --die-when PATH``: kvpush's serve, its
engine core given links whose side channel raises once PATH exists. Decode is a plain
``kvpush serve``. NIXL moves nothing here: the death comes before any KV.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
import uuid

import httpx
import pytest

from kvpush_testing.serve import CRASH
from server_helpers import (
    ServerProcess,
    child_pids,
    pid_alive,
    push_kv,
)

pytestmark = pytest.mark.timeout(180)

LEASE = 2.0
COMMON = ("--kv-transfer", "push", "--lease-timeout", str(LEASE), "--heartbeat-interval",
          "0.2", "--block-size", "16", "--num-blocks", "128", "--max-model-len", "512")


def test_a_dead_transfer_thread_fails_its_streams_exits_and_its_peer_frees(tiny_qwen3,
                                                                         tmp_path):
    trigger = tmp_path / "die"
    with concurrent.futures.ThreadPoolExecutor(3) as pool:  # the two start together
        dying = pool.submit(ServerProcess, tiny_qwen3, "--role", "prefill", *COMMON,
                            log_dir=tmp_path, name="dying",
                            command=("-m", "kvpush_testing.serve", "--die-when", str(trigger)))
        decode = pool.submit(ServerProcess, tiny_qwen3, "--role", "decode", *COMMON,
                             log_dir=tmp_path, name="decode")
        p, d = dying.result(), decode.result()
        try:
            [core] = child_pids(p.proc.pid)
            p_info, d_info = p.get("/kv/info"), d.get("/kv/info")
            # decode's leg: its blocks wait for prefill's KV (prefill's leg never comes)
            tid = uuid.uuid4().hex
            kv = push_kv(tid, p_info, d_info)[1]
            leg = pool.submit(httpx.post, d.url + "/v1/completions", timeout=60, json={
                "prompt": "the quick brown fox jumps over the lazy dog " * 4,
                "max_tokens": 4, "kv_transfer_params": kv})
            deadline = time.monotonic() + 20
            while d.get("/kv/info")["num_free_blocks"] == d_info["num_total_blocks"]:
                assert time.monotonic() < deadline and not leg.done(), leg
                time.sleep(0.02)
            # a stream on prefill: a few tokens out, then its transfer thread dies
            lines: list[str] = []
            body = {"prompt": [5, 6, 7, 8], "max_tokens": 500, "ignore_eos": True,
                    "stream": True}
            with httpx.stream("POST", p.url + "/v1/completions", json=body,
                              timeout=30) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    lines.append(line)
                    if len(lines) == 6:
                        trigger.touch()
            events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
            error = events[-1].get("error")
            assert error is not None, events[-3:]
            assert "the KV transfer thread died" in error["message"], error
            assert CRASH in error["message"], error
            assert "data: [DONE]" in lines[-2:]
            assert p.proc.wait(30) == 1
            log = p.log_path.read_text()
            assert log.count("the KV transfer thread died (") == 1, log
            # serve says why its core ended, as the streams did, not just the exit code
            assert f"kvpush serve: error: the KV transfer thread died: RuntimeError: {CRASH}" \
                in log
            assert "step loop died" not in log
            deadline = time.monotonic() + 10
            while pid_alive(core):
                assert time.monotonic() < deadline, f"the engine core {core} is still there"
                time.sleep(0.05)

            # decode: the receive fails at its lease, every block comes back
            r = leg.result(timeout=30)
            assert r.status_code == 500, r.text
            assert "lease expired" in r.json()["error"]["message"], r.text
            info = d.wait_all_free(timeout=10)
            assert info["num_free_blocks"] == info["num_total_blocks"]
            assert httpx.get(d.url + "/health", timeout=5).status_code == 200
        finally:
            p.stop()
            d.stop()
