"""Issue 40, finding 6: a dying transfer thread tells its ready peers first. Prefill's
thread dies mid-push: decode's legs end at once with the reason, not at their lease
(10 s here; decode's client used to wait its whole lease)."""

from __future__ import annotations

import time

import pytest

from engine_helpers import greedy, random_prompts
from kvpush_testing.faults import FaultPlan
from pd_helpers import PDDriver, make_instance, writes_posted
from test_transfer_thread_death import CRASH, all_free, assert_failed, kill_transfer_thread

pytestmark = pytest.mark.timeout(120)
LEASE = 10.0


def test_decode_hears_of_prefills_death_at_once(tiny_qwen3):
    pf = FaultPlan()
    p = make_instance(tiny_qwen3, "prefill", "push", faults=pf, lease=LEASE,
                      max_num_batched_tokens=16)
    d = make_instance(tiny_qwen3, "decode", "push", lease=LEASE, fence_timeout=LEASE)
    drv = PDDriver(p, d)
    try:
        pf.arm(transfer_delay_s=60.0)  # no WRITE lands before the death
        drv.submit_registered("r", random_prompts([96], seed=2)[0], greedy(3))
        drv.run(until=lambda: writes_posted(p, "r", 2), timeout=20)
        t0 = time.monotonic()
        kill_transfer_thread(p)
        drv.run(until=lambda: drv.d_legs["r"].finished, timeout=LEASE / 2)
        assert time.monotonic() - t0 < LEASE / 2  # not at its lease
        assert_failed(drv.d_legs["r"], "aborted by prefill", "transfer thread died", CRASH)
        drv.run(until=lambda: all_free(d) and not d.connector.fenced_blocks, timeout=10)
        drv.run(until=lambda: all_free(p), timeout=10)
    finally:
        drv.close()
