"""Races at the block-reuse edge, with --kv-digest on (issue 63, point 5).

A prefill and a decode engine in this process over the in-process transport (real
transfer threads and side channel; no root, no namespaces), prefill with a pool of 24
blocks and decode with 10 (one request of the longest prompt at a time, so a freed
block is the next request's), leases of 1 s, and faults from one seeded FaultPlan:
every WRITE and READ completes 0-150 ms after its post (they land, and their
completions arrive, out of the order they were posted in), side-channel messages are
held 20 ms. Requests come in waves of 20 at once, of four kinds: whole requests;
prefill legs with no decode leg (prefill-only churn: their blocks wait for a lease);
decode legs aborted while their KV moves; prefill legs aborted mid-transfer. Prompts
repeat, so decode's prefix cache trims some transfers. With decode's fence taken out
(a registered push's blocks freed at its abort) this test fails on a digest mismatch
within a few hundred requests.

Shown, over at least 1,000 requests per mode: no digest mismatch; every request that
completes has exactly the greedy tokens of one engine alone; every failure says why in
words from a known list; after each wave every block of both pools is free and no
transfer is left; then one byte changed in flight is caught, so the check was live.
Then transport faults: one post in 16 fails (push: prefill's WRITEs;
pull: decode's READs) under 32 concurrent streams, with either load-failure policy:
under recompute every request completes with the right tokens, under fail each one
completes or fails clearly; every free-block count returns.

Run time (2-vCPU Xeon, load 9-12 from other work): 1.5 min per mode for the races,
under a second per transport case (plus model set-up); every wait is bounded (a wave:
60 s, the test: 10 min).
"""

from __future__ import annotations

import random
import re
from collections import Counter

import pytest

from engine_helpers import greedy, make_engine, random_prompts, run_to_completion
from kvpush.engine.outputs import FinishReason
from kvpush_testing.faults import FaultPlan
from pd_helpers import PDDriver, make_instance

BLOCK = 16
MAX_TOKENS = 4
#: decode's pool in the races: one request of the longest prompt (8 blocks and its
#: tokens) at a time, so a freed block is the next request's
DECODE_BLOCKS = 10
#: failures a request of this harness may end with, each with its reason
CLEAR = [re.compile(p) for p in (
    r"KV transfer \S+ from prefill failed: aborted by prefill",
    r"KV transfer \S+ from prefill failed: prefill request aborted",
    r"KV transfer \S+ from prefill failed: prefill ended the transfer",
    r"KV transfer \S+ from prefill failed: .*lease expired",
    r"KV transfer \S+ from prefill failed: .*(WRITE|READ) failed to post",
    r"KV transfer \S+ from prefill failed: .*prefill refused the READ",
    r"KV transfer \S+ from prefill failed: prefill's lend of this KV ended .* too late",
)]
KINDS = ("whole",) * 7 + ("churn", "abort_decode", "abort_prefill")


def _pd(model, mode: str, faults: FaultPlan, decode_blocks: int = 24, **kw) -> PDDriver:
    kw = {"lease": 1.0, "heartbeat": 0.05, "kv_digest": True, "num_blocks": 24,
          "max_model_len": 160, **kw}
    drv = PDDriver(make_instance(model, "prefill", mode, faults=faults, **kw),
                   make_instance(model, "decode", mode, faults=faults,
                                 **{**kw, "num_blocks": decode_blocks}))
    drv.faults = faults
    return drv


def _reference(model, prompts: list[list[int]], n: int) -> list[list[int]]:
    out = run_to_completion(make_engine(model), {str(i): p for i, p in enumerate(prompts)},
                            greedy(n))
    return [out[str(i)] for i in range(len(prompts))]


def _clear(error: str | None) -> bool:
    return bool(error) and any(p.search(error) for p in CLEAR)


def _settled(drv: PDDriver) -> None:
    drv.settle(timeout=30)  # every block of both pools free, no transfer in a table
    for eng in (drv.p, drv.d):
        s = eng.stats()
        assert s.num_free_blocks == s.num_total_blocks, eng.connector.role


