"""A decode step's projections, cold: 30 layers of SmolLM2-135M's shapes (425 MB, random,
fp32), each matrix used once per pass as a step uses it; best of 5 passes. Kernels:
F.linear (MKL sgemm), oneDNN's plain-weight linear, MKL's packed sgemm packed for the
row count, and packed for one row used at m rows (torch falls back to F.linear then).

    python benchmarks/results/s55_vllm/packed_cold.py 1      # torch threads
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
        python benchmarks/results/s55_vllm/packed_cold.py 1

Host D, 1 thread (2026-12-05, another job running): rows 1: F.linear 34.0 ms (12.5 GB/s),
oneDNN 27.8, MKL packed 27.1 (15.7 GB/s); rows 8: 51.2, 47.6, 55.8 (the same at AVX2).
"""
import sys
import time

import torch
import torch.nn.functional as F

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
print(torch.backends.cpu.get_cpu_capability(), torch.get_num_threads())
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
L = 30
with torch.inference_mode():
    ws = [torch.randn(n, k) for _ in range(L) for n, k in shapes]
    total = sum(w.nbytes for w in ws)
    def run(fn, m, packs=None):
        xs = {k: torch.randn(m, k) for k in (576, 1536)}
        best = 1e9
        for _ in range(5):
            t = time.perf_counter()
            for i, w in enumerate(ws):
                fn(xs[w.shape[1]], w, None if packs is None else packs[i])
            best = min(best, time.perf_counter() - t)
        return best * 1e3
    for m in (1, 8):
        a = run(lambda x, w, p: F.linear(x, w), m)
        d = run(lambda x, w, p: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""), m)
        packs = [torch.ops.mkl._mkl_reorder_linear_weight(w, m) for w in ws]
        p = run(lambda x, w, pw, m=m: torch.ops.mkl._mkl_linear(x, pw, w, None, m), m, packs)
        packs1 = [torch.ops.mkl._mkl_reorder_linear_weight(w, 1) for w in ws]
        p1 = run(lambda x, w, pw: torch.ops.mkl._mkl_linear(x, pw, w, None, 1), m, packs1)
        # correctness of packed-for-1 at m rows
        x = torch.randn(m, 576)
        err = (torch.ops.mkl._mkl_linear(x, packs1[0], ws[0], None, 1)
               - F.linear(x, ws[0])).abs().max().item()
        print(f"rows {m}: {total/1e6:.0f} MB  aten {a:.1f} ms ({total/a/1e6:.1f} GB/s)  "
              f"onednn {d:.1f}  mkl-packed {p:.1f} ({total/p/1e6:.1f} GB/s)  "
              f"packed-for-1 {p1:.1f} err {err:.2e}", flush=True)
        del packs, packs1
