"""The few sizes that CPU kernels run at.

oneDNN (bf16 and fp16 linears) and torch's CPU flash attention build a kernel for each
shape they meet and keep it for the life of the process: a server that met every row
count and every prompt length would grow by ~0.7 MiB per linear row count and 0.15-0.8
MiB per attention shape, without end. Run at :func:`padded_size` instead, their state
is bounded and can be built at start.
"""

from __future__ import annotations


def padded_size(n: int) -> int:
    """``n`` up to 8, then rounded up to four sizes per doubling (10, 12, 14, 16, 20,
    ..., 64, 80, 96, 112, 128, 160, ...): at most 25 % more, and 8 + 4 * log2(max / 8)
    sizes in all (36 up to 1,024)."""
    step = 1 << max(0, (n - 1).bit_length() - 3)
    return -(-n // step) * step
