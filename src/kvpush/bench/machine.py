"""What machine a benchmark ran on: the CPU model and the vector extensions that decide
its speed (AVX2 or AVX-512, AVX512-BF16, AMX), recorded with every figure."""

from __future__ import annotations

import os
import platform
from pathlib import Path

#: the flags that change what the engine's kernels can use
SPEED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def cpu_flags(cpuinfo: str | None = None) -> str:
    """The CPU model and its speed-relevant flags, e.g. ``"Intel Xeon ... (2 cores):
    avx2 avx512f"``; ``cpuinfo`` is /proc/cpuinfo's text (read when None)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    model, flags = platform.processor() or "unknown CPU", set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            model = value.strip()
        elif key.strip() == "flags":
            flags = set(value.split())
    have = [f for f in SPEED_FLAGS if f in flags] or ["no AVX2"]
    return f"{model} ({os.cpu_count()} cores): {' '.join(have)}"
