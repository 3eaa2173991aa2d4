"""The soak (benchmarks/soak.py, `make soak`) as a slow test: 2000 requests through
`kvpush bench` against a push-mode `kvpush up` cluster (tiny random Llama) — no failed
request, no leaked block, resident memory flat after warm-up. About 5 minutes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_soak_push(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks/soak.py"), "--modes", "push",
                        "--num-prompts", "2000", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=1100)
    summary = json.loads((tmp_path / "summary.json").read_text())
    (res,) = summary["results"]
    assert res["requests_ok"] and res["real_failures"] == 0, res
    assert res["blocks_ok"], (res["free_blocks_before"], res["free_blocks_after"])
    assert res["rss_ok"], res["rss"]
    assert r.returncode == 0, r.stdout[-3000:]
