"""`kvpush bench --dataset multi-turn`: conversations built to length from a seed, each
turn sent with the history and the answers the server gave, turns in order with their
think times, per-turn figures in the JSON, the tables and `bench compare`'s summary."""

from __future__ import annotations

import asyncio
import json
import math
import os
import threading
import time

import pytest

from kvpush.bench.client import run_benchmark
from kvpush.bench.compare_report import markdown_report, summarize_runs
from kvpush.bench.conversations import (
    QUESTION_HEAD,
    count_messages,
    multi_turn_conversations,
    think_times,
)
from kvpush.bench.datasets import DatasetError, PromptCodec, load_tokenizer
from kvpush.bench.settings import BenchConfig, BenchError
from kvpush.cli import main


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return load_tokenizer(str(tiny_llama))


@pytest.fixture(scope="module")
def chat(tokenizer):
    return PromptCodec(tokenizer, "chat")


def _plain(codec: PromptCodec, text: str) -> int:
    return len(codec.encode_plain(text))


# ------------------------------------------------------------------------- the data set


@pytest.mark.parametrize("system_len, question_len", [(30, 12), (300, 57), (0, 1)])
def test_conversations_have_their_lengths_and_follow_the_seed(chat, system_len, question_len):
    convs = multi_turn_conversations(chat, 4, 3, system_len, question_len, 7, seed=5)
    assert len(convs) == 4 and all(c.turns == 3 and c.output_len == 7 for c in convs)
    assert len({c.system_prompt for c in convs}) == 1  # shared by every conversation
    assert _plain(chat, convs[0].system_prompt) == system_len
    questions = [q for c in convs for q in c.questions]
    assert [_plain(chat, q) for q in questions] == [question_len] * 12
    if question_len >= 20:  # room for the numbered head: every question differs
        assert len(set(questions)) == 12
        assert convs[2].questions[1].startswith(QUESTION_HEAD.format(conversation=3, turn=2))
    again = multi_turn_conversations(chat, 4, 3, system_len, question_len, 7, seed=5)
    assert again == convs
    other = multi_turn_conversations(chat, 4, 3, system_len, question_len, 7, seed=6)
    if question_len > 1:  # a 1-token question is the head's first token
        assert [c.questions for c in other] != [c.questions for c in convs]
    if system_len > 100:  # past the fixed instruction: sonnet lines drawn from the seed
        assert other[0].system_prompt != convs[0].system_prompt


def test_messages_carry_the_history_and_the_answers(chat):
    (conv,) = multi_turn_conversations(chat, 1, 3, 20, 10, 4, seed=0)
    assert conv.messages(1, []) == [{"role": "system", "content": conv.system_prompt},
                                    {"role": "user", "content": conv.questions[0]}]
    three = conv.messages(3, ["A1", "A2"])
    assert [m["role"] for m in three] == ["system", "user", "assistant", "user",
                                          "assistant", "user"]
    assert [m["content"] for m in three[1:]] == [conv.questions[0], "A1", conv.questions[1],
                                                 "A2", conv.questions[2]]
    with pytest.raises(ValueError, match="earlier answer"):
        conv.messages(3, ["A1"])
    with pytest.raises(ValueError, match="not in 1..3"):
        conv.messages(4, ["A1", "A2", "A3"])
    (bare,) = multi_turn_conversations(chat, 1, 1, 0, 10, 4)
    assert bare.messages(1, []) == [{"role": "user", "content": bare.questions[0]}]
    # the server's count: the template's tokens too, and more for a longer history
    assert count_messages(chat, three) > count_messages(chat, conv.messages(2, ["A1"])) \
        > _plain(chat, conv.system_prompt) + 2 * 10


def test_dataset_errors(tokenizer, chat):
    with pytest.raises(DatasetError, match="chat endpoint"):
        multi_turn_conversations(PromptCodec(tokenizer, "completions"), 1, 2, 10, 10, 4)
    with pytest.raises(DatasetError, match="turns must be at least 1"):
        multi_turn_conversations(chat, 1, 0, 10, 10, 4)
    with pytest.raises(BenchError, match="--endpoint chat"):
        BenchConfig(url="http://x", dataset="multi-turn").validate()
    with pytest.raises(BenchError, match="think time distribution"):
        BenchConfig(url="http://x", dataset="multi-turn", endpoint="chat",
                    think_time_dist="uniform").validate()
    BenchConfig(url="http://x", dataset="multi-turn", endpoint="chat").validate()


