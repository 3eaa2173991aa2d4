"""`kvpush serve` with its engine core in a child process (kvpush.engine.core_proc):
the core's death mid-stream, SIGTERM and Ctrl-C, and nothing left running."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from pathlib import Path

import httpx
import msgspec
import pytest

from kvpush.engine.inputs import AbortRequests, AddRequest, EngineCommand, Shutdown
from kvpush.engine.outputs import (
    EngineOutput,
    EngineOutputs,
    EngineSnapshot,
    EngineStats,
    FinishReason,
    RequestFailure,
    TransferRecord,
)
from kvpush.kv_transfer.params import KVTransferParams
from kvpush.kv_transfer.record import TransferCounters
from kvpush.sampling_params import SamplingParams
from server_helpers import ServerProcess, child_pids, pid_alive


def _wait_gone(pids: list[int], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while any(pid_alive(p) for p in pids):
        assert time.monotonic() < deadline, [p for p in pids if pid_alive(p)]
        time.sleep(0.05)


def _core_of(srv: ServerProcess) -> int:
    kids = child_pids(srv.proc.pid)
    assert len(kids) == 1, kids
    assert "kvpush.engine.core_proc" in Path(f"/proc/{kids[0]}/cmdline").read_text()
    return kids[0]


def test_messages_round_trip():
    """What crosses the process boundary decodes to what was sent."""
    enc = msgspec.msgpack.Encoder()
    kv = KVTransferParams(do_remote_prefill=True, transfer_id="t", remote_host="h",
                          remote_port=3, remote_block_ids=[1, 2], prompt_hashes=[b"\x01"])
    params = SamplingParams(max_tokens=5, stop=("ab",), stop_token_ids=[3, 4],
                            logit_bias=((1, 2.0),))
    for cmd in (AddRequest("r#1", [1, 2], params, kv, 1.5), AbortRequests(["a"]), Shutdown()):
        assert msgspec.msgpack.decode(enc.encode(cmd), type=EngineCommand) == cmd
    batch = EngineOutputs(
        [EngineOutput("r", [7], [-0.5], [((7, -0.5),)], FinishReason.ERROR,
                      RequestFailure("no", True, "prompt", None, 400), kv, 2, 1, 0,
                      1.0, 0.5)],
        [TransferRecord("t", "decode", "push", True, 10)], [],
        EngineSnapshot(EngineStats(1, 0, 5, 8, 0, 0, 0),
                       TransferCounters(transfers_ok=1, side_channel_rejected={"stale": 2})))
    assert msgspec.msgpack.decode(enc.encode(batch), type=EngineOutputs) == batch


def test_core_killed_mid_stream(tiny_llama, tmp_path):
    """The core dies while a request streams: the client gets an error event, /health
    says why (or the server is already gone), the server exits non-zero with a clear
    message, and no process is left."""
    srv = ServerProcess(tiny_llama, "--max-model-len", "2048", log_dir=tmp_path)
    try:
        core = _core_of(srv)
        body = {"prompt": [5, 6, 7, 8], "max_tokens": 2000, "ignore_eos": True,
                "stream": True}
        lines: list[str] = []
        health: list[int | None] = []
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                lines.append(line)
                if len(lines) == 6:  # a few tokens out: kill the core
                    os.kill(core, signal.SIGKILL)
                    deadline = time.monotonic() + 10
                    while not health and time.monotonic() < deadline:
                        try:  # 200 until the death is noticed (a pidfd wakes the reader)
                            code = httpx.get(srv.url + "/health", timeout=5).status_code
                            if code != 200:
                                health.append(code)
                        except httpx.HTTPError:
                            health.append(None)  # already stopped
        events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        assert "error" in events[-1], events[-3:]
        assert "engine core process was killed by SIGKILL" in events[-1]["error"]["message"]
        assert lines[-1] == "data: [DONE]" or lines[-2] == "data: [DONE]"
        assert health[0] in (503, None), health
        assert srv.proc.wait(30) == 1
        log = srv.log_path.read_text()
        assert "kvpush serve: error: the engine core process was killed by SIGKILL" in log
        _wait_gone([srv.proc.pid, core])
    finally:
        srv.stop()


@pytest.mark.parametrize("how", [pytest.param("sigterm", marks=pytest.mark.slow),
                                 pytest.param("ctrl-c", marks=pytest.mark.slow),
                                 "group-sigterm"])
def test_signals_stop_both_processes(tiny_llama, tmp_path, how):
    """SIGTERM to the server, SIGINT to its process group (Ctrl-C in a terminal), or
    SIGTERM to the group (`kvpush up`'s stop, systemd: the core gets it too and may be
    gone before the server asks it to stop) stops the API process and the core while a
    request streams, promptly."""
    srv = ServerProcess(tiny_llama, "--max-model-len", "2048", log_dir=tmp_path)
    try:
        core = _core_of(srv)
        body = {"prompt": [5, 6, 7, 8], "max_tokens": 2000, "ignore_eos": True,
                "stream": True}
        with contextlib.suppress(httpx.HTTPError), \
                httpx.stream("POST", srv.url + "/v1/completions", json=body,
                             timeout=30) as r:
            for n, _ in enumerate(r.iter_lines()):
                if n == 4:
                    if how == "sigterm":
                        srv.proc.send_signal(signal.SIGTERM)
                    elif how == "group-sigterm":
                        os.killpg(srv.proc.pid, signal.SIGTERM)
                    else:
                        os.killpg(srv.proc.pid, signal.SIGINT)
        # uvicorn re-raises the signal it handled once it has shut down (130: Ctrl-C)
        sig = signal.SIGINT if how == "ctrl-c" else signal.SIGTERM
        # inside `kvpush up`'s 20 s before SIGKILL (uvicorn's drain is 10 s at most)
        assert srv.proc.wait(15) in (0, -sig, 128 + sig), srv.log_tail()
        assert "kvpush serve: error" not in srv.log_path.read_text(), srv.log_tail()
        assert "Traceback" not in srv.log_path.read_text(), srv.log_tail()
        _wait_gone([core])
    finally:
        srv.stop()


def test_core_client_in_process_app(tiny_llama):
    """The app on a CoreClient (ASGI, no HTTP server): requests run in the core, /kv/info
    and /metrics come from its reports, and a dead core turns /health into a 503 with
    the reason and calls on_death."""
    from kvpush.config import EngineConfig
    from kvpush.engine.core_client import CoreClient
    from kvpush.server.app import build_app

    config = EngineConfig.build(tiny_llama, max_model_len=256, num_blocks=64, block_size=16,
                                max_num_batched_tokens=256)
    client = CoreClient.launch(config, log_level="WARNING")
    deaths: list[str] = []
    client.on_death = deaths.append
    app = build_app(client)

    async def main() -> None:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t",
                                         timeout=30) as c:
                r = await c.post("/v1/completions", json={
                    "prompt": "hello world", "max_tokens": 6, "temperature": 0,
                    "ignore_eos": True})
                assert r.status_code == 200, r.text
                assert r.json()["usage"]["completion_tokens"] == 6
                info = (await c.get("/kv/info")).json()
                assert info["role"] == "both" and info["num_total_blocks"] == 64
                assert (await c.get("/health")).status_code == 200
                client.proc.kill()
                deadline = time.monotonic() + 10
                while not deaths:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.02)
                r = await c.get("/health")
                assert r.status_code == 503
                assert "engine core process was killed by SIGKILL" in r.text
                r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
                assert r.status_code == 503

    try:
        asyncio.run(main())
    finally:
        client.close()
    assert deaths == ["the engine core process was killed by SIGKILL"]


def test_a_parameter_over_64_bits_is_a_400_not_a_500(tiny_llama):
    """What crosses to the core is msgpack (64-bit ints): a top_k over that is clamped
    (it keeps every token either way), and any other value the wire cannot carry is the
    client's 400 with nothing left queued, not the server's 500 (found by
    test_fuzz_real_instance: top_k 1e20 answered 500 with the core in its own process)."""
    from engine_helpers import make_engine
    from kvpush.engine.front import FrontEnd
    from kvpush.errors import RequestError
    from kvpush.sampling_params import MAX_TOP_K

    eng = make_engine(tiny_llama)
    sent: list[bytes] = []

    class WireFront(FrontEnd):
        def _send(self, cmd: EngineCommand) -> None:
            sent.append(msgspec.msgpack.encode(cmd))

        def _core_problem(self) -> str | None:
            return None

    front = WireFront(eng.config, eng.tokenizer, eng.snapshot())
    huge = SamplingParams(max_tokens=2, temperature=1.0, top_k=10**20)
    assert huge.top_k == MAX_TOP_K
    msgspec.msgpack.encode(AddRequest("r#0", [1, 2], huge))

    async def first(params: SamplingParams) -> None:
        async for _ in front.generate("r", [1, 2, 3], params):
            break

    with pytest.raises(RequestError) as e:
        asyncio.run(first(SamplingParams(max_tokens=2, seed=2**70)))
    assert e.value.status_code == 400 and "out of range" in str(e.value)
    assert sent == [] and not front._streams and not front._internal
