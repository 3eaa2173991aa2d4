"""`kvpush bench`: exact-length deterministic prompts, statistics against numpy, and
benchmark runs against a real `kvpush serve` on the tiny model."""

from __future__ import annotations

import asyncio
import json
import math
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kvpush.bench.client import run_benchmark
from kvpush.bench.datasets import (
    DATASETS,
    DatasetError,
    PromptCodec,
    load_tokenizer,
    sample_requests,
    sonnet_lines,
)
from kvpush.bench.metrics import (
    RequestResult,
    compute_metrics,
    format_table,
    mean,
    percentile,
    std,
    summarize,
)
from kvpush.bench.settings import BenchConfig, BenchError, arrival_offsets
from kvpush.cli import main
from server_helpers import ServerProcess, free_port

MAX_MODEL_LEN = 64
#: vLLM `bench serve` result fields a kvpush result must carry.
VLLM_FIELDS = (
    "date", "backend", "model_id", "num_prompts", "request_rate", "max_concurrency",
    "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
    "request_throughput", "output_throughput", "total_token_throughput",
    "input_lens", "output_lens", "ttfts", "itls", "errors",
) + tuple(f"{stat}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el")
          for stat in ("mean", "median", "std", "p90", "p99"))


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return load_tokenizer(str(tiny_llama))


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    srv = ServerProcess(tiny_llama, "--max-model-len", str(MAX_MODEL_LEN),
                        log_dir=tmp_path_factory.mktemp("bench-logs"), name="bench")
    yield srv
    srv.stop()


def _count(codec: PromptCodec, prompt: str | list[int]) -> int:
    return len(prompt) if isinstance(prompt, list) else codec.count(prompt)


# ------------------------------------------------------------------------- data sets


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("dataset", DATASETS)
def test_datasets_exact_length_and_deterministic(tokenizer, endpoint, dataset):
    codec = PromptCodec(tokenizer, endpoint)
    types = ["auto"] if dataset == "sonnet" else ["auto", "text"]
    for prompt_type in types:
        for input_len in (24, 37, 300):
            reqs = sample_requests(codec, dataset, 6, input_len, 8, seed=3,
                                   prompt_type=prompt_type)
            assert [_count(codec, r.prompt) for r in reqs] == [input_len] * 6
            assert all(r.prompt_len == input_len and r.expected_output_len == 8
                       for r in reqs)
            again = sample_requests(codec, dataset, 6, input_len, 8, seed=3,
                                    prompt_type=prompt_type)
            assert [r.prompt for r in again] == [r.prompt for r in reqs]
            other = sample_requests(codec, dataset, 6, input_len, 8, seed=4,
                                    prompt_type=prompt_type)
            assert [r.prompt for r in other] != [r.prompt for r in reqs]
            assert len({str(r.prompt) for r in reqs}) == 6  # prompts differ


def test_prompt_kinds_and_shared_prefixes(tokenizer):
    comp = PromptCodec(tokenizer, "completions")
    ids = sample_requests(comp, "random", 3, 40, 4)
    assert all(isinstance(r.prompt, list) for r in ids)
    assert all(isinstance(r.prompt, str)
               for r in sample_requests(comp, "random", 3, 40, 4, prompt_type="text"))
    shared = sample_requests(comp, "shared-prefix", 4, 50, 4, prefix_len=20)
    heads = {tuple(r.prompt[:20]) for r in shared}
    tails = {tuple(r.prompt[20:]) for r in shared}
    assert len(heads) == 1 and len(tails) == 4
    sonnet = sample_requests(comp, "sonnet", 3, 120, 4, prefix_len=60)
    assert all(r.prompt.startswith("Pick as many lines as you can from these poem lines:\n"
                                   + sonnet_lines()[0]) for r in sonnet)
    assert len(sonnet_lines()) >= 100


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_random_prompt_lengths_spread(tokenizer, endpoint):
    """--input-len-spread: each random prompt's length is drawn from input_len * [1 - s,
    1 + s], exactly that many tokens, the same for the seed; 0 keeps them all equal."""
    codec = PromptCodec(tokenizer, endpoint)
    reqs = sample_requests(codec, "random", 40, 100, 8, seed=2, input_len_spread=0.5)
    lens = [_count(codec, r.prompt) for r in reqs]
    assert lens == [r.prompt_len for r in reqs]
    assert all(50 <= n <= 150 for n in lens) and len(set(lens)) > 20
    again = sample_requests(codec, "random", 40, 100, 8, seed=2, input_len_spread=0.5)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]
    with pytest.raises(BenchError, match="random data set only"):
        BenchConfig(url="http://x", dataset="sonnet", input_len_spread=0.5).validate()
    with pytest.raises(BenchError, match=r"in \[0, 1\)"):
        BenchConfig(url="http://x", input_len_spread=1.0).validate()


