"""Engine step times in float32 against bfloat16 on this CPU, side by side.

kvpush serves in float32 unless told otherwise (``--dtype``). This script builds one
LLMEngine per dtype (same model, same thread count) and alternates them, round by round,
over the same work: a 512-token prefill (one step) followed by 16 batch-1 decodes, and
a batch of 32 requests decoding together. It prints each dtype's median prefill and
decode step and the ratio, and how many greedy tokens bfloat16 shares with float32 (a
different rounding changes some continuations; the engine tests check float32 against
HF transformers token for token).

    .venv/bin/python benchmarks/dtype_steps.py --threads 1 --rounds 3

Alternating rounds, not one dtype after the other: a small VM's speed moves by 10-30%
within minutes (docs/SIMULATOR.md, "What the simulator learned about CPU hosts").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)

    import torch

    from kvpush.config import EngineConfig
    from kvpush.engine.llm_engine import LLMEngine
    from kvpush.models.registry import resolve_model
    from kvpush.sampling_params import SamplingParams

    path = resolve_model(args.model)
    dtypes = ("float32", "bfloat16")
    engines = {d: LLMEngine(EngineConfig.build(path, threads=args.threads, dtype=d,
                                               max_model_len=1024, kv_cache_memory=1 << 29))
               for d in dtypes}
    torch.set_num_threads(args.threads)
    counter = iter(range(10**9))

    def run(eng: LLMEngine, prompts: list[list[int]], max_tokens: int
            ) -> tuple[list[tuple[int, float]], dict[str, list[int]]]:
        """(rows, seconds) of every step, and each request's tokens."""
        ids = [f"r{next(counter)}" for _ in prompts]
        for rid, p in zip(ids, prompts, strict=True):
            eng.add_request(rid, p, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                   ignore_eos=True))
        steps, toks = [], {rid: [] for rid in ids}
        while eng.has_work():
            t = time.perf_counter()
            outs = eng.step()
            steps.append((len(outs), time.perf_counter() - t))
            for o in outs:
                toks[o.request_id] += o.new_token_ids
        return steps, toks

    gen = torch.Generator().manual_seed(0)

    def prompt(n: int) -> list[int]:
        return torch.randint(100, 40000, (n,), generator=gen).tolist()

    for eng in engines.values():  # warm-up
        run(eng, [prompt(64)], 2)
    times: dict[str, dict[str, list[float]]] = {d: {"prefill": [], "decode": [],
                                                    "decode32": []} for d in dtypes}
    same = total = 0
    for _ in range(args.rounds):
        lone, batch = prompt(512), [prompt(128) for _ in range(32)]
        toks = {}
        for d, eng in engines.items():
            steps, out = run(eng, [lone], 17)
            times[d]["prefill"].append(steps[0][1])
            times[d]["decode"] += [s for _, s in steps[2:]]
            toks[d] = next(iter(out.values()))
            steps, _ = run(eng, batch, 9)
            times[d]["decode32"] += [s for n, s in steps if n == 32][1:]
        same += sum(a == b for a, b in zip(toks["float32"], toks["bfloat16"], strict=True))
        total += len(toks["float32"])
    print(f"model {args.model}, {args.threads} thread(s), {args.rounds} rounds alternating\n")
    print("| step | float32 (ms) | bfloat16 (ms) | float32 / bfloat16 |")
    print("|---|---:|---:|---:|")
    for kind, label in (("prefill", "prefill, 512 tokens"), ("decode", "decode, batch 1"),
                        ("decode32", "decode, batch 32")):
        a, b = (statistics.median(times[d][kind]) for d in dtypes)
        print(f"| {label} | {1e3 * a:.1f} | {1e3 * b:.1f} | {a / b:.2f} |")
    print(f"\ngreedy tokens equal at the same position: {same} of {total}")
    for eng in engines.values():
        eng.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
