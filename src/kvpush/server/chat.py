"""Prompt building: request -> (validated) prompt token ids + SamplingParams, chat
messages -> template text -> token ids, and token display text for logprobs.

The tokenizer is the engine's (a transformers fast tokenizer with a ``chat_template``);
nothing here imports transformers itself.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable, Iterable
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any, Literal, TypeVar

from pydantic import TypeAdapter

from kvpush.grammar import GrammarCompiler, GrammarError
from kvpush.models.tokenizer import max_token_bytes, tokens_at_least
from kvpush.sampling_params import (
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_N,
    MAX_TOP_LOGPROBS,
    SamplingParams,
    StructuredOutput,
)
from kvpush.server.errors import APIError
from kvpush.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    Job,
    NamedToolChoice,
    SamplingRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from kvpush.server.structured import structured_output
from kvpush.server.tool_calls import ToolFormat, call_grammar, template_format

T = TypeVar("T")


@dataclass(frozen=True)
class ToolSetup:
    """What a chat's tools ask of the prompt, the sampler and the answer."""

    #: the tools as the chat template gets them (None: not rendered)
    rendered: list[dict[str, Any]] | None = None
    #: the format its answer's calls are parsed in (None: not parsed)
    format: ToolFormat | None = None
    #: the grammar of a required or named call
    grammar: StructuredOutput | None = None
    finish_says_calls: bool = True

_JSON_OBJECT = TypeAdapter(dict[str, Any])

#: Roles a chat request may use. "developer" is OpenAI's newer name for "system" (the
#: official clients send it for some models); chat templates only know "system", so it
#: is renamed. "tool" is passed through: templates that can't render it say so.
ALLOWED_ROLES = ("system", "developer", "user", "assistant", "tool")


def normalize_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Validate roles and flatten content parts into the plain dicts templates expect."""
    if not messages:
        raise APIError("messages must contain at least one message", param="messages")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        role = msg.role
        if role not in ALLOWED_ROLES:
            raise APIError(
                f"messages[{i}].role: unknown role {role!r}; use one of "
                + ", ".join(ALLOWED_ROLES),
                param=f"messages[{i}].role",
            )
        if role == "developer":
            role = "system"
        content = msg.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type != "text":
                    raise APIError(
                        f"messages[{i}].content[{j}]: content parts of type {part.type!r} "
                        "are not supported, only 'text'",
                        param=f"messages[{i}].content[{j}].type",
                    )
                texts.append(part.text or "")
            content = "\n".join(texts)
        elif content is None:
            if role != "assistant":
                raise APIError(
                    f"messages[{i}].content must be given for role {role!r}",
                    param=f"messages[{i}].content",
                )
            content = ""
        entry: dict[str, Any] = {"role": role, "content": content}
        if msg.name is not None:
            entry["name"] = msg.name
        if msg.tool_calls:
            entry["tool_calls"] = [_template_call(c, f"messages[{i}].tool_calls[{j}]")
                                   for j, c in enumerate(msg.tool_calls)]
        if msg.tool_call_id is not None:
            entry["tool_call_id"] = msg.tool_call_id
        out.append(entry)
    return out


def _template_call(call: dict[str, Any], where: str) -> dict[str, Any]:
    """An assistant message's tool call as chat templates read it: OpenAI's shape, its
    ``arguments`` JSON text made an object (Hermes' and Llama's templates write it
    with ``tojson``)."""
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise APIError(f"{where}.function.name must be a string", param=where)
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args or "{}")
        except ValueError:
            raise APIError(f"{where}.function.arguments is not JSON", param=where) from None
    return {**call, "function": {**fn, "arguments": args}}


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], *,
                add_generation_prompt: bool = True,
                continue_final_message: bool = False,
                tools: list[dict[str, Any]] | None = None) -> str:
    """The model's chat template applied to ``messages``, ending in the assistant header
    (``add_generation_prompt``), or leaving the last message open to be continued
    (``continue_final_message``, as /tokenize may ask)."""
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(
            "this model's tokenizer has no chat template; use /v1/completions with a "
            "prompt you format yourself",
            param="messages",
        )
    from jinja2 import TemplateError

    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tokenize=False, tools=tools
        )
    except ValueError as e:  # transformers: continue_final_message with no message to
        raise APIError(str(e), param="messages") from None  # continue, or both flags
    except TemplateError as e:  # raise_exception(...) in the template: a client error
        raise APIError(f"the model's chat template rejected the messages: {e}",
                       param="messages") from None
    if not isinstance(text, str):  # pragma: no cover - defensive, transformers API drift
        raise TypeError(f"apply_chat_template returned {type(text).__name__}, not str")
    return text


def encode_chat(tokenizer: Any, messages: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Token ids of the rendered chat.

    The template writes every special token the model needs (Llama 3's writes
    ``{{ bos_token }}`` itself), so the text is encoded *without* the tokenizer's own
    special tokens: encoding with them would give Llama-style models two BOS tokens.
    """
    return encode_text(tokenizer, render_chat(tokenizer, messages, tools=tools),
                       add_special_tokens=False)


