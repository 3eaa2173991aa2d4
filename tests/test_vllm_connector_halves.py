"""kvpush.vllm's two halves without vLLM: settings, vLLM's KV allocation as a region,
the scheduler half's facts, and a push and a pull between two worker halves over the
in-process transport and a real side channel (tests/vllm has the same through vLLM)."""

from __future__ import annotations

import time

import pytest
import torch

from kvpush.cluster.launcher import free_port
from kvpush.crypto.auth import ParamsSigner
from kvpush.errors import ConfigError
from kvpush.kv_transfer import commands as c
from kvpush.vllm.plan import SchedulerPlan
from kvpush.vllm.region import VLLM_LBHNC, vllm_region
from kvpush.vllm.settings import connector_config
from kvpush.vllm.worker import WorkerSide
from kvpush_testing.links import InProcLinks

BS, LAYERS, BLOCKS, HEADS, DIM = 4, 3, 16, 2, 8
SECRET = b"s" * 32


def kv_caches(layers: int = LAYERS) -> dict[str, torch.Tensor]:
    """vLLM 0.32's CPU allocation: one buffer, [layer, block, head, token, 2 x dim]."""
    buf = torch.zeros(layers, BLOCKS, HEADS, BS, 2 * DIM)
    return {f"model.layers.{i}.self_attn.attn": buf[i] for i in range(layers)}


def cfg(role: str, port: int, mode: str = "push", **extra):
    return connector_config(role, f"e-{role}-{port}", {"side_channel_port": port,
                                                       "kv_transfer": mode, **extra}, env={})


def test_settings_name_what_is_wrong():
    assert cfg("kv_producer", 5000).role == "prefill"
    assert cfg("kv_consumer", 5000, "pull").mode == "pull"
    with pytest.raises(ConfigError, match="kv_role"):
        connector_config("kv_both", "e", {"side_channel_port": 5000}, env={})
    with pytest.raises(ConfigError, match="side_channel_port"):
        connector_config("kv_producer", "e", {}, env={})
    with pytest.raises(ConfigError, match="engine_id"):
        connector_config("kv_producer", "", {"side_channel_port": 5000}, env={})
    env = {"KVPUSH_SIDE_CHANNEL_PORT": "5001", "KVPUSH_KV_SECRET": SECRET.decode()}
    got = connector_config("kv_consumer", "e", None, env=env)
    assert got.side_channel_port == 5001 and got.params_signed


def test_region_is_vllms_allocation():
    caches = kv_caches()
    r = vllm_region(caches)
    base = next(iter(caches.values())).untyped_storage().data_ptr()
    assert r.base == base and r.nbytes == LAYERS * BLOCKS * HEADS * BS * 2 * DIM * 4
    assert r.layout.layout == VLLM_LBHNC and r.layout.block_size == BS
    assert r.layout.block_bytes * BLOCKS == r.layout.layer_bytes
    assert r.layer_of == {f"model.layers.{i}.self_attn.attn": i for i in range(LAYERS)}
    # a view whose blocks are not contiguous cannot be addressed: refused by name
    strided = torch.zeros(BLOCKS, 2, HEADS, BS, 2 * DIM)
    with pytest.raises(ConfigError, match="layer-compact"):
        vllm_region({"a": strided[:, 0], "b": strided[:, 1]})


def test_prefill_plan_states_blocks_per_step_then_token_one():
    plan = SchedulerPlan(cfg("kv_producer", 5000), BS, LAYERS)
    prompt = list(range(10))  # 2 full blocks and a partial one
    raw = {"do_remote_decode": True, "transfer_id": "t1"}
    plan.allocated("r1", prompt, raw, [7, 8, 9], 0)
    step = plan.step([("r1", 0, 6)], lambda rid: [7, 8, 9])  # a chunk of 6 tokens
    assert step.begun == (("r1", "t1"),)
    assert isinstance(step.facts[0], c.Begin) and step.facts[0].num_prompt_tokens == 10
    assert [(w.first_block, w.blocks) for w in step.writes] == [(0, [7])]
    step = plan.step([("r1", 6, 4)], lambda rid: [7, 8, 9])
    assert [(w.first_block, w.blocks) for w in step.writes] == [(1, [8])]
    keep, params = plan.finished("r1", True, [42], [7, 8, 9])
    assert keep and params is None
    step = plan.step([], lambda rid: [])
    tail, done = step.facts
    assert (tail.first_block, tail.blocks, tail.layers) == (2, [9], range(LAYERS))
    assert done.done.first_token == 42 and step.held == ("r1",)
    # a plain request (no params) is not the connector's
    plan.allocated("r2", prompt, None, [1, 2, 3], 0)
    assert plan.finished("r2", True, [1], [1, 2, 3]) == (False, None)


