"""The push/pull hand-off's contracts: its stage stamps (kv_transfer/timeline.py) and
what `kvpush bench handoff` makes of them, completions that go out the moment a transfer
is done, the transfer thread as the transport's one user (READs too), the typed
kv_transfer_params, and the scheduler's block-ownership API the connector goes
through."""

from __future__ import annotations

import logging

import pytest

from engine_helpers import greedy, random_prompts
from kvpush.bench.handoff import (
    PULL_STAGES,
    PUSH_STAGES,
    markdown,
    parse_log_lines,
    rotation,
    timeline,
)
from kvpush.bench.machine import cpu_flags
from kvpush.kv_transfer import commands as c
from kvpush.kv_transfer.timeline import MAX_TRACKED, HandoffTimeline
from kvpush.kv_transfer.transports.transport import TransferPostError, XferState
from kvpush.kv_transfer.wire import messages as m
from pd_helpers import PDDriver, make_instance
from test_worker_fences import BLOCKS, P, kinds, prefilled, sending, worker


# ---- HandoffTimeline ------------------------------------------------------------------
def test_timeline_logs_one_line_per_transfer_in_time_order(caplog):
    tl = HandoffTimeline("prefill")
    tl.stamp("t", "p_first", 0.5)  # before the transfer began here: not kept
    tl.begin("t", "p_added")
    tl.stamp("t", "p_first", 2.0)
    tl.stamp("t", "p_added", 1.0)
    tl.stamp("t", "p_step", 1.5, first=True)
    tl.stamp("t", "p_step", 1.7, first=True)  # a later step keeps the first stamp
    with caplog.at_level(logging.INFO, "kvpush.kv_transfer.handoff"):
        stamps = tl.emit("t")
        assert tl.emit("t") is None  # forgotten once logged
    assert stamps == {"p_added": 1.0, "p_step": 1.5, "p_first": 2.0}
    tl.stamp("t", "p_done_sent")  # after the end: no new line is opened
    assert not tl._stamps
    [line] = [r.getMessage() for r in caplog.records]
    assert line == ("handoff transfer=t role=prefill t_p_added=1.000000 t_p_step=1.500000 "
                    "t_p_first=2.000000")


def test_timeline_decode_line_waits_for_token1_and_is_bounded():
    tl = HandoffTimeline("decode")
    tl.begin("t", "d_added")
    tl.await_first("r", "t")
    tl.first_token("other")  # not a transfer's request: nothing happens
    assert "t" in tl._stamps
    tl.first_token("r")
    assert "t" not in tl._stamps and not tl._first
    tl.await_first("r2", "t2")
    tl.begin("t2", "d_added")
    tl.forget_request("r2")  # ended without a token #1: dropped, not logged later
    assert not tl._stamps and not tl._first
    for i in range(MAX_TRACKED + 10):
        tl.begin(f"x{i}", "d_added")
    assert len(tl._stamps) == MAX_TRACKED and "x0" not in tl._stamps


# ---- the worker: a completion goes out when the transfer is done, not at a poll --------
def test_write_done_inside_its_post_sends_push_done_at_finalize():
    w, ch, tr, events = worker("prefill")
    real_post = tr.post

    def post_done(*a):  # over cma the copy happens inside the post
        h = real_post(*a)
        tr.states[h] = XferState.DONE
        return h

    tr.post = post_done
    sending(w, "t")
    assert not w.handles  # released at once
    prefilled(w, "t")
    assert [d.ok for d in ch.of(m.PushDone)] == [True]  # no inflight.poll() needed
    assert kinds(events) == ["WritesDone"]


def test_pending_write_still_completes_at_the_poll():
    w, ch, tr, _ = worker("prefill")
    sending(w, "t")
    prefilled(w, "t")
    assert ch.of(m.PushDone) == []
    tr.states[1] = XferState.DONE
    w.inflight.poll()
    assert [d.ok for d in ch.of(m.PushDone)] == [True]


