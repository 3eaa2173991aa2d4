"""Legs to vLLM instances: :class:`HttpSender`, the request life's other
:class:`~kvpush.router.senders.LegSender`, over vLLM's OpenAI API.

A leg is a ``POST /v1/completions`` of the prompt's token ids with the leg's sampling
parameters and ``kv_transfer_params`` (vLLM's names), asking for the answer's token ids
(``return_token_ids``); the router makes the text once, as it does for legs over engine
cores, so chats, tools, stop strings and usage are the router's front's whatever the
instance. A prefill leg (``do_remote_decode``) is one token, answered whole, as vLLM's
own P/D proxies send it; a decode leg streams.

Every wait on an instance is bounded: the answer's start by ``first_byte_timeout_s``,
each later read by ``request_timeout_s``, and any of them ends at once when a health
check fails on the instance (kvpush.router.watch). Answers are read within the router's
caps (a whole answer: ``max_answer_bytes``; one stream frame: ``max_frame_bytes``). A
leg whose connection fails, whose stream stops without its end, or whose answer breaks
the protocol takes its instance out of the rotation (``Pool.mark_failed``): that is what
``lost`` reports, and the life moves the request elsewhere.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import httpx

from kvpush.engine.outputs import EngineOutput, FinishReason, RequestFailure
from kvpush.errors import RequestError
from kvpush.kv_transfer.params import KVTransferParams, WireKVParams
from kvpush.router.answers import AnswerTooLarge, read_capped
from kvpush.router.pool import Instance, Pool, describe_error
from kvpush.router.redact import scrub, scrub_error
from kvpush.router.senders import Leg, Lost
from kvpush.router.watch import LegLost, LegWatch
from kvpush.sampling_params import GrammarKind, StructuredOutput

if TYPE_CHECKING:
    from kvpush.router.config import RouterConfig
    from kvpush.sampling_params import SamplingParams


class StreamStopped(Exception):
    """The stream ended before its end (``[DONE]`` after every choice finished): the
    instance's connection or process went away mid-answer."""


class RelayedKVParams(KVTransferParams):
    """A vLLM prefill's ``kv_transfer_params`` (its connector's fields), handed on to
    decode as they came (signed for decode by the life)."""

    def __init__(self, wire: dict[str, Any]) -> None:
        super().__init__(do_remote_prefill=True, transfer_id=wire.get("transfer_id"))
        object.__setattr__(self, "_wire", dict(wire))

    def to_wire(self) -> dict:
        return dict(self._wire)  # type: ignore[attr-defined]


def structured_outputs(spec: StructuredOutput) -> dict[str, Any]:
    """A structured-output spec as vLLM's ``structured_outputs`` field says it."""
    if spec.kind is GrammarKind.JSON_OBJECT:
        return {"json_object": True}
    if spec.kind is GrammarKind.JSON_SCHEMA:
        return {"json": json.loads(spec.spec)}
    if spec.kind is GrammarKind.CHOICE:
        return {"choice": json.loads(spec.spec)}
    return {spec.kind.value: spec.spec}  # regex, grammar


def completion_body(leg: Leg) -> dict[str, Any]:
    """The leg as vLLM's ``/v1/completions`` takes it."""
    p: SamplingParams = leg.params
    kv = leg.kv  # (a vLLM instance's: JSON, LegSigner)
    assert not isinstance(kv, WireKVParams)
    prefill = bool(kv and kv.get("do_remote_decode"))
    body: dict[str, Any] = {
        "prompt": leg.prompt, "max_tokens": 1 if prefill else p.max_tokens,
        "n": 1 if prefill else p.n, "stream": not prefill, "return_token_ids": True,
        "temperature": p.temperature, "top_p": p.top_p, "seed": p.seed,
        "stop": list(p.stop), "stop_token_ids": sorted(p.stop_token_ids),
        "ignore_eos": p.ignore_eos, "presence_penalty": p.presence_penalty,
        "frequency_penalty": p.frequency_penalty,
        "repetition_penalty": p.repetition_penalty,
        "logit_bias": {str(t): b for t, b in p.logit_bias} or None,
    }
    if p.top_k > 0:
        body["top_k"] = p.top_k
    if p.cache_salt is not None:
        body["cache_salt"] = p.cache_salt
    if p.logprobs:
        body["logprobs"] = p.top_logprobs
        body["return_tokens_as_token_ids"] = True
    if p.structured is not None:
        body["structured_outputs"] = structured_outputs(p.structured)
    if kv is not None:
        body["kv_transfer_params"] = kv
    return body


