"""Shared fixtures: tiny random models (built once per session) and engines over them."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
torch.set_num_threads(1)

# Property tests: `make test` (CI) draws the same examples every run, so a red CI run
# means the change broke something; `make fuzz` (KVPUSH_HYPOTHESIS=explore) draws new
# ones each time, which is how new bugs are found (a NaN top_k once failed CI that way).
try:
    from hypothesis import settings as _hypothesis_settings
except ImportError:  # pragma: no cover - hypothesis is in requirements.txt
    pass
else:
    _hypothesis_settings.register_profile("ci", derandomize=True)
    _hypothesis_settings.register_profile("explore", derandomize=False)
    _hypothesis_settings.load_profile(os.environ.get("KVPUSH_HYPOTHESIS", "ci"))


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory) -> Callable[..., Path]:
    """make(arch, preset="tiny", tied=None, seed=0) -> folder, built once per key."""
    from kvpush.models.random_model import make_random_model

    cache: dict[tuple, Path] = {}

    def make(arch: str, preset: str = "tiny", tied: bool | None = None, seed: int = 0) -> Path:
        key = (arch, preset, tied, seed)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{arch}-{preset}-{tied}-{seed}")
            cache[key] = make_random_model(out, arch, preset, seed=seed, tie_word_embeddings=tied)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama(model_factory) -> Path:
    return model_factory("llama")


@pytest.fixture(scope="session")
def tiny_qwen3(model_factory) -> Path:
    return model_factory("qwen3")


@pytest.fixture(scope="session")
def fake_model(tmp_path_factory) -> tuple:
    """(EngineConfig, tokenizer) of the fake engine's tiny model (no weights; 128 tokens
    long): what the tests of the HTTP front, the router and the bounds run on."""
    from fake_engine import make_test_model

    return make_test_model(tmp_path_factory.mktemp("fake-model") / "tiny", max_model_len=128)


@pytest.fixture(scope="session")
def router_cluster(tiny_llama, tmp_path_factory):
    """The router tests' shared instances (router_helpers.RouterCluster), started once per
    session (once per xdist worker that runs a module using it)."""
    from router_helpers import start_router_cluster

    cluster = start_router_cluster(tiny_llama, tmp_path_factory.mktemp("router-cluster"))
    yield cluster
    cluster.stop()
