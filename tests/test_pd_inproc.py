"""Push and pull between a prefill and a decode engine in one process (in-process
transport): outputs equal a single instance, KV bytes equal, every fault ends cleanly."""

from __future__ import annotations

import time

import pytest

from engine_helpers import greedy, make_engine, random_prompts, run_to_completion
from kvpush.config import KVTransferConfig
from kvpush.engine.inputs import AbortTransfer
from kvpush.engine.outputs import FinishReason
from kvpush.errors import ConfigError
from kvpush.kv_cache.block_pool import hash_prefix_blocks
from kvpush.kv_transfer.commands import BlocksReady, StepMessage
from kvpush.kv_transfer.step_loop.prefill_side import AUTO_GROUP_S, WriteGroups, write_groups
from kvpush_testing.faults import FaultPlan
from pd_helpers import PDDriver, make_instance, writes_posted

LENGTHS = [7, 16, 33, 100, 161, 250]  # 1 to 16 blocks of 16, mostly not multiples


@pytest.fixture
def pd(tiny_qwen3, request):
    mode, kw = request.param if isinstance(request.param, tuple) else (request.param, {})
    faults = FaultPlan()
    p = make_instance(tiny_qwen3, "prefill", mode, faults=faults, **kw)
    d = make_instance(tiny_qwen3, "decode", mode, faults=faults, **kw)
    drv = PDDriver(p, d)
    drv.faults = faults
    yield drv
    drv.close()


def single_outputs(model_dir, prompts, n):
    eng = make_engine(model_dir)
    return run_to_completion(eng, {f"r{i}": p for i, p in enumerate(prompts)}, greedy(n))


@pytest.mark.parametrize("pd", ["push", "pull"], indirect=True)
@pytest.mark.parametrize("decode_first", [False, True])
def test_disaggregated_equals_single(pd, tiny_qwen3, decode_first):
    prompts = random_prompts(LENGTHS, seed=21)
    ref = single_outputs(tiny_qwen3, prompts, 12)
    for i, p in enumerate(prompts):
        pd.submit(f"r{i}", p, greedy(12), decode_first=decode_first)
    pd.run()
    for i in range(len(prompts)):
        leg = pd.d_legs[f"r{i}"]
        assert leg.error is None and leg.finish_reason is FinishReason.LENGTH
        assert leg.tokens == ref[f"r{i}"], f"r{i}"
    pd.settle()
    assert pd.p.connector.counters.transfers_ok == len(prompts)
    assert pd.d.connector.counters.transfers_ok == len(prompts)


@pytest.mark.parametrize("pd", ["push", "pull"], indirect=True)
def test_kv_bytes_on_decode_equal_prefill(pd):
    prompt = random_prompts([150], seed=4)[0]
    pd.submit("r", prompt, greedy(1))
    pd.run()
    pd.settle()
    # the prompt's full blocks are in both prefix caches: compare their bytes
    hashes = hash_prefix_blocks(prompt, 16)
    n = len(hashes) if pd.mode == "push" else (len(prompt) - 1) // 16
    p_blocks = pd.p.scheduler.pool.lookup(hashes[:n])
    d_blocks = pd.d.scheduler.pool.lookup(hashes[:n])
    assert len(p_blocks) == len(d_blocks) == n > 0
    p_kv = pd.p.runner.kv_region.kv[:, p_blocks]
    d_kv = pd.d.runner.kv_region.kv[:, d_blocks]
    assert p_kv.abs().sum() > 0
    assert (p_kv == d_kv).all()


@pytest.mark.parametrize("pd", ["push"], indirect=True)
def test_push_token1_travels_with_kv(pd, tiny_qwen3):
    """Decode does not recompute the last prompt token: its first step decodes token #1."""
    prompt = random_prompts([90], seed=5)[0]
    ref = single_outputs(tiny_qwen3, [prompt], 4)["r0"]
    pd.submit("r", prompt, greedy(4, logprobs=True))
    pd.run()
    leg = pd.d_legs["r"]
    assert leg.tokens == ref
    assert pd.p_legs["r"].tokens == ref[:1]  # prefill sampled token #1 ...
    assert len(leg.logprobs) == 4 and leg.logprobs[0] == pytest.approx(pd.p_legs["r"].logprobs[0])
    # ... and decode computed only the 3 tokens after it, never the prompt
    assert pd.d.stats().prefix_cache_query_tokens == 90
    pd.settle()


