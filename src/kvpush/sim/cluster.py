"""A simulated xPyD (or colocated) cluster: router, engines and hand-off; one run.

The front end takes each request in turn (``front_end_s`` each: a burst of requests
reaches the engines spread out, so the first step of a burst runs the first arrivals
only, as on a real host; the gap after a burst's first request is drawn from the
measured ``burst_first_gaps_s`` where the profile has them, and an idle engine starts
its step ``engine_wake_s`` after work reaches it); the router forwards it (client ->
router -> instance: ``request_path_s`` where measured, else ``client_hop_s`` +
``http_hop_s``), picks instances round-robin (kvpush's default policy) or by fewest
outstanding requests, and in push mode dispatches both legs at once. Every token the
client sees travels instance -> router -> client (``token_return_s`` where measured,
else ``http_hop_s + client_hop_s``).
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvpush.sim.engine import EngineSim, Job, JobKind
from kvpush.sim.handoff import Handoff, PushXfer
from kvpush.sim.noise import StepNoise
from kvpush.sim.profile import Profile
from kvpush.sim.workload import SimRequest, Stage, Workload, make_requests

MODES: tuple[str, ...] = ("colocated", "pull", "push")
POLICIES: tuple[str, ...] = ("round-robin", "least-outstanding")


@dataclass(frozen=True)
class ClusterConfig:
    mode: str
    num_prefill: int = 1   # colocated: the number of instances is num_prefill + num_decode
    num_decode: int = 1
    fragmentation: float = 0.0
    policy: str = "round-robin"
    #: False: prefill instances keep no prefix cache (decode-side-only hits)
    prefill_prefix_cache: bool = True
    #: push, full prefix hit on D: who computes the prompt's uncached tail (kvpush's
    #: --prefix-hit-tail; prefill is its default)
    prefix_hit_tail: str = "prefill"
    #: role -> step model name, overriding the profile's ``roles`` (e.g. 1-thread colocated)
    step_models: tuple[tuple[str, str], ...] = ()
    #: how long past the last arrival the simulation may run before giving up (s)
    horizon_s: float = 1e6
    #: seeds the step-noise draws (profiles with host.step_noise or
    #: host.step_noise_quantiles; kvpush.sim.noise)
    seed: int = 0

    def validate(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if self.num_prefill < (0 if self.mode == "colocated" else 1) or self.num_decode < 1:
            raise ValueError("need at least one prefill and one decode instance")
        if not 0.0 <= self.fragmentation <= 1.0:
            raise ValueError(f"fragmentation must be in [0, 1], got {self.fragmentation}")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}")
        if self.prefix_hit_tail not in ("prefill", "decode"):
            raise ValueError(f"prefix_hit_tail must be prefill or decode, got "
                             f"{self.prefix_hit_tail!r}")

    @property
    def label(self) -> str:
        if self.mode == "colocated":
            return f"{self.num_prefill + self.num_decode}x colocated"
        return f"{self.num_prefill}P{self.num_decode}D {self.mode}"


@dataclass
class SimResult:
    config: ClusterConfig
    workload: Workload
    requests: list[SimRequest]
    engines: list[EngineSim] = field(default_factory=list)
    end_time: float = 0.0

    def summary(self) -> dict[str, Any]:
        return summarize([self])


def summarize(results: list[SimResult]) -> dict[str, Any]:
    """Latency percentiles over the requests of all ``results`` pooled (runs of one
    configuration and workload under different noise seeds, as `kvpush bench compare`
    pools its repeats); throughput and utilization are their means over the runs."""
    from kvpush.bench.metrics import mean, percentile

    first = results[0]
    done = [r for res in results for r in res.requests if r.done]
    ttfts = [r.ttft for r in done]
    tpots = [t for r in done if (t := r.tpot) is not None]
    total = sum(len(res.requests) for res in results)
    out: dict[str, Any] = {"mode": first.config.mode, "label": first.config.label,
                           "completed": len(done), "unfinished": total - len(done)}
    if len(results) > 1:
        out["replicas"] = len(results)
    for name, vals in (("ttft", ttfts), ("tpot", tpots)):
        out[f"mean_{name}_ms"] = mean(vals) * 1e3
        for q, key in ((50, "median"), (90, "p90"), (99, "p99")):
            out[f"{key}_{name}_ms"] = percentile(vals, q) * 1e3
    throughputs, busy = [], {}
    for res in results:
        fin = [r for r in res.requests if r.done]
        span = max((r.token_times[-1] for r in fin), default=0.0) - min(
            (r.arrival for r in res.requests), default=0.0)
        throughputs.append(len(fin) / span if span > 0 else 0.0)
        for e in res.engines:
            busy.setdefault(e.name, []).append(e.busy_time / res.end_time
                                               if res.end_time else 0.0)
    out["request_throughput"] = mean(throughputs)
    out["utilization"] = {name: mean(v) for name, v in busy.items()}
    out["mean_descs"] = mean([r.descs for r in done])
    out["stages_ms"] = stage_means(done)
    return out


def stage_means(reqs: list[SimRequest]) -> dict[str, float]:
    """Mean time from arrival to each stage, over the requests that reached it (ms)."""
    from kvpush.bench.metrics import mean

    out = {}
    for st in Stage:
        vals = [r.stages[st] - r.arrival for r in reqs if st in r.stages]
        if vals:
            out[st.value] = mean(vals) * 1e3
    return out


class _Picker:
    def __init__(self, engines: list[EngineSim], policy: str) -> None:
        self.engines, self.policy, self.i = engines, policy, 0

    def pick(self) -> EngineSim:
        if self.policy == "least-outstanding":
            least = min(e.outstanding for e in self.engines)
            cands = [e for e in self.engines if e.outstanding == least]
        else:
            cands = self.engines
        e = cands[self.i % len(cands)]
        self.i += 1
        return e


def _prefix_state(profile: Profile, w: Workload, role: str) -> Mapping[int, int]:
    if w.prefix_len and role in w.prefix_cached_on:
        return {0: w.prefix_len}
    return {}


def simulate_pooled(profile: Profile, workload: Workload, config: ClusterConfig,
                    replicas: int = 1) -> list[SimResult]:
    """``replicas`` runs with noise seeds ``config.seed``, ``config.seed + 1``, ...; one
    run where the profile has no step noise (every run would be the same)."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    n = replicas if profile.has_noise else 1
    return [simulate(profile, workload, dataclasses.replace(config, seed=config.seed + k))
            for k in range(n)]