def test_think_times_fixed_and_exponential():
    fixed = think_times(3, 4, 0.5, "fixed", seed=1)
    assert fixed == [[0.0, 0.5, 0.5, 0.5]] * 3
    assert think_times(2, 3, 0.0, "exponential") == [[0.0] * 3] * 2
    exp = think_times(500, 5, 2.0, "exponential", seed=3)
    assert exp == think_times(500, 5, 2.0, "exponential", seed=3)
    assert exp != think_times(500, 5, 2.0, "exponential", seed=4)
    assert all(row[0] == 0.0 for row in exp)
    pauses = [p for row in exp for p in row[1:]]
    assert sum(pauses) / len(pauses) == pytest.approx(2.0, rel=0.1)
    assert len(set(pauses)) == len(pauses)


# -------------------------------------------------- runs against a recording fake server


class Recorder:
    """What the fake server saw: per request its messages, when it arrived and when its
    stream ended (time.monotonic), and the text it answered."""

    def __init__(self, codec: PromptCodec) -> None:
        self.codec = codec
        self.lock = threading.Lock()
        self.requests: list[dict] = []

    def clear(self) -> None:
        with self.lock:
            self.requests.clear()


def _fake_app(rec: Recorder):
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    def frame(obj) -> bytes:
        return b"data: " + json.dumps(obj).encode() + b"\n\n"

    async def generate(request: Request):
        body = await request.json()
        messages, n = body["messages"], body["max_tokens"]
        assert body["stream"] and body["ignore_eos"] and body["temperature"] == 0.0
        entry = {"messages": messages, "arrived": time.monotonic(), "ended": None}
        with rec.lock:
            index = len(rec.requests)
            rec.requests.append(entry)
        turn = sum(m["role"] == "user" for m in messages)
        if body.get("fake_mode") == "fail-turn-2" and turn == 2:
            return JSONResponse({"error": {"message": "no"}}, status_code=503)
        # an answer no other request gets: the next turn must carry it back verbatim
        chunks = [f" r{index}t{i}" for i in range(n)]
        entry["answer"] = "".join(chunks)
        prompt_tokens = count_messages(rec.codec, messages)

        async def events():
            yield frame({"choices": [{"index": 0, "delta": {"role": "assistant",
                                                             "content": ""}}]})
            for text in chunks:
                await asyncio.sleep(0.002)
                yield frame({"choices": [{"index": 0, "delta": {"content": text},
                                          "finish_reason": None}]})
            yield frame({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
            yield frame({"choices": [], "usage": {"prompt_tokens": prompt_tokens,
                                                  "completion_tokens": n}})
            entry["ended"] = time.monotonic()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [{"id": "fake", "root": "/nowhere"}]})

    return Starlette(routes=[Route("/v1/models", models),
                             Route("/v1/chat/completions", generate, methods=["POST"])])


@pytest.fixture(scope="module")
def fake(chat):
    from server_helpers import uvicorn_server

    rec = Recorder(chat)
    with uvicorn_server(_fake_app(rec)) as url:
        yield url, rec


def _config(url: str, tiny_llama, **kw) -> BenchConfig:
    base = dict(url=url, tokenizer=str(tiny_llama), dataset="multi-turn", endpoint="chat",
                num_conversations=3, turns=3, system_prompt_len=24, question_len=10,
                output_len=4, seed=2, request_timeout=20, timeout=60)
    return BenchConfig(**{**base, **kw})


def _by_conversation(rec: Recorder) -> dict[str, list[dict]]:
    """The recorded requests grouped by conversation (its first question), turn order."""
    out: dict[str, list[dict]] = {}
    for r in rec.requests:
        first_q = next(m["content"] for m in r["messages"] if m["role"] == "user")
        out.setdefault(first_q, []).append(r)
    for reqs in out.values():
        reqs.sort(key=lambda r: len(r["messages"]))
    return out