def reading(w, tid: str) -> None:
    """Pull decode: receive ``tid`` added, its blocks allocated (BLOCKS), and prefill's
    answer to the claim: the READ is posted."""
    w.handle(c.ReceiveAdded(tid, P, "prefill", BLOCKS[1]))
    w.handle(c.BlocksAllocated(tid, local_blocks=BLOCKS[0], remote_blocks=BLOCKS[1]))
    w.receive(m.encode(m.PullClaimed(tid, True, claim=w.receives.recvs[tid].claim)), P)


def test_read_done_inside_its_post_ends_at_once():
    w, ch, tr, events = worker("decode", "pull")
    real_post = tr.post

    def post_done(*a):
        h = real_post(*a)
        tr.states[h] = XferState.DONE
        return h

    tr.post = post_done
    reading(w, "t")
    assert ch.of(m.PullDone) == [m.PullDone("t", ok=True)]
    [done] = events
    assert isinstance(done, c.ReceiveOver) and done.tid == "t" and done.ok
    assert done.why is None and not w.reads and not w.leases
    assert (done.num_descriptors, done.num_bytes) == (1, 64)


def test_read_posted_by_the_transfer_thread_reports_its_failure():
    """A READ that cannot be posted (or reaches no ready peer) fails the transfer on
    both sides: PullDone(ok=False) to prefill, ReceiveOver with the reason to the step
    loop."""
    w, ch, tr, events = worker("decode", "pull")

    def refuse(*a):
        raise TransferPostError("refused")

    tr.post = refuse
    reading(w, "u")
    assert ch.of(m.PullDone) == [m.PullDone("u", ok=False)]
    assert [(e.tid, e.ok, e.why) for e in events] == [
        ("u", False, "READ failed to post: refused")]
    from kvpush.kv_transfer.transfer_thread.inflight import PostRead

    w.inflight.post_read(PostRead("t", "10.0.0.9:1", *BLOCKS))  # no such peer (any more)
    assert w.peers["10.0.0.9:1"].queued == [m.PullDone("t", ok=False)]  # after a handshake
    assert w.counters["transfers_failed"] == 2 and not w.reads


def test_pending_read_ends_at_the_poll():
    w, ch, tr, events = worker("decode", "pull")
    reading(w, "t")
    assert w.reads and events == []
    tr.states[1] = XferState.FAILED
    w.inflight.poll()
    assert ch.of(m.PullDone) == [m.PullDone("t", ok=False)]
    assert [(e.ok, e.why) for e in events] == [(False, "READ failed")]


# ---- both instances stamp a real push and pull ------------------------------------------
@pytest.mark.parametrize("mode", ["push", "pull"])
def test_pd_transfer_logs_its_stages_on_both_sides(tiny_qwen3, mode, caplog):
    p = make_instance(tiny_qwen3, "prefill", mode)
    d = make_instance(tiny_qwen3, "decode", mode)
    drv = PDDriver(p, d)
    try:
        with caplog.at_level(logging.INFO, "kvpush.kv_transfer.handoff"):
            drv.submit("r", random_prompts([40], seed=3)[0], greedy(3))
            drv.run()
            drv.settle()
    finally:
        drv.close()
    lines = parse_log_lines([r.getMessage() for r in caplog.records], "handoff ")
    assert len(lines) == 1
    [fields] = lines.values()
    stamps = {k[2:]: float(v) for k, v in fields.items() if k.startswith("t_")}
    want = {"p_added", "p_step", "p_first", "d_added", "d_first"} | (
        {"p_reg", "p_last_post", "p_done_sent", "d_registered", "d_done"} if mode == "push"
        else {"d_read_post", "d_read_done"})
    assert want <= set(stamps)
    assert stamps["p_added"] <= stamps["p_step"] <= stamps["p_first"]
    assert stamps["d_added"] <= stamps["d_first"]
    if mode == "push":
        assert stamps["p_first"] <= stamps["p_done_sent"] <= stamps["d_done"]
        assert stamps["d_done"] <= stamps["d_first"]
    else:
        assert stamps["p_first"] <= stamps["d_read_post"] <= stamps["d_read_done"]
        assert stamps["d_read_done"] <= stamps["d_first"]


