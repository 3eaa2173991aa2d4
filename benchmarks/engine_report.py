"""Reporting for engine_vs_hf.py: the machine (CPU flags included), token-for-token
matches between engines, and the printed table."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import torch

from kvpush import auto_dtype
from kvpush.bench.machine import cpu_flags

HERE = Path(__file__).resolve().parent
#: the flags that decide the kernels' speed, by the names the table uses
FLAG_NAMES = {"avx2": "AVX2", "avx512f": "AVX-512F", "avx512_bf16": "AVX512-BF16",
              "amx_bf16": "AMX"}


def machine_info() -> dict:
    """CPU model and speed flags, software versions, git commit: recorded with every run."""
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass

    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], capture_output=True, text=True, cwd=HERE).stdout
        except OSError:
            return ""

    import transformers

    flags = auto_dtype.cpu_flags()
    auto = auto_dtype.choose("cpu", flags)
    return {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "cpu_flags": {name: flag in flags for flag, name in FLAG_NAMES.items()},
        "cpu_summary": cpu_flags(),
        "auto_dtype": str(auto.dtype).removeprefix("torch."),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "git_commit": git("rev-parse", "--short", "HEAD").strip(),
        "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no").strip()),
    }


def flags_line(machine: dict) -> str:
    have = machine["cpu_flags"]
    marks = ", ".join(f"{name} {'yes' if have[name] else 'no'}" for name in FLAG_NAMES.values())
    return f"{machine['cpu']} ({machine['logical_cpus']} logical CPUs): {marks}"


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def match_summary(reqs: list[dict], a: dict[str, list[int]], b: dict[str, list[int]]) -> dict:
    """How many requests' outputs are identical in ``a`` and ``b``, how many in their
    first 16 tokens, and where the others part."""
    rows = []
    for r in reqs:
        x, y = a[r["id"]], b[r["id"]]
        rows.append({"id": r["id"], "len": len(x), "first_mismatch": first_mismatch(x, y)})
    return {
        "identical": sum(1 for x in rows if x["first_mismatch"] is None),
        "total": len(rows),
        "first_16_identical": sum(
            1 for x in rows if x["first_mismatch"] is None or x["first_mismatch"] >= 16
        ),
        "identical_tokens": sum(
            x["len"] if x["first_mismatch"] is None else x["first_mismatch"] for x in rows),
        "total_tokens": sum(x["len"] for x in rows),
        "mismatches": [x for x in rows if x["first_mismatch"] is not None],
    }


def print_table(results: dict, base_name: str | None) -> None:
    """Every run's wall time, CPU time, load, throughput, against the HF baseline and
    kvpush against vLLM; a skipped or failed vLLM leg says so in its row."""
    runs = results["runs"]
    print(f"\nmachine: {flags_line(results['machine'])}")
    print(f"{'engine':<16}{'wall s':>8}{'cpu s':>8}{'load':>11}{'out tok/s':>11}{'vs base':>9}")
    for name, run in runs.items():
        ratio = (f"{run['tok_s'] / runs[base_name]['tok_s']:>8.2f}x" if base_name
                 else f"{'-':>9}")
        tag = " (baseline)" if name == base_name else ""
        load = "{:.1f}/{:.1f}".format(*run["loadavg_1m_before_after"])
        cpu = f"{run['cpu_s']:>8.1f}" if run.get("cpu_s") is not None else f"{'-':>8}"
        print(f"{name:<16}{run['wall_s']:>8.1f}{cpu}{load:>11}"
              f"{run['tok_s']:>11.1f}{ratio}{tag}")
    vl = results.get("vllm", {})
    if vl and vl["status"] != "ok":
        print(f"{'vllm':<16}{vl['status']}")
    if "ratio_vs_vllm" in results:
        print(f"kvpush / vLLM ({vl['dtype']}): {results['ratio_vs_vllm']:.2f}x")


def print_matches(results: dict) -> None:
    for key, what in (("match_vs_hf_one_by_one", "kvpush vs HF one-by-one greedy"),
                      ("match_vs_vllm", "kvpush vs vLLM greedy"),
                      ("match_vllm_vs_hf_one_by_one", "vLLM vs HF one-by-one greedy")):
        if key not in results:
            continue
        m = results[key]
        print(f"outputs, {what}: {m['identical']}/{m['total']} identical, "
              f"{m['first_16_identical']}/{m['total']} identical in the first 16 tokens, "
              f"{m['identical_tokens']}/{m['total_tokens']} tokens before the first "
              "difference")
        for x in m["mismatches"]:
            print(f"  {x['id']}: first differing token at {x['first_mismatch']} of {x['len']}")