def test_decode_plan_receives_and_refuses_forged_params():
    secret_cfg = connector_config("kv_consumer", "d1", {"side_channel_port": 5000},
                                  env={"KVPUSH_KV_SECRET": SECRET.decode()})
    plan = SchedulerPlan(secret_cfg, BS, LAYERS)
    prompt = list(range(9))
    raw = {"do_remote_prefill": True, "transfer_id": "t2", "remote_host": "127.0.0.1",
           "remote_port": 5001, "remote_engine_id": "p1"}
    signed = ParamsSigner(SECRET).sign(raw, role="decode", engine_id="d1",
                                       peer_engine_id="p1")
    assert plan.matched("r1", prompt, signed, 4) == (5, True)
    plan.allocated("r1", prompt, signed, [3, 4, 5], 5)
    step = plan.step([], lambda rid: [])
    begin, ready = step.facts
    assert begin.peer.address == "127.0.0.1:5001" and ready.first_block == 1
    assert ready.blocks == [3, 4, 5] and step.begun == (("r1", "t2"),)
    assert plan.matched("r1", prompt, signed, 4) == (0, False)  # asked once
    # the request ends while its KV may still come: the blocks stay until it is over
    assert plan.finished("r1", False, [], [3, 4, 5]) == (True, None)
    assert isinstance(plan.step([], lambda rid: []).facts[0], c.End)
    # unsigned (forged) params: the load fails, nothing is begun
    assert plan.matched("r2", prompt, raw, 0) == (9, True)
    plan.allocated("r2", prompt, raw, [6, 7, 8], 9)
    step = plan.step([], lambda rid: [])
    assert not step.facts and step.refused[0][0] == "r2"
    assert "signature" in step.refused[0][1]


def wait_for(side: WorkerSide, got, what: str, timeout: float = 10.0):
    """Poll ``side.finished()`` until ``what`` has request ``got``; the results."""
    deadline = time.monotonic() + timeout
    seen = {"sending": set(), "recving": set(), "failed": set()}
    while time.monotonic() < deadline:
        r = side.finished()
        for k in seen:
            seen[k] |= getattr(r, k)
        if got in seen[what]:
            return seen
        time.sleep(0.01)
    raise AssertionError(f"{got} not in {what} within {timeout} s: {seen}")


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_two_worker_halves_move_kv(mode):
    links = InProcLinks()
    p_cfg, d_cfg = cfg("kv_producer", free_port(), mode), cfg("kv_consumer", free_port(), mode)
    p_caches, d_caches = kv_caches(), kv_caches()
    for i, t in enumerate(p_caches.values()):
        t.copy_(torch.randn_like(t) + i)
    p, d = WorkerSide(p_cfg, "m", HEADS, links), WorkerSide(d_cfg, "m", HEADS, links)
    p.register(p_caches)
    d.register(d_caches)
    pp, dp = SchedulerPlan(p_cfg, BS, LAYERS), SchedulerPlan(d_cfg, BS, LAYERS)
    try:
        prompt, p_blocks, d_blocks = list(range(10)), [5, 6, 7], [9, 2, 3]
        p_raw = {"do_remote_decode": True, "transfer_id": "t"}
        pp.allocated("pr", prompt, p_raw, p_blocks, 0)
        d_raw = {"do_remote_prefill": True, "transfer_id": "t", "remote_host": "127.0.0.1",
                 "remote_port": p_cfg.side_channel_port, "remote_engine_id": p_cfg.engine_id}
        if mode == "pull":  # prefill first; decode gets its answer
            p.bind(pp.step([("pr", 0, 10)], lambda rid: p_blocks))
            keep, d_raw = pp.finished("pr", True, [1], p_blocks)
            assert keep and d_raw["remote_block_ids"] == p_blocks
            p.bind(pp.step([], lambda rid: []))  # the lend: vLLM's next step
        assert dp.matched("dr", prompt, d_raw, 0) == (10, True)
        dp.allocated("dr", prompt, d_raw, d_blocks, 10)
        d.bind(dp.step([], lambda rid: []))
        if mode == "push":
            p.bind(pp.step([("pr", 0, 10)], lambda rid: p_blocks))
            for name in p_caches:  # the forward pass saves each layer
                p.layer_saved(name)
            p.step_saved()
            assert pp.finished("pr", True, [1], p_blocks) == (True, None)
            p.bind(pp.step([], lambda rid: []))
        seen = wait_for(d, "dr", "recving")
        assert not seen["failed"]
        assert wait_for(p, "pr", "sending")["sending"] == {"pr"}
        src = torch.stack(list(p_caches.values()))
        dst = torch.stack(list(d_caches.values()))
        # push moves every block with prompt tokens; pull the 9 tokens before the last
        for pb, db in zip(p_blocks, d_blocks):  # ceil(10/4) = ceil(9/4) = 3 blocks
            assert torch.equal(src[:, pb], dst[:, db])
        untouched = [b for b in range(BLOCKS) if b not in d_blocks]
        assert not dst[:, untouched].any()
    finally:
        p.shutdown()
        d.shutdown()