@pytest.mark.parametrize("pd", ["push", "pull"], indirect=True)
def test_disaggregated_penalties_equal_single(pd, tiny_qwen3):
    """Penalties and logit_bias through P/D: prefill samples token #1 (push) with the
    prompt as history, decode goes on with prompt + output; the tokens equal a single
    instance's, which differ from the unpenalized ones."""
    prompts = random_prompts([33, 100], seed=22)
    params = greedy(12, repetition_penalty=1.6, presence_penalty=1.0, frequency_penalty=0.5,
                    logit_bias=((11, 3.0),))
    ref = run_to_completion(make_engine(tiny_qwen3),
                            {f"r{i}": p for i, p in enumerate(prompts)}, params)
    assert ref != single_outputs(tiny_qwen3, prompts, 12)
    for i, p in enumerate(prompts):
        pd.submit(f"r{i}", p, params)
    pd.run()
    for i in range(len(prompts)):
        assert pd.d_legs[f"r{i}"].tokens == ref[f"r{i}"], f"r{i}"
    pd.settle()


@pytest.mark.parametrize("pd", ["push", "pull"], indirect=True)
def test_disaggregated_top_logprobs_equal_single(pd, tiny_qwen3):
    """top_logprobs through P/D: token #1's alternatives come from prefill (push: with the
    KV, in PushDone; pull: decode samples token #1 itself), the rest from decode; all
    equal a single instance's."""
    prompt = random_prompts([90], seed=7)[0]
    params = greedy(4, logprobs=True, top_logprobs=3)
    eng = make_engine(tiny_qwen3)
    eng.add_request("r", prompt, params)
    ref = []
    while eng.has_work():
        for o in eng.step():
            ref += o.new_top_logprobs or []
    pd.submit("r", prompt, params)
    pd.run()
    leg = pd.d_legs["r"]
    assert leg.error is None and len(leg.top_logprobs) == 4
    for got, want in zip(leg.top_logprobs, ref, strict=True):
        assert [t for t, _ in got] == [t for t, _ in want]
        # float32 summation order: pull's decode attends the prompt's last token over
        # the moved KV at a padded width, the single instance over the fresh prompt
        assert [lp for _, lp in got] == pytest.approx([lp for _, lp in want], rel=1e-5,
                                                      abs=1e-5)
    if pd.mode == "push":
        assert pd.p_legs["r"].top_logprobs[0] == leg.top_logprobs[0]
    pd.settle()


@pytest.mark.parametrize("pd", ["push"], indirect=True)
def test_push_token1_goes_out_before_decode_runs_a_forward(pd):
    """Token #1 arrives with the KV; decode hands it out at once, not with the output
    of its next forward pass (which it has no part in: with the dense decode cache
    filled for a long context, that step alone costs tens of ms on CPU)."""
    delivered_at_forward = []  # tokens the client had when each decode forward began
    run = pd.d.runner.execute

    def counting(plan, hook=None):
        delivered_at_forward.append(len(pd.d_legs["r"].tokens))
        return run(plan, hook)

    pd.d.runner.execute = counting
    pd.submit("r", random_prompts([70], seed=6)[0], greedy(3))
    pd.run()
    assert len(pd.d_legs["r"].tokens) == 3
    assert delivered_at_forward == [1, 2]  # token #1 was out before the first forward
    pd.settle()


@pytest.mark.parametrize("preset,group,posts", [
    # WRITEs in the order the transfer thread posted them (their layers): those stated
    # before the registration landed, each later group, then the partial last block
    ("tiny", 1, [(0,), (1,), (0, 1)]),  # 2 layers, one per group: layer 0 was stated
    ("small", 1, [(0,), (1,), (2,), (3,), (0, 1, 2, 3)]),
    ("small", 2, [(0, 1), (2, 3), (0, 1, 2, 3)])])  # nothing stated yet at layer 1
def test_registration_arriving_mid_step_starts_the_writes_there(model_factory, preset,
                                                                 group, posts):
    """Decode registers while prefill's one-step forward pass is at layer 1: the
    transfer thread writes the layer groups already stated computed as the registration
    lands (mid-step) and every later group as it is stated; the last group and the
    partial last block go with the step's end."""
    model = model_factory("qwen3", preset)
    pd = PDDriver(make_instance(model, "prefill", "push", layers_per_write=group),
                  make_instance(model, "decode", "push", layers_per_write=group))
    try:
        _registration_mid_step(pd, model, posts)
    finally:
        pd.close()