# ---- what the benchmark makes of the logs -------------------------------------------------
def test_rotation_puts_each_mode_first_in_turn():
    modes = ["colocated", "push", "pull"]
    assert [rotation(modes, i)[0] for i in range(4)] == ["colocated", "push", "pull",
                                                         "colocated"]
    assert sorted(rotation(modes, 1)) == sorted(modes)


def test_timeline_joins_router_and_instance_lines_by_transfer(tmp_path):
    (tmp_path / "router.log").write_text(
        "x INFO kvpush.router.requests: request r1 completion stream mode=push "
        "transfer=T1 t_r_in=10.000 t_r_sent=10.001 t_r_first=10.020\n"
        "x INFO kvpush.router.requests: request r2 completion stream mode=push "
        "transfer=T2 t_r_in=20.000 t_r_sent=20.001 t_r_first=20.030\n")
    (tmp_path / "prefill-0.log").write_text(
        "x INFO kvpush.kv_transfer.handoff: handoff transfer=T1 role=prefill "
        "t_p_added=10.003 t_p_first=10.010 t_p_done_sent=10.012\n"
        "x INFO kvpush.kv_transfer.handoff: handoff transfer=T2 role=prefill "
        "t_p_added=20.003 t_p_first=20.010 t_p_done_sent=20.014\n")
    (tmp_path / "decode-0.log").write_text(
        "x INFO kvpush.kv_transfer.handoff: handoff transfer=T1 role=decode "
        "t_d_done=10.013 t_d_first=10.014\n")
    rows = {r["stage"]: r for r in timeline(tmp_path, "push")}
    assert rows["total: request in -> first byte at router"]["median_ms"] == pytest.approx(25)
    p_done = rows["P: token #1 -> completion sent (last WRITEs done)"]
    assert p_done["median_ms"] == pytest.approx(3) and p_done["n"] == 2
    d_out = rows["D: completion received -> token #1 out"]
    assert d_out["median_ms"] == pytest.approx(1) and d_out["n"] == 1
    assert {label for label, *_ in PUSH_STAGES} >= set(rows)
    assert timeline(tmp_path, "pull")[0]["stage"] == PULL_STAGES[0][0]


def test_markdown_reports_push_adds_and_pull_over_push():
    def cell(ms):
        return {"median_ms": ms, "p90_ms": ms + 1, "min_ms": ms - 1, "n": 3}

    summary = {"config": {"requests": 3}, "date": "d", "cpu_flags": "f",
               "first_chunk": {"8": {"colocated": cell(10.0), "push": cell(11.5),
                                     "pull": cell(23.0)}},
               "timeline": {"push": [{"stage": "s", "median_ms": 0.5, "n": 3}]}}
    text = markdown(summary)
    assert "| 8 tokens | 10.0 (11.0) ms | 11.5 (12.5) ms | 23.0 (24.0) ms | +1.5 ms | 2.00x |" \
        in text
    assert "| s | 0.50 | 3 |" in text


def test_cpu_flags_names_model_and_vector_extensions():
    info = "model name\t: Some CPU\nflags\t\t: fpu sse avx2 avx512f avx512_bf16\n"
    text = cpu_flags(info)
    assert text.startswith("Some CPU (") and text.endswith("avx2 avx512f avx512_bf16")
    assert cpu_flags("model name : Old\nflags : sse sse2\n").endswith("no AVX2")