def test_a_kvpush_instance_and_a_vllm_one_are_refused_naming_both_layouts():
    """Mixed pairs: kvpush's P/D region is head-major, vLLM's [layer, block, head,
    token, K|V]; the handshake refuses the pair with both names, nothing moves."""
    from kvpush.config import HEAD_MAJOR
    from kvpush.kv_cache.kv_region import KVLayout
    from kvpush.kv_transfer.wire import messages as m

    region = vllm_region(kv_caches())
    kvpush_layout = KVLayout(HEAD_MAJOR, LAYERS, BLOCKS, BS, HEADS, DIM, "float32",
                             region.layout.block_bytes, region.layout.layer_bytes)

    def hello(role, layout):
        return m.Hello(version=m.PROTOCOL_VERSION, engine_id=role, role=role,
                       address="127.0.0.1:1", transport="nixl", agent_metadata=b"",
                       model="m", kv_transfer="push", base_address=4096, layout=layout,
                       model_kv_heads=HEADS)

    problems = m.compatibility_problems(hello("decode", region.layout),
                                        hello("prefill", kvpush_layout))
    assert problems == [f"layout: peer has {HEAD_MAJOR!r}, this instance {VLLM_LBHNC!r}"]
    assert not m.compatibility_problems(hello("decode", region.layout),
                                        hello("prefill", region.layout))


def test_router_signs_for_vllm_instances_it_was_given_identities_of():
    """A vLLM instance named URL@ENGINE_ID@HOST:PORT gets signed params (the connector
    checks them); one named by URL alone gets them as vLLM's own proxies send them."""
    from kvpush.discovery.instance_spec import parse_instance
    from kvpush.router.config import RouterKeys
    from kvpush.router.pool import Instance
    from kvpush.router.wire import LegSigner

    signer = LegSigner(RouterKeys.from_secret(SECRET))
    named = Instance(parse_instance("http://127.0.0.1:1@vd@127.0.0.1:5"), "decode", 0)
    plain = Instance(parse_instance("http://127.0.0.1:2"), "decode", 1)
    params = {"do_remote_prefill": True, "transfer_id": "t"}
    signed = signer.sign(params, named, "decode")
    assert ParamsSigner(SECRET).verify(signed, role="decode", engine_id="vd")
    assert signer.sign(params, plain, "decode") == params


def test_prefill_hands_each_layer_group_over_as_vllm_saves_it():
    """push_layers_per_write 1: a step's blocks go to the transfer thread layer by layer
    while the forward pass runs, the last with the last layer; none twice."""
    p_cfg = cfg("kv_producer", free_port(), push_layers_per_write=1)
    side = WorkerSide(p_cfg, "m", HEADS, InProcLinks())
    caches = kv_caches()
    side.register(caches)
    sent: list[c.StepMessage] = []
    try:
        side.worker.submit = sent.append  # what the transfer thread would be handed
        plan = SchedulerPlan(p_cfg, BS, LAYERS)
        plan.allocated("r", list(range(8)), {"do_remote_decode": True, "transfer_id": "t"},
                       [4, 5], 0)
        side.bind(plan.step([("r", 0, 8)], lambda rid: [4, 5]))
        assert [type(f) for f in sent.pop().facts] == [c.Begin]
        for i, name in enumerate(caches):
            side.layer_saved(name)
            (ready,) = sent[-1].facts
            assert (ready.layers, ready.blocks) == (range(i, i + 1), [4, 5])
        side.step_saved()
        assert len(sent) == LAYERS
    finally:
        side.shutdown()