def _registration_mid_step(pd, model, posts: list[tuple[int, ...]]) -> None:
    prompt, warm = random_prompts([250, 20], seed=8)  # 250: 15 full blocks and a part
    pd.submit("warm", warm, greedy(1))  # the instances meet (Hello) before the step
    pd.settle()  # (its counters are in)
    worker = pd.p.connector.worker
    late = pd.p.connector.counters.registrations_after_blocks
    posted: list[tuple[int, ...]] = []  # (transfer thread) each WRITE's layers
    at_registration: list[int] = []  # WRITEs posted once the registration was matched
    post = worker.ctx.posts.post

    def recording(op, rec, peer, agent, local, remote, layers, ready=None):
        posted.append(tuple(layers))
        return post(op, rec, peer, agent, local, remote, layers, ready)

    worker.ctx.posts.post = recording
    execute = pd.p.runner.execute

    def registering_at_layer_1(plan, hook=None):
        assert hook is not None  # a push send's blocks are stated per layer group
        def on_layer(layer):
            if layer == 1:  # decode's leg arrives; wait until prefill matched it
                pd.send_decode("r", prompt, greedy(6))
                deadline = time.monotonic() + 10
                while getattr(worker.table.get("r"), "reg", None) is None:
                    assert time.monotonic() < deadline, "registration never matched"
                    outs = pd.d.process_inbox()
                    if pd.d.has_work():
                        outs += pd.d.step()
                    pd._absorb(outs, pd.d_legs)
                    time.sleep(0.001)
                at_registration.append(len(posted))
            hook(layer)
        return execute(plan, on_layer)

    pd.p.runner.execute = registering_at_layer_1
    pd.send_prefill("r", prompt, greedy(6))
    pd.run(until=lambda: "r" in pd.d_legs and pd.d_legs["r"].finished)
    stated_first = posts[0] == (0,)  # layer 0 was stated before the registration
    pd.settle()
    assert pd.p.connector.counters.registrations_after_blocks - late == int(stated_first)
    assert at_registration == [1 if stated_first else 0]  # written as it landed
    assert posted == posts
    assert pd.d_legs["r"].tokens == single_outputs(model, [prompt], 6)["r0"]
    _assert_clean(pd)


@pytest.mark.parametrize("configured,layer_s,expected_groups", [
    (1, 0.0, [(0,), (1,), (2,), (3,)]), (3, 0.0, [(0, 1, 2), (3,)]),
    (4, 0.0, [(0, 1, 2, 3)]), (9, 0.0, [(0, 1, 2, 3)]),
    # auto on CPU, by compute time: each layer 0.6 of AUTO_GROUP_S, or far less
    (0, 0.6 * AUTO_GROUP_S, [(0, 1), (2, 3)]), (0, 0.01 * AUTO_GROUP_S, [(0, 1, 2, 3)])])
def test_push_writes_layers_in_groups(model_factory, configured, layer_s, expected_groups):
    """--push-layers-per-write: a prefill step hands the transfer thread one WRITE per
    group of layers (the last group may be shorter), each covering exactly its layers,
    the groups closed mid-step each on one wake-up and the last with the step's end;
    decode's KV and tokens equal a single instance's. (``layer_s``: each layer's compute
    time on the step loop's clock, a fake one.)"""
    model = model_factory("qwen3", "small")  # 4 layers
    p = make_instance(model, "prefill", "push", layers_per_write=configured)
    d = make_instance(model, "decode", "push", layers_per_write=configured)
    pd = PDDriver(p, d)
    try:
        warm, prompt = random_prompts([20, 100], seed=31)  # 100: 6 full blocks and a part
        pd.submit("warm", warm, greedy(1))  # meet and register before the step we watch
        pd.run()
        assert p.kv_info().push_layers_per_write == min(configured, 4)
        in_forward, groups, messages = [False], [], [0]  # groups: (layers, mid-step)
        now = [0.0]
        p.connector.side.clock = lambda: now[0]
        submit, execute = p.connector.worker.submit, p.runner.execute

        def recording(msg):
            assert isinstance(msg, StepMessage)  # the step loop hands over facts only
            messages[0] += in_forward[0]
            for fact in msg.facts:
                if isinstance(fact, BlocksReady) and fact.first_block == 0:
                    groups.append((tuple(fact.layers), in_forward[0]))
            submit(msg)

        def watched(plan, hook=None):
            in_forward[0] = True

            def timed(layer):
                now[0] += layer_s  # the layer was computed
                hook(layer)
            try:
                return execute(plan, timed if hook is not None else None)
            finally:
                in_forward[0] = False

        p.connector.worker.submit, p.runner.execute = recording, watched
        pd.submit_registered("r", prompt, greedy(5))  # registered before prefill's step
        pd.run(until=lambda: "r" in pd.d_legs and pd.d_legs["r"].finished)
        assert [g for g, _ in groups] == expected_groups
        assert [mid for _, mid in groups] == [True] * (len(groups) - 1) + [False]
        assert messages[0] == len(expected_groups) - 1  # one wake-up per mid-step group
        assert pd.d_legs["r"].tokens == single_outputs(model, [prompt], 5)["r0"]
        pd.settle()
        hashes = hash_prefix_blocks(prompt, 16)
        p_blocks, d_blocks = p.scheduler.pool.lookup(hashes), d.scheduler.pool.lookup(hashes)
        assert len(p_blocks) == len(d_blocks) == 6
        assert (p.runner.kv_region.kv[:, p_blocks] == d.runner.kv_region.kv[:, d_blocks]).all()
        for eng in (p, d):
            s = eng.stats()
            assert s.num_free_blocks == s.num_total_blocks
    finally:
        pd.close()


