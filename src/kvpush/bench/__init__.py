"""`kvpush bench`: a load generator for OpenAI-compatible servers, with results in
``vllm bench serve``'s format.

The names below are imported on first use, so that `kvpush --help` (which imports
:mod:`kvpush.bench.cli`) stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "BenchConfig": "kvpush.bench.settings",
    "BenchError": "kvpush.bench.settings",
    "BenchResult": "kvpush.bench.client",
    "run_benchmark": "kvpush.bench.client",
    "arun_benchmark": "kvpush.bench.client",
    "prepare_requests": "kvpush.bench.client",
    "resolve_tokenizer": "kvpush.bench.client",
    "Conversation": "kvpush.bench.conversations",
    "multi_turn_conversations": "kvpush.bench.conversations",
    "DatasetError": "kvpush.bench.datasets",
    "PromptCodec": "kvpush.bench.datasets",
    "SampleRequest": "kvpush.bench.datasets",
    "load_tokenizer": "kvpush.bench.datasets",
    "sample_requests": "kvpush.bench.datasets",
    "RequestResult": "kvpush.bench.metrics",
    "compute_metrics": "kvpush.bench.metrics",
    "format_table": "kvpush.bench.metrics",
    "percentile": "kvpush.bench.metrics",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
