"""How often the step loop and the transfer thread wake each other per push (issue 37).

A prefill and a decode LLMEngine in one process (the tests' ``PDDriver``, in-process
transport, a tiny random model), N push requests, a few at a time, both legs sent
together as the router does. Per request it counts:

* ``step messages``: calls of ``TransferWorker.submit`` (each a queue item and a
  wake-up of the transfer thread: a byte on its pipe), per instance;
* ``inbox items``: the transfer thread's ``TransferUpdate``s in the engine's inbox;
* ``transfer CPU``: the transfer thread's own CPU time (``pthread_getcpuclockid``),
  per instance, in microseconds.

Counts do not depend on the host's load; the CPU figure moves with it less than wall
time does. Run from this tree:

    PYTHONPATH=src python benchmarks/transfer_wakeups.py --requests 60 --batch 3
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # pd_helpers, engine_helpers


def thread_cpu_s(thread) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--batch", type=int, default=3, help="requests sent together")
    ap.add_argument("--prompt-len", type=int, default=128)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)
    from engine_helpers import greedy, random_prompts
    from kvpush.models.random_model import make_random_model
    from pd_helpers import PDDriver, make_instance

    with tempfile.TemporaryDirectory() as tmp:
        model = make_random_model(Path(tmp) / "m", "llama", "tiny", seed=0)
        p = make_instance(model, "prefill", "push")
        d = make_instance(model, "decode", "push")
        pd = PDDriver(p, d)
        counts = {"P": [0, 0], "D": [0, 0]}  # step messages (each a wake-up), inbox items
        for name, eng in (("P", p), ("D", d)):
            w = eng.connector.worker
            submit = w.submit

            def counted_submit(msg, _submit=submit, _k=name):
                counts[_k][0] += 1
                _submit(msg)

            w.submit = counted_submit
            post = w.post_update  # one inbox item of the engine per call

            def counted_post(update, _post=post, _k=name):
                counts[_k][1] += 1
                _post(update)

            w.post_update = counted_post
        try:
            warm = random_prompts([args.prompt_len], seed=99)[0]
            pd.submit("warm", warm, greedy(2))
            pd.run()
            pd.settle()
            for k in counts:
                counts[k][:] = [0, 0]
            cpu0 = {k: thread_cpu_s(e.connector.worker._thread) for k, e in (("P", p), ("D", d))}
            prompts = random_prompts([args.prompt_len] * args.requests, seed=1)
            t0 = time.perf_counter()
            for i in range(0, args.requests, args.batch):
                for j, prompt in enumerate(prompts[i:i + args.batch]):
                    pd.submit(f"r{i + j}", prompt, greedy(2))
                pd.run()
            pd.settle()
            wall = time.perf_counter() - t0
            cpu1 = {k: thread_cpu_s(e.connector.worker._thread) for k, e in (("P", p), ("D", d))}
        finally:
            pd.close()
    n = args.requests
    print(f"{n} push requests, {args.batch} at a time, {args.prompt_len}-token prompts, "
          f"{wall:.2f} s")
    print("| instance | step messages (wake-ups) / request | inbox items / request "
          "| transfer thread CPU / request (us) |")
    print("|---|---:|---:|---:|")
    for k in ("P", "D"):
        print(f"| {k} | {counts[k][0] / n:.2f} | {counts[k][1] / n:.2f} | "
              f"{(cpu1[k] - cpu0[k]) / n * 1e6:.0f} |")


if __name__ == "__main__":
    main()