def test_write_groups_auto_and_bounds():
    assert write_groups(0, 30, cuda=True) == WriteGroups(1)  # overlap the kernels to run
    assert write_groups(0, 30, cuda=False) == WriteGroups(0, AUTO_GROUP_S)  # by time
    assert write_groups(5, 30, cuda=True) == WriteGroups(5)
    assert write_groups(99, 30, cuda=False) == WriteGroups(30)
    by_time = write_groups(0, 30, cuda=False)
    assert not by_time.closes(12, AUTO_GROUP_S * 0.99)
    assert by_time.closes(1, AUTO_GROUP_S)
    assert WriteGroups(3).closes(3, 0.0) and not WriteGroups(3).closes(2, 1e9)
    with pytest.raises(ConfigError, match="--push-layers-per-write"):
        KVTransferConfig(role="prefill", push_layers_per_write=-1).validate()


def _assert_clean(pd) -> None:
    pd.settle()
    for eng in (pd.p, pd.d):
        s = eng.stats()
        assert s.num_free_blocks == s.num_total_blocks
    # every transfer's record ended too (its lease and fence with it): settle waits
    # for the transfer threads' tables to empty
    for eng in (pd.p, pd.d):
        assert not eng.connector.holds.by_tid


@pytest.mark.parametrize("pd", [("push", {"lease": 0.6})], indirect=True)
def test_lost_registration_is_sent_again(pd, tiny_qwen3):
    """Prefill's heartbeat lists transfers it has no registration for; decode re-sends."""
    prompt = random_prompts([60])[0]
    pd.faults.arm(drop_messages={"PushRegister": 1})
    pd.submit("r", prompt, greedy(5))
    pd.run(timeout=15)
    leg = pd.d_legs["r"]
    assert leg.finish_reason is FinishReason.LENGTH
    assert leg.tokens == single_outputs(tiny_qwen3, [prompt], 5)["r0"]
    assert pd.faults.count("message_drops:PushRegister") == 1
    _assert_clean(pd)


@pytest.mark.parametrize("pd", [("push", {"lease": 0.6})], indirect=True)
def test_all_registrations_lost_ends_with_clear_error(pd):
    pd.faults.arm(drop_messages={"PushRegister": 1000})
    pd.submit("r", random_prompts([60])[0], greedy(5))
    pd.run(timeout=15)
    leg = pd.d_legs["r"]
    assert leg.finish_reason is FinishReason.ERROR
    assert "registration lost 4 times" in leg.error
    _assert_clean(pd)


@pytest.mark.parametrize("pd", ["push", "pull"], indirect=True)
def test_failed_post_fails_request_cleanly(pd):
    pd.faults.arm(fail_posts=1)
    pd.submit("r", random_prompts([70])[0], greedy(5))
    pd.run(timeout=15)
    leg = pd.d_legs["r"]
    assert leg.finish_reason is FinishReason.ERROR
    assert "failed to post" in leg.error
    assert pd.faults.count("post_failures") == 1
    _assert_clean(pd)
    # the next request goes through
    pd.submit("ok", random_prompts([70])[0], greedy(5))
    pd.run(timeout=15)
    assert pd.d_legs["ok"].finish_reason is FinishReason.LENGTH
    _assert_clean(pd)


@pytest.mark.parametrize("pd", [("push", {"policy": "recompute"}),
                                ("pull", {"policy": "recompute"})], indirect=True)
