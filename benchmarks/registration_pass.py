"""The transfer thread's CPU per pass on a push prefill instance, and what it spends while
prefill's step runs (issue 61): a prefill and a decode LLMEngine in one process, NIXL and
the signed ZMQ side channel as ``kvpush up`` runs them, a tiny random Qwen3.

    PYTHONPATH=src python benchmarks/registration_pass.py [--requests 40] [--prompt-len 128]

Per request, as the router's two legs land: decode's leg first (its step registers the
blocks: ``PushRegister`` leaves), then prefill's, whose prefill step runs while the
registration reaches prefill's transfer thread. Thread CPU clocks
(``time.thread_time_ns``, ``pthread_getcpuclockid``), medians, microseconds:

* per pass of push prefill's transfer thread, by what it handled (``Begin``,
  ``registration``, ...): the whole ``run_once`` and its parts: the side channel's
  ``recv`` (poll, drain, MAC check), ``on_frame`` (decode, checks, record), the facts,
  ``poll`` (NIXL progress), tick, flush;
* prefill's step from its layer hook ("p_step") to token #1 sampled ("p_first"): wall
  time, the step thread's CPU, and the transfer thread's CPU inside that window (it takes
  the GIL from the step), push and pull (pull: the same pair in pull mode). In one
  process decode's threads compete for the GIL too: compare the CPU figures;
* hot costs of the pieces alone: ``m.decode`` of a registration, ``ChannelAuth.check``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # pd_helpers, engine_helpers

SECRET = b"registration-pass-benchmark-secret"
PARTS = ("recv", "on_frame", "_take_facts", "poll", "tick", "flush")


def cpu_of(thread) -> int:
    return time.clock_gettime_ns(time.pthread_getcpuclockid(thread.ident))


def make(model, role: str, mode: str):
    from kvpush.config import EngineConfig, KVTransferConfig
    from kvpush.engine.llm_engine import LLMEngine
    from kvpush.kv_transfer.links import NixlLinks

    kvt = KVTransferConfig(role=role, mode=mode, engine_id=f"{role}-{uuid.uuid4().hex[:6]}",
                           lease_timeout_s=5.0, heartbeat_interval_s=1.0,
                           side_channel_secret=SECRET)
    return LLMEngine(EngineConfig.build(model, kv_transfer=kvt, block_size=16,
                                        num_blocks=512, max_model_len=2048),
                     links=NixlLinks())


class PassProbe:
    """Wraps a worker's per-pass methods (looked up on the instance each pass) with the
    transfer thread's CPU clock; a pass is marked when it handled a registration."""

    def __init__(self, worker) -> None:
        self.current: dict[str, int] = defaultdict(int)
        self.current_reg = False
        self.passes: dict[str, list[dict[str, int]]] = defaultdict(list)
        for name in PARTS:
            owner = worker.channel if name == "recv" else worker
            setattr(owner, name, self._timed(name, getattr(owner, name)))
        run_once = worker.run_once
        on_register = worker.role._on_register

        def timed_run_once():
            self.current, self.current_reg = defaultdict(int), False
            t0 = time.thread_time_ns()
            ok = run_once()
            self.current["pass"] = time.thread_time_ns() - t0
            kind = "+".join(k for k in ("Begin", "registration", "BlocksReady",
                                        "Prefilled", "End") if self.current.get(k)
                            or k == "registration" and self.current_reg) or "nothing"
            self.passes[kind].append(dict(self.current))
            return ok

        def marked_on_register(reg):
            self.current_reg = True
            t0 = time.thread_time_ns()
            on_register(reg)
            self.current["_on_register"] += time.thread_time_ns() - t0

        handle = worker.handle

        def counted_handle(msg):
            for f in msg.facts:
                self.current[type(f).__name__] += 1
            return handle(msg)

        worker.run_once, worker.role._on_register = timed_run_once, marked_on_register
        worker.handle = counted_handle

    def _timed(self, name, fn):
        def wrapper(*args, **kw):
            t0 = time.thread_time_ns()
            try:
                return fn(*args, **kw)
            finally:
                self.current[name] += time.thread_time_ns() - t0
        return wrapper


class StepWindow:
    """Prefill's step from its first stamp ("p_step": the step's layer hook) to token #1
    sampled ("p_first"): wall time, the step thread's CPU, the transfer thread's CPU."""

    def __init__(self, engine) -> None:
        timeline, thread = engine.connector.holds.timeline, engine.connector.worker._thread
        stamp, self.at = timeline.stamp, {}
        self.windows: list[tuple[int, int, int]] = []

        def probed(tid, stage, t=None, first=False):
            if stage in ("p_step", "p_first") and stage not in self.at:
                self.at[stage] = (time.perf_counter_ns(), time.thread_time_ns(),
                                  cpu_of(thread))
            return stamp(tid, stage, t, first)

        timeline.stamp = probed

    def take(self) -> None:
        a, b = self.at.get("p_step"), self.at.get("p_first")
        if a is not None and b is not None:
            self.windows.append((b[0] - a[0], b[1] - a[1], b[2] - a[2]))
        self.at = {}