def test_dataset_errors(tokenizer):
    chat = PromptCodec(tokenizer, "chat")
    with pytest.raises(DatasetError, match="too short"):
        sample_requests(chat, "random", 1, chat.overhead, 4)
    with pytest.raises(DatasetError, match="token-id prompts"):
        sample_requests(chat, "random", 1, 40, 4, prompt_type="token-ids")
    comp = PromptCodec(tokenizer, "completions")
    with pytest.raises(DatasetError, match="prefix length"):
        sample_requests(comp, "shared-prefix", 1, 40, 4, prefix_len=40)
    with pytest.raises(DatasetError, match="unknown data set"):
        sample_requests(comp, "nope", 1, 40, 4)


# ------------------------------------------------------------------------ statistics


def test_percentiles_mean_std_match_numpy():
    rng = random.Random(0)
    for n in (1, 2, 3, 7, 100, 1001):
        values = [rng.expovariate(3.0) for _ in range(n)]
        for q in (0, 1, 25, 50, 90, 99, 99.9, 100):
            assert percentile(values, q) == pytest.approx(np.percentile(values, q),
                                                          rel=1e-12, abs=1e-15)
        assert mean(values) == pytest.approx(np.mean(values), rel=1e-12)
        assert std(values) == pytest.approx(np.std(values), rel=1e-9, abs=1e-15)
    assert percentile([], 99) == mean([]) == std([]) == 0.0
    with pytest.raises(ValueError):
        percentile([1.0], 101)
    s = summarize([0.001, 0.002, 0.003], "ttft", (90, 99.9))
    assert set(s) == {"mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p90_ttft_ms",
                      "p99.9_ttft_ms"}
    assert s["median_ttft_ms"] == pytest.approx(2.0)


def test_compute_metrics_by_hand():
    ok = RequestResult(prompt_len=10, success=True, output_tokens=5, ttft=0.1,
                       itl=[0.05] * 4, latency=0.3)
    one = RequestResult(prompt_len=10, success=True, output_tokens=1, ttft=0.2, latency=0.2)
    bad = RequestResult(prompt_len=10, error="HTTP 400: no")
    m = compute_metrics([ok, one, bad], duration=2.0)
    assert (m["completed"], m["failed"]) == (2, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (20, 6)
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(3.0)
    assert m["total_token_throughput"] == pytest.approx(13.0)
    assert m["mean_tpot_ms"] == pytest.approx(50.0)  # (0.3 - 0.1) / 4; `one` has no TPOT
    assert m["mean_ttft_ms"] == pytest.approx(150.0)
    assert m["mean_itl_ms"] == pytest.approx(50.0)
    assert m["p99_e2el_ms"] == pytest.approx(np.percentile([300, 200], 99))
    table = format_table({**m, "duration": 2.0, "request_rate": "inf",
                          "max_concurrency": None})
    assert "Serving Benchmark Result" in table and "Mean TTFT (ms):" in table


def test_arrival_offsets():
    assert arrival_offsets(4, math.inf, 0) == [0.0] * 4
    a = arrival_offsets(2000, 4.0, 7)
    assert a == arrival_offsets(2000, 4.0, 7) and a != arrival_offsets(2000, 4.0, 8)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:]))
    assert a[-1] / (len(a) - 1) == pytest.approx(0.25, rel=0.1)  # mean gap 1 / rate


