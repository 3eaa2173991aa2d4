"""A tensor-parallel rank killed during a push (issue 52, point 5), in real `kvpush serve`
processes over NIXL: prefill at TP 2 pushes to decode at TP 1 (or TP 1 to TP 2), and
rank 1 of the TP 2 side is SIGKILLed while a long prompt's KV is being written. That
instance ends (its streams fail within a second, `kvpush serve` exits 1, no core or rank
process is left); its peer ends the push by its lease (2 s here), has every block back
and serves on.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time
import uuid
from pathlib import Path

import httpx
import pytest

from server_helpers import ServerProcess, all_child_pids, child_pids, pid_alive, push_kv

pytest.importorskip("nixl._api", reason="NIXL is not installed (make venv installs it)")
pytestmark = pytest.mark.timeout(180)

LEASE = 2.0
COMMON = ("--kv-transfer", "push", "--lease-timeout", str(LEASE), "--heartbeat-interval",
          "0.2", "--block-size", "8", "--num-blocks", "512", "--max-model-len", "2048",
          "--max-num-batched-tokens", "8")  # a long prompt prefills in many steps
PROMPT = [(7 * i + 3) % 1000 + 10 for i in range(1900)]  # 238 blocks, 238 steps
WHY = "tensor-parallel rank 1 was killed by SIGKILL"


def _stream(url: str, body: dict, lines: list[str]) -> float:
    """Read an SSE stream into ``lines``; when it ended (monotonic). A leg whose request
    reached its instance only after the kill (a loaded host) is answered with an error
    status instead of a stream: its body goes into ``lines`` as the last event."""
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        if r.status_code != 200:
            assert r.status_code >= 500, r.read()
            lines.append("data: " + r.read().decode())
            return time.monotonic()
        for line in r.iter_lines():
            lines.append(line)
    return time.monotonic()


def _end(lines: list[str]) -> dict:
    """A stream's last event."""
    events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert events, lines
    return events[-1]


def _error(lines: list[str]) -> str:
    end = _end(lines)
    assert "error" in end, lines[-3:]
    return end["error"]["message"]


def _free_again(srv: ServerProcess, want: int) -> float:
    """When ``srv``'s free blocks are ``want`` again (monotonic)."""
    _wait(lambda: srv.get("/kv/info")["num_free_blocks"] == want, "blocks not freed", 30)
    return time.monotonic()


