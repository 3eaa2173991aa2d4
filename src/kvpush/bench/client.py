"""The load generator: Poisson arrivals of streaming requests against any
OpenAI-compatible server (kvpush serve, the kvpush router, vLLM), measured client-side.

Library use::

    from kvpush.bench import BenchConfig, run_benchmark
    result = run_benchmark(BenchConfig(url="http://127.0.0.1:8000", num_prompts=8,
                                       input_len=32, output_len=8))
    result.save("result.json"); print(result.table())

Every request streams (SSE) with ``max_tokens = output_len``, ``ignore_eos`` and
temperature 0, asking for the final usage chunk (:mod:`kvpush.bench.stream`). The
``multi-turn`` data set sends conversations instead of independent prompts
(:mod:`kvpush.bench.multiturn`): each turn resends the history with the server's
answers, and the result adds per-turn figures. A run is bounded in count
(``num_prompts``, or conversations x turns) and time (``timeout`` for the whole run,
``request_timeout`` per request); requests that fail, time out or are never sent are
counted with their errors.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from kvpush.bench.conversations import (
    Conversation,
    multi_turn_conversations,
)
from kvpush.bench.datasets import (
    DatasetError,
    PromptCodec,
    SampleRequest,
    find_tokenizer,
    local_tokenizer_dir,
    sample_requests,
)
from kvpush.bench.metrics import (
    RequestResult,
    compute_metrics,
    format_table,
)
from kvpush.bench.settings import (
    ENDPOINTS,
    BenchConfig,
    BenchError,
    arrival_offsets,
    request_body,
)
from kvpush.bench.stream import auth_headers, send_one

#: vLLM's ``backend`` name for each endpoint.
BACKENDS = {"completions": "openai", "chat": "openai-chat"}


@dataclass
class BenchResult:
    """A finished run: its settings, what each request measured, and the summary."""

    config: BenchConfig
    model_id: str
    tokenizer_id: str
    date: str
    duration: float
    outputs: list[RequestResult]
    #: compute_metrics' fields (vLLM names).
    metrics: dict[str, Any]
    warnings: list[str] = field(default_factory=list)
    #: the wall clock (time.time()) at the instant start_times count from, to set the
    #: requests beside server-side logs
    start_wall: float = 0.0

    @property
    def completed(self) -> int:
        return int(self.metrics["completed"])

    @property
    def failed(self) -> int:
        return int(self.metrics["failed"])

    def to_dict(self) -> dict[str, Any]:
        """The result JSON: ``vllm bench serve``'s fields, then kvpush's extras."""
        c = self.config
        rate: float | str = c.request_rate if math.isfinite(c.request_rate) else "inf"
        out: dict[str, Any] = {
            "date": self.date,
            "backend": BACKENDS[c.endpoint],
            "endpoint_type": BACKENDS[c.endpoint],
            "label": c.label,
            "model_id": self.model_id,
            "tokenizer_id": self.tokenizer_id,
            "num_prompts": len(self.outputs),
            "request_rate": rate,
            "burstiness": 1.0,
            "max_concurrency": c.max_concurrency,
            "duration": self.duration,
        }
        out.update(self.metrics)
        out.update({
            "input_lens": [r.prompt_len for r in self.outputs],
            "output_lens": [r.output_tokens if r.success else 0 for r in self.outputs],
            "ttfts": [r.ttft for r in self.outputs],
            "itls": [r.itl for r in self.outputs],
            "errors": [r.error for r in self.outputs],
            # kvpush extras
            "e2els": [r.latency for r in self.outputs],
            "start_times": [r.start_time for r in self.outputs],
            "start_wall": self.start_wall,
            "url": c.url,
            "endpoint": ENDPOINTS[c.endpoint],
            "dataset_name": c.dataset,
            "input_len": c.input_len,
            "output_len": c.output_len,
            "prefix_len": c.effective_prefix_len(),
            "seed": c.seed,
            "timeout": c.timeout,
            "request_timeout": c.request_timeout,
            "warnings": self.warnings,
        })
        if c.multi_turn:
            from kvpush.bench.multiturn import result_fields

            out.update(result_fields(c, self.outputs))
        return out

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        if p.parent != Path():
            p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return p

    def table(self) -> str:
        return format_table(self.to_dict(), self.config.percentiles)


# ----------------------------------------------------------------- model and tokenizer


def list_models(url: str, timeout: float = 10.0) -> list[dict[str, Any]]:
    """The server's ``GET /v1/models`` cards; raises :class:`BenchError` if unreachable."""
    import httpx

    try:
        r = httpx.get(url.rstrip("/") + "/v1/models", timeout=timeout, trust_env=False,
                      headers=auth_headers())
        r.raise_for_status()
        data = r.json().get("data") or []
    except (httpx.HTTPError, ValueError, AttributeError) as e:
        raise BenchError(f"cannot list the models of {url} (GET /v1/models): {e}") from None
    return [d for d in data if isinstance(d, dict)]