# ----------------------------------------------------------- runs against kvpush serve


def _check_ok(result, n: int, input_len: int, output_len: int) -> dict:
    d = result.to_dict()
    missing = [f for f in VLLM_FIELDS if f not in d]
    assert not missing, missing
    assert (d["completed"], d["failed"]) == (n, 0), d["errors"]
    assert d["input_lens"] == [input_len] * n
    assert d["output_lens"] == [output_len] * n
    assert d["errors"] == [""] * n
    assert all(0 < t < e for t, e in zip(d["ttfts"], d["e2els"]))
    assert d["total_output_tokens"] == n * output_len
    assert 0 < d["mean_ttft_ms"] < d["mean_e2el_ms"]
    assert d["request_throughput"] > 0 and not result.warnings
    json.dumps(d, allow_nan=False)
    return d


def test_run_rate_inf(server, tiny_llama):
    cfg = BenchConfig(url=server.url, input_len=32, output_len=8, num_prompts=8)
    before = time.time()
    result = run_benchmark(cfg)
    d = _check_ok(result, 8, 32, 8)
    assert before < d["start_wall"] < time.time() - d["duration"]  # when start_times count
    assert d["model_id"] == Path(tiny_llama).name  # from GET /v1/models
    assert d["tokenizer_id"] == str(tiny_llama)  # its root
    assert d["request_rate"] == "inf" and d["backend"] == "openai"


def test_run_finite_rate_with_concurrency_cap(server):
    cfg = BenchConfig(url=server.url, input_len=32, output_len=8, num_prompts=8,
                      request_rate=40.0, max_concurrency=2, seed=1)
    result = run_benchmark(cfg)
    d = _check_ok(result, 8, 32, 8)
    offsets = arrival_offsets(8, 40.0, 1)
    assert all(s >= o - 0.005 for s, o in zip(d["start_times"], offsets))
    assert d["duration"] >= offsets[-1]
    assert d["request_rate"] == 40.0 and d["max_concurrency"] == 2


def test_run_chat_sonnet_and_shared_prefix(server):
    chat = BenchConfig(url=server.url, endpoint="chat", dataset="sonnet", input_len=40,
                       output_len=6, num_prompts=4, request_rate=50.0)
    assert _check_ok(run_benchmark(chat), 4, 40, 6)["backend"] == "openai-chat"
    shared = BenchConfig(url=server.url, dataset="shared-prefix", input_len=48,
                         prefix_len=32, output_len=4, num_prompts=4)
    assert _check_ok(run_benchmark(shared), 4, 48, 4)["prefix_len"] == 32


def test_cli_run_writes_json(server, tmp_path, capsys):
    out = tmp_path / "r" / "result.json"
    rc = main(["bench", "--url", server.url, "--input-len", "16", "--output-len", "4",
               "--num-prompts", "3", "--request-rate", "inf", "--no-progress",
               "--label", "cli", "--out", str(out)])
    assert rc == 0
    d = json.loads(out.read_text())
    assert d["completed"] == 3 and d["label"] == "cli" and d["output_lens"] == [4] * 3
    assert "Serving Benchmark Result" in capsys.readouterr().out


def test_cli_run_with_vllm_flags(server, tmp_path, capsys):
    """`vllm bench serve`'s names: --base-url, --dataset-name, --random-input-len,
    --random-output-len, --metric-percentiles, --result-dir (the JSON under vLLM's kind
    of name) and --endpoint as a path."""
    rc = main(["bench", "--base-url", server.url + "/v1", "--dataset-name", "random",
               "--random-input-len", "16", "--random-output-len", "4", "--num-prompts", "2",
               "--metric-percentiles", "50", "--endpoint", "/v1/completions",
               "--no-progress", "--result-dir", str(tmp_path / "res")])
    assert rc == 0
    (path,) = (tmp_path / "res").glob("kvpush-infqps-*.json")
    d = json.loads(path.read_text())
    assert d["completed"] == 2 and d["output_lens"] == [4] * 2
    assert "p50_ttft_ms" in d and "p99_ttft_ms" not in d
    assert f"result written to {path}" in capsys.readouterr().out


