"""AsyncEngine: concurrent streams through the step-loop thread, cancellation frees."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from engine_helpers import greedy, hf_greedy, make_engine, random_prompts
from kvpush.engine.async_engine import AsyncEngine
from kvpush.engine.core_loop import CoreLoop
from kvpush.engine.outputs import EngineOutput, FinishReason, RequestError


def _async_engine(model_dir, **kw) -> AsyncEngine:
    eng = make_engine(model_dir, **kw)
    return AsyncEngine(eng.config, engine=eng)


async def _wait_all_free(engine: AsyncEngine, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        s = engine.stats()
        if s.num_free_blocks == s.num_total_blocks and s.num_running + s.num_waiting == 0:
            return
        assert asyncio.get_running_loop().time() < deadline, s
        await asyncio.sleep(0.01)


def test_concurrent_requests_match_hf(tiny_qwen3):
    prompts = random_prompts([3, 20, 47, 90, 130], seed=8)

    async def main():
        engine = _async_engine(tiny_qwen3, max_num_batched_tokens=64)
        engine.start()
        try:
            async def one(i, p):
                toks, reason = [], None
                async for out in engine.generate(f"r{i}", p, greedy(12)):
                    toks += out.new_token_ids
                    reason = out.finish_reason
                return toks, reason

            results = await asyncio.wait_for(
                asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))), 60
            )
            await _wait_all_free(engine)
            return results
        finally:
            await engine.shutdown()

    results = asyncio.run(main())
    for p, (toks, reason) in zip(prompts, results):
        assert reason is FinishReason.LENGTH
        assert toks == hf_greedy(tiny_qwen3, p, 12)


def test_consumer_leaving_aborts_and_frees(tiny_llama):
    async def main():
        engine = _async_engine(tiny_llama)
        engine.start()
        try:
            n = 0
            stream = engine.generate("r", random_prompts([30])[0], greedy(500))
            async for _ in stream:
                n += 1
                if n == 3:
                    break
            await stream.aclose()
            await _wait_all_free(engine)

            # a task cancelled while waiting for output aborts too
            async def consume():
                async for _ in engine.generate("c", random_prompts([30])[0], greedy(500)):
                    pass

            task = asyncio.create_task(consume())
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await _wait_all_free(engine)
            assert engine.is_healthy()
        finally:
            await engine.shutdown()
        assert not engine.is_healthy()

    asyncio.run(main())


def test_bad_request_raises_before_streaming(tiny_llama):
    async def main():
        engine = _async_engine(tiny_llama, max_model_len=64)
        engine.start()
        try:
            with pytest.raises(RequestError):
                async for _ in engine.generate("r", [5] * 70, greedy(4)):
                    pass
            # the engine keeps serving
            toks = []
            async for out in engine.generate("ok", [5] * 10, greedy(4)):
                toks += out.new_token_ids
            assert len(toks) == 4
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_step_loop_sleeps_when_idle(tiny_llama):
    """No spinning: an idle engine's step-loop thread uses (almost) no CPU."""

    async def main():
        engine = _async_engine(tiny_llama)
        engine.start()
        try:
            await asyncio.sleep(0.1)
            tid = engine._thread.native_id
            t0 = _thread_cpu(tid)
            await asyncio.sleep(0.5)
            return _thread_cpu(tid) - t0
        finally:
            await engine.shutdown()

    used = asyncio.run(main())
    assert used < 0.05, f"idle step loop used {used:.3f} s CPU in 0.5 s"


def _thread_cpu(tid: int) -> float:
    import os

    with open(f"/proc/{os.getpid()}/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def test_outputs_from_the_inbox_go_out_before_the_next_step():
    """Token #1 that arrives with pushed KV (an inbox event) must reach its stream
    before the engine runs a forward pass it has no part in."""
    events: list[str] = []

    class StubEngine:
        tokenizer = None
        scheduler = SimpleNamespace(requests={})
        inbox_answers = [[EngineOutput("token-1", [1])], []]
        stopping = False

        def process_inbox(self, block=False, timeout=None):
            answer = self.inbox_answers.pop(0)
            self.stopping = not self.inbox_answers
            return list(answer)

        def prepare_step_thread(self):
            events.append("prepare")

        def has_work(self):
            return True

        def step(self):
            events.append("step")
            return [EngineOutput("token-2", [2])]

        def shutdown(self):
            events.append("shutdown")

    core = CoreLoop(None, engine=StubEngine())  # type: ignore[arg-type]
    core.run(lambda batch: events.append(f"post {[o.request_id for o in batch.outputs]}"))
    assert events == ["prepare", "post ['token-1']", "step", "post ['token-2']", "shutdown"]


_THREADS_SCRIPT = r"""
import asyncio, json, sys, torch
from kvpush.config import EngineConfig
from kvpush.engine.async_engine import AsyncEngine
from kvpush.engine.core_loop import CoreLoop
from kvpush.sampling_params import SamplingParams

config = EngineConfig.build(sys.argv[1], threads=2, block_size=16, num_blocks=64,
                            max_model_len=128)
engine = AsyncEngine(config)
seen = []
step = engine.engine.step

def traced_step():
    seen.append(torch.get_num_threads())
    return step()

engine.engine.step = traced_step

async def main():
    engine.start()
    try:
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        async for _ in engine.generate("r", list(range(5, 40)), params):
            pass
    finally:
        await engine.shutdown()

asyncio.run(main())
print(json.dumps({"main": torch.get_num_threads(), "step": sorted(set(seen))}))
"""


def test_only_the_step_loop_runs_multithreaded_torch(tiny_llama):
    """The model loads with one torch thread and the step loop sets --threads for
    itself: a second OpenMP pool on the main thread made every 2-thread step sleep and
    wake its worker at each parallel region (a fresh process: the test runner's main
    thread has its own torch settings)."""
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _THREADS_SCRIPT, str(tiny_llama)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"main": 1, "step": [2]}


def test_a_request_the_core_never_took_fails_at_once_with_the_loops_reason(tiny_llama):
    """The core loop's last batch says why it died (EngineOutputs.fatal): a stream whose
    request the loop never took (still on its way in) fails then, with that reason, not
    later with the process's exit code; requests after it are refused."""
    from kvpush.engine.core_link import NO_SNAPSHOT
    from kvpush.engine.front import FrontEnd
    from kvpush.engine.inputs import AddRequest
    from kvpush.engine.outputs import EngineOutputs
    from kvpush.models.tokenizer import load_tokenizer
    from kvpush.sampling_params import SamplingParams

    why = "tensor-parallel rank 1 was killed by SIGKILL"

    class Unread(FrontEnd):  # the core takes nothing it is sent
        def __init__(self) -> None:
            super().__init__(None, load_tokenizer(str(tiny_llama)), NO_SNAPSHOT)
            self.sent: list = []

        def _add(self, internal, prompt_token_ids, params, kv_transfer_params):
            return AddRequest(internal, list(prompt_token_ids), params, None), params

        def _send(self, cmd) -> None:
            self.sent.append(cmd)

        def _core_problem(self):
            return self.fatal

    async def main() -> None:
        front = Unread()
        stream = front.generate("r", [5, 6, 7], SamplingParams(max_tokens=2))
        first = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.05)
        assert not first.done() and len(front.sent) == 1  # sent, never answered
        front.dispatch(EngineOutputs([], fatal=why))
        out = await asyncio.wait_for(first, 1)
        assert out.finished and out.finish_reason is FinishReason.ERROR and why in out.error
        with pytest.raises(RequestError, match=why):
            await anext(front.generate("s", [5], SamplingParams(max_tokens=1)))

    asyncio.run(main())
