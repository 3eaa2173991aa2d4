"""Structured outputs (issue 65): the grammar's mask in the sampler, the engine's
outputs under JSON schemas, regexes and choices on the tiny random model (the mask
forces a random model into the grammar), compiled once per spec, and the API's 400s
before any compute (on the fake engine), n's and best_of's among them. P/D:
tests/test_openai_surface_pd.py."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import jsonschema
import pytest
import torch

from engine_helpers import assert_all_blocks_free, make_engine, run_to_completion
from fake_engine import FakeEngine, make_test_model
from kvpush.engine.outputs import FinishReason
from kvpush.grammar import GrammarCompiler, GrammarError
from kvpush.model.sampler import sample
from kvpush.sampling_params import GrammarKind, SamplingParams, StructuredOutput
from kvpush.server.app import build_app

pytestmark = pytest.mark.timeout(60)

#: bounded answers: every value has a bounded length, so max_tokens covers any answer
SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "ok", "n", "colour", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": -5, "maximum": 500},
                         "colour": {"enum": ["red", "green", "blue"]},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                  "maxItems": 3}}}
JSON_SCHEMA = StructuredOutput(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA))


def decoded(engine: Any, tokens: list[int]) -> str:
    return engine.tokenizer.decode(tokens, skip_special_tokens=True)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return make_engine(tiny_llama)


def test_sampler_masks_every_token_the_grammar_does_not_allow(engine) -> None:
    """The mask is a tensor op on the batch: a guided row keeps exactly the grammar's
    tokens, an unguided row is untouched, and logprobs stay the raw distribution's."""
    compiler = GrammarCompiler(engine.tokenizer, engine.vocab_size)
    g = compiler.grammar(StructuredOutput(GrammarKind.REGEX, "ab"))
    vocab = engine.vocab_size
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(0))
    # the grammar's only first tokens ("a", "ab"), made the least likely
    allowed = [engine.tokenizer.convert_tokens_to_ids(t) for t in ("a", "ab")]
    logits[0, allowed] = torch.tensor([-50.0, -40.0])
    params = [SamplingParams(temperature=0.0, logprobs=True)] * 2
    tokens, logprobs, _ = sample(logits, params, [None, None], torch.Generator(),
                                 grammars=[g, None])
    assert tokens[0] == allowed[1]  # forced, though greedy would never pick it
    assert tokens[1] == int(logits[1].argmax())
    raw = torch.log_softmax(logits, -1)
    assert logprobs == pytest.approx([float(raw[0, tokens[0]]), float(raw[1, tokens[1]])])
    g.consume(tokens[0])
    tokens, _, _ = sample(logits, params[:1], [None], torch.Generator(), grammars=[g])
    assert tokens[0] in engine.eos_token_ids  # "ab" is complete: only its end is left


def test_json_schema_outputs_validate_and_compile_once(engine) -> None:
    seeds = range(6)
    prompts = {f"s{s}": [5 + s, 6, 7, 8] for s in seeds}
    params = {f"s{s}": SamplingParams(max_tokens=120, temperature=1.0, seed=s,
                                      structured=JSON_SCHEMA) for s in seeds}
    prompts["greedy"] = [9, 10, 11]
    params["greedy"] = SamplingParams(max_tokens=120, temperature=0.0, structured=JSON_SCHEMA)
    before = engine.grammars.compiles
    outs = run_to_completion(engine, prompts, params)
    answers = {rid: json.loads(decoded(engine, toks)) for rid, toks in outs.items()}
    for answer in answers.values():
        jsonschema.validate(answer, SCHEMA)
    assert len({json.dumps(a) for a in answers.values()}) > 1  # sampled, not fixed
    # the same spec, however many requests: compiled once (each request a copy)
    assert engine.grammars.compiles - before <= 1
    run_to_completion(engine, {"again": [1, 2]}, SamplingParams(
        max_tokens=120, structured=StructuredOutput(GrammarKind.JSON_SCHEMA,
                                                    json.dumps(SCHEMA))))
    assert engine.grammars.compiles - before <= 1
    assert_all_blocks_free(engine)


