"""benchmarks/engine_vs_hf.py's vLLM leg and report: found or skipped, matches, flags.

The vLLM run itself is the benchmark's (minutes, its own venv); these check the parts
that decide what the benchmark reports: which Python it takes, that a missing vLLM is a
skip (and not an error), the token-for-token summary and the machine's CPU flags."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import engine_report  # noqa: E402
import engine_vllm  # noqa: E402


def test_missing_vllm_python_is_a_skip(tmp_path, monkeypatch):
    monkeypatch.setattr(engine_vllm, "DEFAULT_VLLM_PYTHON", str(tmp_path / "none"))
    monkeypatch.delenv("VLLM_PYTHON", raising=False)
    assert engine_vllm.find_vllm_python(None) == (None, "skipped, not installed")
    assert engine_vllm.find_vllm_python(str(tmp_path / "also-none"))[0] is None


def test_a_python_without_vllm_is_named(monkeypatch):
    pytest.importorskip("torch")  # kvpush's venv: it has no vllm
    monkeypatch.setenv("VLLM_PYTHON", sys.executable)
    python, why = engine_vllm.find_vllm_python(None)
    assert python is None and "cannot import vllm" in why and sys.executable in why


def test_vllm_python_env_wins_over_the_default(tmp_path, monkeypatch):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexit 0\n")  # "imports vllm": exits 0
    fake.chmod(0o755)
    monkeypatch.setattr(engine_vllm, "DEFAULT_VLLM_PYTHON", str(tmp_path / "none"))
    monkeypatch.setenv("VLLM_PYTHON", str(fake))
    assert engine_vllm.find_vllm_python(None) == (str(fake), "found")


def test_a_vllm_leg_that_dies_is_a_failure_with_its_log(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho broken >&2\nexit 3\n")
    fake.chmod(0o755)

    class Args:
        max_model_len, max_num_seqs, max_num_batched_tokens, kv_cache_gib = 256, 4, 64, 1

    log = tmp_path / "vllm.log"
    leg = engine_vllm.run_vllm(str(fake), model="m", dtype="float32", threads=1,
                               reqs=[{"id": "r0", "prompt": [5], "max_tokens": 2}],
                               warm=[], args=Args, timeout_s=30, log_path=log)
    assert not leg.ok and leg.status == "failed: exit 3"
    assert "broken" in log.read_text()


def test_match_summary_counts_where_outputs_part():
    reqs = [{"id": f"r{i}"} for i in range(3)]
    a = {"r0": [1, 2, 3], "r1": list(range(20)), "r2": [7, 8]}
    b = {"r0": [1, 2, 3], "r1": [*range(17), 0, 0, 0], "r2": [9, 8]}
    m = engine_report.match_summary(reqs, a, b)
    assert (m["identical"], m["total"], m["first_16_identical"]) == (1, 3, 2)
    assert (m["identical_tokens"], m["total_tokens"]) == (3 + 17 + 0, 25)
    assert [(x["id"], x["first_mismatch"]) for x in m["mismatches"]] == [("r1", 17), ("r2", 0)]


def test_machine_info_records_the_speed_flags(monkeypatch):
    from kvpush import auto_dtype

    monkeypatch.setattr(auto_dtype, "cpu_flags",
                        lambda cpuinfo=None: frozenset({"avx2", "avx512f", "amx_bf16"}))
    info = engine_report.machine_info()
    assert info["cpu_flags"] == {"AVX2": True, "AVX-512F": True, "AVX512-BF16": False,
                                 "AMX": True}
    assert info["auto_dtype"] == "bfloat16"
    line = engine_report.flags_line(info)
    assert "AVX512-BF16 no" in line and "AMX yes" in line
