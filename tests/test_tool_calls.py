"""Tools (issue 65, point 2): ``tools`` rendered by the model's chat template, the
answer's calls parsed into ``tool_calls`` (Hermes/Qwen3 ``<tool_call>`` blocks, Llama's
JSON), streamed as deltas the official ``openai`` client accumulates, and a ``required``
or named ``tool_choice`` held by the grammar, so that even a random model's calls parse
and validate against their functions' schemas. The parsers on their own first."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from kvpush.server.tool_calls import (
    ToolFormat,
    ToolStream,
    parse_tool_calls,
    template_format,
)

pytestmark = pytest.mark.timeout(120)

#: a Hermes-style template (as Qwen2.5's and Qwen3's render tools), ChatML around it
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n\n<tools>{% for t in tools %}\n"
    "{{ t | tojson }}{% endfor %}\n</tools>\n\nFor each function call, return a json object "
    "within <tool_call></tool_call> XML tags.<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{% for tc in m.tool_calls %}<tool_call>\n{\"name\": \"{{ tc.function.name }}\", "
    "\"arguments\": {{ tc.function.arguments | tojson }}}\n</tool_call>{% endfor %}"
    "<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: a Llama 3.1-style JSON tool template (tool answers under the ipython role)
LLAMA_TEMPLATE = (
    "{% if tools %}<|start_header_id|>user<|end_header_id|>\n\nRespond in the format "
    "{\"name\": function name, \"parameters\": dictionary of argument name and its value}."
    "\n\n{% for t in tools %}{{ t | tojson }}\n\n{% endfor %}<|eot_id|>{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}<|start_header_id|>ipython"
    "<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{% else %}<|start_header_id|>"
    "{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% endif %}"
)

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "maxLength": 8},
                          "days": {"type": "integer", "minimum": 1, "maximum": 9}}}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "weather",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "ping", "parameters": {
        "type": "object", "additionalProperties": False, "properties": {}}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MSGS = [{"role": "user", "content": "what is the weather in Paris?"}]


def test_template_format_is_read_from_the_template() -> None:
    assert template_format(HERMES_TEMPLATE) is ToolFormat.HERMES
    assert template_format(LLAMA_TEMPLATE) is ToolFormat.LLAMA3_JSON
    assert template_format("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert template_format(None) is None


def test_hermes_blocks_become_calls_and_the_rest_content() -> None:
    text = ('Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"'
            ', "days": 2}}\n</tool_call>\n<tool_call>\n{"name": "ping", "arguments": {}}'
            "\n</tool_call>")
    content, calls = parse_tool_calls(ToolFormat.HERMES, text)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 2}), ("ping", {})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    # a block that does not parse leaves the text as it is
    bad = "<tool_call>\n{not json}\n</tool_call>"
    assert parse_tool_calls(ToolFormat.HERMES, bad) == (bad, [])
    assert parse_tool_calls(ToolFormat.HERMES, "just words") == ("just words", [])


def test_llama_json_is_a_call_only_when_it_is_all_calls() -> None:
    content, calls = parse_tool_calls(
        ToolFormat.LLAMA3_JSON,
        '<|python_tag|>{"name": "ping", "parameters": {}}; '
        '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}')
    assert content is None
    assert [c.name for c in calls] == ["ping", "get_weather"]
    assert json.loads(calls[1].arguments) == {"city": "Oslo", "days": 1}
    for text in ('{"name": "ping"} and more', "Sunny, 20 C.", '{"nam": "x"}'):
        assert parse_tool_calls(ToolFormat.LLAMA3_JSON, text) == (text, [])


@pytest.mark.parametrize("fmt, text, want_content", [
    (ToolFormat.HERMES, 'ok <tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>',
     "ok "),
    (ToolFormat.HERMES, "a < b, and <tool_ca is not a call", "a < b, and <tool_ca is not a call"),
    (ToolFormat.LLAMA3_JSON, ' {"name": "ping", "parameters": {}}', ""),
    (ToolFormat.LLAMA3_JSON, "Plain answer {with braces}", "Plain answer {with braces}"),
])
@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_streamed_text_gives_the_same_calls_and_content(fmt, text, want_content,
                                                        piece) -> None:
    stream = ToolStream(fmt)
    content, calls = "", []
    for i in range(0, len(text), piece):
        c, k = stream.feed(text[i:i + piece])
        content += c
        calls += k
    c, k = stream.finish()
    content += c
    calls += k
    assert content == want_content
    whole_content, whole_calls = parse_tool_calls(fmt, text)
    assert [(c.name, c.arguments) for c in calls] == [
        (c.name, c.arguments) for c in whole_calls]


# ----------------------------------------------------------------- through the API


@pytest.fixture(scope="module")
def served(tiny_qwen3):
    from kvpush.config import EngineConfig
    from kvpush.engine.async_engine import AsyncEngine
    from kvpush.server.app import build_app
    from server_helpers import uvicorn_server

    config = EngineConfig.build(tiny_qwen3, max_model_len=1024, num_blocks=256, block_size=16)
    engine = AsyncEngine(config)
    engine.tokenizer.chat_template = HERMES_TEMPLATE
    with uvicorn_server(build_app(engine)) as url:
        yield url, engine, config.served_model_name
    engine.tokenizer.chat_template = None


@pytest.fixture
def client(served):
    import openai

    url, engine, _ = served
    engine.tokenizer.chat_template = HERMES_TEMPLATE
    with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60) as c:
        yield c
    _all_free(engine)


def _all_free(engine) -> None:
    from waits import wait_until

    def free() -> bool:
        s = engine.stats()
        return s.num_free_blocks == s.num_total_blocks and s.num_running == 0
    wait_until(free, timeout=10)


def _valid(call: Any) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _model(served) -> str:
    return served[2]


@pytest.mark.parametrize("template", ["hermes", "llama"])
def test_named_tool_choice_always_gives_that_call(served, client, template) -> None:
    served[1].tokenizer.chat_template = (HERMES_TEMPLATE if template == "hermes"
                                        else LLAMA_TEMPLATE)
    for seed in range(4):
        r = client.chat.completions.create(
            model=_model(served), messages=MSGS, tools=TOOLS, max_tokens=80, seed=seed,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice  # asked for: OpenAI's "stop"
        assert choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather"
        _valid(call)


def test_required_calls_parse_and_say_tool_calls(served, client) -> None:
    names = set()
    for seed in range(6):
        r = client.chat.completions.create(model=_model(served), messages=MSGS, tools=TOOLS,
                                           tool_choice="required", max_tokens=120, seed=seed,
                                           parallel_tool_calls=False)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        [call] = choice.message.tool_calls
        _valid(call)
        names.add(call.function.name)
    assert names <= set(SCHEMAS)


def test_streamed_calls_are_what_the_openai_client_accumulates(served, client) -> None:
    """The client's own stream helper rebuilds the calls from the deltas; n = 2
    streams each choice's calls under its index."""
    with client.chat.completions.stream(
            model=_model(served), messages=MSGS, tools=TOOLS, max_tokens=80, seed=5,
            tool_choice={"type": "function", "function": {"name": "get_weather"}}) as s:
        final = s.get_final_completion()
    [call] = final.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    _valid(call)

    calls: dict[tuple[int, int], dict[str, str]] = {}
    reasons = {}
    for chunk in client.chat.completions.create(
            model=_model(served), messages=MSGS, tools=TOOLS, max_tokens=120, seed=9, n=2,
            tool_choice="required", stream=True, parallel_tool_calls=False):
        for c in chunk.choices:
            for d in c.delta.tool_calls or ():
                got = calls.setdefault((c.index, d.index), {"name": "", "arguments": ""})
                got["name"] += d.function.name or ""
                got["arguments"] += d.function.arguments or ""
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert sorted(calls) == [(0, 0), (1, 0)]
    assert reasons == {0: "tool_calls", 1: "tool_calls"}
    for got in calls.values():
        jsonschema.validate(json.loads(got["arguments"]), SCHEMAS[got["name"]])