def test_recompute_policy_gives_correct_answer(pd, tiny_qwen3):
    prompt = random_prompts([70], seed=8)[0]
    ref = single_outputs(tiny_qwen3, [prompt], 6)["r0"]
    pd.faults.arm(fail_transfers=1)
    pd.submit("r", prompt, greedy(6))
    pd.run(timeout=15)
    assert pd.d_legs["r"].tokens == ref
    assert pd.faults.count("transfer_failures") == 1
    assert pd.d.connector.counters.transfers_failed == 1
    _assert_clean(pd)


@pytest.mark.parametrize("pd", [("push", {"lease": 0.5})], indirect=True)
def test_prefill_lease_expires_when_decode_never_registers(pd):
    pd.send_prefill("r", random_prompts([50])[0], greedy(5))  # no decode leg at all
    pd.run(until=lambda: pd.p_legs["r"].finished, timeout=10)
    assert pd.p.stats().num_free_blocks < pd.p.stats().num_total_blocks  # held for D
    _assert_clean(pd)
    assert pd.p.connector.counters.leases_expired == 1


@pytest.mark.parametrize("pd", [("pull", {"lease": 0.5})], indirect=True)
def test_pull_lease_expires_when_decode_never_reads(pd):
    pd.send_prefill("r", random_prompts([50])[0], greedy(5))
    pd.run(until=lambda: pd.p_legs["r"].finished, timeout=10)
    assert pd.p_legs["r"].kv_transfer_params["remote_block_ids"]
    pd._pull_waiting.clear()
    _assert_clean(pd)
    assert pd.p.connector.counters.leases_expired == 1


@pytest.mark.parametrize("pd", [("push", {"lease": 0.5})], indirect=True)
def test_decode_lease_expires_when_prefill_never_gets_request(pd):
    pd.send_decode("r", random_prompts([50])[0], greedy(5))  # P never hears of it
    pd.run(timeout=10)
    leg = pd.d_legs["r"]
    assert leg.finish_reason is FinishReason.ERROR
    assert "lease expired" in leg.error
    _assert_clean(pd)


@pytest.mark.parametrize("pd", ["push", "pull"], indirect=True)
@pytest.mark.parametrize("when", ["before_kv", "while_decoding"])
def test_decode_abort_propagates(pd, when):
    prompt = random_prompts([120])[0]
    pd.faults.arm(transfer_delay_s=0.3 if when == "before_kv" else 0.0)
    pd.submit("r", prompt, greedy(200))
    if when == "before_kv":
        pd.run(until=lambda: "d-r" in pd.d.scheduler.remote_waiting, timeout=10)
    else:
        pd.run(until=lambda: "r" in pd.d_legs and len(pd.d_legs["r"].tokens) >= 3,
               timeout=10)
    out = pd.d.abort_request("d-r")
    assert out.finish_reason is FinishReason.ABORT
    pd.d_legs["r"].finish_reason = FinishReason.ABORT
    _assert_clean(pd)


@pytest.mark.parametrize("pd", [("push", {"max_num_batched_tokens": 16})], indirect=True)
def test_prefill_abort_fails_decode(pd):
    """Prefill aborted mid-prefill, with layer WRITEs in flight: decode hears of it after
    they drain and fails the request."""
    pd.faults.arm(transfer_delay_s=0.05)
    # registered before prefill starts: one block written per 16-token step, so prefill
    # is still running (19 steps) when the second block goes out
    pd.submit_registered("r", random_prompts([300])[0], greedy(5))
    pd.run(until=lambda: writes_posted(pd.p, "r", 2), timeout=10)
    assert "p-r" in pd.p.scheduler.requests  # still prefilling
    pd.p.abort_request("p-r")
    pd.run(timeout=10)
    leg = pd.d_legs["r"]
    assert leg.finish_reason is FinishReason.ERROR and "aborted" in leg.error
    _assert_clean(pd)


@pytest.mark.parametrize("pd", [("push", {"max_num_batched_tokens": 16, "lease": 0.5})],
                         indirect=True)