def test_each_turn_sends_the_history_with_the_servers_answers(fake, tiny_llama, chat):
    url, rec = fake
    rec.clear()
    cfg = _config(url, tiny_llama, think_time=0.05, think_time_dist="fixed")
    result = run_benchmark(cfg)
    d = result.to_dict()
    assert (d["completed"], d["failed"]) == (9, 0), d["errors"]
    assert not result.warnings  # the client's prompt counts are the server's
    convs = multi_turn_conversations(chat, 3, 3, 24, 10, 4, seed=2)
    groups = _by_conversation(rec)
    assert sorted(groups) == sorted(c.questions[0] for c in convs)
    for conv in convs:
        reqs = groups[conv.questions[0]]
        assert len(reqs) == 3
        answers = [r["answer"] for r in reqs]
        for t, r in enumerate(reqs, 1):
            # the history, with the answers exactly as the server streamed them
            assert r["messages"] == conv.messages(t, answers[:t - 1])
        for prev, nxt in zip(reqs, reqs[1:]):  # in order, after the think time
            assert nxt["arrived"] >= prev["ended"] + 0.05
    # the result: conversation-major, each turn's prompt as the server counted it
    assert d["conversations"] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert d["turns"] == [1, 2, 3] * 3
    for i, (c, t) in enumerate(zip(d["conversations"], d["turns"])):
        sent = groups[convs[c].questions[0]][t - 1]
        assert d["input_lens"][i] == count_messages(chat, sent["messages"])
        assert result.outputs[i].generated_text == sent["answer"]
    assert d["input_lens"][1] > d["input_lens"][0] + 10 + 4  # question + answer added
    assert [t["turn"] for t in d["per_turn"]] == [1, 2, 3]
    assert all(t["n"] == 3 and t["failed"] == 0 and t["median_ttft_ms"] > 0
               and t["mean_tpot_ms"] > 0 for t in d["per_turn"])
    assert d["turns_2plus"]["n"] == 6
    assert d["per_turn"][1]["mean_input_len"] > d["per_turn"][0]["mean_input_len"]
    assert d["multi_turn"]["turns"] == 3 and d["input_len"] is None
    assert d["num_prompts"] == 9 and d["backend"] == "openai-chat"
    table = result.table()
    assert "Per turn" in table and "\n2+ " in table
    json.dumps(d, allow_nan=False)


def test_max_concurrency_bounds_conversations_not_requests(fake, tiny_llama):
    url, rec = fake
    rec.clear()
    result = run_benchmark(_config(url, tiny_llama, num_conversations=2, turns=2,
                                   max_concurrency=1))
    assert result.completed == 4
    first, second = sorted(_by_conversation(rec).values(), key=lambda g: g[0]["arrived"])
    assert second[0]["arrived"] >= first[-1]["ended"]  # one conversation at a time


def test_a_failed_turn_ends_its_conversation(fake, tiny_llama):
    url, rec = fake
    rec.clear()
    result = run_benchmark(_config(url, tiny_llama, num_conversations=2, turns=3,
                                   extra_body={"fake_mode": "fail-turn-2"}))
    d = result.to_dict()
    assert (d["completed"], d["failed"]) == (2, 4)
    assert d["errors"][0::3] == ["", ""]
    assert all(e.startswith("HTTP 503") for e in d["errors"][1::3])
    assert d["errors"][2::3] == ["not sent: turn 2 of this conversation failed"] * 2
    assert len(rec.requests) == 4  # the third turns were never sent
    assert [(t["turn"], t["n"], t["failed"]) for t in d["per_turn"]] == [
        (1, 2, 0), (2, 0, 2), (3, 0, 2)]


def test_cli_multi_turn_writes_per_turn_json(fake, tiny_llama, tmp_path, capsys):
    url, rec = fake
    out = tmp_path / "mt.json"
    rc = main(["bench", "--url", url, "--tokenizer", str(tiny_llama), "--dataset",
               "multi-turn", "--num-conversations", "2", "--turns", "2",
               "--system-prompt-len", "16", "--question-len", "8", "--output-len", "3",
               "--think-time", "0.01", "--no-progress", "--out", str(out)])
    assert rc == 0
    d = json.loads(out.read_text())
    assert d["endpoint"] == "/v1/chat/completions" and d["completed"] == 4
    assert [t["turn"] for t in d["per_turn"]] == [1, 2]
    assert d["multi_turn"]["think_time_dist"] == "exponential"
    assert "Per turn" in capsys.readouterr().out
    rc = main(["bench", "--url", url, "--tokenizer", str(tiny_llama), "--dataset",
               "multi-turn", "--endpoint", "completions", "--no-progress"])
    assert rc == 2 and "--endpoint chat" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--url", url, "--dataset", "multi-turn", "--think-time", "-1"])


