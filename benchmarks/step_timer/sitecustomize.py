"""Per-step wall and CPU time of every kvpush instance (issue 37's measurement).

Put this folder first on PYTHONPATH and set ``KVPUSH_STEP_TIMER=DIR``: every process
that imports kvpush (``kvpush up`` / ``bench handoff`` / ``bench compare`` start
instances with the caller's environment) appends one line per model step to
``DIR/steps.<pid>.txt``::

    <role>-<kv mode> <tokens in the step> <requests> <layer hook set: 0/1> <wall ms> <cpu ms>

``cpu`` is the step thread's own CPU time (``time.thread_time``) over
``ModelRunner.execute``: equal to wall when nothing else took the core or the GIL.
Summarize with ``python benchmarks/step_timer/summary.py DIR``. Test only: never set
in production.
"""

import os

_DIR = os.environ.get("KVPUSH_STEP_TIMER")
if _DIR:
    import sys
    import time

    def _tag() -> str:
        a = sys.argv
        role = a[a.index("--role") + 1] if "--role" in a else "none"
        mode = a[a.index("--kv-transfer") + 1] if "--kv-transfer" in a else "none"
        return f"{role}-{mode}"

    _mr = None
    if "serve" in sys.argv:  # instances only (not router, bench)
        # the engine core child (kvpush.engine.core_proc, no --role on its command
        # line) inherits the tag through the environment
        os.environ["KVPUSH_STEP_TIMER_TAG"] = _tag()
    if "serve" in sys.argv or os.environ.get("KVPUSH_STEP_TIMER_TAG"):
        import kvpush.engine.model_runner as _mr
    if _mr is not None:
        _orig = _mr.ModelRunner.execute
        _out = open(os.path.join(_DIR, f"steps.{os.getpid()}.txt"), "a", buffering=1)  # noqa: SIM115
        _t = os.environ.get("KVPUSH_STEP_TIMER_TAG") or _tag()

        def execute(self, plan, layer_hook=None):
            t0, c0 = time.perf_counter(), time.thread_time()
            r = _orig(self, plan, layer_hook)
            t1, c1 = time.perf_counter(), time.thread_time()
            ntok = sum(len(ch.token_ids) for ch in plan.chunks)
            _out.write(f"{_t} {ntok} {len(plan.chunks)} {int(layer_hook is not None)} "
                       f"{(t1 - t0) * 1e3:.3f} {(c1 - c0) * 1e3:.3f}\n")
            return r

        _mr.ModelRunner.execute = execute
