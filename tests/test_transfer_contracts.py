"""The contract between the step loop and the transfer thread (kv_transfer/commands.py)
and the hand-off around it: the step loop states at most four kinds of fact, the facts
of one turn (or one layer group) in one StepMessage; it hears two kinds of event, in
one TransferUpdate per pass of the transfer thread, and the engine's actions follow
from the outcome; the transfer thread's counters reach the step loop only in those
updates. Completions go out the moment a transfer is done (not at a poll); the stage
stamps (kv_transfer/timeline.py) and what `kvpush bench handoff` makes of them;
kv_transfer_params checked once where a request enters (FrontEnd), typed after; the
scheduler's block-ownership API the connector goes through."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import re
import time
import typing

import pytest

from contract_fakes import CHAIN, PROMPT_TOKENS, D, P, closed_ports, frame, step, worker
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
from kvpush.engine.front import FrontEnd
from kvpush.engine.inputs import AbortRequests, AddRequest
from kvpush.engine.llm_engine import LLMEngine
from kvpush.engine.outputs import FinishReason
from kvpush.kv_transfer import commands as c
from kvpush.kv_transfer.params import KVTransferParams
from kvpush.kv_transfer.record import TransferCounters
from kvpush.kv_transfer.timeline import MAX_TRACKED, HandoffTimeline
from kvpush.kv_transfer.transports.transport import TransferPostError, XferState
from kvpush.kv_transfer.wire import messages as m
from kvpush.sampling_params import SamplingParams
from pd_helpers import PDDriver, make_instance

BLOCKS = list(range(8))


# ---- the contract's shape ------------------------------------------------------------
def test_four_kinds_of_fact_two_kinds_of_event():
    assert typing.get_args(c.Fact) == (c.Begin, c.BlocksReady, c.Prefilled, c.End)
    assert typing.get_args(c.Event) == (c.Failing, c.Over)
    assert [f.name for f in dataclasses.fields(c.StepMessage)] == ["facts"]
    assert [f.name for f in dataclasses.fields(c.TransferUpdate)] == ["events", "counters"]
    assert {o.name for o in c.Outcome} == {"OK", "FAILED", "REJECTED", "NOT_NEEDED"}


def test_the_step_loop_reaches_the_transfer_thread_only_through_its_queues():
    """Nothing is shared but the queues: the step loop's side calls the worker's submit
    (and start/stop) only, and reads nothing of the transfer thread's."""
    from kvpush.kv_transfer.step_loop import connector, decode_side, holds, prefill_side

    src = inspect.getsource(connector)
    assert set(re.findall(r"\bself\.worker\.(\w+)", src)) <= {"submit", "start", "stop"}
    for mod in (decode_side, holds, prefill_side):
        assert "transfer_thread" not in inspect.getsource(mod), mod.__name__