def _wave(drv: PDDriver, rng: random.Random, prompts, ref, start: int, size: int,
          seen: Counter) -> None:
    """``size`` requests of random kinds at once; checks each one's end."""
    kinds: dict[str, str] = {}
    which: dict[str, int] = {}
    for n in range(start, start + size):
        rid, i = f"r{n}", rng.randrange(len(prompts))
        kinds[rid], which[rid] = rng.choice(KINDS), i
        if kinds[rid] == "churn":  # a prefill leg only: nobody registers or reads
            drv.send_prefill(rid, prompts[i], greedy(MAX_TOKENS))
        else:
            drv.submit(rid, prompts[i], greedy(MAX_TOKENS), decode_first=rng.random() < 0.5)
    aborts = {rid: rng.randrange(1, 12) for rid, k in kinds.items() if k.startswith("abort")}
    pumps = 0
    while aborts:  # aborts a few pumps in: mid-prefill, mid-transfer or mid-decode
        drv.pump()
        pumps += 1
        for rid, at in list(aborts.items()):
            if pumps < at:
                continue
            del aborts[rid]
            eng, req = ((drv.d, f"d-{rid}") if kinds[rid] == "abort_decode"
                        else (drv.p, f"p-{rid}"))
            if eng.abort_request(req) is not None:
                legs = drv.d_legs if eng is drv.d else drv.p_legs
                legs[rid].finish_reason = FinishReason.ABORT
                seen[f"{kinds[rid]}: aborted"] += 1
    drv.run(timeout=60)
    for rid, kind in kinds.items():
        leg = drv.d_legs.get(rid)
        if kind == "churn" or leg is None:  # (a pull leg aborted on prefill has none)
            seen[f"{kind}: no decode leg"] += 1
            continue
        if leg.finish_reason is FinishReason.LENGTH:
            assert leg.tokens == ref[which[rid]], (rid, kind, leg)
            seen[f"{kind}: ok"] += 1
        elif leg.finish_reason is FinishReason.ABORT:
            assert kind.startswith("abort"), (rid, kind, leg)
        else:
            assert leg.finish_reason is FinishReason.ERROR and _clear(leg.error), (
                rid, kind, leg)
            assert "digest" not in leg.error
            seen[f"{kind}: failed: {leg.error.split(': ', 1)[1][:40]}"] += 1
    _settled(drv)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["push", "pull"])
def test_a_thousand_racing_requests_no_mismatch_no_leak(tiny_qwen3, mode, note):
    prompts = random_prompts([5, 16, 17, 31, 40, 48, 63, 64, 70, 90, 100, 120] * 2, seed=63)
    prompts += [p[:k] for p, k in zip(prompts[:8], (16, 32, 20, 33, 48, 8, 40, 60))]
    ref = _reference(tiny_qwen3, prompts, MAX_TOKENS)
    faults = FaultPlan(transfer_jitter_s=0.15, message_delay_s=0.02, seed=63)
    drv = _pd(tiny_qwen3, mode, faults, decode_blocks=DECODE_BLOCKS)
    rng, seen, total, wave = random.Random(63), Counter(), 1000, 20
    try:
        for start in range(0, total, wave):
            _wave(drv, rng, prompts, ref, start, wave, seen)
        counters = drv.d.connector.counters
        assert counters.digest_mismatches == 0
        ok = sum(v for k, v in seen.items() if k.endswith(": ok"))
        assert ok >= total // 2, seen
        assert counters.transfers_ok >= ok // 2  # most went through a checked transfer
        assert faults.count("transfer_delays") >= total // 2
        faults.arm(corrupt_transfers=1)  # the check is live here: one byte is caught
        drv.submit("corrupt", random_prompts([100], seed=999)[0], greedy(MAX_TOKENS))
        drv.run(timeout=60)
        assert "KV digest mismatch" in drv.d_legs["corrupt"].error
        assert faults.count("corruptions") == 1
        _settled(drv)
        assert drv.d.connector.counters.digest_mismatches == 1
        note(mode=mode, requests=total, digests_checked=counters.transfers_ok,
             mismatches=counters.digest_mismatches, outcomes=dict(sorted(seen.items())))
    finally:
        drv.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("policy", ["recompute", "fail"])
@pytest.mark.parametrize("mode", ["push", "pull"])
def test_one_post_in_16_fails_under_32_streams(tiny_qwen3, mode, policy, note):
    prompts = random_prompts([20, 33, 47, 64, 80, 96, 110, 127], seed=16)
    ref = _reference(tiny_qwen3, prompts, 8)
    faults = FaultPlan(fail_post_every=16, transfer_jitter_s=0.005, seed=16)
    drv = _pd(tiny_qwen3, mode, faults, policy=policy, num_blocks=64)
    outcomes: Counter = Counter()
    try:
        for wave in range(4):
            for n in range(32):
                drv.submit(f"w{wave}-{n}", prompts[n % len(prompts)], greedy(8))
            drv.run(timeout=120)
            for n in range(32):
                leg = drv.d_legs[f"w{wave}-{n}"]
                if leg.finish_reason is FinishReason.LENGTH:
                    assert leg.tokens == ref[n % len(prompts)]
                    outcomes["ok"] += 1
                else:
                    assert policy == "fail", leg  # recompute: every one completes
                    assert leg.finish_reason is FinishReason.ERROR and _clear(leg.error), leg
                    assert "failed to post" in leg.error
                    outcomes["failed clearly"] += 1
            _settled(drv)
        assert faults.count("post_failures") >= 4, faults.injected
        if policy == "fail":
            assert outcomes["failed clearly"] >= 1
        assert drv.d.connector.counters.digest_mismatches == 0
        note(mode=mode, policy=policy, posts_failed=faults.count("post_failures"),
             outcomes=dict(outcomes))
    finally:
        drv.close()
