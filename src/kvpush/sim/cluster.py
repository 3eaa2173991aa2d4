"""A simulated xPyD (or colocated) cluster: router, engines and hand-off; one run.

The router forwards each request (client -> router -> instance: ``client_hop_s +
http_hop_s``), picks instances round-robin (the router's default policy), and in push
mode dispatches both legs at once. Every token the client sees travels instance ->
router -> client (``http_hop_s + client_hop_s``).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

from kvpush.sim.engine import EngineSim, Job
from kvpush.sim.handoff import Handoff, PushXfer
from kvpush.sim.profile import Profile
from kvpush.sim.workload import SimRequest, Stage, Workload, make_requests

MODES: tuple[str, ...] = ("colocated", "pull", "push")


@dataclass(frozen=True)
class ClusterConfig:
    mode: str
    num_prefill: int = 1   # colocated: the number of instances is num_prefill + num_decode
    num_decode: int = 1
    fragmentation: float = 0.0
    #: False: prefill instances keep no prefix cache (decode-side-only hits)
    prefill_prefix_cache: bool = True
    #: how long past the last arrival the simulation may run before giving up (s)
    horizon_s: float = 1e6

    def validate(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if self.num_prefill < (0 if self.mode == "colocated" else 1) or self.num_decode < 1:
            raise ValueError("need at least one prefill and one decode instance")
        if not 0.0 <= self.fragmentation <= 1.0:
            raise ValueError(f"fragmentation must be in [0, 1], got {self.fragmentation}")

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
        """Latency percentiles (ms), throughput, utilization, and per stage the mean
        time from arrival over the requests that reached it (ms)."""
        from kvpush.bench.metrics import mean, percentile

        done = [r for r in self.requests if r.done]
        tpots = [t for r in done if (t := r.tpot) is not None]
        out: dict[str, Any] = {"mode": self.config.mode, "label": self.config.label,
                               "completed": len(done),
                               "unfinished": len(self.requests) - len(done)}
        for name, vals in (("ttft", [r.ttft for r in done]), ("tpot", tpots)):
            out[f"mean_{name}_ms"] = mean(vals) * 1e3
            for q, key in ((50, "median"), (90, "p90"), (99, "p99")):
                out[f"{key}_{name}_ms"] = percentile(vals, q) * 1e3
        span = max((r.token_times[-1] for r in done), default=0.0) - min(
            (r.arrival for r in self.requests), default=0.0)
        out["request_throughput"] = len(done) / span if span > 0 else 0.0
        # Arrival and completion rates, first to last (req/s): the queue grows when
        # requests complete more slowly than they arrive (nan for one request, or all at
        # once).
        arr = sorted(r.arrival for r in self.requests)
        fin = sorted(r.token_times[-1] for r in done)
        out["arrival_rate"] = ((len(arr) - 1) / (arr[-1] - arr[0])
                               if len(arr) > 1 and arr[-1] > arr[0] else math.nan)
        out["completion_rate"] = ((len(fin) - 1) / (fin[-1] - fin[0])
                                  if len(fin) > 1 and fin[-1] > fin[0] else math.nan)
        out["utilization"] = {e.name: e.busy_time / self.end_time if self.end_time else 0.0
                              for e in self.engines}
        out["mean_descs"] = mean([r.descs for r in done])
        out["stages_ms"] = {st.value: mean([r.stages[st] - r.arrival for r in done
                                            if st in r.stages]) * 1e3
                            for st in Stage if any(st in r.stages for r in done)}
        return out


def simulate(profile: Profile, workload: Workload, config: ClusterConfig) -> SimResult:
    """Replay ``workload`` through the cluster ``config`` on ``profile``; deterministic
    for a workload seed."""
    import simpy

    config.validate()
    env = simpy.Environment()
    reqs = make_requests(workload)
    ho = profile.handoff
    forward = ho.client_hop_s + ho.http_hop_s
    back = ho.http_hop_s + ho.client_hop_s

    def emit(job: Job, t: float) -> None:
        req = job.req
        if not req.token_times:
            req.mark(Stage.FIRST_TOKEN, t)
            req.mark(Stage.CLIENT_FIRST_TOKEN, t + back)
        req.token_times.append(t + back)
        if len(req.token_times) >= req.output_len:
            req.mark(Stage.FINISHED, t + back)

    def make(role: str, n: int, cache_role: str) -> list[EngineSim]:
        caching = role != "prefill" or config.prefill_prefix_cache
        warm = workload.prefix_len and cache_role in workload.prefix_cached_on
        return [EngineSim(env, f"{role}{i}", profile.step_model(role), profile.instance,
                          {0: workload.prefix_len} if warm else {}, caching)
                for i in range(n)]

    if config.mode == "colocated":
        engines = make("colocated", config.num_prefill + config.num_decode, "decode")
        pick = itertools.cycle(engines)

        def start(req: SimRequest) -> None:
            e = next(pick)
            job = Job(req, req.output_len, on_token=emit)
            req.mark(Stage.PREFILL_RECEIVED, env.now)
            e.submit(lambda: e.add(job))
    else:
        prefills = make("prefill", config.num_prefill, "prefill")
        decodes = make("decode", config.num_decode, "decode")
        engines = prefills + decodes
        hand = Handoff(env, profile, config.fragmentation, emit)
        if config.mode == "push":
            for p in prefills:
                p.step_hook = hand.on_prefill_step
        pp, dp = itertools.cycle(prefills), itertools.cycle(decodes)

        def start(req: SimRequest) -> None:
            p, d = next(pp), next(dp)
            if config.mode == "pull":
                req.mark(Stage.PREFILL_RECEIVED, env.now)
                hand.pull(req, p, d)
            else:
                xf = PushXfer(req, p, d)
                hand.push_prefill_leg(xf)
                hand.push_decode_leg(xf)

    def arrivals():
        for req in reqs:
            if req.arrival > env.now:
                yield env.timeout(req.arrival - env.now)
            req.mark(Stage.ARRIVED, env.now)
            env.timeout(forward).callbacks.append(lambda _e, req=req: start(req))

    env.process(arrivals())
    last = max((r.arrival for r in reqs), default=0.0)
    env.run(until=last + config.horizon_s)
    end = max((r.token_times[-1] for r in reqs if r.token_times), default=env.now)
    return SimResult(config, workload, reqs, engines, end_time=end if math.isfinite(end) else 0)
