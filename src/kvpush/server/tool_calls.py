"""Tool calls: which format a model's chat template writes them in, the grammar that
makes a ``required`` or named call always parse, and the parser that turns a choice's
text into OpenAI ``tool_calls`` (whole, or streamed as it comes).

Formats (vLLM's parser names):

* ``hermes`` (Hermes, Qwen2.5, Qwen3): ``<tool_call>\\n{"name": ..., "arguments":
  {...}}\\n</tool_call>``, one block a call, text around them is content;
* ``llama3_json`` (Llama 3.1 / 3.2): the whole answer is ``{"name": ..., "parameters":
  {...}}`` (``arguments`` taken too; several joined by ``;``), optionally after
  ``<|python_tag|>``; an answer that is not such JSON is content.

A template that names ``<tool_call>`` is ``hermes``; one that renders ``tools`` with
``ipython`` or ``<|python_tag|>`` is ``llama3_json``; a template that does not render
``tools`` makes a request with tools a 400.
"""

from __future__ import annotations

import enum
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from kvpush.sampling_params import GrammarKind, StructuredOutput

HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|\Z)", re.DOTALL)


class ToolFormat(str, enum.Enum):
    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"


def template_format(chat_template: str | None) -> ToolFormat | None:
    """The tool-call format ``chat_template`` writes (None: it renders no tools)."""
    t = chat_template or ""
    if "tools" not in t:
        return None
    if HERMES_OPEN in t:
        return ToolFormat.HERMES
    if "ipython" in t or PYTHON_TAG in t:
        return ToolFormat.LLAMA3_JSON
    return None


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = ""

    def wire(self, index: int | None = None) -> dict[str, Any]:
        """OpenAI's ``tool_calls`` entry (with ``index``: a streamed delta's)."""
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def _call(obj: Any, args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # already JSON text (some models write it so)
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False),
                    f"call_{uuid.uuid4().hex[:24]}")


def _hermes(text: str) -> tuple[str | None, list[ToolCall]] | None:
    calls = []
    for m in _HERMES_BLOCK.finditer(text):
        try:
            call = _call(json.loads(m.group(1)), "arguments")
        except ValueError:
            return None
        if call is None:
            return None
        calls.append(call)
    if not calls:
        return None
    content = _HERMES_BLOCK.sub("", text).strip()
    return content or None, calls


def _llama_json(text: str) -> tuple[str | None, list[ToolCall]] | None:
    s = text.strip()
    s = s.removeprefix(PYTHON_TAG).lstrip()
    if not s.startswith("{"):
        return None
    dec = json.JSONDecoder()
    calls, i = [], 0
    while i < len(s):
        try:
            obj, i = dec.raw_decode(s, i)
        except ValueError:
            return None
        call = _call(obj, "parameters")
        if call is None:
            return None
        calls.append(call)
        while i < len(s) and s[i] in "; \n\t\r":
            i += 1
    return None, calls


def parse_tool_calls(fmt: ToolFormat, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a choice's whole text; text that does not parse as calls is
    content, as it is."""
    parsed = _hermes(text) if fmt is ToolFormat.HERMES else _llama_json(text)
    return parsed if parsed is not None else (text, [])


class ToolStream:
    """One streamed choice's text -> content deltas and whole tool calls. Text that may
    begin a call is held until it does or cannot; a call goes out once it parses (its
    arguments in one delta, which OpenAI's clients accumulate as any other)."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self._held = ""
        #: a llama3_json answer that began as anything but a call: content throughout
        self._plain = False
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content to send now, calls completed now)."""
        self._held += text
        if self.fmt is ToolFormat.HERMES:
            return self._hermes_feed()
        if not self._plain:
            s = self._held.lstrip()
            if not s or s.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(s):
                return "", []  # may be the call: parsed whole at the end
            self._plain = True
        out, self._held = self._held, ""
        return out, []

    def _hermes_feed(self) -> tuple[str, list[ToolCall]]:
        content, calls = "", []
        while True:
            start = self._held.find(HERMES_OPEN)
            if start < 0:
                keep = _open_prefix_len(self._held)
                out = self._held[:len(self._held) - keep]
                self._held = self._held[len(self._held) - keep:]
                content += out
                break
            end = self._held.find(HERMES_CLOSE, start)
            if end < 0:
                content += self._held[:start]
                self._held = self._held[start:]
                break
            block = self._held[start:end + len(HERMES_CLOSE)]
            parsed = _hermes(block)
            content += self._held[:start]
            self._held = self._held[end + len(HERMES_CLOSE):]
            if parsed is None:
                content += block
            else:
                calls += parsed[1]
        if self.calls or calls:
            content = content if content.strip() else ""  # separators between calls
        self.calls += calls
        return content, calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is held at the choice's end: calls that parse, else content."""
        held, self._held = self._held, ""
        if not held:
            return "", []
        if self._plain:
            return held, []
        content, calls = parse_tool_calls(self.fmt, held)
        self.calls += calls
        if self.calls and content is not None and not content.strip():
            content = None
        return content or "", calls


def _open_prefix_len(text: str) -> int:
    """How many trailing characters of ``text`` may begin ``<tool_call>``."""
    for k in range(min(len(text), len(HERMES_OPEN) - 1), 0, -1):
        if HERMES_OPEN.startswith(text[-k:]):
            return k
    return 0


def call_schema(function: dict[str, Any], fmt: ToolFormat) -> dict[str, Any]:
    """The JSON schema of one call of ``function`` in ``fmt``'s object."""
    params = function.get("parameters") or {"type": "object", "properties": {}}
    key = "arguments" if fmt is ToolFormat.HERMES else "parameters"
    return {"type": "object", "additionalProperties": False, "required": ["name", key],
            "properties": {"name": {"const": function["name"]}, key: params}}


def call_grammar(fmt: ToolFormat, functions: list[dict[str, Any]],
                 several: bool) -> StructuredOutput:
    """The grammar of an answer that is calls of ``functions`` (one of them: a named
    tool_choice; any: ``required``, ``several`` calls when parallel calls are allowed)."""
    schemas = [call_schema(f, fmt) for f in functions]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    if fmt is ToolFormat.LLAMA3_JSON:
        return StructuredOutput(GrammarKind.JSON_SCHEMA,
                                json.dumps(schema, sort_keys=True, separators=(",", ":")))
    # compact JSON, as kvpush.grammar asks of a JSON schema (llguidance's options)
    compact = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
    body = json.dumps({**schema, "x-guidance": compact}, sort_keys=True,
                      separators=(",", ":"))
    start = 'start: call ("\\n" call)*' if several else "start: call"
    lark = (start + "\n"
            + 'call: "<tool_call>\\n" body "\\n</tool_call>"\n'
            + "body: %json " + body + "\n")
    return StructuredOutput(GrammarKind.GRAMMAR, lark)