def test_write_waits_for_its_ready_event_before_posting():
    """CUDA: the layer hook records an event instead of synchronizing the stream; the
    transfer thread waits on it, then posts."""
    w, _, tr, _ = worker("prefill")
    order: list[str] = []

    class Event:
        def synchronize(self) -> None:
            order.append(f"synchronized at {tr.posts} posts")

    sending(w, "t", computed=False)
    w.handle(c.BlocksComputed("t", 0, BLOCKS[0], BLOCKS[2], Event()))
    assert order == ["synchronized at 0 posts"] and tr.posts == 1


# ---- kv_transfer_params: checked once, typed ------------------------------------------------
def test_kv_params_are_parsed_once_into_a_typed_object(tiny_qwen3):
    from kvpush.kv_transfer.step_loop.state import KVTransferParams
    from kvpush.sampling_params import SamplingParams

    p = make_instance(tiny_qwen3, "prefill", "push", max_model_len=256)
    try:
        raw = {"do_remote_decode": True, "transfer_id": "t1"}
        kv = p.validate([5] * 200, SamplingParams(max_tokens=200), raw)
        assert kv == KVTransferParams(do_remote_decode=True, transfer_id="t1")
        assert p.kv_params(kv) is kv  # typed params are not parsed again
        # a prefill leg ends with token #1 whatever the client asked: its context check
        # counts one token, so 200 + 200 > 256 is no reason to refuse it
        req = p.add_request("r", [5] * 200, SamplingParams(max_tokens=200), kv)
        assert req.params.max_tokens == 1 and req.params.logprobs
        assert p.connector.by_request["r"] == "t1"
    finally:
        p.shutdown()


def test_a_push_prefill_hashes_its_prompt_once(tiny_qwen3, monkeypatch):
    """The hash chain a push prefill states (PushAdded) and the scheduler's prefix-cache
    keys are one computation: each block of the prompt is hashed once."""
    from kvpush.kv_cache import block_pool
    from kvpush.scheduler import scheduler as sched

    calls = []
    real = block_pool.hash_block_tokens

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(block_pool, "hash_block_tokens", counted)
    monkeypatch.setattr(sched, "hash_block_tokens", counted)
    p = make_instance(tiny_qwen3, "prefill", "push")
    try:
        prompt = random_prompts([100], seed=2)[0]  # 6 full blocks of 16 and a partial one
        req = p.add_request("r", prompt, greedy(1),
                            p.kv_params({"do_remote_decode": True, "transfer_id": "t"}))
        p.step()  # the scheduler admits it: its prefix lookup needs the hashes
        assert len(req.block_hashes) == 6 and len(calls) == 7
        assert req.block_hashes == block_pool.hash_prompt_chain(prompt, 16)[:6]
        p.abort_request("r")
    finally:
        p.shutdown()


# ---- block ownership: the connector goes through the scheduler ---------------------------
def test_scheduler_hands_blocks_over_and_takes_them_back(tiny_qwen3):
    from engine_helpers import make_engine

    eng = make_engine(tiny_qwen3, num_blocks=80)
    free0 = eng.scheduler.pool.num_free
    req = eng.add_request("r", random_prompts([40], seed=1)[0], greedy(2))
    eng.step()
    assert len(req.block_ids) == 3  # 40 tokens of 16-token blocks
    blocks = eng.scheduler.detach_blocks(req)
    assert req.block_ids == [] and len(blocks) == 3
    assert eng.scheduler.pool.num_free == free0 - 3  # the caller holds them
    eng.scheduler.release_blocks(blocks)
    assert eng.scheduler.pool.num_free == free0


def test_connector_never_frees_blocks_or_edits_a_request_s_block_list():
    """Every block the connector holds comes and goes through the scheduler's API
    (detach_blocks, finish(keep_blocks=True), on_preempt, release_blocks)."""
    import inspect
    import re

    from kvpush.kv_transfer.step_loop import connector, decode_side, prefill_side

    for mod in (connector, decode_side, prefill_side):
        src = inspect.getsource(mod)
        assert not re.search(r"\.pool\b", src), mod.__name__
        assert not re.search(r"\breq\.block_ids\s*=[^=]", src), mod.__name__