# ------------------------------------------------------------------ bench compare


def _mt_run(mode: str, ttfts: list[float]) -> dict:
    """A canned multi-turn run: 2 conversations x 2 turns, ``ttfts`` in that order."""
    return {"mode": mode, "mode_label": mode, "request_rate": "inf", "repeat": 0,
            "ttfts": ttfts, "e2els": [t + 0.3 for t in ttfts], "output_lens": [4] * 4,
            "errors": [""] * 4, "itls": [[0.1] * 3] * 4, "completed": 4, "failed": 0,
            "request_throughput": 1.0, "median_ttft_ms": 0.0,
            "turns": [1, 2, 1, 2], "conversations": [0, 0, 1, 1]}


def test_compare_summary_has_per_turn_figures_and_ratios():
    from kvpush.bench.compare import CompareConfig, ModeSpec

    cfg = CompareConfig(modes=[ModeSpec("pull"), ModeSpec("push")], rates=[math.inf],
                        out_dir="unused", dataset="multi-turn", num_conversations=2,
                        turns=2, output_len=4)
    runs = [_mt_run("pull", [0.4, 0.6, 0.4, 0.8]), _mt_run("push", [0.2, 0.1, 0.2, 0.3])]
    s = summarize_runs(runs, cfg)
    push = s["cells"]["push@inf"]
    assert [(t["turn"], t["n"]) for t in push["per_turn"]] == [(1, 2), (2, 2)]
    assert push["per_turn"][1]["median_ttft_ms"] == pytest.approx(200)
    assert push["turns_2plus"]["mean_tpot_ms"] == pytest.approx(100)
    r = s["ratios"]["pull/push@inf"]["turns"]
    assert r["turns_2plus_median_ttft_ms"] == pytest.approx(700 / 200)
    assert r["turn1_median_ttft_ms"] == pytest.approx(2.0)
    assert r["turns_2plus_mean_tpot_ms"] == pytest.approx(1.0)
    assert [x["turn"] for x in r["per_turn_median_ttft_ms"]] == [1, 2]
    md = markdown_report({**s, "skipped": []})
    assert "Per-turn ratios against push" in md and "| pull/push | inf | 2.00 | 3.50 |" in md
    assert "2 conversations of 2 turns" in md and "| push | inf | 2+ | 2 |" in md


@pytest.mark.slow
def test_compare_multi_turn_end_to_end_1p2d(tiny_llama, tmp_path):
    """pull and push, one prefill and two decode instances each, 2 conversations x 2
    turns on the tiny model: a summary with per-turn ratios, every process stopped."""
    pytest.importorskip("nixl._api", reason="push mode needs NIXL")
    from kvpush.bench.compare import CompareConfig, ModeSpec, run_compare
    from kvpush.cluster.launcher import descendant_pids

    before = set(descendant_pids(os.getpid()))
    cfg = CompareConfig(modes=[ModeSpec("pull"), ModeSpec("push")], rates=[math.inf],
                        out_dir=tmp_path / "out", model=str(tiny_llama), dataset="multi-turn",
                        num_conversations=2, turns=2, system_prompt_len=16, question_len=8,
                        output_len=4, warmup=1, prefill=1, decode=2, run_timeout=120,
                        startup_timeout=120, time_limit=600, label="mt")
    summary = run_compare(cfg, log=lambda *_: None)
    assert set(summary["cells"]) == {"pull@inf", "push@inf"}
    for cell in summary["cells"].values():
        assert (cell["completed"], cell["failed"]) == (4, 0)
        assert [(t["turn"], t["n"]) for t in cell["per_turn"]] == [(1, 2), (2, 2)]
    turns = summary["ratios"]["pull/push@inf"]["turns"]
    assert turns["turns_2plus_median_ttft_ms"] > 0
    run = json.loads((tmp_path / "out" / "runs" / "push_rinf_rep0.json").read_text())
    assert run["turns"] == [1, 2, 1, 2] and not run["warnings"]
    assert run["instances"] == "1 prefill + 2 decode"
    assert "Per-turn ratios against push" in (tmp_path / "out" / "summary.md").read_text()
    assert set(descendant_pids(os.getpid())) <= before
