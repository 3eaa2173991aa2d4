"""`kvpush simulate plan`: the smallest xPyD split and mode that meet latency targets.

Every configuration up to ``max_instances`` instances is simulated on the same workload
(colocated: 1..N instances; pull and push: every x prefill + y decode with x + y <= N).
A configuration meets the targets when its p90 TTFT and p90 TPOT are at or under them
and every request finished. The answer is the feasible one with the fewest instances;
among those the lowest p90 TTFT. The frontier plot shows, per mode, the best p90 TTFT and
p90 TPOT reachable with each instance count, against the targets.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpush.sim.cluster import ClusterConfig, simulate
from kvpush.sim.profile import Profile
from kvpush.sim.report import markdown_table
from kvpush.sim.workload import Workload


@dataclass(frozen=True)
class PlanTargets:
    ttft_p90_ms: float
    tpot_p90_ms: float


@dataclass(frozen=True)
class Candidate:
    mode: str
    num_prefill: int
    num_decode: int
    ttft_p90_ms: float
    tpot_p90_ms: float
    ttft_median_ms: float
    unfinished: int
    meets: bool

    @property
    def instances(self) -> int:
        return self.num_prefill + self.num_decode

    @property
    def label(self) -> str:
        return ClusterConfig(self.mode, self.num_prefill, self.num_decode).label


@dataclass
class PlanResult:
    profile: str
    workload: Workload
    targets: PlanTargets
    candidates: list[Candidate] = field(default_factory=list)

    @property
    def best(self) -> Candidate | None:
        ok = [c for c in self.candidates if c.meets]
        return min(ok, key=lambda c: (c.instances, c.ttft_p90_ms)) if ok else None

    def frontier(self) -> dict[str, list[Candidate]]:
        """Per mode: for each instance count, the best configuration (one that meets the
        targets before one that does not, then the lowest p90 TTFT)."""
        best: dict[str, dict[int, Candidate]] = {}
        for c in self.candidates:
            by_n = best.setdefault(c.mode, {})
            old = by_n.get(c.instances)
            if old is None or (c.meets, -c.ttft_p90_ms) > (old.meets, -old.ttft_p90_ms):
                by_n[c.instances] = c
        return {mode: [by_n[n] for n in sorted(by_n)] for mode, by_n in best.items()}

    def to_dict(self) -> dict[str, Any]:
        b = self.best
        return {"profile": self.profile, "rate": self.workload.rate,
                "input_len": self.workload.input_len, "output_len": self.workload.output_len,
                "targets": vars(self.targets), "best": b.label if b else None,
                "candidates": [dict(vars(c), label=c.label) for c in self.candidates]}


def configurations(max_instances: int, modes: tuple[str, ...]) -> list[tuple[str, int, int]]:
    out = []
    for n in range(1, max_instances + 1):
        if "colocated" in modes:
            out.append(("colocated", 0, n))
        for x in range(1, n):
            for mode in ("pull", "push"):
                if mode in modes:
                    out.append((mode, x, n - x))
    return out


def plan_cluster(profile: Profile, workload: Workload, targets: PlanTargets,
                 max_instances: int = 8, modes: tuple[str, ...] = ("colocated", "pull", "push"),
                 fragmentation: float = 0.0, prefill_prefix_cache: bool = True
                 ) -> PlanResult:
    """Every split up to ``max_instances`` in every mode, each simulated and checked
    against the targets."""
    if max_instances < 1:
        raise ValueError("max_instances must be >= 1")
    bad = set(modes) - {"colocated", "pull", "push"}
    if bad:
        raise ValueError(f"unknown modes {sorted(bad)}")
    res = PlanResult(profile.name, workload, targets)
    for mode, x, y in configurations(max_instances, modes):
        cfg = ClusterConfig(mode, x, y, fragmentation,
                            prefill_prefix_cache=prefill_prefix_cache)
        s = simulate(profile, workload, cfg).summary()
        meets = (s["unfinished"] == 0 and s["p90_ttft_ms"] <= targets.ttft_p90_ms
                 and s["p90_tpot_ms"] <= targets.tpot_p90_ms)
        res.candidates.append(Candidate(mode, x, y, s["p90_ttft_ms"], s["p90_tpot_ms"],
                                        s["median_ttft_ms"], s["unfinished"], meets))
    return res


def format_plan(res: PlanResult) -> str:
    w, t = res.workload, res.targets
    head = (f"profile {res.profile}, {w.rate} req/s, {w.input_len} in / {w.output_len} out, "
            f"{w.num_prompts} prompts; targets p90 TTFT <= {t.ttft_p90_ms} ms, p90 TPOT <= "
            f"{t.tpot_p90_ms} ms")
    rows = [[c.label, c.instances, c.ttft_median_ms, c.ttft_p90_ms, c.tpot_p90_ms,
             c.unfinished, "yes" if c.meets else "no"]
            for lst in res.frontier().values() for c in lst]
    rows.sort(key=lambda r: (r[1], r[0]))
    table = markdown_table(["best per mode and size", "instances", "TTFT med (ms)",
                            "TTFT p90 (ms)", "TPOT p90 (ms)", "unfinished (requests)",
                            "meets"], rows)
    b = res.best
    verdict = (f"smallest configuration meeting the targets: **{b.label}** ({b.instances} "
               f"instances; p90 TTFT {b.ttft_p90_ms:.1f} ms, p90 TPOT {b.tpot_p90_ms:.1f} ms)"
               if b else f"no configuration of up to {max(c.instances for c in res.candidates)}"
                         " instances meets the targets")
    return f"{head}\n\n{table}\n\n{verdict}"


def plot_frontier(res: PlanResult, path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    marks = {"colocated": "s", "pull": "o", "push": "^"}
    for mode, lst in res.frontier().items():
        xs = [c.instances for c in lst]
        for ax, key in zip(axes, ("ttft_p90_ms", "tpot_p90_ms")):
            ax.plot(xs, [getattr(c, key) for c in lst], marker=marks.get(mode, "x"), label=mode)
    for ax, target, name in zip(axes, (res.targets.ttft_p90_ms, res.targets.tpot_p90_ms),
                                ("p90 TTFT (ms)", "p90 TPOT (ms)")):
        ax.axhline(target, color="red", linestyle="--", linewidth=1, label="target")
        ax.set_xlabel("instances (x prefill + y decode, or colocated)")
        ax.set_ylabel(name)
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend()
    b = res.best
    fig.suptitle(f"{res.profile}: {res.workload.rate} req/s, {res.workload.input_len}/"
                 f"{res.workload.output_len} tokens; best: {b.label if b else 'none'}")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
