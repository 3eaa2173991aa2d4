"""Summarise py-spy ``--format raw`` files: each thread's share of the samples and,
per thread, the share of the innermost frame that falls in a known bucket.

    python benchmarks/profile_summary.py /tmp/prof.*.txt

``--inner MATCH`` (for ``py-spy record --native``): of the samples with a frame that
contains MATCH, the share by the innermost frame's library or Python file (unnamed:
JIT-compiled code, oneDNN's and MKL's kernels), and by the innermost Python frame.

    python benchmarks/profile_summary.py --inner "measure (step_overhead.py:100)" /tmp/s.txt
"""

from __future__ import annotations

import collections
import re
import sys

#: (bucket, substring of a frame), first match from the innermost frame outwards
RULES = (
    ("detokenizer (tokenizer.decode)", "detokenizer.py"),
    ("SSE chunk building, pydantic JSON (server/protocol.py)", "protocol.py"),
    ("uvicorn / starlette", "uvicorn"),
    ("uvicorn / starlette", "starlette"),
    ("model forward (torch)", "model/"),
    ("runner step metadata", "model_runner.py"),
    ("scheduler", "scheduler/"),
    ("engine bookkeeping (llm_engine, outputs)", "llm_engine.py"),
    ("engine core process loop / ZMQ", "engine/core"),
    ("engine client (outputs to streams)", "engine/client"),
    ("step loop -> event loop hand-off (async_engine)", "async_engine.py"),
    ("server app (handlers, metrics)", "server/"),
    ("asyncio / uvloop", "asyncio"),
)


def inner(match: str, paths: list[str]) -> None:
    where: collections.Counter[str] = collections.Counter()
    py: collections.Counter[str] = collections.Counter()
    for path in paths:
        with open(path) as f:
            for line in f:
                if not line.strip():
                    continue
                stack, n = line.rstrip().rsplit(" ", 1)
                frames = stack.split(";")
                if not any(match in fr for fr in frames):
                    continue
                m = re.search(r"\(([^)]*)\)$", frames[-1])
                where[m.group(1).split(":")[0] if m else "(unnamed)"] += int(n)
                py[next((fr for fr in reversed(frames) if ".py:" in fr), "-")] += int(n)
    total = sum(where.values())
    print(f"{total} samples; innermost frame's library or file:")
    for k, n in where.most_common(12):
        print(f"{100 * n / total:5.1f}%  {k}")
    print("innermost Python frame:")
    for k, n in py.most_common(12):
        print(f"{100 * n / total:5.1f}%  {k}")


def main(paths: list[str]) -> None:
    if paths[:1] == ["--inner"]:
        return inner(paths[1], paths[2:])
    threads: collections.Counter[str] = collections.Counter()
    buckets: collections.Counter[tuple[str, str]] = collections.Counter()
    for path in paths:
        with open(path) as f:
            for line in f:
                line = line.rstrip()
                if not line:
                    continue
                stack, n = line.rsplit(" ", 1)
                frames = stack.split(";")
                thread = frames[0].split(":", 1)[-1].strip()
                threads[thread] += int(n)
                bucket = "other"
                for frame in reversed(frames):
                    hit = [name for name, pat in RULES if pat in frame]
                    if hit:
                        bucket = hit[0]
                        break
                buckets[(thread, bucket)] += int(n)
    total = sum(threads.values())
    print(f"{total} samples")
    for thread, n in threads.most_common():
        print(f"{100 * n / total:5.1f}%  thread {thread}")
    print()
    for (thread, bucket), n in buckets.most_common(30):
        print(f"{100 * n / total:5.1f}%  {thread:28s} {bucket}")


if __name__ == "__main__":
    main(sys.argv[1:])
