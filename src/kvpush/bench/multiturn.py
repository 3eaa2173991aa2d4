"""Running the ``multi-turn`` data set (:mod:`kvpush.bench.conversations`): each
conversation is a task that sends its turns in order on the chat endpoint, streaming,
every turn with the history and the answers the server streamed back.

Scheduling: conversations start at Poisson arrivals of ``request_rate`` per second (all
at once for ``inf``); ``max_concurrency`` bounds the conversations in progress (a
conversation holds its slot through its think times, as a user at a chat window does).
Within a conversation turn ``k + 1`` is sent only after turn ``k``'s stream has ended
and its think time has passed. A turn that fails ends its conversation: its later turns
are not sent and count as failed, with that reason.

Results are one :class:`RequestResult` per turn, conversation-major (conversation 0's
turns 1..T, then conversation 1's...), each knowing its conversation and turn.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

from kvpush.bench.conversations import Conversation, count_messages, think_times
from kvpush.bench.datasets import PromptCodec
from kvpush.bench.metrics import RequestResult, per_turn_metrics
from kvpush.bench.settings import BenchConfig, arrival_offsets, request_body
from kvpush.bench.stream import send_one


def new_results(convs: Sequence[Conversation], codec: PromptCodec | None) -> list[RequestResult]:
    """One empty result per turn, conversation-major. Turn 1's prompt length is known
    now (with a tokenizer); later turns' once their history is (:func:`fill_prompt_lens`)."""
    out = []
    for c, conv in enumerate(convs):
        for t in range(1, conv.turns + 1):
            n = count_messages(codec, conv.messages(1, [])) if codec and t == 1 else 0
            out.append(RequestResult(prompt_len=n, conversation=c, turn=t))
    return out


def fill_prompt_lens(convs: Sequence[Conversation], results: Sequence[RequestResult],
                     codec: PromptCodec | None) -> None:
    """Set the prompt length of every turn that was sent: its messages (with the answers
    the server gave) rendered and counted; without a tokenizer, the server's count."""
    i = 0
    for conv in convs:
        answers: list[str] = []
        for t in range(1, conv.turns + 1):
            r = results[i]
            i += 1
            if r.start_time >= 0:
                if codec is not None:
                    r.prompt_len = count_messages(codec, conv.messages(t, answers))
                elif r.server_prompt_tokens is not None:
                    r.prompt_len = r.server_prompt_tokens
            answers.append(r.generated_text)


def result_fields(config: BenchConfig, outputs: Sequence[RequestResult]) -> dict[str, Any]:
    """The result JSON's multi-turn fields: each request's conversation and turn, the
    per-turn figures (``per_turn``; ``turns_2plus`` pools every turn after the first),
    the workload's settings; ``input_len`` is None (each turn's is in ``input_lens``)."""
    per_turn, later = per_turn_metrics(outputs, config.percentiles)
    return {
        "input_len": None,
        "conversations": [r.conversation for r in outputs],
        "turns": [r.turn for r in outputs],
        "per_turn": per_turn,
        "turns_2plus": later,
        "multi_turn": {"num_conversations": config.num_conversations,
                       "turns": config.turns, "system_prompt_len": config.system_prompt_len,
                       "question_len": config.question_len, "think_time": config.think_time,
                       "think_time_dist": config.think_time_dist},
    }


def conversation_tasks(config: BenchConfig, model_id: str, convs: Sequence[Conversation],
                       results: list[RequestResult], client: Any, url: str, t0: float,
                       bar: Any) -> list[asyncio.Future]:
    """Start one task per conversation (see the module docstring); they fill
    ``results``. The caller bounds them in time and cancels what is left."""
    offsets = arrival_offsets(len(convs), config.request_rate, config.seed)
    pauses = think_times(len(convs), max(c.turns for c in convs), config.think_time,
                         config.think_time_dist, config.seed)
    sem = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    first = [0]
    for conv in convs:
        first.append(first[-1] + conv.turns)

    async def talk(c: int) -> None:
        conv, answers = convs[c], []
        for t in range(1, conv.turns + 1):
            res = results[first[c] + t - 1]
            if pauses[c][t - 1] > 0:
                await asyncio.sleep(pauses[c][t - 1])
            body = request_body(config, model_id, None, messages=conv.messages(t, answers),
                                max_tokens=conv.output_len)
            await send_one(client, url, body, res, True, t0, config.request_timeout)
            if bar is not None:
                bar.update(1)
            if not res.success:
                for later in results[first[c] + t:first[c + 1]]:
                    later.error = f"not sent: turn {t} of this conversation failed"
                    if bar is not None:
                        bar.update(1)
                return
            answers.append(res.generated_text)

    async def one(c: int) -> None:
        delay = t0 + offsets[c] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if sem is None:
            await talk(c)
        else:
            async with sem:
                await talk(c)

    return [asyncio.ensure_future(one(c)) for c in range(len(convs))]
