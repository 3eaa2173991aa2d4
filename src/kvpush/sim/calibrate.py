"""`kvpush simulate calibrate`: measure this machine's profile from kvpush's own engine.

Step times come from :class:`kvpush.engine.llm_engine.LLMEngine` itself: a few prompts
are run through ``step()`` with the scheduler's plan captured, so every step is one
sample (its chunks and its wall time, scheduling, sampling and detokenization included).
Prefill samples use a set token budget (chunks of n tokens at contexts 0, n, 2n...);
decode samples run B requests of C prompt tokens each. A ``linear`` step model is fitted
per torch thread count by non-negative least squares on relative error. The transfer
link comes from :mod:`kvpush.sim.transfer_probe` (real NIXL between two processes).

The engine's own matmuls (its ``linear`` on one layer's real weights, times the number
of layers, and the LM head) are timed for 1..1024 token rows with the engine idle before
each pass and after the last: CPU torch runs a 1-row matmul as GEMV and 2+ rows as GEMM
at about twice the cost, a step the linear terms cannot express. The lower median of
those timings per row goes into the step model (``token_rows_s``, ``sample_rows_s``) and the
linear terms are fitted to what remains.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpush.sim.matmul_tables import measure_matmuls, settle_tables, thread_warnings
from kvpush.sim.push_step import LIGHT, LOADED, ProbeLoad, probe_push_step
from kvpush.sim.step_fit import Sample, Tables, fit_linear, pass_levels, pass_warning


@dataclass(frozen=True)
class CalibrationPlan:
    #: (chunk tokens, prompt tokens): the prompt is prefilled in chunks of that size.
    prefill: tuple[tuple[int, int], ...] = ((1024, 1024), (512, 1024), (128, 512), (32, 128))
    #: (batch, prompt tokens): decode steps of that many requests.
    #: (32, 128): a busy colocated instance decodes ~32 short requests at once; without
    #: it the fit extrapolated from 16 and priced those steps 25-30% high (v10)
    decode: tuple[tuple[int, int], ...] = ((1, 128), (4, 128), (16, 128), (32, 128),
                                           (1, 1024), (2, 512), (8, 1024))
    decode_steps: int = 8
    threads: tuple[int, ...] = (1, 2)
    #: (batch, prompt tokens, new prompt tokens): decode steps of a batch into which a new
    #: prompt arrives (mixed prefill + decode steps, as colocated instances run them).
    mixed: tuple[tuple[int, int, int], ...] = ((2, 128, 512), (4, 256, 1024))
    #: (batch, cached prefix tokens, new tokens): a batch of prompts that share a prefix
    #: already in the prefix cache, each computing only its new tail (short chunks over
    #: long context, as decode-side prefix hits run them); prefixes are whole blocks
    prefix: tuple[tuple[int, int, int], ...] = ((15, 992, 32), (4, 480, 128))
    #: measure the slowdown beside a busy neighbour engine (host.corun_slowdown); off
    #: by default: on this shared VM it measured 1.0, 2.1 and 1.7 within two minutes
    corun: bool = False
    #: passes over the plan per thread count, all fitted together: one pass's decode
    #: steps moved by 5-15% between calibrations 25 minutes apart (v7), and the fit's
    #: per-context cost with them (0.9 vs 3.3 us per token on one thread)
    repeats: int = 2
    #: serve a short workload per thread count through a real instance and the router
    #: and record how much longer its steps are than the engine alone's
    #: (host.served_factors, kvpush.sim.served); at one thread also through a 1P1D push
    #: pair, for how much slower steps run beside the other instance's
    #: (host.corun_by_kind, kvpush.sim.corun)
    served: bool = True
    #: seconds of the idle host probe (kvpush.bench.host_probe) before each pass and
    #: after the last (just after the matmul tables' timing there), per thread count
    #: (measured.host_probe_ms): the host's speed level while the steps were timed,
    #: which benchmarks/sim_validate.py compares with the level `kvpush bench compare
    #: --host-probe` saw beside each run; 0: none
    host_probe: float = 1.5
    #: loads of the short-prompt pull and push pairs served side by side, turns
    #: alternating: (req/s, prompts per turn, turns, output tokens) each
    #: (kvpush.sim.push_step.ProbeLoad; handoff.push_prefill_step_s, _block_s and their
    #: corun_ twins); with the served probe; (): none. 2 req/s is mostly one prompt per
    #: step (24 turns, ~50-60 steps beside a D step; 8 turns gave 15-19 and +0.3 / +5.3
    #: ms in two calibrations, benchmarks/SIMULATION.md 1-v15); 4 req/s batches up to 7
    #: prompts per step beside a decoding D, where push's cost per step grew (1-v19), so
    #: the per-block term can be fitted (~9 min for both)
    push_step_loads: tuple[ProbeLoad, ...] = (LIGHT, LOADED)

    @classmethod
    def quick(cls) -> CalibrationPlan:
        return cls(prefill=((32, 64), (8, 16)), decode=((1, 16), (4, 16)), decode_steps=3,
                   threads=(1,), mixed=((2, 16, 32),), prefix=((2, 32, 8),), repeats=1,
                   served=False, host_probe=0.0, push_step_loads=())


CLOCKS = ("auto", "wall", "cpu")
#: handoff's figures from the pull / push pair probe (kvpush.sim.push_step)
PUSH_STEP_KEYS = ("push_prefill_step_s", "push_prefill_corun_step_s",
                  "push_prefill_block_s", "push_prefill_corun_block_s")


def choose_clock(clock: str) -> str:
    """``auto``: wall time on a quiet machine, CPU time when the load average exceeds
    the core count (then wall time mostly measures waiting for a core)."""
    if clock != "auto":
        return clock
    try:
        busy = os.getloadavg()[0] > 0.75 * (os.cpu_count() or 1)
    except OSError:
        busy = False
    return "cpu" if busy else "wall"


def measure_steps(model_dir: str | Path, threads: int, plan: CalibrationPlan,
                  block_size: int = 32, clock: str = "wall",
                  log: Callable[[str], None] = print,
                  table_timings: list[Tables] | None = None,
                  between_passes: Callable[[], None] | None = None) -> list[Sample]:
    """Run ``plan`` through a fresh LLMEngine with ``threads`` torch threads. ``clock``:
    ``wall`` (time.perf_counter) or ``cpu`` (CPU time of the thread that steps: what the
    step would take on dedicated cores, as that thread is busy, or spinning at the
    parallel regions' barriers, for the whole step). ``between_passes``: called with the
    engine idle before each pass over the plan and after the last (the host probe);
    ``table_timings``: the engine's own matmuls are timed at each of those points, just
    before ``between_passes`` (:func:`kvpush.sim.matmul_tables.measure_matmuls`), and
    each timing is appended there."""
    import torch

    from kvpush.config import EngineConfig
    from kvpush.engine.llm_engine import LLMEngine
    from kvpush.engine.step_trace import StepShapes
    from kvpush.sampling_params import SamplingParams

    longest = max([p for _, p in plan.prefill] + [p for _, p in plan.decode]
                  + [m[2] for m in plan.mixed] + [c + n for _, c, n in plan.prefix])
    if any(c % block_size for _, c, _ in plan.prefix):
        raise ValueError(f"prefix lengths must be multiples of the block size {block_size}")
    budget = max(1024, longest)
    prefill_steps = max([-(-b * n // budget) for b, n in plan.decode], default=0)
    max_len = longest + plan.decode_steps + prefill_steps + 8
    cfg = EngineConfig.build(model_dir, threads=threads, block_size=block_size,
                             max_model_len=max_len, enable_prefix_caching=bool(plan.prefix),
                             max_num_batched_tokens=budget, max_num_seqs=64,
                             kv_cache_memory=1 << 30)
    eng = LLMEngine(cfg)
    vocab = cfg.model.vocab_size
    gen = torch.Generator().manual_seed(0)
    samples: list[Sample] = []
    captured: list[Any] = []
    orig = eng.scheduler.schedule

    def schedule():
        plan_ = orig()
        captured.append(plan_)
        return plan_

    eng.scheduler.schedule = schedule  # type: ignore[method-assign]
    sched_cfg = eng.scheduler.config
    n_req = 0

    def tokens(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    def run(prompts: Sequence[int | list[int]], max_tokens: int, budget: int, record: bool,
            later: list[tuple[int, int]] | None = None) -> None:
        """``prompts``: a length (random tokens; every prompt differs, so the prefix
        cache never hits) or the tokens; ``later``: (after this many steps, prompt
        tokens) to add mid-run."""
        eng.scheduler.config = dataclasses.replace(sched_cfg, max_num_batched_tokens=budget)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        later = list(later or [])

        def add(n: int | list[int]) -> None:
            nonlocal n_req
            eng.add_request(f"cal{n_req}", tokens(n) if isinstance(n, int) else n, params)
            n_req += 1

        for n in prompts:
            add(n)
        steps_done = 0
        shapes = StepShapes()
        while eng.has_work():
            captured.clear()
            t0, c0 = time.perf_counter(), time.thread_time()
            eng.step()
            dt = time.perf_counter() - t0
            if clock == "cpu":
                dt = time.thread_time() - c0
            steps_done += 1
            if later and steps_done == later[0][0]:
                add(later.pop(0)[1])
            if captured:
                chunks = shapes.shapes(captured[-1])
                if record and chunks:
                    samples.append((chunks, dt))

    try:
        # warm-up: first-step allocations and kernels, and the dense decode cache sized
        # once for the longest request (1 GiB region: room for every batch of the plan),
        # so that a first decode costs its copy only, as in a serving engine's steady
        # state, not a reallocation of the whole buffer
        run([64], 2, 1024, record=False)
        run([longest], 3, budget, record=False)
        tag = ""

        def timed(what: str, *runs: tuple[Any, ...]) -> None:
            """Each of ``runs`` (run()'s arguments) in turn, and log their time."""
            t0 = time.perf_counter()
            for args in runs:
                run(*args)
            log(f"[calibrate] threads={threads}{tag} {what}: {time.perf_counter() - t0:.2f} s")

        def probe() -> None:  # the engine idle: the matmul tables, then the host's level
            if table_timings is not None:  # (the probe next to the pass it describes)
                table_timings.append(measure_matmuls(eng.runner.model, clock=clock))
            if between_passes is not None:
                between_passes()

        for rep in range(plan.repeats):  # the whole plan again: a fit over all passes
            tag = f" pass {rep + 1}/{plan.repeats}" if plan.repeats > 1 else ""
            probe()
            for chunk, prompt in plan.prefill:
                timed(f"prefill {prompt} tokens in chunks of {chunk}",
                      ([prompt], 1, chunk, True))
            for batch, prompt in plan.decode:
                # the prompts prefill a budget's worth per step while the earlier ones
                # start decoding; every request lasts until the whole batch has decoded
                # decode_steps times together (the batched long-context decodes a
                # serving decode instance runs)
                steps = plan.decode_steps + 1 + -(-batch * prompt // budget)
                timed(f"decode batch {batch} at {prompt} tokens",
                      ([prompt] * batch, steps, budget, True))
            for batch, prompt, new in plan.mixed:
                timed(f"decode batch {batch} at {prompt} tokens + a {new}-token prompt",
                      ([prompt] * batch, plan.decode_steps + 2, budget, True, [(2, new)]))
            for batch, cached, new in plan.prefix:
                shared = tokens(cached)  # the first run puts it in the prefix cache
                timed(f"{batch} prompts of {new} tokens over a cached {cached}-token prefix",
                      ([shared + tokens(new)], 1, budget, False),
                      ([shared + tokens(new) for _ in range(batch)], 2, budget, True))
        probe()
    finally:
        eng.shutdown()
    return samples


def _shape_of(model_dir: Path) -> dict[str, Any]:
    from kvpush.config import ModelConfig

    m = ModelConfig.from_dir(model_dir)
    return {"name": model_dir.name, "num_layers": m.num_layers, "num_kv_heads": m.num_kv_heads,
            "head_dim": m.head_dim, "hidden_size": m.hidden_size, "num_heads": m.num_heads,
            "intermediate_size": m.intermediate_size, "vocab_size": m.vocab_size,
            "kv_bytes_per_elem": 4, "weight_bytes_per_elem": 4,
            "tied_embeddings": m.tie_word_embeddings}


def load_avg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def arrival_costs(served: dict[str, Any], pair: dict[str, Any], one: str
                  ) -> dict[str, float]:
    """host.arrival_step_s: the 1-thread figure from the served pair (P/D instances,
    both cores busy), the others from their served probe; none where not measured."""
    out = {name: v["arrival_step"]["arrival_step_s"] for name, v in served.items()
           if name != one and v.get("arrival_step")}
    if pair.get("arrival_step"):
        out[one] = pair["arrival_step"]["arrival_step_s"]
    return {k: v for k, v in sorted(out.items()) if v is not None}


def calibrate(model: str | None, out: str | Path, plan: CalibrationPlan,
              transfer: bool = True, note: str = "", clock: str = "auto",
              log: Callable[[str], None] = print,
              matmul_tables: bool = True) -> dict[str, Any]:
    """Measure and write a profile; returns its dict."""
    from kvpush.config import DEFAULT_BLOCK_SIZE
    from kvpush.kv_transfer.prefill_side import layers_per_write
    from kvpush.models.registry import DEFAULT_MODEL, resolve_model

    model_dir = resolve_model(model or DEFAULT_MODEL)
    shape = _shape_of(model_dir)
    started = time.time()
    load_before = load_avg()
    clock = choose_clock(clock)
    log(f"[calibrate] load average {load_before} on {os.cpu_count()} cpus: {clock} clock")
    step_models: dict[str, Any] = {}
    fits: dict[str, Any] = {}
    samples_out: dict[str, Any] = {}
    served: dict[str, Any] = {}
    pair: dict[str, Any] = {}
    push_step: dict[str, Any] = {}
    probes: dict[str, list[float]] = {}
    matmul_timings: dict[str, list[Tables]] = {}
    warnings: list[str] = []

    def warn(message: str) -> None:  # logged now, and kept in the profile
        warnings.append(message)
        log(f"[calibrate] {message}")

    for th in plan.threads:
        timings = matmul_timings[f"threads={th}"] = []
        levels_ms = probes[f"threads={th}"] = []
        with contextlib.ExitStack() as stack:
            between = None
            if plan.host_probe:
                from kvpush.bench.host_probe import HostProbe

                hp = stack.enter_context(HostProbe())

                def between(hp=hp, th=th, levels_ms=levels_ms) -> None:
                    levels_ms.append(hp.measure(th, plan.host_probe))
                    log(f"[calibrate] threads={th} host probe: {levels_ms[-1]:.0f} ms")

            samples = measure_steps(model_dir, th, plan, clock=clock, log=log,
                                    table_timings=timings if matmul_tables else None,
                                    between_passes=between)
        tables: Tables = {}
        if timings:
            tables, table_warnings = settle_tables(timings, th)
            for message in table_warnings:
                warn(message)
        m, quality = fit_linear(samples, tables)
        levels = pass_levels(samples, m, plan.repeats)
        step_models[f"threads={th}"] = {"kind": "linear", **dataclasses.asdict(m)}
        fits[f"threads={th}"] = {**quality, "pass_levels": levels}
        # every step measured ([[tokens, context, sampled], ...], seconds): a refit of
        # another step model needs no new run
        samples_out[f"threads={th}"] = [[[list(ch) for ch in chunks], round(dt, 6)]
                                        for chunks, dt in samples]
        log(f"[calibrate] threads={th}: {m} (median rel. err {quality['median_rel_err']:.1%})")
        if warning := pass_warning(f"threads={th}", levels):
            warn(warning)
        if plan.served:
            from kvpush.sim.served import probe_served

            served[f"threads={th}"] = probe_served(str(model_dir), th, m, log=log)
            if th == 1:  # P/D instances run one thread each: serve a 1P1D pair too
                from kvpush.sim.corun import probe_served_pair

                pair = probe_served_pair(str(model_dir), m, log=log)
                if plan.push_step_loads:
                    push_step = probe_push_step(
                        str(model_dir), m, DEFAULT_BLOCK_SIZE,
                        plan.push_step_loads, log=log)
    for warning in thread_warnings(step_models):  # e.g. 2 threads timed at 1-thread speed
        warn(warning)
    corun_info: dict[str, float] = {}
    if plan.corun:
        try:
            from kvpush.sim.corun import measure_corun

            corun_info = measure_corun(model_dir, clock=clock, log=log)
        except (RuntimeError, OSError, ZeroDivisionError) as e:
            log(f"[calibrate] co-run probe failed ({e}); corun_slowdown 1")
    front_ends = [v["front_end_s"] for v in served.values() if v.get("front_end_s")]
    first_gaps = [g for v in served.values() for g in v.get("burst_first_gaps_s", [])]
    wakes = [v["engine_wake_s"] for v in served.values()
             if v.get("engine_wake_s") is not None]
    paths = {k: [v[k] for v in served.values() if v.get(k) is not None]
             for k in ("request_path_s", "token_return_s")}
    one = f"threads={plan.threads[0]}"
    two = f"threads={plan.threads[-1]}"
    if transfer:
        from kvpush.sim.transfer_probe import probe_transfer

        tr, tr_rows = probe_transfer(shape, log=log)
    else:
        tr = {"bandwidth_Bps": 5e9, "latency_s": 5e-5, "post_base_s": 0.0,
              "post_per_desc_s": 0.0, "per_desc_s": 2e-6, "setup_s": 1e-4}
        tr_rows = []
    data = {
        "name": Path(out).stem,
        "description": f"this machine ({platform.node() or 'host'}), {model_dir.name} fp32, "
                       "measured by `kvpush simulate calibrate`",
        "measured": {"started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
                     "wall_s": round(time.time() - started, 1), "cpus": os.cpu_count(),
                     "load_avg_before": load_before, "load_avg_after": load_avg(),
                     "clock": clock,
                     "fits": fits, "transfer_samples": tr_rows,
                     **({"matmul_timings": matmul_timings} if matmul_tables else {}),
                     "warnings": warnings,
                     **({"host_probe_ms": probes} if plan.host_probe else {}),
                     "plan": dataclasses.asdict(plan),
                     "step_samples": samples_out, "corun": corun_info, "served": served,
                     "served_pair": pair, "push_step": push_step},
        "notes": [n for n in (note,) if n] + [
            f"Step times are {'wall' if clock == 'wall' else 'stepping-thread CPU'} times of "
            "LLMEngine.step() (scheduling, forward, sampling, detokenization), one engine "
            "per thread count, fitted by non-negative least squares on relative error."
            + (" token_rows_s / sample_rows_s: the engine's own projections (all layers) "
               "and LM head timed per number of rows (1-row GEMV vs 2+-row GEMM), with "
               "the engine idle before each pass and after the last (the lower median per "
               "row; every timing in measured.matmul_timings); the linear terms are "
               "fitted to the rest." if matmul_tables else "")
            + (" CPU time was used because the machine was loaded: it estimates dedicated "
               "cores (the stepping thread is busy, or spins at barriers, for a whole step)."
               if clock == "cpu" else ""),
            "host.corun_slowdown: a 1-thread engine's step time with another 1-thread "
            "engine process serving 512/16 requests beside it, over without (geometric "
            "mean of prefill and decode steps; --corun only); the simulator applies it to "
            "a step that starts while another instance is mid-step. host.corun_by_kind "
            "(replaces it where present): the same per kind of step, from a 1P1D push "
            "pair served at 1 req/s (measured.served_pair: steps that started beside the "
            "other instance's over those that started alone, measured / modelled).",
            "roles: P/D instances use 1 torch thread each and colocated uses all (as "
            "`kvpush bench compare` does on 2 cores).",
            "host.served_factors: a step model's steps inside a serving instance (the "
            "router and the streaming load generator on the same host) over the engine "
            "alone's, per kind of step (prefill_burst: four or more prompts' chunks of "
            "64-256 tokens; prefill_batched: any other two or more chunks of 64+ tokens; "
            "prefill: any other chunk over one token; decode), from a short served "
            "probe (kvpush.sim.served; measured.served, with its steps; its last phase a "
            "burst of 128-token prompts for prefill_burst): decode "
            "the median ratio, prefill kinds also a factor by the step's length over the "
            "probe's two prompt lengths (host.served_factor_curves). The same probe's "
            "light-rate requests give handoff.request_path_s (client send to the "
            "engine's inbox) and handoff.token_return_s (the end of the step that sampled "
            "token #1 to the client's read); the other handoff figures are estimates.",
            "host.arrival_step_s: seconds each request arriving at the host adds to an "
            "engine step in flight (the client, router and front end take it in on the "
            "same cores; kvpush.sim.arrival_cost): per arrival, the median excess of the "
            "decode steps it arrived during over those with none, from the served probe "
            "(2+ threads) and the served 1P1D pair's D (1 thread).",
            "host.step_noise: the scatter of the probe's steps around the served model "
            "(robust sigma of log measured / modelled, per prefill and decode steps); "
            "host.step_noise_quantiles: the percentiles 0-100 of the same scatter, its "
            "tail included, for kinds with 200+ probe steps (decode); the simulator "
            "draws those steps' times from them, the others' from the log-normal "
            "(kvpush.sim.noise).",
            "kvpush posts pull's READ from its transfer thread, not the step loop "
            "(pull_post_on_step_loop false). Over cma the copy happens inside post(), so the "
            "whole cost is on the wire terms.",
            "handoff.push_prefill_step_s / push_prefill_corun_step_s, plus "
            "push_prefill_block_s / push_prefill_corun_block_s per KV block the step "
            "completes: how much longer P's "
            "prefill steps ran in a push pair than in a pull pair serving the same "
            "128-token prompts, turns alternating, at each load of the plan, for steps "
            "that started with D idle / mid-step (measured.push_step; "
            "kvpush.sim.push_step): push's WRITE hand-offs (handoff.push_layers_per_write "
            "layers each) and, likely, the transfer thread's copies, on P's interpreter "
            "and the cores.",
        ],
        "sources": {
            "step_models": "measured here (LLMEngine.step wall time)",
            "transfer": "measured here (NIXL UCX WRITE between two processes)" if transfer
                        else "PLATFORM.md figures (5-6 GB/s, ~2 us per descriptor)",
            "handoff": "estimates: localhost HTTP hop through uvicorn/httpx ~1 ms; side "
                       "channel one-way ~12 us (PLATFORM.md: 25 us round trip); "
                       "front_end_s, burst_first_gaps_s, engine_wake_s, request_path_s "
                       "and token_return_s measured by the served probe, "
                       "push_prefill_step_s by the pull / push pair probe "
                       "(absent / 0 when they did not run)",
        },
        "model": shape,
        "host": {"corun_slowdown": corun_info.get("corun_slowdown", 1.0),
                 **({"corun_by_kind": {k: pair[k] for k in ("prefill", "decode")}}
                    if pair else {}),
                 "served_factors": {k: v["factors"] for k, v in served.items()},
                 "served_factor_curves": {k: v["curves"] for k, v in served.items()
                                          if v.get("curves")},
                 "step_noise": {k: v["noise"] for k, v in served.items() if v.get("noise")},
                 "step_noise_quantiles": {k: v["noise_quantiles"] for k, v in served.items()
                                          if v.get("noise_quantiles")},
                 "arrival_step_s": arrival_costs(served, pair, one)},
        "step_models": step_models,
        "roles": {"prefill": one, "decode": one, "colocated": two},
        "transfer": tr,
        "handoff": {"http_hop_s": 1e-3, "client_hop_s": 1e-3, "relay_s": 5e-4,
                    "side_channel_s": 1.2e-5, "handshake_s": 5e-3,
                    "front_end_s": round(statistics.median(front_ends), 6) if front_ends
                    else 0.0,
                    **({"burst_first_gaps_s": first_gaps} if first_gaps else {}),
                    **({"engine_wake_s": round(statistics.median(wakes), 6)} if wakes
                       else {}),
                    **{k: round(statistics.median(v), 6) for k, v in paths.items() if v},
                    **{k: push_step[k] for k in PUSH_STEP_KEYS if k in push_step},
                    "pull_post_on_step_loop": False,
                    # what the served prefill instances used (kvpush serve's CPU default)
                    "push_layers_per_write": layers_per_write(0, shape["num_layers"],
                                                              cuda=False)},
        "instance": {"block_size": DEFAULT_BLOCK_SIZE, "num_blocks": (1 << 30) // (
            DEFAULT_BLOCK_SIZE * 2 * shape["num_layers"] * shape["num_kv_heads"]
            * shape["head_dim"] * 4),
                     "max_num_batched_tokens": 1024, "max_num_seqs": 64},
    }
    from kvpush.sim.profile import profile_from_dict

    profile_from_dict(data, str(out))  # refuse to write what cannot be loaded
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(data, indent=1) + "\n")
    log(f"[calibrate] wrote {out}")
    return data
