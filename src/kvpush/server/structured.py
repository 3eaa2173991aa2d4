"""A request's structured-output fields -> one typed
:class:`~kvpush.sampling_params.StructuredOutput` (or None), checked for shape here and
compiled by the front's :class:`~kvpush.grammar.GrammarCompiler` before any compute.

Accepted, one at a time: OpenAI's ``response_format`` (``json_object``, ``json_schema``;
``text`` asks for nothing), vLLM's ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar`` and its ``structured_outputs`` (``json``,
``regex``, ``choice``, ``grammar``, ``json_object``). A JSON schema is kept as
canonical JSON text (sorted keys), so equal schemas share one compiled grammar.
"""

from __future__ import annotations

import json
from typing import Any

from kvpush.sampling_params import GrammarKind, StructuredOutput
from kvpush.server.errors import APIError
from kvpush.server.protocol import SamplingRequest


def _schema_text(schema: dict[str, Any] | str, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise APIError(f"{param}: not JSON: {e}", param=param) from None
    if not isinstance(schema, dict):
        raise APIError(f"{param}: a JSON schema must be an object", param=param)
    return json.dumps(schema, sort_keys=True, separators=(",", ":"))


def _given(req: SamplingRequest) -> list[tuple[str, StructuredOutput]]:
    """Every constraint the request gives, with the parameter that gave it."""
    out: list[tuple[str, StructuredOutput]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        out.append(("response_format", StructuredOutput(GrammarKind.JSON_OBJECT)))
    elif rf is not None and rf.type == "json_schema":
        param = "response_format.json_schema.schema"
        if rf.json_schema is None or rf.json_schema.json_schema is None:
            raise APIError(f"{param} is required with type json_schema", param=param)
        out.append(("response_format", StructuredOutput(
            GrammarKind.JSON_SCHEMA, _schema_text(rf.json_schema.json_schema, param))))
    so = req.structured_outputs
    vllm = [("guided_json", req.guided_json, GrammarKind.JSON_SCHEMA),
            ("guided_regex", req.guided_regex, GrammarKind.REGEX),
            ("guided_choice", req.guided_choice, GrammarKind.CHOICE),
            ("guided_grammar", req.guided_grammar, GrammarKind.GRAMMAR)]
    if so is not None:
        vllm += [("structured_outputs.json", so.json_spec, GrammarKind.JSON_SCHEMA),
                 ("structured_outputs.regex", so.regex, GrammarKind.REGEX),
                 ("structured_outputs.choice", so.choice, GrammarKind.CHOICE),
                 ("structured_outputs.grammar", so.grammar, GrammarKind.GRAMMAR)]
        if so.json_object:
            out.append(("structured_outputs.json_object",
                        StructuredOutput(GrammarKind.JSON_OBJECT)))
    for param, value, kind in vllm:
        if value is None:
            continue
        if kind is GrammarKind.JSON_SCHEMA:
            spec = _schema_text(value if isinstance(value, (dict, str)) else str(value),
                                param)
        elif kind is GrammarKind.CHOICE:
            spec = json.dumps(value)
        else:
            spec = str(value)
        out.append((param, StructuredOutput(kind, spec)))
    return out


def structured_output(req: SamplingRequest) -> tuple[str, StructuredOutput] | None:
    """The request's one structured output and the parameter that gave it (None: no
    constraint); an APIError 400 for a malformed one or for more than one."""
    given = _given(req)
    if len(given) > 1:
        names = ", ".join(p for p, _ in given)
        raise APIError(f"give at most one structured output constraint; got {names}",
                       param=given[1][0])
    return given[0] if given else None
