"""Request and response bodies of the OpenAI-compatible API, as pydantic models, and
the formatters that turn engine outputs into them.

Requests are parsed strictly where a wrong type would otherwise be coerced into a
surprising value (``"max_tokens": "10"`` or ``true`` is a 400, not 10 or 1), unknown
fields are ignored (OpenAI clients send some we do not use), and NaN/Infinity are
refused. Fields that change what the model would generate but that kvpush does not
implement (``echo``, ``suffix``, ...) are parsed so that the server can refuse them
with a clear 400 instead of silently ignoring them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializeAsAny,
    Strict,
    ValidationInfo,
    field_validator,
)

from kvpush.sampling_params import (
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)
from kvpush.server.tool_calls import ToolFormat

Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]  # strict float still takes JSON integers
Bool = Annotated[bool, Strict()]

#: Messages one chat request may carry. Rendering the chat template is Python (Jinja) and
#: costs per message, so a cap bounds the work one request can ask for: 200,000 empty
#: messages (6.6 MB) once held the event loop for 7.6 s. Long agent conversations reach a
#: few hundred messages; the context length bounds the rest.
MAX_CHAT_MESSAGES = 4096
#: Content parts one message may carry (each is checked in Python while parsing)
MAX_CONTENT_PARTS = 256
#: Longest cache_salt accepted (it is hashed with the first block of every request)
MAX_CACHE_SALT_CHARS = 1024
#: request fields this server cannot honour -> the values that ask for nothing
UNHONOURED: dict[str, tuple[Any, ...]] = {
    "min_p": (0, 0.0), "min_tokens": (0,), "priority": (0,), "prompt_logprobs": (),
}
#: the most strings a guided_choice may list
MAX_CHOICES = 1024

# Lists and maps a request may carry, capped while the body is parsed (pydantic-core
# stops at the first item over the cap; the 400 names the field and both counts).
StopList = Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)]
StopTokenIds = Annotated[list[Int], Field(max_length=MAX_STOP_TOKEN_IDS)]
LogitBias = Annotated[dict[str, Float], Field(max_length=MAX_LOGIT_BIAS_ENTRIES)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Model):
    include_usage: Bool = False


class JsonSchemaFormat(_Model):
    """OpenAI's ``response_format.json_schema``."""

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: Bool | None = None


class ResponseFormat(_Model):
    """OpenAI's ``response_format`` (chat; vLLM takes it on completions too)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


Choices = Annotated[list[str], Field(min_length=1, max_length=MAX_CHOICES)]


class StructuredOutputsRequest(_Model):
    """vLLM's ``structured_outputs``: one of its constraints."""

    json_spec: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: Choices | None = None
    grammar: str | None = None
    json_object: Bool | None = None


class SamplingRequest(_Model):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: Int | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    top_k: Int | None = None  # extension (vLLM): 0 or -1 disables
    seed: Int | None = None
    stop: StopList | None = None
    stop_token_ids: StopTokenIds | None = None  # extension (vLLM)
    ignore_eos: Bool = False  # extension (vLLM)
    include_stop_str_in_output: Bool = False  # extension (vLLM)
    n: Int | None = 1
    stream: Bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    repetition_penalty: Float | None = None  # extension (vLLM): 1 is off
    logit_bias: LogitBias | None = None
    #: KV-transfer instructions from the disaggregation router (vLLM's names), checked
    #: and typed once by the server (EngineClient.kv_params) and handed to generate
    kv_transfer_params: dict[str, Any] | None = None
    #: vLLM's field: requests share prefix-cache blocks only with the same salt
    cache_salt: str | None = Field(default=None, min_length=1,
                                   max_length=MAX_CACHE_SALT_CHARS)
    # Structured outputs (kvpush.server.structured): OpenAI's field, vLLM's older
    # guided_* fields and its newer structured_outputs; at most one of them
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Choices | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    # Fields other servers (vLLM) honour and this one cannot: refused when set to
    # anything but their no-op value, never silently ignored (``_unhonoured``).
    min_p: Any = None
    min_tokens: Any = None
    priority: Any = None
    prompt_logprobs: Any = None

    @property
    def constrained(self) -> bool:
        """Whether the request asks for a structured output (kvpush.server.structured)."""
        rf = self.response_format
        return (rf is not None and rf.type != "text") or any(
            v is not None for v in (self.guided_json, self.guided_regex, self.guided_choice,
                                    self.guided_grammar, self.structured_outputs))

    @field_validator(*UNHONOURED)
    @classmethod
    def _unhonoured(cls, v: Any, info: ValidationInfo) -> Any:
        if v is None or v in UNHONOURED[str(info.field_name)]:
            return v
        raise ValueError(f"{info.field_name} is not supported by this server (it would be "
                         "ignored, so the request is refused)")

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [v]
        return v

    @field_validator("seed")
    @classmethod
    def _seed(cls, v: int | None) -> int | None:
        if v is not None and not -(2**63) <= v < 2**64:
            raise ValueError("seed must fit in 64 bits")
        return v