class HttpSender:
    """Legs to vLLM instances (those the router does not reach over an engine core)."""

    def __init__(self, cfg: RouterConfig, pool: Pool, client: httpx.AsyncClient) -> None:
        self.cfg = cfg
        self.pool = pool
        self.client = client

    # ---- LegSender -----------------------------------------------------------------
    def usable(self, inst: Instance) -> bool:
        return inst.healthy

    def lost(self, inst: Instance) -> Lost | None:
        """The pool's word: an instance a leg or a health check found gone is out of the
        rotation until a check passes again."""
        return None if inst.healthy else Lost("connection_lost",
                                              inst.last_error or "it stopped answering")

    def handshaking(self, inst: Instance) -> bool:
        return False

    def release(self, inst: Instance, transfer_id: str) -> None:
        """Nothing to send: vLLM frees a prefill's held blocks when its connector's lease
        ends (its API has no call to drop them sooner)."""

    async def stream(self, leg: Leg) -> AsyncIterator[EngineOutput]:
        inst, tid = leg.inst, leg.transfer_id
        body = completion_body(leg)
        req = self.client.build_request("POST", inst.url + "/v1/completions", json=body,
                                        headers={"X-Request-Id": tid})
        resp: httpx.Response | None = None
        try:
            with LegWatch(inst.watches, "the answer's start"):
                resp = await self.client.send(req, stream=True)
            if resp.status_code != 200:
                raise _refusal(resp.status_code, await self._whole(resp, inst), inst.role,
                               self.pool.engine_ids())
            if not body["stream"]:
                answer = _json(await self._whole(resp, inst))
                yield _prefill_output(tid, answer)
                return
            async for out in self._events(resp, inst, tid, leg.params.n):
                yield out
        except RequestError:  # its refusal: the request's error
            raise
        except (httpx.HTTPError, OSError, LegLost, StreamStopped) as e:
            # its way is gone: out of the rotation (a failed health check that ended
            # the wait took it out already)
            why = e.reason if isinstance(e, LegLost) else describe_error(e)
            if not isinstance(e, LegLost):
                self.pool.mark_failed(inst, f"{inst.role} leg: {why}")
            yield _failed(tid, f"the {inst.role} instance failed: {why}")
        except ValueError as e:  # a broken answer: over a cap (AnswerTooLarge), no JSON
            yield _failed(tid, f"the {inst.role} instance's answer was broken: {e}")
        finally:
            if resp is not None:
                await resp.aclose()

    # ---- reading ---------------------------------------------------------------------
    async def _whole(self, resp: httpx.Response, inst: Instance) -> bytes:
        """The answer, read whole within ``max_answer_bytes``."""
        with LegWatch(inst.watches, "its answer", self.cfg.request_timeout_s):
            return await read_capped(resp, self.cfg.max_answer_bytes)

    async def _frames(self, resp: httpx.Response, inst: Instance) -> AsyncIterator[bytes]:
        """The stream's SSE frames (``data: ...``), each within ``max_frame_bytes``; the
        first read waits ``first_byte_timeout_s`` at most, each later one
        ``request_timeout_s``."""
        cap, pending = self.cfg.max_frame_bytes, bytearray()
        chunks = resp.aiter_bytes()
        wait = self.cfg.first_byte_timeout_s
        while True:
            with LegWatch(inst.watches, "its stream", wait):
                chunk = await anext(chunks, None)
            if chunk is None:
                return
            wait = self.cfg.request_timeout_s
            start = max(0, len(pending) - 1)  # an end may straddle two chunks
            pending += chunk
            while (end := pending.find(b"\n\n", start)) >= 0:
                yield bytes(pending[:end])
                del pending[:end + 2]
                start = 0
            if len(pending) > cap:
                raise AnswerTooLarge(f"a frame of its stream passed {len(pending)} bytes "
                                     f"without an end (the router's cap is {cap >> 20} MiB)")

    async def _events(self, resp: httpx.Response, inst: Instance, tid: str,
                      n: int) -> AsyncIterator[EngineOutput]:
        finished: set[int] = set()
        first_token: float | None = None
        async for frame in self._frames(resp, inst):
            data = frame.removeprefix(b"data:").strip()
            if not data or frame.startswith(b":"):
                continue
            if data == b"[DONE]":
                if len(finished) < n:
                    raise StreamStopped("its stream ended before every choice finished")
                return
            event = _json(data)
            if "error" in event:
                yield _in_band_error(tid, event, self.pool.engine_ids())
                return
            for choice in event.get("choices") or ():
                out = _choice_output(tid, choice)
                if out.new_token_ids and first_token is None:
                    first_token = time.perf_counter()
                out.first_token_time = first_token
                if out.finished:
                    finished.add(out.index)
                    out.more_choices = len(finished) < n
                yield out
        raise StreamStopped("its stream stopped before its end")