def encode_text(tokenizer: Any, text: str, *, add_special_tokens: bool) -> list[int]:
    """Token ids of ``text``. Completion prompts are encoded with the tokenizer's special
    tokens (its BOS, as vLLM does); rendered chats without (see :func:`encode_chat`)."""
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


#: Request bodies larger than this many bytes are parsed, checked, rendered and tokenized
#: on a worker thread. Below it all of that costs less than the thread hop; above it,
#: doing it on the event loop would hold up /health and the token delivery of every
#: other stream for as long as it takes, which grows with the body (docs/MEASURED.md).
#: The body's size, not its prompt's, decides: 200,000 empty chat messages (6.6 MB, no
#: content at all) once held the loop for 7.6 s. transformers encodes through the Rust
#: ``encode_batch``, which releases the GIL, so the worker stalls neither the event loop
#: nor the engine's step-loop thread; JSON parsing (pydantic) and chat-template
#: rendering (Jinja, Python) share the GIL in the interpreter's switch-interval slices
#: (``sys.getswitchinterval()``, 5 ms).
INLINE_BODY_BYTES = 4096
#: Chats with more messages than this are rendered and tokenized on a worker thread
#: however small their body (the template's work grows with the message count).
INLINE_MESSAGES = 32

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class PromptBuilder:
    """Turns a parsed request into a :class:`Job`: checks the fields kvpush does not
    support, tokenizes, and checks prompt + max_tokens against the context length."""

    def __init__(self, tokenizer: Any, model_name: str, max_model_len: int, vocab_size: int,
                 executor: Executor, grammars: GrammarCompiler | None = None) -> None:
        """``grammars``: the engine's compiler when it runs in this process (a spec is
        then compiled once, here, and the engine finds it compiled)."""
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.executor = executor
        #: the most UTF-8 bytes one token spells (0: unknown): a text too long for the
        #: context by its size alone is refused before it is tokenized
        self.max_token_bytes = max_token_bytes(tokenizer)
        #: structured outputs checked (compiled, cached) before anything runs
        self.grammars = grammars or GrammarCompiler(tokenizer, vocab_size)

    async def _in_worker(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn)

    async def parse(self, kind: Literal["completion", "chat"], body: bytes) -> SamplingRequest:
        """The parsed request (pydantic ValidationError: a 400); a large body is parsed
        on a worker thread (see :data:`INLINE_BODY_BYTES`)."""
        model = ChatCompletionRequest if kind == "chat" else CompletionRequest
        if len(body) <= INLINE_BODY_BYTES:
            return model.model_validate_json(body)
        return await self._in_worker(lambda: model.model_validate_json(body))

    async def job(self, req: SamplingRequest, request_id: str, arrival: float,
                  body_bytes: int) -> Job:
        """Validate and tokenize a parsed request; on a worker thread when its body was
        large or, for a chat, when it has many messages."""
        # a structured output's grammar may take a while to compile the first time
        heavy = body_bytes > INLINE_BODY_BYTES or req.constrained
        make: Callable[[], Job]
        if isinstance(req, ChatCompletionRequest):
            heavy = heavy or len(req.messages) > INLINE_MESSAGES
            chat = req
            make = lambda: self.chat_job(chat, request_id, arrival)  # noqa: E731
        else:
            assert isinstance(req, CompletionRequest)
            completion = req
            make = lambda: self.completion_job(completion, request_id, arrival)  # noqa: E731
        if not heavy:
            return make()
        return await self._in_worker(make)

    def serves(self, model: str) -> bool:
        """Whether ``model`` names the served model: its name, or a folder path ending in
        it (vLLM serves a folder under the path it was given, and its clients send that
        path: `vllm bench serve --model /models/X`)."""
        return model == self.model_name or (
            "/" in model and PurePosixPath(model.rstrip("/")).name == self.model_name)

    def check_model(self, model: str | None) -> None:
        """A 404 for a model this server does not serve (None: the served one)."""
        if model is not None and not self.serves(model):
            raise APIError(f"the model {model!r} does not exist; this server serves "
                           f"{self.model_name!r}", status_code=404, param="model",
                           code="model_not_found")

    async def tokenize(self, body: bytes) -> TokenizeResponse:
        """``POST /tokenize`` (vLLM's): a prompt's or a chat's token ids, encoded as the
        generation endpoints encode them; on a worker thread when the body is large."""
        def run() -> TokenizeResponse:
            raw = _JSON_OBJECT.validate_json(body)  # a 400 unless a JSON object
            model = TokenizeChatRequest if "messages" in raw else TokenizeCompletionRequest
            req = model.model_validate(raw)
            self.check_model(req.model)
            if isinstance(req, TokenizeChatRequest):
                text = render_chat(self.tokenizer, normalize_messages(req.messages),
                                   add_generation_prompt=req.add_generation_prompt,
                                   continue_final_message=req.continue_final_message)
            else:
                text = req.prompt
            ids = encode_text(self.tokenizer, text, add_special_tokens=req.add_special_tokens)
            strs = (list(self.tokenizer.convert_ids_to_tokens(ids))
                    if req.return_token_strs else None)
            return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len,
                                    tokens=ids, token_strs=strs)
        return run() if len(body) <= INLINE_BODY_BYTES else await self._in_worker(run)

    async def detokenize(self, body: bytes) -> DetokenizeResponse:
        """``POST /detokenize`` (vLLM's): the text of token ids (special tokens kept)."""
        def run() -> DetokenizeResponse:
            req = DetokenizeRequest.model_validate_json(body)
            self.check_model(req.model)
            if req.tokens:
                self._check_token_ids(req.tokens, "tokens")
            return DetokenizeResponse(prompt=self.tokenizer.decode(req.tokens))
        return run() if len(body) <= INLINE_BODY_BYTES else await self._in_worker(run)

    def _check_common(self, req: SamplingRequest) -> None:
        self.check_model(req.model)
        if req.n is not None and not 1 <= req.n <= MAX_N:
            raise APIError(f"n must be from 1 to {MAX_N}, got {req.n}", param="n")
        if req.max_tokens is not None and req.max_tokens < 1:
            raise APIError(f"max_tokens must be at least 1, got {req.max_tokens}",
                           param="max_tokens")
        if req.logit_bias:
            if len(req.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
                raise APIError(f"logit_bias: at most {MAX_LOGIT_BIAS_ENTRIES} tokens, got "
                               f"{len(req.logit_bias)}", param="logit_bias")
            ids = []
            for key in req.logit_bias:
                if not (key.isascii() and key.isdigit()):
                    raise APIError(f"logit_bias: {key!r} is not a token id", param="logit_bias")
                ids.append(int(key))
            self._check_token_ids(ids, "logit_bias")
        if req.stop_token_ids:
            self._check_token_ids(req.stop_token_ids, "stop_token_ids")

    def _check_token_ids(self, ids: list[int], param: str) -> None:
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            bad = next(t for t in ids if not 0 <= t < self.vocab_size)
            raise APIError(f"{param}: token id {bad} is out of range [0, {self.vocab_size})",
                           param=param)

    def _check_text_size(self, texts: Iterable[str], what: str) -> None:
        """Refuse a text that cannot fit the context by its size alone (a 20 MB prompt
        would hold a worker for many seconds of tokenizing before its 400)."""
        size = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
        at_least = tokens_at_least(size, self.max_token_bytes)
        if at_least >= self.max_model_len:
            raise APIError(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, your {what} is at least {at_least} tokens by its size alone "
                f"({size} bytes of text). Please reduce the length of the {what}.",
                param="messages" if what == "messages" else "prompt",
                code="context_length_exceeded",
            )

    def _check_context(self, prompt_len: int, max_tokens: int, what: str) -> None:
        limit = self.max_model_len
        if prompt_len >= limit:
            raise APIError(
                f"This model's maximum context length is {limit} tokens. However, your "
                f"{what} is {prompt_len} tokens, which leaves no room to generate. Please "
                f"reduce the length of the {what}.",
                param="messages" if what == "messages" else "prompt",
                code="context_length_exceeded",
            )
        if prompt_len + max_tokens > limit:
            raise APIError(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the {what}, "
                f"{max_tokens} in the completion). Please reduce the length of the {what} "
                "or completion.",
                param="max_tokens",
                code="context_length_exceeded",
            )

    def _structured(self, req: SamplingRequest) -> StructuredOutput | None:
        """The request's structured output, compiled once here (a 400 if it cannot be)."""
        given = structured_output(req)
        return None if given is None else self._compiled(given[1], given[0])

    def _compiled(self, spec: StructuredOutput, param: str) -> StructuredOutput:
        """``spec``, compiled (or found compiled); a 400 naming ``param`` if it cannot be."""
        try:
            self.grammars.check(spec)
        except GrammarError as e:
            raise APIError(f"{param}: {e}", param=param) from None
        return spec

    @staticmethod
    def _sampling_params(req: SamplingRequest, max_tokens: int, logprobs: bool,
                         top_logprobs: int = 0,
                         structured: StructuredOutput | None = None) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            seed=req.seed,
            stop=tuple(req.stop or ()),
            stop_token_ids=frozenset(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=tuple((int(k), v) for k, v in (req.logit_bias or {}).items()),
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            include_stop_str_in_output=req.include_stop_str_in_output,
            cache_salt=req.cache_salt,
            structured=structured,
            n=req.n or 1,
        )

    def completion_job(self, req: CompletionRequest, request_id: str, arrival: float) -> Job:
        """Validate a completion request and tokenize its prompt."""
        self._check_common(req)
        if req.echo:
            raise APIError("echo is not supported", param="echo")
        if req.suffix:
            raise APIError("suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of != (req.n or 1):
            raise APIError(f"best_of must equal n ({req.n or 1}), got {req.best_of}: "
                           "kvpush does not rank extra completions to return the most "
                           "likely (n > 1 returns every choice)", param="best_of")
        if req.logprobs is not None and not 0 <= req.logprobs <= 5:
            raise APIError(f"logprobs must be between 0 and 5, got {req.logprobs}",
                           param="logprobs")
        prompt = req.prompt
        if not prompt:
            raise APIError("prompt must not be empty", param="prompt")
        if isinstance(prompt, str):
            self._check_text_size([prompt], "prompt")
            ids = encode_text(self.tokenizer, prompt, add_special_tokens=True)
            if not ids:
                raise APIError("prompt encodes to no tokens", param="prompt")
        else:
            self._check_context(len(prompt), 1, "prompt")  # before looking at each id
            self._check_token_ids(prompt, "prompt")
            ids = list(prompt)
        max_tokens = req.max_tokens
        if max_tokens is None:
            max_tokens = COMPLETION_DEFAULT_MAX_TOKENS
        self._check_context(len(ids), 1, "prompt")
        params = self._sampling_params(req, max_tokens, logprobs=req.logprobs is not None,
                                       top_logprobs=req.logprobs or 0,
                                       structured=self._structured(req))
        self._check_context(len(ids), max_tokens, "prompt")
        return Job(request_id, ids, params, arrival, bool(req.stream),
                   bool(req.stream_options and req.stream_options.include_usage),
                   return_token_ids=bool(req.return_token_ids))

    def chat_job(self, req: ChatCompletionRequest, request_id: str, arrival: float) -> Job:
        """Validate a chat request, render its messages and tokenize them."""
        self._check_common(req)
        mct = req.max_completion_tokens
        if mct is not None and mct < 1:
            raise APIError(f"max_completion_tokens must be at least 1, got {mct}",
                           param="max_completion_tokens")
        tools = self._tools(req)
        top = req.top_logprobs
        if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
            raise APIError(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {top}",
                           param="top_logprobs")
        if top and not req.logprobs:
            raise APIError("top_logprobs needs logprobs set to true", param="top_logprobs")
        messages = normalize_messages(req.messages)
        self._check_text_size((m["content"] for m in messages), "messages")
        ids = encode_chat(self.tokenizer, messages, tools.rendered)
        self._check_context(len(ids), 1, "messages")
        max_tokens = mct if mct is not None else req.max_tokens
        if max_tokens is None:
            max_tokens = self.max_model_len - len(ids)
        structured = self._structured(req)
        if tools.grammar is not None:
            if structured is not None:
                raise APIError("a required or named tool_choice constrains the answer: "
                               "give no structured output with it", param="tool_choice")
            structured = self._compiled(tools.grammar, "tools")
        params = self._sampling_params(req, max_tokens, logprobs=bool(req.logprobs),
                                       top_logprobs=(top or 0) if req.logprobs else 0,
                                       structured=structured)
        self._check_context(len(ids), max_tokens, "messages")
        return Job(request_id, ids, params, arrival, bool(req.stream),
                   bool(req.stream_options and req.stream_options.include_usage),
                   tools.format, tools.finish_says_calls)

    def _tools(self, req: ChatCompletionRequest) -> ToolSetup:
        """What the request's tools and tool_choice ask for (a 400 if they cannot be)."""
        if req.functions:
            raise APIError("functions is OpenAI's deprecated field: give tools",
                           param="functions")
        choice = req.tool_choice
        if not req.tools:
            if choice not in (None, "none"):
                raise APIError("tool_choice needs tools", param="tool_choice")
            return ToolSetup()
        fmt = template_format(getattr(self.tokenizer, "chat_template", None))
        if fmt is None:
            raise APIError("this model's chat template does not render tools (give one "
                           "that does with --chat-template)", param="tools")
        if choice == "none":  # the model is not told of them, and nothing is parsed
            return ToolSetup()
        rendered = [t.model_dump(exclude_none=True) for t in req.tools]
        functions = [t["function"] for t in rendered]
        if isinstance(choice, NamedToolChoice):
            named = [f for f in functions if f["name"] == choice.function.name]
            if not named:
                raise APIError(f"tool_choice names {choice.function.name!r}, which is not "
                               "among the tools", param="tool_choice")
            return ToolSetup(rendered, fmt, call_grammar(fmt, named, several=False), False)
        if choice == "required":
            several = req.parallel_tool_calls is not False
            return ToolSetup(rendered, fmt, call_grammar(fmt, functions, several))
        return ToolSetup(rendered, fmt)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte <-> printable character table used by byte-level BPE vocabularies."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


_BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenTexts:
    """Display text and raw UTF-8 bytes of single tokens, for logprobs; cached per id.

    A token can hold part of a UTF-8 character: its ``bytes`` are then the exact bytes
    (clients join them to rebuild the text), and its display text has U+FFFD for the
    incomplete part, as the tokenizer's own decode would.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        self._byte_level = decoder is not None and "ByteLevel" in str(decoder)
        # SentencePiece-style vocabularies write a leading space as U+2581
        self._metaspace = decoder is not None and "\u2581" in str(decoder)
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._compute(token_id)
            if len(self._cache) < 1 << 20:
                self._cache[token_id] = hit
        return hit

    def _compute(self, token_id: int) -> tuple[str, list[int]]:
        raw: bytes | None = None
        piece = self._tok.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            m = _BYTE_FALLBACK.fullmatch(piece)
            if m:
                raw = bytes([int(m.group(1), 16)])
            elif self._byte_level and all(c in _BYTE_DECODER for c in piece):
                raw = bytes(_BYTE_DECODER[c] for c in piece)
            elif self._metaspace:
                raw = piece.replace("\u2581", " ").encode("utf-8")
        if raw is None:
            text = self._tok.decode([token_id])
            return text, list(text.encode("utf-8"))
        return raw.decode("utf-8", errors="replace"), list(raw)
