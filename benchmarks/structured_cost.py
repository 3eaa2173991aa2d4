"""What structured outputs cost (issue 65, point 5), on an LLMEngine (no HTTP).

* per token: B requests in steady decode, plain sampling against a JSON schema whose
  string value must run on (``{"text": "..."}``, at least LONG_CHARS characters), in
  alternating rounds of N steps each; the median ms per token of each, their ratio, and
  the grammar's own share of a guided step (mask fill + apply, token consume), timed by
  wrapping them;
* time to first token of one request: with a schema compiled for the first time (a new
  one each trial), with the same schema again (cached), and plain; and what the first
  structured request of a process pays once (llguidance's tokenizer, built from the
  model's).

In ``kvpush serve`` the API front compiles a new schema too (its 400 check) before the
engine core does (on its grammar thread, off the step loop): the first use of a schema
pays the compile twice, once per process; ``--engine-core thread`` shares one compiler.

    PYTHONPATH=src python benchmarks/structured_cost.py --batches 1,8
    PYTHONPATH=src python benchmarks/structured_cost.py --smollm2 --batches 1,8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if "PYTHONPATH" not in os.environ:
    sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

#: the per-token schema: a string that cannot close before LONG_CHARS characters, so
#: every request of a batch is still generating after --steps (a real model closes a
#: plain string within ~10 tokens, and a batch that thins out costs more per token)
LONG_CHARS = 400
LONG = {"type": "object", "properties": {"text": {"type": "string", "minLength": LONG_CHARS}},
        "required": ["text"], "additionalProperties": False}


def schema(i: int) -> dict:
    """A schema of the kind extraction asks for, distinct per ``i`` (a cold compile)."""
    return {"type": "object", "additionalProperties": False,
            "required": [f"name{i}", "age", "tags", "address"],
            "properties": {f"name{i}": {"type": "string", "maxLength": 40},
                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                           "tags": {"type": "array", "items": {"type": "string"},
                                    "maxItems": 5},
                           "address": {"type": "object", "properties": {
                               "city": {"type": "string"},
                               "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                               "required": ["city", "zip"]}}}


class GrammarTimer:
    """Seconds spent in the grammar's per-token work (mask, consume) while wrapped."""

    def __init__(self) -> None:
        import kvpush.grammar as g
        import kvpush.model.sampler as s

        self.seconds = 0.0
        self._s, self._mask, self._consume = s, s.mask_logits, g.Grammar.consume
        s.mask_logits = self._wrap(self._mask)
        g.Grammar.consume = self._wrap(self._consume)

    def _wrap(self, fn):
        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.seconds += time.perf_counter() - t
        return timed


def per_token(engine, batch: int, steps: int, rounds: int, prompt_len: int) -> dict:
    from kvpush.sampling_params import GrammarKind, SamplingParams, StructuredOutput

    guided = StructuredOutput(GrammarKind.JSON_SCHEMA, json.dumps(LONG))
    timer = GrammarTimer()
    ms: dict[str, list[float]] = {"plain": [], "json": []}
    grammar_ms: list[float] = []
    for r in range(rounds):
        for kind in ("plain", "json"):
            for i in range(batch):
                engine.add_request(f"{kind}{r}-{i}", [(7 * i + j) % 200 + 3
                                                      for j in range(prompt_len)],
                                   SamplingParams(max_tokens=steps + 8, seed=i, ignore_eos=True,
                                                  structured=guided if kind == "json" else None))
            while any(req.num_output_tokens == 0 for req in engine.scheduler.requests.values()):
                engine.step()  # prefill: token #1 of each
            tokens, t0, g0 = 0, time.perf_counter(), timer.seconds
            for _ in range(steps):
                tokens += sum(len(o.new_token_ids) for o in engine.step())
            dt = time.perf_counter() - t0
            ms[kind].append(dt * 1e3 / max(tokens, 1))
            if kind == "json":
                grammar_ms.append((timer.seconds - g0) * 1e3 / max(tokens, 1))
            for rid in list(engine.scheduler.requests):
                engine.abort_request(rid)
    plain, guided_ms = statistics.median(ms["plain"]), statistics.median(ms["json"])
    return {"batch": batch, "plain_ms_per_token": round(plain, 3),
            "json_ms_per_token": round(guided_ms, 3), "ratio": round(guided_ms / plain, 3),
            "grammar_ms_per_token": round(statistics.median(grammar_ms), 3)}


def ttft(engine, trials: int, prompt_len: int) -> dict:
    from kvpush.sampling_params import GrammarKind, SamplingParams, StructuredOutput

    prompts = iter(range(10**6))

    def first_token_s(rid: str, spec) -> float:
        k = next(prompts)  # a prompt of its own: no prefix-cache hit
        prompt = [3 + (k * 31 + j * 7) % 250 for j in range(prompt_len)]
        t = time.perf_counter()
        engine.add_request(rid, prompt, SamplingParams(max_tokens=1, structured=spec))
        while not any(o.request_id == rid and o.new_token_ids for o in engine.step()):
            pass
        return time.perf_counter() - t

    first_ever = first_token_s("warm", StructuredOutput(GrammarKind.JSON_SCHEMA,
                                                       json.dumps(schema(-1))))
    cold, cached, plain = [], [], []
    for i in range(trials):
        spec = StructuredOutput(GrammarKind.JSON_SCHEMA, json.dumps(schema(i)))
        cold.append(first_token_s(f"cold{i}", spec))
        cached.append(first_token_s(f"cached{i}", spec))
        plain.append(first_token_s(f"plain{i}", None))
    med = lambda xs: round(statistics.median(xs) * 1e3, 1)  # noqa: E731
    return {"prompt_tokens": prompt_len, "plain_ms": med(plain),
            "schema_cached_ms": med(cached), "schema_first_compile_ms": med(cold),
            "first_structured_request_of_process_ms": round(first_ever * 1e3, 1)}


def main(argv: list[str] | None = None) -> int:
    from step_overhead import build_engine

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smollm2", action="store_true", help="SmolLM2-135M (installed)")
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        engine, name = build_engine(tmp, args.smollm2, args.preset, "llama", args.threads,
                                    "float32", 1024, 64, 1024)
        print(json.dumps({"model": name, "threads": args.threads,
                          "load": os.getloadavg()[0]}))
        print(json.dumps({"ttft": ttft(engine, args.trials, args.prompt)}))
        for b in (int(x) for x in args.batches.split(",")):
            print(json.dumps({"per_token": per_token(engine, b, args.steps, args.rounds,
                                                     args.prompt)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