def _wait(cond, what, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


# both in the slow tier: the kill must land while the push is in flight, which a loaded
# CI host's slow /kv/info polls can miss (the default suite keeps a rank killed
# mid-request: tests/test_tensor_parallel.py)
@pytest.mark.parametrize("dying", [pytest.param("prefill", marks=pytest.mark.slow),
                                   pytest.param("decode", marks=pytest.mark.slow)])
def test_rank_killed_during_a_push(tiny_llama, tmp_path, dying):
    tp = {role: ("-tp", "2" if role == dying else "1") for role in ("prefill", "decode")}
    # prefill at TP 1 computes the prompt too fast to catch it: its WRITEs' completions
    # are held a while (NIXL has moved the bytes; prefill has not said PushDone yet)
    slow = ("-m", "kvpush_testing.serve", "--faults", json.dumps({"transfer_delay_s": 1.5}))
    command = {"prefill": slow if dying == "decode" else ("-m", "kvpush", "serve"),
               "decode": ("-m", "kvpush", "serve")}
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        starts = [pool.submit(ServerProcess, tiny_llama, "--role", role, *tp[role], *COMMON,
                              log_dir=tmp_path, name=role, command=command[role])
                  for role in ("prefill", "decode")]
        concurrent.futures.wait(starts)
        servers = [s.result() for s in starts if s.exception() is None]
        try:
            p, d = (s.result() for s in starts)
            p_info, d_info = p.get("/kv/info"), d.get("/kv/info")
            gone, peer = (p, d) if dying == "prefill" else (d, p)
            peer_free = peer.get("/kv/info")["num_free_blocks"]
            assert gone.get("/kv/info")["tensor_parallel_size"] == 2
            (core,) = child_pids(gone.proc.pid)
            (rank1,) = all_child_pids(core)
            assert "kvpush.engine.rank_proc" in Path(f"/proc/{rank1}/cmdline").read_text()

            # a stream on the instance that loses its rank, under way before the push
            plain: list[str] = []
            plain_end = pool.submit(_stream, gone.url, {
                "prompt": [5, 6, 7, 8], "max_tokens": 2000, "ignore_eos": True,
                "stream": True}, plain)
            _wait(lambda: len(plain) >= 4 or plain_end.done(), "no tokens")

            # the push: both legs at once, as the router sends them (decode registers
            # its blocks at prefill, whose WRITEs follow its chunks); both legs stream
            tid = uuid.uuid4().hex
            p_kv, d_kv = push_kv(tid, p_info, d_info)
            p_free = p.get("/kv/info")["num_free_blocks"]
            d_lines: list[str] = []
            p_lines: list[str] = []
            d_leg = pool.submit(_stream, d.url, {"prompt": PROMPT, "max_tokens": 4,
                                                 "stream": True, "kv_transfer_params": d_kv},
                                d_lines)
            p_leg = pool.submit(_stream, p.url, {"prompt": PROMPT, "max_tokens": 1,
                                                 "stream": True, "kv_transfer_params": p_kv},
                                p_lines)
            # prefill is part-way through the prompt, and decode has no token #1 yet
            _wait(lambda: p.get("/kv/info")["num_free_blocks"] < p_free - 20
                  or d_leg.done() or p_leg.done(), "the push did not start")
            assert not d_leg.done() and not d_lines, d_lines  # token #1 not in
            killed = time.monotonic()
            os.kill(rank1, signal.SIGKILL)
            peer_free_at = pool.submit(_free_again, peer, peer_free)

            # that instance ends: its streams fail with the reason, serve exits 1, and
            # nothing is left
            gone_legs = (p_leg, p_lines) if dying == "prefill" else (d_leg, d_lines)
            plain_s = plain_end.result(timeout=30) - killed
            leg_s = gone_legs[0].result(timeout=30) - killed
            assert WHY in _error(plain) and WHY in _error(gone_legs[1]), (plain[-2:],
                                                                          gone_legs[1])
            assert gone.proc.wait(30) == 1
            exit_s = time.monotonic() - killed
            _wait(lambda: not any(pid_alive(x) for x in (core, rank1)),
                  "the core or a rank is still there", timeout=10)
            assert "step loop died" not in gone.log_path.read_text()

            # the peer: the push ends by its lease, every block comes back, it serves on
            peer_leg = (d_leg, d_lines) if dying == "prefill" else (p_leg, p_lines)
            failed_s = peer_leg[0].result(timeout=30) - killed
            end = _end(peer_leg[1])
            how = end["error"]["message"] if "error" in end else end["choices"][0][
                "finish_reason"]
            free_s = peer_free_at.result(timeout=30) - killed
            print(f"\n{dying} rank 1 killed: its streams failed in {plain_s:.2f} s (plain) "
                  f"and {leg_s:.2f} s (its leg), serve exited 1 in {exit_s:.2f} s; the "
                  f"peer's leg ended in {failed_s:.2f} s ({how!r}), its "
                  f"blocks free in {free_s:.2f} s (lease {LEASE} s)")
            assert plain_s < 1.0 and leg_s < 1.0, (plain_s, leg_s)
            assert free_s < LEASE + 2.0, free_s
            after = httpx.post(peer.url + "/v1/completions", timeout=30, json={
                "prompt": [5, 6, 7, 8], "max_tokens": 4, "ignore_eos": True})
            assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 4
            peer.wait_all_free(timeout=10)
        finally:
            for s in servers:
                s.stop()