def test_one_step_message_per_turn_and_per_layer_group(tiny_qwen3):
    """A push: each engine turn hands the transfer thread at most one StepMessage (the
    inbox's turn, the step's end) plus one per layer group closed mid-step (every group
    but the last, which goes with the step's end); each transfer's
    facts come in order: Begin, BlocksReady..., Prefilled (prefill) or Begin,
    BlocksReady (decode)."""
    p = make_instance(tiny_qwen3, "prefill", "push", max_num_batched_tokens=32,
                      layers_per_write=1)
    d = make_instance(tiny_qwen3, "decode", "push")
    drv = PDDriver(p, d)
    sent: dict[LLMEngine, list[c.StepMessage]] = {}
    for eng in (p, d):
        worker_ = eng.connector.worker
        msgs = sent[eng] = []
        real = worker_.submit
        worker_.submit = lambda msg, real=real, msgs=msgs: (msgs.append(msg), real(msg))[-1]
    layers = p.runner.kv_region.layout.num_layers
    groups = -(-layers // p.connector.side.groups.layers)
    assert groups >= 2
    try:
        drv.submit("r", random_prompts([100], seed=1)[0], greedy(3))
        deadline = time.monotonic() + 20
        while not drv.d_legs["r"].finished:  # PDDriver.pump, counting the messages
            assert time.monotonic() < deadline, drv.d_legs
            busy = False
            for eng, legs in ((p, drv.p_legs), (d, drv.d_legs)):
                n = len(sent[eng])
                outs = eng.process_inbox()
                assert len(sent[eng]) - n <= 1
                if eng.has_work():
                    busy, n = True, len(sent[eng])
                    outs += eng.step()
                    assert len(sent[eng]) - n <= groups
                drv._absorb(outs, legs)
            if not busy:
                time.sleep(0.001)  # the transfer threads' turn
        assert drv.d_legs["r"].finish_reason is FinishReason.LENGTH
        drv.settle()
    finally:
        drv.close()
    for eng, want in ((p, ["Begin", "BlocksReady", "Prefilled"]),
                      (d, ["Begin", "BlocksReady"])):
        assert all(isinstance(msg, c.StepMessage) and msg.facts for msg in sent[eng])
        kinds = [type(f).__name__ for msg in sent[eng] for f in msg.facts if f.tid == "r"]
        squeezed = [k for i, k in enumerate(kinds) if i == 0 or kinds[i - 1] != k]
        assert squeezed == want, kinds
    # prefill's mid-step groups: several BlocksReady, each in its own message
    assert sum(isinstance(f, c.BlocksReady) for msg in sent[p] for f in msg.facts) >= groups


def test_counters_travel_in_updates_as_copies_only_when_changed():
    w, _, _, updates, _ = worker("prefill")
    step(w, c.Begin("t", PROMPT_TOKENS, CHAIN))
    frame(w, m.Abort("t", "client gone"), D)  # counted: aborts_received
    [*_, last] = updates
    assert last.counters is not None and last.counters.aborts_received == 1
    w.ctx.counters.aborts_received += 5  # the thread's own: what was posted is a copy
    assert last.counters.aborts_received == 1
    n = len(updates)
    step(w, c.End("nothing", "gone"))  # nothing changed: no update at all
    assert len(updates) == n


def test_the_connector_keeps_the_counters_of_the_last_update(tiny_qwen3):
    """connector.counters is what the last update carried (an update without counters
    keeps them); stats() adds the step loop's gauges of what it holds."""
    d = make_instance(tiny_qwen3, "decode", "push")
    try:
        deadline = time.monotonic() + 10  # the thread's own first figures (then: none,
        while not d.connector.counters.side_channel_peers:  # nothing changes here)
            assert time.monotonic() < deadline
            d.process_inbox(block=True, timeout=0.1)
        d.inbox.put(c.TransferUpdate((), TransferCounters(transfers_ok=7, fences=2)))
        d.process_inbox()
        d.inbox.put(c.TransferUpdate(()))
        d.process_inbox()
        assert d.connector.counters.transfers_ok == 7
        s = d.connector.stats()
        assert (s.transfers_ok, s.fences, s.recvs_in_flight, s.blocks_fenced) == (7, 2, 0, 0)
        assert s is not d.connector.counters
    finally:
        d.shutdown()


# ---- the engine's actions follow from the outcome ------------------------------------
def _leg(eng: LLMEngine, tid: str, kv: dict, n_tokens: int = 40) -> str:
    rid = f"x-{tid}"
    eng.add_request(rid, random_prompts([n_tokens], seed=sum(map(ord, tid)))[0], greedy(3), kv)
    eng.step()  # decode: its blocks are allocated (a push leg: its prefill starts)
    return rid


def _update(eng: LLMEngine, *events: c.Event) -> dict:
    eng.inbox.put(c.TransferUpdate(events))
    return {o.request_id: o for o in eng.process_inbox()}


def test_decode_actions_follow_from_the_outcome(tiny_qwen3):
    """Decode: OK with token #1 emits it; FAILED fails the request (or recomputes it,
    by policy); REJECTED is the client's 400; Failing ends the request at once and its
    blocks stay fenced until Over. The prefill named never answers (its lease is long)."""
    port = closed_ports(1)[0]
    engines = [make_instance(tiny_qwen3, "decode", "push", lease=60.0, policy=policy)
               for policy in ("fail", "recompute")]
    d, re_d = engines
    vocab = d.config.model.vocab_size

    def kv(tid: str) -> dict:
        return {"do_remote_prefill": True, "transfer_id": tid, "remote_host": "127.0.0.1",
                "remote_port": port}

    try:
        rid = _leg(d, "ok", kv("ok"))
        out = _update(d, c.Over("ok", c.Outcome.OK, first=m.PushDone("ok", True, 5)))[rid]
        assert out.new_token_ids == [5] and not out.finished
        rid = _leg(d, "bad", kv("bad"))
        out = _update(d, c.Over("bad", c.Outcome.OK, first=m.PushDone("bad", True, vocab)))[rid]
        assert out.finish_reason is FinishReason.ERROR and "invalid first token" in \
            out.failure.message
        rid = _leg(d, "failed", kv("failed"))
        out = _update(d, c.Over("failed", c.Outcome.FAILED, "prefill said no"))[rid]
        assert out.finish_reason is FinishReason.ERROR and not out.failure.rejected
        assert "prefill said no" in out.failure.message
        rid = _leg(d, "rejected", kv("rejected"))
        out = _update(d, c.Over("rejected", c.Outcome.REJECTED, "not that prefill"))[rid]
        assert out.failure.rejected and out.failure.param == "kv_transfer_params"
        rid = _leg(d, "failing", kv("failing"))
        free = d.stats().num_free_blocks
        out = _update(d, c.Failing("failing", "lease expired"))[rid]
        assert out.finish_reason is FinishReason.ERROR and "lease expired" in \
            out.failure.message
        assert d.stats().num_free_blocks == free and d.connector.fenced_blocks == 3
        assert _update(d, c.Over("failing", c.Outcome.FAILED, "lease expired")) == {}
        assert d.connector.fenced_blocks == 0 and d.stats().num_free_blocks == free + 3

        rid = _leg(re_d, "again", kv("again"))
        assert _update(re_d, c.Over("again", c.Outcome.FAILED, "gone")) == {}
        outs = []
        for _ in range(50):  # computed here instead
            outs += re_d.step()
            if outs and outs[-1].finished:
                break
        assert outs[-1].finish_reason is FinishReason.LENGTH
        assert sum(len(o.new_token_ids) for o in outs) == 3
    finally:
        for eng in engines:
            eng.shutdown()


def test_prefill_actions_follow_from_the_outcome(tiny_qwen3):
    """Push prefill: NOT_NEEDED (decode holds the whole prompt) and REJECTED are 400s,
    FAILED aborts the leg with the reason; each leg's blocks go back."""
    p = make_instance(tiny_qwen3, "prefill", "push", lease=60.0, max_num_batched_tokens=16)
    try:
        free = p.stats().num_free_blocks
        cases = {"not_needed": (c.Outcome.NOT_NEEDED, None),
                 "rejected": (c.Outcome.REJECTED, "invalid registration"),
                 "failed": (c.Outcome.FAILED, "lease expired")}
        for tid, (outcome, why) in cases.items():
            rid = _leg(p, tid, {"do_remote_decode": True, "transfer_id": tid})
            out = _update(p, c.Over(tid, outcome, why))[rid]
            if outcome is c.Outcome.FAILED:
                assert out.finish_reason is FinishReason.ABORT and out.failure.message == why
            else:
                assert out.failure.rejected
                assert out.failure.code == ("prefill_not_needed"
                                            if outcome is c.Outcome.NOT_NEEDED else None)
        assert not p.scheduler.requests and p.stats().num_free_blocks == free
    finally:
        p.shutdown()


# ---- the worker: a completion goes out when the transfer is done, not at a poll --------
def _done_at_post(tr) -> None:
    real_post = tr.post

    def post_done(*a):  # over cma the copy happens inside the post
        h = real_post(*a)
        tr.states[h] = XferState.DONE
        return h

    tr.post = post_done


def _sending(w, tid: str = "t") -> None:
    """Push prefill: the leg begun, decode's registration, every block computed."""
    step(w, c.Begin(tid, PROMPT_TOKENS, CHAIN))
    frame(w, m.PushRegister(tid, "decode", D, BLOCKS, 0, PROMPT_TOKENS,
                            prompt_hashes=list(CHAIN)), D)
    step(w, c.BlocksReady(tid, 0, BLOCKS, range(1)))


def _prefilled(w, tid: str = "t") -> None:
    step(w, c.Prefilled(tid, m.PushDone(tid, ok=True, first_token=3)))


def test_write_done_inside_its_post_sends_push_done_at_prefilled():
    w, ch, tr, updates, _ = worker("prefill")
    _done_at_post(tr)
    _sending(w)
    _prefilled(w)  # no poll needed
    assert [(d.ok, d.first_token) for d in ch.of(m.PushDone)] == [(True, 3)]
    [over] = updates.events()
    assert isinstance(over, c.Over) and over.outcome is c.Outcome.OK and not len(w.table)


def test_pending_write_still_completes_at_the_poll():
    w, ch, tr, updates, _ = worker("prefill")
    _sending(w)
    _prefilled(w)
    assert ch.of(m.PushDone) == [] and updates.events() == []
    tr.states[1] = XferState.DONE
    w.poll()
    w.flush()
    assert [d.ok for d in ch.of(m.PushDone)] == [True]
    assert updates.kinds() == ["Over"]


def test_write_waits_for_its_ready_event_before_posting():
    """CUDA: the layer hook records an event instead of synchronizing the stream; the
    transfer thread waits on it, then posts."""
    w, _, tr, _, _ = worker("prefill")
    order: list[str] = []

    class Event:
        def synchronize(self) -> None:
            order.append(f"synchronized at {tr.posts} posts")

    step(w, c.Begin("t", PROMPT_TOKENS, CHAIN))
    frame(w, m.PushRegister("t", "decode", D, BLOCKS, 0, PROMPT_TOKENS,
                            prompt_hashes=list(CHAIN)), D)
    step(w, c.BlocksReady("t", 0, BLOCKS, range(1), Event()))
    assert order == ["synchronized at 0 posts"] and tr.posts == 1


def _reading(w, tid: str = "t") -> None:
    """Pull decode: the leg begun (prefill's lend named), its blocks allocated, and
    prefill's yes to the claim: the READ is posted."""
    step(w, c.Begin(tid, PROMPT_TOKENS, (), c.PeerRef(P, "prefill", tuple(BLOCKS))))
    step(w, c.BlocksReady(tid, 0, BLOCKS))
    [claim] = w.channel.of(m.PullClaim)
    frame(w, m.PullClaimed(tid, True, claim=claim.claim), P)


def test_read_done_inside_its_post_ends_at_once():
    w, ch, tr, updates, _ = worker("decode", "pull")
    _done_at_post(tr)
    _reading(w)
    assert ch.of(m.PullDone) == [m.PullDone("t", ok=True)]
    [over] = updates.events()
    assert isinstance(over, c.Over) and over.outcome is c.Outcome.OK and over.why is None
    assert (over.record.num_descriptors, over.record.num_bytes) == (1, 64)
    assert not len(w.table)


def test_a_read_that_cannot_be_posted_fails_the_transfer_on_both_sides():
    """PullDone(ok=False) to prefill (its lend can go), Over with the reason to the step
    loop, counted."""
    w, ch, tr, updates, _ = worker("decode", "pull")

    def refuse(*a):
        raise TransferPostError("refused")

    tr.post = refuse
    _reading(w)
    assert ch.of(m.PullDone) == [m.PullDone("t", ok=False)]
    assert [(e.tid, e.outcome, e.why) for e in updates.events()] == [
        ("t", c.Outcome.FAILED, "READ failed to post: refused")]
    assert updates.counters().transfers_failed == 1 and not len(w.table)


def test_pending_read_ends_at_the_poll():
    w, ch, tr, updates, _ = worker("decode", "pull")
    _reading(w)
    assert updates.events() == []
    tr.states[1] = XferState.FAILED
    w.poll()
    w.flush()
    assert ch.of(m.PullDone) == [m.PullDone("t", ok=False)]
    assert [(e.outcome, e.why) for e in updates.events()] == [(c.Outcome.FAILED, "READ failed")]


# ---- HandoffTimeline ------------------------------------------------------------------
def test_timeline_logs_one_line_per_transfer_in_time_order(caplog):
    tl = HandoffTimeline("prefill")
    tl.stamp("t", "p_first", 0.5)  # before the transfer began here: not kept
    tl.begin("t", "p_added")
    tl.stamp("t", "p_first", 2.0)
    tl.stamp("t", "p_added", 1.0)
    tl.stamp("t", "p_step", 1.5, first=True)
    tl.stamp("t", "p_step", 1.7, first=True)  # a later step keeps the first stamp
    with caplog.at_level(logging.DEBUG, "kvpush.kv_transfer.handoff"):
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


# ---- both instances stamp a real push and pull ------------------------------------------
@pytest.mark.parametrize("mode", ["push", "pull"])
def test_pd_transfer_logs_its_stages_on_both_sides(tiny_qwen3, mode, caplog):
    p = make_instance(tiny_qwen3, "prefill", mode)
    d = make_instance(tiny_qwen3, "decode", mode)
    drv = PDDriver(p, d)
    try:
        with caplog.at_level(logging.DEBUG, "kvpush.kv_transfer.handoff"):
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


# ---- kv_transfer_params: checked once, where the request enters -----------------------
def test_kv_params_are_parsed_once_where_the_request_enters(tiny_qwen3, monkeypatch):
    """The server checks a request's kv_transfer_params once (FrontEnd.kv_params, a 400
    or 403 there) and hands the typed object to FrontEnd.generate; the AddRequest the
    engine core gets carries that same object, and the core does not parse it again."""
    parsed = []
    real_parse = KVTransferParams.parse

    def parse(*a, **kw):
        parsed.append(a)
        return real_parse(*a, **kw)

    monkeypatch.setattr(KVTransferParams, "parse", parse)
    p = make_instance(tiny_qwen3, "prefill", "push", max_model_len=256)
    sent: list = []

    class Front(FrontEnd):
        def _send(self, cmd) -> None:
            sent.append(cmd)
            p.inbox.put(cmd)

        def _core_problem(self) -> str | None:
            return None

    front = Front(p.config, p.tokenizer, p.snapshot())

    async def main() -> None:
        kv = front.kv_params({"do_remote_decode": True, "transfer_id": "t1"})
        assert kv == KVTransferParams(do_remote_decode=True, transfer_id="t1")
        # a prefill leg ends with token #1 whatever the client asked: its context check
        # counts one token, so 200 + 200 > 256 is no reason to refuse it
        stream = front.generate("r", [5] * 200, SamplingParams(max_tokens=200), kv)
        first = asyncio.ensure_future(anext(stream))
        for _ in range(100):
            if sent:
                break
            await asyncio.sleep(0)
        [add] = sent
        assert isinstance(add, AddRequest) and add.kv_transfer_params is kv
        assert add.params.max_tokens == 1 and add.params.logprobs
        p.process_inbox()  # the core admits it as it is
        assert p.connector.holds.by_request[add.request_id] == "t1"
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        await stream.aclose()  # the client left: the request is aborted
        assert isinstance(sent[-1], AbortRequests)

    try:
        asyncio.run(main())
        p.process_inbox()
        assert len(parsed) == 1 and not p.scheduler.requests
    finally:
        p.shutdown()


def test_a_push_prefill_hashes_its_prompt_once(tiny_qwen3, monkeypatch):
    """The hash chain a push prefill states (Begin) and the scheduler's prefix-cache
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
        req = p.add_request("r", prompt, greedy(1), {"do_remote_decode": True,
                                                     "transfer_id": "t"})
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
    from kvpush.kv_transfer.step_loop import connector, decode_side, holds, prefill_side

    for mod in (connector, decode_side, holds, prefill_side):
        src = inspect.getsource(mod)
        assert not re.search(r"\.pool\b", src), mod.__name__
        assert not re.search(r"\breq\.block_ids\s*=[^=]", src), mod.__name__