def test_refused_requests_are_counted_and_json_written(server, tmp_path, capsys):
    out = tmp_path / "refused.json"
    rc = main(["bench", "--url", server.url, "--input-len", str(MAX_MODEL_LEN + 10),
               "--output-len", "4", "--num-prompts", "3", "--no-progress",
               "--out", str(out)])
    assert rc == 1
    d = json.loads(out.read_text())
    assert (d["completed"], d["failed"]) == (0, 3)
    assert all(e.startswith("HTTP 400:") and "maximum context length" in e
               for e in d["errors"])
    assert d["output_lens"] == [0] * 3 and d["mean_ttft_ms"] == 0.0
    assert "3 request(s) failed" in capsys.readouterr().out


def test_run_timeout_bounds_the_run(server):
    cfg = BenchConfig(url=server.url, input_len=16, output_len=4, num_prompts=5,
                      request_rate=0.2, seed=2, timeout=1.5)
    result = run_benchmark(cfg)
    assert result.duration < 5
    assert result.completed >= 1 and result.failed >= 1  # the first goes at t=0
    assert result.completed + result.failed == 5
    assert any("before it was sent" in r.error for r in result.outputs)


def test_unreachable_server_counts_failures(tiny_llama):
    cfg = BenchConfig(url=f"http://127.0.0.1:{free_port()}", model="m",
                      tokenizer=str(tiny_llama), input_len=16, output_len=4, num_prompts=2)
    result = run_benchmark(cfg)
    assert result.failed == 2 and all("Connect" in r.error for r in result.outputs)


# ------------------------------------------------ other OpenAI-compatible servers (fake)