def test_prefill_lease_expiry_mid_prefill_drains_writes_before_freeing(pd):
    """Decode goes silent while prefill is still computing and WRITEs are in flight:
    prefill's lease ends, the prefill request is aborted, and its blocks stay held until
    the WRITEs reading them have drained (then everything is free on both sides)."""
    pd.submit_registered("r", random_prompts([300])[0], greedy(5))
    # decode silent: no heartbeats, and its own lease-end Abort lost too; the WRITEs take
    # far longer than the 0.5 s lease, so they are surely in flight when it ends (at
    # 0.4 s they sometimes completed first, and the send was gone before the check)
    pd.faults.arm(transfer_delay_s=2.0, drop_messages={"Heartbeat": 10**6, "Abort": 10**6})
    pd.run(until=lambda: writes_posted(pd.p, "r", 2), timeout=10)
    deadline = time.monotonic() + 10
    while "p-r" in pd.p.scheduler.requests:  # prefill is held: handle events, no steps
        assert time.monotonic() < deadline, "prefill's lease did not expire"
        pd.p.process_inbox()
        time.sleep(0.005)
    hold = pd.p.connector.holds.by_tid["r"]
    assert hold.request_id is None and hold.blocks  # aborted, its WRITEs still draining
    s = pd.p.stats()
    assert s.num_free_blocks < s.num_total_blocks  # the blocks they read are still held
    pd.faults.clear()
    pd.run(timeout=10)
    assert pd.d_legs["r"].finish_reason is FinishReason.ERROR
    _assert_clean(pd)


def test_prefill_lease_expiry_tells_decode_only_after_its_writes_drain(tiny_qwen3):
    """Prefill's lease on a push ends while its WRITEs are in flight and decode is
    still waiting (its own lease is longer): prefill sends no Abort (decode would free
    blocks those WRITEs still reach) but PushDone(ok=False) once they have drained."""
    faults = FaultPlan()
    p = make_instance(tiny_qwen3, "prefill", "push", faults=faults, lease=0.5,
                      max_num_batched_tokens=16)
    d = make_instance(tiny_qwen3, "decode", "push", faults=faults, lease=30.0,
                      max_num_batched_tokens=16)
    pd = PDDriver(p, d)
    pd.faults = faults
    try:
        pd.submit_registered("r", random_prompts([300])[0], greedy(5))
        faults.arm(transfer_delay_s=2.0, drop_messages={"Heartbeat": 10**6})
        pd.run(until=lambda: writes_posted(p, "r", 2), timeout=10)
        deadline = time.monotonic() + 10
        while "p-r" in p.scheduler.requests:  # prefill held: events only, no steps
            assert time.monotonic() < deadline, "prefill's lease did not expire"
            p.process_inbox()
            time.sleep(0.005)
        rec = p.connector.worker.table.get("r")
        assert rec is not None and rec.handles  # WRITEs still in flight
        d.process_inbox()
        assert "r" in d.connector.holds.by_tid  # no Abort reached decode: its blocks are held
        faults.clear()
        pd.run(timeout=10)
        assert pd.d_legs["r"].finish_reason is FinishReason.ERROR
        assert "lease expired" in pd.d_legs["r"].error
        _assert_clean(pd)
    finally:
        pd.close()


@pytest.mark.parametrize("pd", [("push", {"prefix_hit_tail": "decode"})], indirect=True)
def test_decode_prefix_hit_trims_the_write(pd, tiny_qwen3):
    shared = random_prompts([96], seed=30)[0]
    first, second = shared + [9, 9, 9], shared + list(range(100, 120))
    pd.submit("a", first, greedy(3))
    pd.run()
    pd.settle()
    bytes_a = pd.p.transfer_records[-1].num_bytes
    pd.submit("b", second, greedy(3))
    pd.run()
    ref = single_outputs(tiny_qwen3, [second], 3)["r0"]
    assert pd.d_legs["b"].tokens == ref
    pd.settle()
    bytes_b = pd.p.transfer_records[-1].num_bytes
    # 'a' sent 7 blocks (99 tokens); 'b' (116) only the 2 blocks after the 6 shared ones
    assert bytes_b * 7 == bytes_a * 2
    assert pd.d.stats().prefix_cache_hit_tokens == 96
    # a full hit (every full block cached), --prefix-hit-tail decode: decode computes the
    # 3-token tail itself and prefill stops without writing
    n_records = len(pd.p.transfer_records)
    pd.submit("c", list(first), greedy(3))
    pd.run()
    assert pd.d_legs["c"].tokens == pd.d_legs["a"].tokens
    _assert_clean(pd)
    assert len(pd.p.transfer_records) == n_records
    # prefill either finished first or was told to stop (a 400 the router expects)
    assert (pd.p_legs["c"].finish_reason is FinishReason.LENGTH
            or pd.p_legs["c"].code == "prefill_not_needed"), pd.p_legs["c"]
    # the full-hit registration may reach prefill before prefill's own leg: that leg is
    # then stopped with prefill_not_needed, and nothing is written either way
    pd.send_decode("e", list(first), greedy(3))
    pd.run(until=lambda: pd.p.connector.worker.table.get("e") is not None, timeout=10)
    pd.send_prefill("e", list(first), greedy(3))
    pd.run(until=lambda: pd.p_legs["e"].finished and pd.d_legs["e"].finished)
    e = pd.p_legs["e"]  # (a one-step prefill may finish before the answer is back)
    assert e.finish_reason is FinishReason.LENGTH or (
        e.rejected and e.code == "prefill_not_needed" and "nothing to prefill" in e.error), e
    assert pd.d_legs["e"].tokens == pd.d_legs["a"].tokens
    _assert_clean(pd)