def test_regex_choice_and_json_object_outputs(engine) -> None:
    regex = StructuredOutput(GrammarKind.REGEX, r"[a-c]{3}-\d{2}")
    choice = StructuredOutput(GrammarKind.CHOICE, json.dumps(["yes", "no way"]))
    brace = engine.tokenizer.convert_tokens_to_ids("}")
    outs = run_to_completion(engine, {"re": [3, 4], "ch": [3, 4], "obj": [3, 4]}, {
        "re": SamplingParams(max_tokens=30, seed=1, structured=regex),
        "ch": SamplingParams(max_tokens=30, seed=2, structured=choice),
        # any object; "}" favoured so the random model closes it soon, but never first
        "obj": SamplingParams(max_tokens=30, temperature=0.0, logit_bias=((brace, 100.0),),
                              structured=StructuredOutput(GrammarKind.JSON_OBJECT))})
    assert re.fullmatch(r"[a-c]{3}-\d{2}", decoded(engine, outs["re"]))
    assert decoded(engine, outs["ch"]) in ("yes", "no way")
    assert json.loads(decoded(engine, outs["obj"])) == {}
    assert_all_blocks_free(engine)


def test_a_token_that_breaks_the_grammar_fails_the_request_in_one_line(engine) -> None:
    """A token from elsewhere (token #1 sent with the KV) that the grammar does not
    allow fails the request with a short reason, and frees its blocks."""
    from kvpush.sampling_params import SampledToken
    from kvpush.scheduler.request import RequestState

    req = engine.add_request("broken", [3, 4, 5], SamplingParams(
        max_tokens=8, structured=StructuredOutput(GrammarKind.REGEX, "[0-9]+")))
    engine.step()  # prefill: token #1, a digit
    assert req.output_token_ids and req.grammar.error is None
    from kvpush.scheduler.scheduler import _append_token

    _append_token(req, SampledToken(engine.tokenizer.convert_tokens_to_ids("a")))
    out = engine._token_output(req, 0.0)
    assert req.state is RequestState.FINISHED_ERROR
    assert "breaks the structured output's grammar" in out.failure.message
    assert "\n" not in out.failure.message and "<grammar>" not in out.failure.message
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("spec", [
    StructuredOutput(GrammarKind.JSON_SCHEMA, '{"type": "no-such-type"}'),
    StructuredOutput(GrammarKind.REGEX, "(unclosed"),
    StructuredOutput(GrammarKind.GRAMMAR, "start: undefined_rule"),
])
def test_a_spec_that_cannot_compile_raises(engine, spec) -> None:
    compiler = GrammarCompiler(engine.tokenizer, engine.vocab_size)
    with pytest.raises(GrammarError):
        compiler.check(spec)


def test_a_spec_compiles_off_the_step_loop(tiny_llama, monkeypatch) -> None:
    """A command naming a spec not yet compiled does not hold the step loop: its request
    waits for the grammar thread (GrammarReady) while others step; an abort meanwhile
    ends it; a spec that fails there is the request's refusal."""
    import threading

    from kvpush.engine.inputs import AbortRequests, AddRequest

    eng = make_engine(tiny_llama)
    gate = threading.Event()
    check = eng.grammars.check

    def slow_check(spec: StructuredOutput) -> None:
        assert gate.wait(30)
        check(spec)

    monkeypatch.setattr(eng.grammars, "check", slow_check)
    regex = StructuredOutput(GrammarKind.REGEX, "(yes|no)")
    eng.inbox.put(AddRequest("guided", [5, 6, 7], SamplingParams(max_tokens=8,
                                                                 structured=regex)))
    eng.inbox.put(AddRequest("plain", [5, 6, 7], SamplingParams(max_tokens=3,
                                                                ignore_eos=True)))
    eng.inbox.put(AddRequest("gone", [5, 6], SamplingParams(max_tokens=3,
                                                            structured=JSON_SCHEMA)))
    eng.inbox.put(AbortRequests(["gone"]))
    outs = eng.process_inbox()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("gone", FinishReason.ABORT)]
    plain: list[int] = []
    while eng.has_work():  # the plain request runs to its end while "guided" compiles
        plain += [t for o in eng.step() for t in o.new_token_ids]
    assert len(plain) == 3 and "guided" not in eng.scheduler.requests
    gate.set()
    got: list[int] = []
    for _ in range(200):
        outs = eng.process_inbox(block=not eng.has_work(), timeout=10)
        outs += eng.step() if eng.has_work() else []
        got += [t for o in outs if o.request_id == "guided" for t in o.new_token_ids]
        if any(o.request_id == "guided" and o.finished for o in outs):
            break
    assert decoded(eng, got) in ("yes", "no")
    bad = StructuredOutput(GrammarKind.REGEX, "(unclosed")
    eng.inbox.put(AddRequest("bad", [5], SamplingParams(max_tokens=2, structured=bad)))
    assert eng.process_inbox() == []
    outs = eng.process_inbox(block=True, timeout=10)
    assert outs[0].request_id == "bad" and outs[0].failure.rejected
    assert_all_blocks_free(eng)
    eng.shutdown()