class CompletionRequest(SamplingRequest):
    #: A string, a list of one string, a list of token ids, or a list of one such list;
    #: normalized by the validator to ``str`` or ``list[int]``.
    prompt: str | list[int]
    echo: Bool | None = False
    logprobs: Int | None = None
    suffix: str | None = None
    best_of: Int | None = None
    #: vLLM's: each choice carries its ``token_ids`` (and the first, ``prompt_token_ids``)
    return_token_ids: Bool = False

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
            v = v[0]
        if isinstance(v, str):
            return v
        if isinstance(v, list):
            if all(isinstance(t, int) and not isinstance(t, bool) for t in v):
                return v
            if all(isinstance(t, (str, list)) for t in v):
                raise ValueError("batched prompts are not supported: send one prompt per request")
        raise ValueError("prompt must be a string, a list of one string, or a list of token ids")


class ContentPart(_Model):
    type: str
    text: str | None = None


#: tools one chat request may offer (OpenAI's limit)
MAX_TOOLS = 128


class FunctionDef(_Model):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: Bool | None = None


class ToolDef(_Model):
    """One of OpenAI's ``tools``: a function the model may call."""

    type: Literal["function"]
    function: FunctionDef


class ToolChoiceFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    """``tool_choice`` naming the function the model must call."""

    type: Literal["function"]
    function: ToolChoiceFunction


class ChatMessage(_Model):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    #: an assistant message's calls (OpenAI's shape: id, type, function name/arguments)
    tool_calls: Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS)] | None = None
    #: a tool message's answer to this call
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v: Any) -> Any:
        # Checked by hand so that a bad part gives one clear error, not one per union member.
        if v is None or isinstance(v, str):
            return v
        if not isinstance(v, list):
            raise ValueError("content must be a string or a list of content parts")
        if len(v) > MAX_CONTENT_PARTS:
            raise ValueError(f"at most {MAX_CONTENT_PARTS} content parts per message, got "
                             f"{len(v)}")
        parts = []
        for i, part in enumerate(v):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise ValueError(f"content part {i} must be an object with a string 'type'")
            if part["type"] == "text" and not isinstance(part.get("text"), str):
                raise ValueError(f"content part {i} of type 'text' needs a string 'text'")
            parts.append(ContentPart(type=part["type"], text=part.get("text")))
        return parts


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(max_length=MAX_CHAT_MESSAGES)]
    max_completion_tokens: Int | None = None
    logprobs: Bool | None = False
    top_logprobs: Int | None = None
    tools: Annotated[list[ToolDef], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: Bool | None = None
    functions: list[Any] | None = None


# ---------------------------------------------------------------------------- responses


class UsageInfo(_Model):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(_Model):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Model):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionChoiceIds(CompletionChoice):
    """A choice with return_token_ids (vLLM's): the tokens of its text, and the
    prompt's."""

    token_ids: list[int]
    prompt_token_ids: list[int] | None = None


class CompletionResponse(_Model):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[SerializeAsAny[CompletionChoice]]
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None


class TopLogprob(_Model):
    token: str
    logprob: float | None
    bytes: list[int] | None


class ChatTokenLogprob(_Model):
    token: str
    logprob: float | None
    bytes: list[int] | None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Model):
    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None


class ToolCallFunction(_Model):
    name: str
    arguments: str


class ToolCallOut(_Model):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatResponseMessage(_Model):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


class ChatChoice(_Model):
    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(_Model):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None


def _is_none(v: Any) -> bool:
    return v is None


class DeltaToolCall(ToolCallOut):
    index: int


class DeltaMessage(_Model):
    role: Literal["assistant"] | None = Field(default=None, exclude_if=_is_none)
    content: str | None = Field(default=None, exclude_if=_is_none)
    tool_calls: list[DeltaToolCall] | None = Field(default=None, exclude_if=_is_none)


class ChatStreamChoice(_Model):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Model):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(_Model):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvpush"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(_Model):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ------------------------------------------------------ /tokenize, /detokenize (vLLM's)

#: Token ids one /detokenize request may carry (a full long context)
MAX_DETOKENIZE_TOKENS = 1 << 20


class TokenizeCompletionRequest(_Model):
    """``POST /tokenize`` with a prompt (vLLM's TokenizeCompletionRequest)."""

    model: str | None = None
    prompt: str
    add_special_tokens: Bool = True
    return_token_strs: Bool = False


class TokenizeChatRequest(_Model):
    """``POST /tokenize`` with chat messages (vLLM's TokenizeChatRequest): the ids the
    chat endpoint would run, by default."""

    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(max_length=MAX_CHAT_MESSAGES)]
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False
    add_special_tokens: Bool = False
    return_token_strs: Bool = False


class TokenizeResponse(_Model):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Model):
    model: str | None = None
    tokens: Annotated[list[Int], Field(max_length=MAX_DETOKENIZE_TOKENS)]


class DetokenizeResponse(_Model):
    prompt: str


class VersionResponse(_Model):
    version: str


# ------------------------------------------------------------ engine outputs -> bodies


@dataclass
class Job:
    """A validated, tokenized request, ready for the engine."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float
    stream: bool
    include_usage: bool
    #: the tool-call format of a chat that offered tools (None: no parsing)
    tools: ToolFormat | None = None
    #: finish_reason "tool_calls" when it calls them (not for a named tool_choice)
    tool_calls_finish: bool = True
    #: completions: each choice says its token ids (vLLM's return_token_ids)
    return_token_ids: bool = False

    @property
    def logprobs(self) -> int | None:
        """None: no logprobs; else how many top alternatives the client asked for."""
        return self.params.top_logprobs if self.params.logprobs else None