@pytest.mark.parametrize("pd", ["push"], indirect=True)
def test_full_prefix_hit_tail_comes_from_prefill_by_default(pd, tiny_qwen3):
    """Decode holds every full block: prefill computes the tail and writes only that
    block with token #1; decode's step loop computes nothing but decode steps."""
    first = random_prompts([99], seed=31)[0]
    pd.submit("a", first, greedy(3))
    pd.run()
    pd.settle()
    bytes_a = pd.p.transfer_records[-1].num_bytes  # 7 blocks
    pd.submit("c", list(first), greedy(3))
    pd.run()
    assert pd.d_legs["c"].tokens == pd.d_legs["a"].tokens
    assert pd.p_legs["c"].finish_reason is FinishReason.LENGTH
    pd.settle()
    rec = pd.p.transfer_records[-1]
    assert rec.ok and rec.num_bytes * 7 == bytes_a  # the tail block, nothing more
    assert pd.d.stats().prefix_cache_hit_tokens == 96
    _assert_clean(pd)


def test_incompatible_peer_is_refused_with_reason(tiny_qwen3):
    p = make_instance(tiny_qwen3, "prefill", "push", block_size=16)
    d = make_instance(tiny_qwen3, "decode", "push", block_size=32)
    drv = PDDriver(p, d)
    try:
        drv.submit("r", random_prompts([40])[0], greedy(3))
        drv.run(timeout=10)
        leg = drv.d_legs["r"]
        assert leg.finish_reason is FinishReason.ERROR
        assert "block_size" in leg.error and "16" in leg.error and "32" in leg.error
        drv.p.abort_request("p-r")
        drv.settle()
    finally:
        drv.close()


@pytest.mark.parametrize("pd", ["pull"], indirect=True)
def test_pull_with_block_ids_outside_region_fails_cleanly(pd):
    prompt = random_prompts([60])[0]
    kv = {**pd.d_params("bad"), "remote_block_ids": [10**6, 10**6 + 1, 10**6 + 2, 7]}
    pd.send_decode("bad", prompt, greedy(3), kv)
    pd.run(timeout=10)
    leg = pd.d_legs["bad"]
    assert leg.finish_reason is FinishReason.ERROR and "bad remote_block_ids" in leg.error
    _assert_clean(pd)


@pytest.mark.parametrize("pd", ["push"], indirect=True)
@pytest.mark.parametrize("bad", [
    {"do_remote_prefill": True, "transfer_id": "t"},  # no remote_host/port
    {"do_remote_prefill": True, "transfer_id": "t", "remote_host": 5, "remote_port": 1},
    {"do_remote_prefill": True, "transfer_id": "t", "remote_host": "h", "remote_port": "x"},
    {"do_remote_prefill": True, "transfer_id": "t", "remote_host": "h", "remote_port": 0},
    {"do_remote_prefill": "yes"},
    "not a dict",
])
def test_malformed_kv_transfer_params_are_refused(pd, bad):
    from kvpush.errors import RequestError

    with pytest.raises(RequestError, match="kv_transfer_params"):
        pd.d.add_request("x", [5] * 20, greedy(3), bad)
    assert not pd.d.scheduler.requests
    _assert_clean(pd)


@pytest.mark.parametrize("pd", ["push"], indirect=True)
def test_registration_after_prefill_finished(pd, tiny_qwen3):
    """Side-channel messages delayed: prefill finishes first and holds its blocks until
    decode's registration arrives, then writes everything at once."""
    prompt = random_prompts([90], seed=12)[0]
    # long enough that prefill finishes first even on a loaded host (0.3 s was not)
    pd.faults.arm(message_delay_s=1.5)
    pd.submit("r", prompt, greedy(5))
    pd.run(until=lambda: pd.p_legs["r"].finished, timeout=10)
    assert pd.p.connector.holds.by_tid["r"].request_id is None  # finished, held
    # the Begin goes with the step's hand-off: the transfer thread takes both at once
    pd.run(until=lambda: pd.p.connector.worker.table.get("r") is not None, timeout=5)
    assert pd.p.connector.worker.table.get("r").reg is None  # and not registered yet
    pd.run(timeout=15)
    assert pd.d_legs["r"].tokens == single_outputs(tiny_qwen3, [prompt], 5)["r0"]
    assert pd.faults.count("message_delays") > 0
    _assert_clean(pd)