def test_auto_parses_what_the_model_writes(served, client) -> None:
    """auto: whatever the model answers is parsed; a grammar makes the random model
    write a Hermes call, which comes back as tool_calls, streamed or not."""
    grammar = ('start: "<tool_call>\\n{\\"name\\": \\"ping\\", \\"arguments\\": {}}\\n'
               '</tool_call>"')
    r = client.chat.completions.create(model=_model(served), messages=MSGS, tools=TOOLS,
                                       max_tokens=80, extra_body={"guided_grammar": grammar})
    [call] = r.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == ("ping", "{}")
    assert r.choices[0].finish_reason == "tool_calls"
    content, names = "", []
    for chunk in client.chat.completions.create(
            model=_model(served), messages=MSGS, tools=TOOLS, max_tokens=80, stream=True,
            extra_body={"guided_grammar": grammar}):
        for c in chunk.choices:
            content += c.delta.content or ""
            names += [d.function.name for d in c.delta.tool_calls or ()]
    assert names == ["ping"] and content == ""
    # a plain answer stays content
    r = client.chat.completions.create(model=_model(served), messages=MSGS, tools=TOOLS,
                                       max_tokens=8, extra_body={"guided_regex": "[a-z ]+"})
    assert r.choices[0].message.tool_calls == [] and r.choices[0].message.content


def test_none_renders_no_tools_and_parses_nothing(served, client) -> None:
    plain = client.chat.completions.create(model=_model(served), messages=MSGS,
                                           max_tokens=2)
    none = client.chat.completions.create(model=_model(served), messages=MSGS, tools=TOOLS,
                                          tool_choice="none", max_tokens=2)
    auto = client.chat.completions.create(model=_model(served), messages=MSGS, tools=TOOLS,
                                          max_tokens=2)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens  # the tools are rendered


def test_a_conversation_with_calls_and_answers_renders(served, client) -> None:
    msgs = [*MSGS,
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = client.chat.completions.create(model=_model(served), messages=msgs, tools=TOOLS,
                                       max_tokens=3)
    assert r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("extra, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "no-such-type"}}}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]},
     "tools[0].function.name"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {
        "name": "f", "arguments": "{oops"}}]}]}, "messages[0].tool_calls[0]"),
])
def test_bad_tools_are_a_400_before_any_compute(served, client, extra, param) -> None:
    import httpx

    url, engine, model = served
    before = engine.stats().num_free_blocks
    r = httpx.post(url + "/v1/chat/completions",
                   json={"model": model, "messages": MSGS, "max_tokens": 2, **extra},
                   timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert engine.stats().num_free_blocks == before
