"""The transfer thread's wait on the side channel: never a zero wait for a timer that
is not yet due (a spin through recv(0) until it is)."""

from __future__ import annotations

from worker_helpers import make


def test_a_timer_due_in_under_a_millisecond_is_waited_for_not_spun_on():
    h = make("prefill")
    due = h.worker.table.timers.next_due()  # the heartbeat
    h.clock.now = due - 0.0003
    h.run_once()
    assert h.channel.waits_ms[-1] == 1  # rounded up, not down to 0
    h.clock.now = due - 0.0042
    h.run_once()
    assert h.channel.waits_ms[-1] == 5
    h.clock.now = due
    h.run_once()
    assert h.channel.waits_ms[-1] == 0  # due now: no wait