def test_push_sender_preempted_mid_prefill(tiny_qwen3):
    """Prefill runs out of blocks while sending: a preempted sender's blocks stay out of
    the pool until its WRITEs are done, and its KV is written again after recompute."""
    # slow WRITEs keep each finished sender's blocks out of the pool for a while, so the
    # next prompts run short of blocks while their own WRITEs are in flight
    faults = FaultPlan(transfer_delay_s=0.5)
    p = make_instance(tiny_qwen3, "prefill", "push", faults=faults, num_blocks=24,
                      max_model_len=256, max_num_batched_tokens=64)
    d = make_instance(tiny_qwen3, "decode", "push", faults=faults)
    drv = PDDriver(p, d)
    kept: list[bool] = []

    def spy(req, blocks):
        kept.append(p.connector.on_preempt(req, blocks))
        return kept[-1]

    p.scheduler.on_preempt = spy
    try:
        prompts = random_prompts([150, 160, 170], seed=13)
        ref = single_outputs(tiny_qwen3, prompts, 4)
        # registrations first, so every sender writes from its first chunk on
        for i, prompt in enumerate(prompts):
            drv.send_decode(f"r{i}", prompt, greedy(4))
        drv.run(until=lambda: len(p.connector.worker.table) == 3, timeout=10)
        for i, prompt in enumerate(prompts):
            drv.send_prefill(f"r{i}", prompt, greedy(4))
        drv.run(timeout=30)
        assert p.stats().num_preemptions > 0
        assert any(kept)  # a sender with WRITEs in flight kept its blocks out of the pool
        for i in range(3):
            assert drv.d_legs[f"r{i}"].tokens == ref[f"r{i}"]
        drv.settle()
    finally:
        drv.close()


@pytest.mark.parametrize("pd", [("push", {"lease": 30}), ("pull", {"lease": 30})],
                         indirect=True)
def test_router_abort_releases_prefill_blocks_at_once(pd):
    """Decode refused the request: the router's /kv/abort frees prefill's blocks now,
    not when the (here 30 s) lease runs out, and a late leg for it is refused."""
    pd.send_prefill("r", random_prompts([70])[0], greedy(3))
    pd._pull_waiting.clear()
    pd.run(until=lambda: pd.p_legs["r"].finished, timeout=10)
    assert pd.p.stats().num_free_blocks < pd.p.stats().num_total_blocks
    pd.p.inbox.put(AbortTransfer("r", "decode refused the request"))
    pd.settle(timeout=5)
    if pd.mode == "push":  # a push leg for the same transfer id arriving late
        pd.send_prefill("r", random_prompts([70])[0], greedy(3))
        deadline = time.monotonic() + 10  # the transfer thread's verdict, before a step
        while not pd.p_legs["r"].finished:
            assert time.monotonic() < deadline, "the late leg was not refused"
            pd._absorb(pd.p.process_inbox(block=True, timeout=0.05), pd.p_legs)
        leg = pd.p_legs["r"]
        assert leg.rejected and "already ended" in leg.error, leg
        pd.settle(timeout=5)


@pytest.mark.parametrize("pd", [("push", {"shuffle_free_blocks": 3}),
                                ("pull", {"shuffle_free_blocks": 3})], indirect=True)
def test_fragmented_kv_transfers_correctly(pd, tiny_qwen3):
    """Scattered block ids on both sides: one descriptor per layer per block, same output."""
    prompt = random_prompts([250], seed=12)[0]
    pd.submit("r", prompt, greedy(6))
    pd.run()
    assert pd.d_legs["r"].tokens == single_outputs(tiny_qwen3, [prompt], 6)["r0"]
    pd.settle()
    recs = (pd.p if pd.mode == "push" else pd.d).transfer_records
    assert len(recs) == 1  # one record per transfer, bytes and descriptors in it
    rec = recs[0]
    layers = pd.p.runner.kv_region.layout.num_layers
    assert rec.ok and rec.num_descriptors > 8 * layers  # 16 blocks, a few runs at most