def test_an_engine_in_the_api_process_shares_the_fronts_compiled_specs(tiny_llama) -> None:
    """--engine-core thread: the front checks a spec with the engine's own compiler, so
    it compiles once, not once per side."""
    from kvpush.config import EngineConfig
    from kvpush.engine.async_engine import AsyncEngine
    from server_helpers import uvicorn_server

    engine = AsyncEngine(EngineConfig.build(tiny_llama, max_model_len=256, num_blocks=64,
                                            block_size=16))
    app = build_app(engine)
    with uvicorn_server(app) as url:
        r = httpx.post(url + "/v1/completions", timeout=60, json={
            "prompt": "a", "max_tokens": 4, "guided_regex": "(up|down)"})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("up", "down")
    assert app.state.server.prompts.grammars is engine.grammars
    assert engine.grammars.compiles == 1


# ---- the API: typed through, refused before any compute --------------------------------


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    return make_test_model(tmp_path_factory.mktemp("model") / "tiny")


@contextlib.asynccontextmanager
async def running(engine: FakeEngine) -> AsyncIterator[httpx.AsyncClient]:
    app = build_app(engine)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test",
                                     timeout=10) as client:
            yield client


MSGS = [{"role": "user", "content": "hi"}]
CANONICAL = json.dumps(SCHEMA, sort_keys=True, separators=(",", ":"))


@pytest.mark.anyio
@pytest.mark.parametrize(("path", "extra", "expected"), [
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}},
     StructuredOutput(GrammarKind.JSON_OBJECT)),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": SCHEMA, "strict": True}}},
     StructuredOutput(GrammarKind.JSON_SCHEMA, CANONICAL)),
    ("/v1/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": SCHEMA}}}, StructuredOutput(GrammarKind.JSON_SCHEMA, CANONICAL)),
    ("/v1/completions", {"guided_json": json.dumps(SCHEMA)},
     StructuredOutput(GrammarKind.JSON_SCHEMA, CANONICAL)),
    ("/v1/completions", {"guided_regex": "[0-9]+"},
     StructuredOutput(GrammarKind.REGEX, "[0-9]+")),
    ("/v1/chat/completions", {"guided_choice": ["a", "b"]},
     StructuredOutput(GrammarKind.CHOICE, '["a", "b"]')),
    ("/v1/chat/completions", {"structured_outputs": {"json": SCHEMA}},
     StructuredOutput(GrammarKind.JSON_SCHEMA, CANONICAL)),
    ("/v1/chat/completions", {"structured_outputs": {"json_object": True}},
     StructuredOutput(GrammarKind.JSON_OBJECT)),
    ("/v1/chat/completions", {"response_format": {"type": "text"}}, None),
])
async def test_each_field_reaches_the_engine_typed(model, path, extra, expected) -> None:
    engine = FakeEngine(*model)
    body = {"max_tokens": 2, **extra,
            **({"messages": MSGS} if "chat" in path else {"prompt": "hi"})}
    async with running(engine) as client:
        r = await client.post(path, json=body)
        assert r.status_code == 200, r.text
    assert engine.requests[-1][2].structured == expected


@pytest.mark.anyio
@pytest.mark.parametrize(("extra", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "no-such-type"}}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": "[1, 2]"}, "guided_json"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_grammar": "start: nothing_here"}, "guided_grammar"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs.regex"),
])
async def test_a_bad_or_doubled_spec_is_a_400_before_any_compute(model, extra,
                                                                 param) -> None:
    engine = FakeEngine(*model)
    async with running(engine) as client:
        r = await client.post("/v1/chat/completions",
                              json={"messages": MSGS, "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert engine.requests == []  # nothing reached the engine


@pytest.mark.anyio
@pytest.mark.parametrize(("path", "extra", "param", "says"), [
    ("/v1/chat/completions", {"n": 0}, "n", "n must be from 1 to 64, got 0"),
    ("/v1/completions", {"n": 65}, "n", "n must be from 1 to 64, got 65"),
    ("/v1/completions", {"best_of": 2}, "best_of", "best_of must equal n (1), got 2"),
])
async def test_n_out_of_range_and_best_of_are_refused(model, path, extra, param,
                                                      says) -> None:
    """Issue 65, point 3: n outside 1..64 and a best_of other than n are a 400 saying
    why (best_of: no ranking), never a silent single choice."""
    engine = FakeEngine(*model)
    body = {"max_tokens": 2, **extra,
            **({"messages": MSGS} if "chat" in path else {"prompt": "hi"})}
    async with running(engine) as client:
        r = await client.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and says in err["message"]
    assert engine.requests == []