def _fake_app():
    """Streams the way vLLM does (chat: a role chunk first; a separate finish chunk; usage
    in a last chunk with no choices; SSE comments), or misbehaves, by ``fake_mode``."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    def frame(obj) -> bytes:
        return b"data: " + json.dumps(obj).encode() + b"\n\n"

    async def generate(request: Request):
        body = await request.json()
        mode, n = body.get("fake_mode", "vllm"), body["max_tokens"]
        chat = "messages" in body
        assert body["stream"] and body["ignore_eos"] and body["temperature"] == 0.0
        if mode == "http-error":
            return JSONResponse({"error": {"message": "overloaded"}}, status_code=503)

        def choice(text, finish=None):
            if chat:
                delta = {"content": text} if text or not finish else {}
                return {"index": 0, "delta": delta, "finish_reason": finish}
            return {"index": 0, "text": text, "finish_reason": finish}

        async def events():
            yield b": ping\n\n"
            if chat:
                yield frame({"choices": [{"index": 0, "delta": {"role": "assistant",
                                                                 "content": ""}}]})
            for i in range(n):
                await asyncio.sleep(0.002)
                # "held": the first token's text waits for the second (part of a
                # UTF-8 character), sent as an empty text the way vLLM does
                text = "" if mode == "held" and i == 0 else " the"
                yield frame({"choices": [choice(text)]})
                if mode == "error" and i == 1:
                    yield frame({"error": {"message": "boom", "code": 500}})
                    yield b"data: [DONE]\n\n"
                    return
                if mode == "slow":
                    await asyncio.sleep(5)
            if mode == "truncated":
                return
            yield frame({"choices": [choice("", "length")]})
            if mode != "no-usage":
                yield frame({"choices": [], "usage": {"prompt_tokens": 7,
                                                      "completion_tokens": n,
                                                      "total_tokens": n + 7}})
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [{"id": "fake", "root": "/nowhere"}]})

    return Starlette(routes=[Route("/v1/models", models),
                             Route("/v1/completions", generate, methods=["POST"]),
                             Route("/v1/chat/completions", generate, methods=["POST"])])


@pytest.fixture(scope="module")
def fake_server():
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(_fake_app(), log_level="warning",
                                           access_log=False, timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(10)
    sock.close()


def _fake_run(url, tiny_llama, mode, endpoint="completions", **kw):
    cfg = BenchConfig(url=url, tokenizer=str(tiny_llama), endpoint=endpoint, input_len=16,
                      output_len=5, num_prompts=2, extra_body={"fake_mode": mode}, **kw)
    return run_benchmark(cfg)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_vllm_style_stream(fake_server, tiny_llama, endpoint):
    result = _fake_run(fake_server, tiny_llama, "vllm", endpoint)
    d = result.to_dict()
    assert (d["completed"], d["model_id"], d["output_lens"]) == (2, "fake", [5, 5])
    assert [len(i) for i in d["itls"]] == [4, 4]  # content chunks only
    assert result.outputs[0].generated_text == " the" * 5
    assert any("prompt_tokens" in w for w in result.warnings)  # the fake says 7, not 16


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_first_token_with_held_back_text_counts(fake_server, tiny_llama, endpoint):
    # TTFT is the first token's chunk even when its text is empty, as in vLLM's
    # benchmark: every token chunk after it is one gap, the finish chunk none
    result = _fake_run(fake_server, tiny_llama, "held", endpoint)
    d = result.to_dict()
    assert d["completed"] == 2 and [len(i) for i in d["itls"]] == [4, 4]
    assert result.outputs[0].generated_text == " the" * 4


def test_stream_without_usage_counts_tokens(fake_server, tiny_llama):
    result = _fake_run(fake_server, tiny_llama, "no-usage")
    expected = len(load_tokenizer(str(tiny_llama)).encode(" the" * 5, add_special_tokens=False))
    assert result.completed == 2 and [r.output_tokens for r in result.outputs] == [expected] * 2


@pytest.mark.parametrize("mode, error", [
    ("http-error", "HTTP 503: {"),
    ("error", "error in stream:"),
    ("truncated", "the stream ended before [DONE]"),
    ("slow", "timed out after 0.5 s"),
])
def test_failed_streams(fake_server, tiny_llama, mode, error):
    result = _fake_run(fake_server, tiny_llama, mode, request_timeout=0.5)
    assert result.failed == 2 and result.completed == 0
    assert all(r.error.startswith(error) for r in result.outputs), [r.error for r in
                                                                    result.outputs]
    if mode == "http-error":
        assert "overloaded" in result.outputs[0].error


# --------------------------------------------------------------------------- the CLI


@pytest.mark.parametrize("argv, message", [
    (["--url", "http://x:1", "--num-prompts", "0"], "must be at least 1"),
    (["--url", "http://x:1", "--request-rate", "-2"], "must be positive"),
    (["--url", "http://x:1", "--dataset", "nope"], "invalid choice"),
    (["--url", "http://x:1", "--input-len", "ten"], "not an integer"),
    (["--url", "http://x:1", "--timeout", "0"], "positive number of seconds"),
    (["--url", "ftp://x"], "not an http(s) URL"),
    (["--url", "http://x:1", "--percentiles", "99,120"], "0..100"),
])
def test_cli_bad_flags(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_parser_stays_light():
    code = ("import sys; from kvpush.cli import build_parser; "
            "build_parser().parse_args(['bench', '--url', 'h:1']); "
            "print(sorted(m for m in ('kvpush.bench.client', 'transformers', 'httpx', "
            "'asyncio') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out.strip() == "[]"


def test_cli_bad_settings_exit_2(tiny_llama, capsys):
    assert main(["bench", "--input-len", "8"]) == 2
    assert "--url is required" in capsys.readouterr().err
    rc = main(["bench", "--url", "http://127.0.0.1:9", "--model", "m", "--tokenizer",
               str(tiny_llama), "--input-len", "8", "--prefix-len", "8",
               "--dataset", "shared-prefix", "--no-progress"])
    assert rc == 2
    assert "prefix_len must be in 1..7" in capsys.readouterr().err
    rc = main(["bench", "--url", "http://127.0.0.1:9", "--model", "no-such-model",
               "--no-progress"])
    assert rc == 2
    assert "GET /v1/models" in capsys.readouterr().err