def _opens_burst(reqs: list[SimRequest], i: int) -> bool:
    """Whether request ``i`` is the first of several sent at the same instant."""
    t = reqs[i].arrival
    return (i + 1 < len(reqs) and reqs[i + 1].arrival == t
            and (i == 0 or reqs[i - 1].arrival != t))


def simulate(profile: Profile, workload: Workload, config: ClusterConfig) -> SimResult:
    """Replay ``workload`` through the cluster ``config`` on ``profile``; deterministic
    for a workload seed and ``config.seed``."""
    import simpy

    config.validate()
    env = simpy.Environment()
    noise_rng = random.Random(config.seed)
    reqs = make_requests(workload)
    overrides = dict(config.step_models)
    lim = profile.instance
    ho = profile.handoff
    back = ho.token_return_s if ho.token_return_s is not None else (
        ho.http_hop_s + ho.client_hop_s)
    forward = ho.request_path_s if ho.request_path_s is not None else (
        ho.client_hop_s + ho.http_hop_s)

    def emit(job: Job, t: float) -> None:
        req = job.req
        if not req.token_times:
            req.mark(Stage.FIRST_TOKEN, t)
            req.mark(Stage.CLIENT_FIRST_TOKEN, t + back)
        req.token_times.append(t + back)
        if len(req.token_times) >= req.output_len:
            req.mark(Stage.FINISHED, t + back)

    def make(role: str, n: int, cache_role: str) -> list[EngineSim]:
        model = profile.step_model(role, overrides.get(role))
        sigmas = profile.noise_sigmas(role, overrides.get(role))
        quantiles = profile.noise_quantiles(role, overrides.get(role))
        caching = role != "prefill" or config.prefill_prefix_cache
        engines = [EngineSim(env, f"{role}{i}", role, model, lim,
                             _prefix_state(profile, workload, cache_role), caching)
                   for i in range(n)]
        for e in engines:  # one generator: SimPy's event order makes the draws repeatable
            e.noise = StepNoise(sigmas, noise_rng, quantiles) if sigmas or quantiles else None
            e.arrival_cost = profile.arrival_cost(role, overrides.get(role))
            e.wake_s = ho.engine_wake_s
        return engines

    if config.mode == "colocated":
        engines = make("colocated", config.num_prefill + config.num_decode, "decode")
        pick = _Picker(engines, config.policy)

        def start(req: SimRequest) -> None:
            e = pick.pick()
            job = Job(req, JobKind.FULL, req.output_len, on_token=emit)
            def arrive(_e: Any) -> None:
                req.mark(Stage.PREFILL_RECEIVED, env.now)
                e.submit(lambda: e.add(job))

            env.timeout(forward).callbacks.append(arrive)
    else:
        prefills = make("prefill", config.num_prefill, "prefill")
        decodes = make("decode", config.num_decode, "decode")
        engines = prefills + decodes
        hand = Handoff(env, profile, config.fragmentation, emit, config.prefix_hit_tail)
        if config.mode == "push":
            for p in prefills:
                p.step_hook = hand.on_prefill_step
                p.step_extra = hand.push_step_extra
        pp, dp = _Picker(prefills, config.policy), _Picker(decodes, config.policy)

        def start(req: SimRequest) -> None:
            p = pp.pick()
            if config.mode == "pull":
                env.timeout(forward).callbacks.append(
                    lambda _e: (req.mark(Stage.PREFILL_RECEIVED, env.now),
                                hand.pull(req, p, dp.pick())))
                return
            xf = PushXfer(req, p, dp.pick())
            env.timeout(forward).callbacks.append(lambda _e: (hand.push_prefill_leg(xf),
                                                              hand.push_decode_leg(xf)))

    for e in engines:  # every instance of a run shares the profile's host
        e.host, e.corun = engines, profile if profile.has_corun else None

    front_free = [0.0]  # when the front end is done with the requests before
    # its own generator, so that a profile with first gaps draws the same step noise
    gap_rng = random.Random(f"burst-first-gap/{config.seed}")

    def through_front_end(req: SimRequest, gap: float) -> None:
        # the hops above are a lone request's path; a request queues only behind the
        # ones the front end is still passing on
        t = max(env.now, front_free[0])
        front_free[0] = t + gap
        if t > env.now:
            env.timeout(t - env.now).callbacks.append(lambda _e: start(req))
        else:
            start(req)

    def arrivals():
        for i, req in enumerate(reqs):
            if req.arrival > env.now:
                yield env.timeout(req.arrival - env.now)
            req.mark(Stage.ARRIVED, env.now)
            for e in engines:
                e.host_arrival()
            gap = ho.front_end_s
            if ho.burst_first_gaps_s and _opens_burst(reqs, i):
                gap = gap_rng.choice(ho.burst_first_gaps_s)
            through_front_end(req, gap)

    env.process(arrivals())
    last = max((r.arrival for r in reqs), default=0.0)
    env.run(until=last + config.horizon_s)
    end = max((r.token_times[-1] for r in reqs if r.token_times), default=env.now)
    return SimResult(config, workload, reqs, engines, end_time=end if math.isfinite(end) else 0)
