"""`kvpush simulate calibrate --corun`: a 1-thread engine's steps beside a busy neighbour.

Two instances of a 1P1D pair on one small host share its cores, caches and memory
bandwidth. This probe re-measures a few step shapes of the calibration with a second
engine process serving 512-in / 16-out requests two at a time beside it, and alone
before and after; the ratio is ``host.corun_slowdown``, which the simulator applies to a
step that starts while another instance of the run is mid-step. On the 2-vCPU
development VM it measured 1.0, 2.1 and 1.7 within two minutes (the vCPUs are not
reliably two cores), so it is off by default and the CPU profiles keep 1.0.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kvpush.sim.calibrate import CalibrationPlan, Sample, measure_steps

_CORUNNER = """
import sys, torch
from kvpush.config import EngineConfig
from kvpush.engine.llm_engine import LLMEngine
from kvpush.sampling_params import SamplingParams
cfg = EngineConfig.build(sys.argv[1], threads=1, block_size=32, max_model_len=1100,
                         enable_prefix_caching=False, max_num_seqs=64,
                         kv_cache_memory=256 << 20)
eng = LLMEngine(cfg)
p = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
g = torch.Generator().manual_seed(1)
n = 0
while True:
    while eng.scheduler.num_running + eng.scheduler.num_waiting < 2:
        ids = torch.randint(0, cfg.model.vocab_size, (512,), generator=g).tolist()
        eng.add_request(f"co{n}", ids, p)
        n += 1
    eng.step()
    if n == 4:
        print("ready", flush=True)
"""

#: what is re-measured with and without a busy neighbour: 512-token prefill steps and
#: decode steps of two requests at 512 tokens
CORUN_PLAN = CalibrationPlan(prefill=((512, 512), (512, 512)), decode=((2, 512),),
                             decode_steps=6, threads=(1,), mixed=())


def measure_corun(model_dir: str | Path, clock: str = "wall",
                  log: Callable[[str], None] = print) -> dict[str, float]:
    """How much slower a 1-thread engine steps while another 1-thread engine process on
    this host serves 512-in / 16-out requests two at a time (as the other instance of a
    1P1D pair does): the ratio of step times with and without it, for prefill and for
    decode steps, and their geometric mean (``corun_slowdown``)."""
    import math
    import subprocess
    import sys

    def split(samples: list[Sample]) -> tuple[float, float]:
        pre = sum(dt for ch, dt in samples if any(c[0] > 1 for c in ch))
        dec = sum(dt for ch, dt in samples if all(c[0] == 1 for c in ch))
        return pre, dec

    def run() -> tuple[float, float]:
        return split(measure_steps(model_dir, 1, CORUN_PLAN, clock=clock, log=lambda _m: None))

    before = run()
    proc = subprocess.Popen([sys.executable, "-c", _CORUNNER, str(model_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        if proc.stdout is None or proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the co-running engine did not start")
        busy = run()
    finally:
        proc.kill()
        proc.wait()
    after = run()  # alone before and after: the mean cancels drift and warm-up
    pre = 2 * busy[0] / (before[0] + after[0])
    dec = 2 * busy[1] / (before[1] + after[1])
    f = max(1.0, math.sqrt(pre * dec))
    log(f"[calibrate] with a busy neighbour engine: prefill steps x{pre:.2f}, decode steps "
        f"x{dec:.2f} -> corun_slowdown {f:.2f}")
    return {"prefill_ratio": round(pre, 3), "decode_ratio": round(dec, 3),
            "corun_slowdown": round(f, 3)}