def one_request(pd, rid: str, prompt, params, mode: str, window: StepWindow) -> None:
    """Both legs as the router sends them; decode's registration leaves (push) as
    prefill's leg lands, so it reaches prefill while prefill's step runs."""
    p, d = pd.p, pd.d
    if mode == "push":
        pd.send_decode(rid, prompt, params)
        pd._absorb(d.process_inbox(), pd.d_legs)
        pd._absorb(d.step(), pd.d_legs)  # allocates and registers: PushRegister leaves
    pd.send_prefill(rid, prompt, params)
    if mode == "pull":
        pd._pull_waiting[rid] = (prompt, params)
    pd._absorb(p.process_inbox(), pd.p_legs)
    pd._absorb(p.step(), pd.p_legs)
    window.take()
    pd.run(timeout=30)
    pd.settle()


def med_us(xs) -> float:
    return statistics.median(xs) / 1000 if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=128)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)
    from engine_helpers import greedy, random_prompts
    from kvpush.bench.handoff import tiny_model
    from kvpush.crypto.auth import ChannelAuth
    from kvpush.kv_transfer.wire import messages as m
    from pd_helpers import PDDriver

    n = args.requests + args.warmup
    prompts = random_prompts([args.prompt_len] * n, seed=7)
    steps: dict[str, list[tuple[int, int, int]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model(Path(tmp) / "m")
        for mode in ("push", "pull"):
            pd = PDDriver(make(model, "prefill", mode), make(model, "decode", mode))
            probe = PassProbe(pd.p.connector.worker) if mode == "push" else None
            window = StepWindow(pd.p)
            try:
                for i, prompt in enumerate(prompts):
                    if i == args.warmup:
                        window.windows.clear()
                        if probe is not None:
                            probe.passes.clear()
                    one_request(pd, f"{mode}{i}", prompt, greedy(2), mode, window)
            finally:
                pd.close()
            steps[mode] = window.windows
            if probe is not None:
                print(f"push prefill's transfer thread, CPU per pass, us (median; "
                      f"{args.prompt_len}-token prompts):")
                keys = ("pass", *PARTS, "_on_register")
                print("| pass handles | n | " + " | ".join(keys) + " |")
                print("|---|---:|" + "---:|" * len(keys))
                for kind, rows in sorted(probe.passes.items()):
                    print(f"| {kind} | {len(rows)} | " + " | ".join(
                        f"{med_us([r.get(k, 0) for r in rows]):.1f}" for k in keys) + " |")

    print(f"prefill step, step start -> token #1 sampled ({args.prompt_len} tokens), "
          f"us, median (mean) of {args.requests}:")
    print("| mode | wall | step thread CPU | transfer thread CPU in it |")
    print("|---|---:|---:|---:|")
    for mode, xs in steps.items():
        print(f"| {mode} | " + " | ".join(
            f"{med_us([x[i] for x in xs]):.1f} ({statistics.mean(x[i] for x in xs) / 1000:.1f})"
            for i in range(3)) + " |")

    # the pieces alone, hot
    reg = m.PushRegister("t" * 32, "decode-abcdef", "127.0.0.1:5555",
                         list(range(-(-args.prompt_len // 16))), 0, args.prompt_len,
                         prompt_hashes=[bytes(32)] * (args.prompt_len // 16))
    payload = m.encode(reg)
    auth = ChannelAuth(SECRET, 60.0)
    k = 2000
    t0 = time.thread_time_ns()
    for _ in range(k):
        m.decode(payload)
    t1 = time.thread_time_ns()
    for i in range(k):  # a fresh counter each time: no replay refusal
        auth.check(b"127.0.0.1:5555", payload,
                   auth.seal(b"127.0.0.1:5555", b"abcdefgh", i + 1, payload))
    t2 = time.thread_time_ns()
    for i in range(k):
        auth.seal(b"127.0.0.1:5555", b"abcdefgh", i + 1, payload)
    t3 = time.thread_time_ns()
    print(f"hot, us each: decode a registration {(t1 - t0) / k / 1000:.1f}, "
          f"MAC check {((t2 - t1) - (t3 - t2)) / k / 1000:.1f}, "
          f"seal {(t3 - t2) / k / 1000:.1f} ({len(payload)} bytes)")


if __name__ == "__main__":
    main()
