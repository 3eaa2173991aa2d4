"""Tensor parallelism inside one instance (issue 52, points 1, 2, 4 and 8).

The split's rules on model shapes (no process started); greedy completions at TP 2
equal TP 1 token for token at float32 on the tiny Llama and Qwen3 models and on a
one-KV-head model (replicated on both ranks), through prefill chunks, batched decodes
and a prefix-cache hit; /kv/info; shapes and roles refused at start; a rank killed
mid-request ends `kvpush serve` (failed streams, exit 1, no process left).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
import torch

from engine_helpers import assert_all_blocks_free, greedy, make_engine, run_to_completion
from kvpush.cli import build_parser
from kvpush.config import ConfigError, EngineConfig, KVTransferConfig, ModelConfig, tp_problem
from kvpush.model.parallel import TPShard
from server_helpers import ServerProcess, all_child_pids, child_pids, pid_alive


def _shape(model_dir: Path, **kw) -> ModelConfig:
    return dataclasses.replace(ModelConfig.from_dir(model_dir), **kw)


# ---- the split's rules ---------------------------------------------------------------
def test_shape_rules(tiny_llama):
    ok = _shape(tiny_llama, num_heads=8, num_kv_heads=2, intermediate_size=128)
    assert tp_problem(ok, 1) is None and tp_problem(ok, 2) is None
    assert tp_problem(ok, 8) is None  # 2 KV heads, each on 4 ranks
    assert "8 attention heads do not divide by 3" in tp_problem(ok, 3)
    odd_kv = _shape(tiny_llama, num_heads=6, num_kv_heads=3)
    assert "3 KV heads neither divide by 2 nor divide 2" in tp_problem(odd_kv, 2)
    assert "MLP width 98 does not divide by 4" in tp_problem(
        _shape(tiny_llama, intermediate_size=98), 4)

    # split: rank r holds its query heads' KV heads, 1 of 2 each
    s = [TPShard.of(ok, 2, r) for r in range(2)]
    assert [(list(x.heads), list(x.kv_heads)) for x in s] == [
        ([0, 1, 2, 3], [0]), ([4, 5, 6, 7], [1])]
    # replicated: 8 ranks, 2 KV heads: ranks 0-3 hold KV head 0, ranks 4-7 KV head 1,
    # which is the head their query head reads (group of 4)
    s = [TPShard.of(ok, 8, r) for r in range(8)]
    assert [list(x.kv_heads) for x in s] == [[0]] * 4 + [[1]] * 4
    for x in s:
        assert x.heads.start // (ok.num_heads // ok.num_kv_heads) == x.kv_heads.start
    # each rank's KV bytes per token: its KV heads only
    f32 = torch.float32
    assert ok.kv_bytes_per_token(f32, 2) * 2 == ok.kv_bytes_per_token(f32)
    assert ok.kv_bytes_per_token(f32, 8) * 2 == ok.kv_bytes_per_token(f32)


def test_refused_at_start(tiny_llama):
    # tiny: 4 attention heads
    with pytest.raises(ConfigError, match="4 attention heads do not divide by 3"):
        EngineConfig.build(tiny_llama, num_blocks=64, max_model_len=256,
                           tensor_parallel_size=3)
    for role in ("prefill", "decode"):  # P/D at TP > 1: on the CPU (test_pd_tp.py)
        cfg = EngineConfig.build(tiny_llama, num_blocks=64, max_model_len=256,
                                 tensor_parallel_size=2, kv_transfer=KVTransferConfig(role=role))
        assert cfg.cache.kv_layout.startswith("head-major")
        with pytest.raises(ConfigError, match="disaggregation with tensor parallelism runs "
                                              "on the CPU only so far"):
            EngineConfig.build(tiny_llama, num_blocks=64, max_model_len=256, device="cuda",
                               tensor_parallel_size=2,
                               kv_transfer=KVTransferConfig(role=role))
    # the flag: serve and up take N (the shape is checked at start), up per role too
    parser = build_parser()
    assert parser.parse_args(["serve", "m", "-tp", "2"]).tensor_parallel_size == 2
    args = parser.parse_args(["up", "-tp", "2", "--decode-tp", "1"])
    assert (args.tensor_parallel_size, args.prefill_tp, args.decode_tp) == (2, None, 1)


def test_a_rank_that_cannot_start_fails_the_start(tiny_llama, monkeypatch):
    """Rank 1 fails while loading (here: a CUDA device on a CPU build): the engine is
    not built, the error names the rank and why, and no rank process is left."""
    from kvpush.engine.tp import group

    started: list = []
    real_init = group.RankGroup.__init__

    def init(self, *a, **kw):
        real_init(self, *a, **kw)
        started.extend(self._procs)

    monkeypatch.setattr(group, "rank_device", lambda device, rank: "cuda:7" if rank else device)
    monkeypatch.setattr(group.RankGroup, "__init__", init)
    with pytest.raises(ConfigError, match="tensor-parallel rank 1 could not start: "):
        make_engine(tiny_llama, tensor_parallel_size=2)
    assert len(started) == 1 and started[0].poll() is not None


# ---- equal outputs -------------------------------------------------------------------
PROMPTS = {
    "long": [(7 * i + 3) % 1000 + 10 for i in range(70)],  # chunked: 3 steps of 32
    "short": [11, 12, 13],
    "edge": list(range(100, 132)),  # exactly two blocks
}


@pytest.mark.parametrize("arch, preset", [
    ("llama", "tiny"),  # 2 KV heads: one per rank
    ("qwen3", "tiny"),  # q/k norms, untied LM head
    ("llama", "tiny-mqa"),  # 1 KV head: replicated on both ranks
])
def test_tp2_equals_tp1(model_factory, arch, preset):
    model = model_factory(arch, preset)
    kw = dict(max_num_batched_tokens=32)
    want = run_to_completion(make_engine(model, **kw), PROMPTS, greedy(10))
    again = {"again": PROMPTS["long"][:48] + [5, 6]}  # a prefix-cache hit (3 blocks)
    want_again = run_to_completion(make_engine(model, **kw), again, greedy(6))
    engine = make_engine(model, tensor_parallel_size=2, **kw)
    try:
        assert run_to_completion(engine, PROMPTS, greedy(10)) == want
        got_again = run_to_completion(engine, again, greedy(6))
        assert engine.scheduler.prefix_hit_tokens >= 48
        assert got_again == want_again
        assert_all_blocks_free(engine)
        info = engine.kv_info()
        cfg = ModelConfig.from_dir(model)
        assert info.tensor_parallel_size == 2
        tp = info.tensor_parallel
        assert tp is not None
        assert tp["kv_heads_replicated"] == (cfg.num_kv_heads < 2)
        assert [r["kv_heads"] for r in tp["ranks"]] == (
            [[0], [1]] if cfg.num_kv_heads == 2 else [[0], [0]])
        assert info.layout["num_kv_heads"] == 1  # one rank's region
        procs = engine.runner.group._procs
    finally:
        engine.shutdown()
    assert all(p.poll() is not None for p in procs)
    assert make_engine(model).kv_info().tensor_parallel_size == 1


# ---- a rank that dies ----------------------------------------------------------------
def test_rank_killed_mid_request_ends_the_instance(tiny_llama, tmp_path):
    """Rank 1 is killed while a request streams: the stream ends with an error naming
    the rank, `kvpush serve` exits 1, and no process is left (the core, rank 1)."""
    srv = ServerProcess(tiny_llama, "-tp", "2", "--max-model-len", "2048",
                        log_dir=tmp_path)
    try:
        info = srv.get("/kv/info")
        assert info["tensor_parallel_size"] == 2
        assert [r["kv_heads"] for r in info["tensor_parallel"]["ranks"]] == [[0], [1]]
        (core,) = child_pids(srv.proc.pid)
        (rank1,) = all_child_pids(core)
        assert "kvpush.engine.rank_proc" in Path(f"/proc/{rank1}/cmdline").read_text()
        body = {"prompt": [5, 6, 7, 8], "max_tokens": 2000, "ignore_eos": True,
                "stream": True}
        lines: list[str] = []
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                lines.append(line)
                if len(lines) == 6:
                    killed = time.monotonic()
                    os.kill(rank1, signal.SIGKILL)
        ended = time.monotonic() - killed
        events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        message = events[-1]["error"]["message"]
        assert "tensor-parallel rank 1 was killed by SIGKILL" in message, events[-2:]
        assert ended < 5, ended
        assert srv.proc.wait(30) == 1
        deadline = time.monotonic() + 20
        while any(pid_alive(p) for p in (core, rank1)):
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        srv.stop()


def test_a_dead_ranks_kv_posts_fail_and_its_kv_thread_ends_it():
    """P/D: a dead rank's posts fail at once on rank 0 (its proxy, set by the rank
    watcher), and a rank whose KV thread dies ends itself (here: on_death is called)."""
    import threading

    import msgspec
    import zmq

    from kvpush.engine.tp.kv_ranks import KVPost, RankKVServer, RankProxy
    from kvpush.kv_transfer.transports.transport import TransferPostError, XferState

    ctx = zmq.Context()
    ours, theirs = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    ours.bind("inproc://rank1")
    theirs.connect("inproc://rank1")
    proxy = RankProxy(ours, 1)
    try:
        handle = proxy.post("WRITE", "peer", [(0, 8)], [(0, 8)])
        assert isinstance(msgspec.msgpack.decode(theirs.recv(), type=KVPost), KVPost)
        assert proxy.state(handle) is XferState.PENDING
        proxy.dead = "tensor-parallel rank 1 was killed by SIGKILL"
        assert proxy.state(handle) is XferState.FAILED
        with pytest.raises(TransferPostError, match="killed by SIGKILL"):
            proxy.post("WRITE", "peer", [(0, 8)], [(0, 8)])
    finally:
        proxy.close()
        theirs.close(linger=0)

    class Broken:  # a transport whose progress raises (a bug in the KV thread)
        def progress(self):
            raise RuntimeError("boom")

        def close(self):
            pass

    died = threading.Event()
    server = RankKVServer(Broken(), ctx, "inproc://rank2", 2, b"token", on_death=died.set)
    try:
        assert died.wait(5)
    finally:
        server.close()
        ctx.term()
