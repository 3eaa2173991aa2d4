"""Push and pull between two real processes over real NIXL (UCX on 127.0.0.1).

Each instance is an LLMEngine in its own process, driven over a pipe by the test (the
router's two legs); the KV moves by NIXL between the processes' KV regions.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time

import msgspec
import pytest

from engine_helpers import greedy, make_engine, random_prompts, run_to_completion
from kvpush.kv_transfer.links import NixlLinks

pytest.importorskip("nixl._api", reason="NIXL is not installed (make venv installs it)")

LENGTHS = [9, 40, 129, 200]


def _instance_main(conn, model_dir: str, role: str, mode: str, tp: int = 1) -> None:
    """A P or D instance: an engine stepped in a loop, commands from the pipe."""
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    import torch

    torch.set_num_threads(1)
    from kvpush.kv_cache.block_pool import hash_prefix_blocks
    from pd_helpers import make_instance

    eng = make_instance(model_dir, role, mode, links=NixlLinks(), lease=10.0, heartbeat=0.2,
                        tensor_parallel_size=tp)
    conn.send(("ready", eng.connector.address, eng.connector.engine_id))
    outs: dict[str, dict] = {}
    try:
        while True:
            if conn.poll(0 if eng.has_work() else 0.002):
                cmd = conn.recv()
                if cmd[0] == "stop":
                    break
                if cmd[0] == "add":
                    _, rid, prompt, params, kv = cmd
                    outs[rid] = {"tokens": [], "done": False, "error": None, "kv": None}
                    eng.add_request(rid, prompt, params, kv)
                elif cmd[0] == "outputs":
                    s = eng.stats()
                    idle = s.num_free_blocks == s.num_total_blocks and not eng.scheduler.requests
                    conn.send((outs, idle))
                elif cmd[0] == "stats":
                    conn.send({"prefix_cache_hit_tokens": eng.stats().prefix_cache_hit_tokens})
                elif cmd[0] == "records":
                    conn.send([msgspec.structs.asdict(r) for r in eng.transfer_records])
                elif cmd[0] == "kv_blocks":
                    _, prompt, n = cmd
                    ids = eng.scheduler.pool.lookup(hash_prefix_blocks(prompt, 16)[:n])
                    conn.send(eng.runner.kv_region.kv[:, ids].clone().numpy().tobytes())
            for o in eng.process_inbox() + (eng.step() if eng.has_work() else []):
                if o.request_id not in outs:
                    continue
                rec = outs[o.request_id]
                rec["tokens"] += o.new_token_ids
                if o.finished:
                    rec["done"] = True
                    rec["error"] = o.failure.message if o.failure is not None else None
                    ktp = o.kv_transfer_params  # as the server's answer carries it
                    rec["kv"] = ktp.to_wire() if ktp is not None else None
    finally:
        eng.shutdown()


class Instance:
    def __init__(self, ctx, model_dir, role, mode, tp: int = 1):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_instance_main,
                                args=(child, str(model_dir), role, mode, tp), daemon=True)
        self.proc.start()
        if not self.conn.poll(60):
            raise TimeoutError(f"{role} instance did not start")
        _, self.address, self.engine_id = self.conn.recv()

    def add(self, rid, prompt, params, kv):
        self.conn.send(("add", rid, prompt, params, kv))

    def outputs(self):
        self.conn.send(("outputs",))
        return self.conn.recv()

    def stats(self) -> dict:
        self.conn.send(("stats",))
        return self.conn.recv()

    def records(self) -> list[dict]:
        self.conn.send(("records",))
        return self.conn.recv()

    def kv_blocks(self, prompt, n) -> bytes:
        self.conn.send(("kv_blocks", prompt, n))
        return self.conn.recv()

    def stop(self):
        with contextlib.suppress(BrokenPipeError, OSError):
            self.conn.send(("stop",))
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def _wait(pred, timeout=60.0):
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_nixl_between_processes(tiny_llama, mode):
    ctx = mp.get_context("spawn")
    prompts = random_prompts(LENGTHS, seed=40)
    ref = run_to_completion(make_engine(tiny_llama),
                            {f"r{i}": p for i, p in enumerate(prompts)}, greedy(10))
    p = Instance(ctx, tiny_llama, "prefill", mode)
    d = Instance(ctx, tiny_llama, "decode", mode)
    try:
        host, port = p.address.rsplit(":", 1)
        for i, prompt in enumerate(prompts):
            rid = f"r{i}"
            d_kv = {"do_remote_prefill": True, "transfer_id": rid, "remote_host": host,
                    "remote_port": int(port), "remote_engine_id": p.engine_id}
            if mode == "push":  # both legs at once; alternate which arrives first
                legs = [(p, {"do_remote_decode": True, "transfer_id": rid}), (d, d_kv)]
                for inst, kv in legs if i % 2 == 0 else reversed(legs):
                    inst.add(rid, prompt, greedy(10), kv)
            else:
                p.add(rid, prompt, greedy(10), {"do_remote_decode": True, "transfer_id": rid})
        if mode == "pull":  # D legs once P answered with its block ids
            p_outs = _wait(lambda: (o := p.outputs()[0]) and all(
                r["done"] for r in o.values()) and o)
            for rid, rec in p_outs.items():
                assert rec["error"] is None and rec["kv"]["remote_block_ids"]
                d.add(rid, prompts[int(rid[1:])], greedy(10), rec["kv"])
        d_outs = _wait(lambda: (o := d.outputs()[0]) and len(o) == len(prompts) and all(
            r["done"] for r in o.values()) and o)
        for rid, rec in d_outs.items():
            assert rec["error"] is None, rec["error"]
            assert rec["tokens"] == ref[rid], rid
        # both instances end with every block free
        _wait(lambda: p.outputs()[1] and d.outputs()[1], timeout=20)
        # the KV bytes that crossed equal prefill's, for every full block moved
        for prompt in prompts:
            n = (len(prompt) if mode == "push" else len(prompt) - 1) // 16
            if n:
                assert p.kv_blocks(prompt, n) == d.kv_blocks(prompt, n)
    finally:
        p.stop()
        d.stop()