def _failed(tid: str, why: str) -> EngineOutput:
    return EngineOutput(tid, [], finish_reason=FinishReason.ERROR,
                        failure=RequestFailure(why, status_code=502))


def _json(data: bytes) -> dict[str, Any]:
    obj = json.loads(data)
    if not isinstance(obj, dict):
        raise ValueError("its answer is not a JSON object")
    return obj


def _finish(reason: object) -> FinishReason | None:
    if reason is None:
        return None
    try:
        return FinishReason(reason)
    except ValueError:
        return FinishReason.STOP  # (vLLM's other reasons end the choice as a stop does)


def _choice_output(tid: str, choice: dict[str, Any]) -> EngineOutput:
    """One choice's progress in one frame (its ``token_ids``, logprobs, finish)."""
    ids = choice.get("token_ids") or []
    if not isinstance(ids, list) or not all(type(t) is int for t in ids):
        raise ValueError("a frame's token_ids are not a list of ids")
    out = EngineOutput(tid, ids, finish_reason=_finish(choice.get("finish_reason")),
                       index=int(choice.get("index") or 0))
    lps = choice.get("logprobs")
    if isinstance(lps, dict) and ids:
        out.new_logprobs = [float(x) if x is not None else float("-inf")
                            for x in lps.get("token_logprobs") or ()]
        tops = lps.get("top_logprobs")
        if tops:
            out.new_top_logprobs = [
                tuple(sorted(((int(str(k).rpartition(":")[2]), float(v))
                              for k, v in (top or {}).items()), key=lambda kv: -kv[1]))
                for top in tops]
    return out


def _prefill_output(tid: str, answer: dict[str, Any]) -> EngineOutput:
    """A prefill leg's whole answer: its token and what decode needs (pull)."""
    choices = answer.get("choices") or [{}]
    out = _choice_output(tid, choices[0])
    out.finish_reason = out.finish_reason or FinishReason.LENGTH
    kv = answer.get("kv_transfer_params")
    if isinstance(kv, dict):
        out.kv_transfer_params = RelayedKVParams(kv)
    return out


def _refusal(status: int, content: bytes, role: str, engine_ids: list[str]) -> RequestError:
    """An instance's non-200 answer as the request's error: its OpenAI error (kvpush's,
    or vLLM's older flat one), scrubbed, with its status; else (no JSON error) what it
    said, scrubbed, as a 502 for a 5xx."""
    try:
        obj = json.loads(content)
    except ValueError:
        obj = None
    err = scrub_error(obj, status, engine_ids)
    if err is None:
        said = scrub(content[:200].decode("utf-8", "replace").strip(), engine_ids)
        return RequestError(f"the {role} instance answered HTTP {status}: {said}",
                            status_code=502 if status >= 500 else status)
    return err


def _in_band_error(tid: str, event: dict[str, Any], engine_ids: list[str]) -> EngineOutput:
    err = scrub_error(event, 500, engine_ids)
    message = str(err) if err is not None else "the instance reported an error"
    return EngineOutput(tid, [], finish_reason=FinishReason.ERROR,
                        failure=RequestFailure(message, status_code=500))
