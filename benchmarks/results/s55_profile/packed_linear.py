"""Best of 7 calls of each fp32 linear kernel on SmolLM2's weight shapes at 1, 8 and 64
rows: F.linear (MKL sgemm), oneDNN's plain-weight linear (what the engine's autotune
picks between) and MKL's prepacked sgemm (torch.ops.mkl._mkl_linear, weights packed
once). Weights are random; 1 thread.

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
        python benchmarks/results/s55_profile/packed_linear.py
"""

import time

import torch
import torch.nn.functional as F


def best(f, *args, n=7):
    b = 1e9
    for _ in range(n):
        t = time.perf_counter()
        f(*args)
        b = min(b, time.perf_counter() - t)
    return b * 1e3


torch.set_num_threads(1)
print(torch.backends.cpu.get_cpu_capability())
with torch.inference_mode():
    for n, k in [(49152, 576), (3072, 576), (576, 1536), (960, 576)]:
        w = torch.randn(n, k)
        for m in (1, 8, 64):
            x = torch.randn(m, k)
            pw = torch.ops.mkl._mkl_reorder_linear_weight(w, m)
            a = best(F.linear, x, w)
            d = best(torch.ops.mkldnn._linear_pointwise, x, w, None, "none", [], "")
            p = best(torch.ops.mkl._mkl_linear, x, pw, w, None, m)
            print(f"{n}x{k} rows {m}: aten {a:.2f} onednn {d:.2f} mkl-packed {p:.2f} ms "
                  f"(GB/s aten {w.nbytes / a / 1e6:.1f}, packed {w.nbytes / p / 1e6:.1f})",
                  flush=True)