def resolve_tokenizer(config: BenchConfig, model_id: str,
                      cards: Sequence[dict[str, Any]] | None = None) -> tuple[Any, str]:
    """(tokenizer, where it came from): ``config.tokenizer`` if given; else the model name
    (a kvpush model, a folder); else the ``root`` the server lists for the model
    (GET /v1/models), if it is here; else the local Hugging Face cache. Never downloads."""
    if config.tokenizer:
        return find_tokenizer([config.tokenizer])
    names = [model_id]
    if local_tokenizer_dir(model_id) is None:
        if cards is None:
            cards = list_models(config.url)
        names += [c["root"] for c in cards if c.get("id") == model_id
                  and isinstance(c.get("root"), str) and c["root"]]
    try:
        return find_tokenizer(names)
    except DatasetError as e:
        raise BenchError(f"{e}; pass --tokenizer DIR") from None


def prepare_requests(config: BenchConfig,
                     tokenizer: Any) -> list[SampleRequest] | list[Conversation]:
    """The run's prompts, or for multi-turn its conversations (deterministic for the
    seed and tokenizer)."""
    codec = PromptCodec(tokenizer, config.endpoint)  # type: ignore[arg-type]
    if config.multi_turn:
        return multi_turn_conversations(codec, config.num_conversations, config.turns,
                                        config.system_prompt_len, config.question_len,
                                        config.output_len, config.seed)
    return sample_requests(codec, config.dataset, config.num_prompts, config.input_len,
                           config.output_len, config.seed, config.effective_prefix_len(),
                           config.prompt_type, config.input_len_spread)


# ------------------------------------------------------------------------ the requests


