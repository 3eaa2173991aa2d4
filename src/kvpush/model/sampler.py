"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, logprobs.

Before any of those, a row's logits get its logit_bias and its penalties: the
repetition penalty over the prompt's and output's tokens (a positive logit divided by
it, a negative one multiplied, as HF transformers and vLLM do), then the presence and
frequency penalties over the output's (OpenAI: ``logit - count x frequency - (count >
0) x presence``).

A row with a structured output (kvpush.grammar) then has every token its grammar
does not allow next masked out.

Logprobs are those of the model's raw distribution (log_softmax of the logits before
temperature and truncation), as vLLM and OpenAI report them: the sampled token's, and
for a row whose params ask for ``top_logprobs`` N, the N most likely tokens' (id,
logprob), most likely first.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

from kvpush.grammar import Grammar, mask_logits
from kvpush.sampling_params import SamplingParams, TopLogprobs


def _truncate(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask a 1-D logits row to its top-k and nucleus (top-p) support."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # keep the smallest prefix whose mass reaches top_p (the first token always)
        cum = probs.cumsum(-1) - probs
        drop = cum >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    return logits


#: a row's tokens so far: (prompt token ids, output token ids)
History = tuple[Sequence[int], Sequence[int]]


def adjust_logits_(row: torch.Tensor, p: SamplingParams, history: History | None) -> None:
    """Apply ``p``'s logit_bias and penalties to one 1-D logits row, in place."""
    vocab = row.shape[-1]
    if p.logit_bias:
        ids = torch.tensor([t for t, _ in p.logit_bias if t < vocab], dtype=torch.long)
        bias = torch.tensor([b for t, b in p.logit_bias if t < vocab], dtype=row.dtype)
        row.index_add_(0, ids, bias)
    if not p.penalized or history is None:
        return
    prompt, output = history
    if p.repetition_penalty != 1.0:
        # every position of the prompt and output, repeats and all: a token seen twice is
        # gathered twice and written back twice with the same value, so no set is built
        # (numpy's fromiter costs less than a set and torch.tensor: docs/MEASURED.md)
        seen = torch.from_numpy(np.fromiter(itertools.chain(prompt, output), dtype=np.int64,
                                            count=len(prompt) + len(output)))
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty,
                                vals * p.repetition_penalty)
    if output and (p.presence_penalty or p.frequency_penalty):
        # only the distinct output tokens move (not a vocabulary-wide count per row)
        ids, counts = torch.unique(torch.tensor(output, dtype=torch.long), return_counts=True)
        keep = ids < vocab
        penalty = counts[keep].to(row.dtype) * p.frequency_penalty + p.presence_penalty
        row.index_add_(0, ids[keep], -penalty)


def sample(
    logits: torch.Tensor,  # [N, V] float32
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    default_generator: torch.Generator,
    histories: Sequence[History | None] | None = None,
    grammars: Sequence[Grammar | None] | None = None,
) -> tuple[list[int], list[float] | None, list[TopLogprobs | None] | None]:
    """One token per row, and, only when some row asks for them, each row's logprobs
    (the sampled token's) and top logprobs (None for a row that asked for none).
    ``histories``: per row, its tokens so far (needed by rows with penalties);
    ``grammars``: per row, its structured output's matcher (the tokens it does not
    allow next are masked out after bias and penalties). Logprobs are the raw
    distribution's, before bias, penalties and grammar."""
    n = logits.shape[0]
    raw = logits
    adjusted = [i for i, p in enumerate(params) if p.adjusts_logits]
    guided = [i for i, g in enumerate(grammars or ()) if g is not None]
    if adjusted or guided:
        logits = logits.clone()  # the raw rows stay for the logprobs
        for i in adjusted:
            adjust_logits_(logits[i], params[i],
                           histories[i] if histories is not None else None)
        if guided:
            assert grammars is not None
            logits = mask_logits(logits, guided,
                                 [grammars[i] for i in guided])  # type: ignore[misc]
    tokens = [0] * n
    greedy_rows = [i for i, p in enumerate(params) if p.greedy]
    if len(greedy_rows) == n:  # all greedy: no row gather
        tokens = logits.argmax(-1).tolist()
    elif greedy_rows:
        idx = torch.tensor(greedy_rows)
        for i, t in zip(greedy_rows, logits[idx].argmax(-1).tolist(), strict=False):
            tokens[i] = t
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = logits[i] / p.temperature
        row = _truncate(row, p.top_k, p.top_p)
        probs = row.softmax(-1)
        if not bool(torch.isfinite(probs).all()):  # degenerate logits: never fail the step
            tokens[i] = int(logits[i].nan_to_num(nan=float("-inf")).argmax())
            continue
        gen = generators[i] or default_generator
        tokens[i] = int(torch.multinomial(probs, 1, generator=gen).item())
    logprobs: list[float] | None = None
    tops: list[TopLogprobs | None] | None = None
    if any(p.logprobs for p in params):
        lp = torch.log_softmax(raw.float(), dim=-1)
        logprobs = lp[torch.arange(n), torch.tensor(tokens)].tolist()
        k = min(max(p.top_logprobs for p in params), lp.shape[-1])
        if k:
            values, ids = lp.topk(k, dim=-1)
            values, ids = values.tolist(), ids.tolist()
            tops = [tuple(zip(ids[i][:p.top_logprobs], values[i][:p.top_logprobs],
                              strict=True)) if p.top_logprobs else None
                    for i, p in enumerate(params)]
    return tokens, logprobs, tops