async def _drive(config: BenchConfig, model_id: str,
                 requests: Sequence[SampleRequest] | Sequence[Conversation],
                 results: list[RequestResult]) -> tuple[float, float]:
    """Send every request (or conversation) on schedule; fill ``results``; return the
    run's duration and the wall clock at its start."""
    import httpx

    from kvpush.bench.multiturn import conversation_tasks

    chat = config.endpoint == "chat"
    url = config.url.rstrip("/") + ENDPOINTS[config.endpoint]
    offsets = arrival_offsets(len(requests), config.request_rate, config.seed)
    sem = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    bar = _progress_bar(len(results), config.progress)
    timeout = httpx.Timeout(config.request_timeout, connect=min(30.0, config.request_timeout))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False,
                                 headers=auth_headers()) as client:
        t0 = time.perf_counter()
        t0_wall = time.time()

        async def one(i: int) -> None:
            delay = t0 + offsets[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            body = request_body(config, model_id, requests[i])  # type: ignore[arg-type]
            try:
                if sem is None:
                    await send_one(client, url, body, results[i], chat, t0,
                                config.request_timeout)
                else:
                    async with sem:
                        await send_one(client, url, body, results[i], chat, t0,
                                    config.request_timeout)
            finally:
                if bar is not None:
                    bar.update(1)

        if config.multi_turn:
            tasks = conversation_tasks(config, model_id, requests,  # type: ignore[arg-type]
                                       results, client, url, t0, bar)
        else:
            tasks = [asyncio.ensure_future(one(i)) for i in range(len(requests))]
        _, pending = await asyncio.wait(tasks, timeout=config.timeout)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        duration = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    for r in results:
        if not r.success and not r.error:
            r.error = (f"cancelled: the benchmark timeout ({config.timeout:g} s) ran out"
                       + (" while it was in flight" if r.start_time >= 0
                          else " before it was sent"))
    return duration, t0_wall


def _progress_bar(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm comes with transformers
        return None
    return tqdm(total=total, unit="req", desc="bench", dynamic_ncols=True)


def _warnings(config: BenchConfig, outputs: Sequence[RequestResult]) -> list[str]:
    out = []
    done = [r for r in outputs if r.success]
    off = sum(1 for r in done if r.output_tokens != config.output_len)
    if off:
        out.append(f"{off} completed request(s) did not generate exactly --output-len "
                   f"{config.output_len} tokens (does the server honour ignore_eos?)")
    mism = sum(1 for r in done if r.server_prompt_tokens not in (None, r.prompt_len))
    if mism:
        out.append(f"{mism} request(s) had a prompt_tokens count from the server that "
                   "differs from the client's: is --tokenizer the served model's?")
    return out


def _prepare(config: BenchConfig, requests: Sequence[SampleRequest] | Sequence[Conversation] | None,
             tokenizer: Any | None
             ) -> tuple[str, str, Any, Sequence[SampleRequest] | Sequence[Conversation]]:
    """(model id, tokenizer id, tokenizer or None, prompts) for a run (blocking)."""
    config.validate()
    cards = None
    model_id = config.model
    if model_id is None:
        cards = list_models(config.url)
        if not cards or not isinstance(cards[0].get("id"), str):
            raise BenchError(f"{config.url} lists no models; pass --model")
        model_id = cards[0]["id"]
    tok_id = config.tokenizer or model_id
    if tokenizer is None and requests is None:
        tokenizer, tok_id = resolve_tokenizer(config, model_id, cards)
    if requests is None:
        requests = prepare_requests(config, tokenizer)
    if not requests:
        raise BenchError("no requests to send")
    if config.multi_turn != isinstance(requests[0], Conversation):
        raise BenchError("the multi-turn data set takes conversations, the others prompts")
    return model_id, tok_id, tokenizer, requests


async def arun_benchmark(config: BenchConfig, *,
                         requests: Sequence[SampleRequest] | Sequence[Conversation] | None
                         = None, tokenizer: Any | None = None) -> BenchResult:
    """:func:`run_benchmark` for callers already inside an event loop (the set-up runs in
    a worker thread)."""
    from kvpush.bench import multiturn

    model_id, tok_id, tokenizer, requests = await asyncio.to_thread(
        _prepare, config, requests, tokenizer)
    codec = None
    if config.multi_turn:
        codec = PromptCodec(tokenizer, "chat") if tokenizer is not None else None
        results = multiturn.new_results(requests, codec)  # type: ignore[arg-type]
    else:
        results = [RequestResult(prompt_len=r.prompt_len)  # type: ignore[union-attr]
                   for r in requests]
    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    duration, start_wall = await _drive(config, model_id, requests, results)
    if config.multi_turn:  # now that the answers are known
        await asyncio.to_thread(multiturn.fill_prompt_lens, requests, results, codec)
    for r in results:  # a server that sent no usage: count the text's tokens (or chunks)
        if r.success and r.output_tokens == 0:
            r.output_tokens = (len(tokenizer.encode(r.generated_text, add_special_tokens=False))
                               if tokenizer is not None else len(r.itl) + 1)
    metrics = compute_metrics(results, duration, config.percentiles)
    return BenchResult(config=config, model_id=model_id, tokenizer_id=tok_id, date=date,
                       duration=duration, outputs=results, metrics=metrics,
                       warnings=_warnings(config, results), start_wall=start_wall)


def run_benchmark(config: BenchConfig, *,
                  requests: Sequence[SampleRequest] | Sequence[Conversation] | None = None,
                  tokenizer: Any | None = None) -> BenchResult:
    """Run one benchmark and return its result (nothing is written or printed).

    ``requests``: prompts (multi-turn: conversations) to send instead of building them
    from the config's data set (e.g. the same prompts against several servers);
    ``tokenizer``: an already loaded
    tokenizer. Raises :class:`BenchError` (or DatasetError) if the run cannot start;
    failed requests do not raise, they are counted in the result. Not for use inside a
    running event loop: await :func:`arun_benchmark` there.
    """
    return asyncio.run(arun_benchmark(config, requests=requests, tokenizer=tokenizer))
