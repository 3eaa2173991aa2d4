"""The router's shutdown is bounded: a background task that ignores its cancellation is
named in the log and left behind, and the shutdown goes on."""

from __future__ import annotations

import asyncio
import logging

from kvpush.router.stopping import cancel_and_wait


async def _stubborn(started: asyncio.Event, release: asyncio.Event) -> None:
    started.set()
    while not release.is_set():
        try:
            await release.wait()
        except asyncio.CancelledError:  # a cancellation lost (what the bound is for)
            continue


def test_a_task_that_ignores_its_cancellation_is_named_and_left(caplog):
    async def main() -> tuple[bool, bool, bool]:
        started, release = asyncio.Event(), asyncio.Event()
        stubborn = asyncio.create_task(_stubborn(started, release), name="stubborn-one")
        polite = asyncio.create_task(asyncio.sleep(60), name="polite-one")
        await started.wait()
        done = await cancel_and_wait([stubborn, polite, None], "test tasks", timeout=0.2)
        left_running = not stubborn.done()
        release.set()
        await stubborn
        return done, left_running, polite.cancelled()

    with caplog.at_level(logging.WARNING, logger="kvpush.router.stopping"):
        done, left_running, polite_cancelled = asyncio.run(main())
    assert done is False and left_running and polite_cancelled
    msg = " ".join(r.getMessage() for r in caplog.records)
    assert "test tasks: 1 task(s) did not stop" in msg and "stubborn-one" in msg
    assert "polite-one" not in msg


def test_tasks_that_stop_return_true_without_a_warning(caplog):
    async def main() -> bool:
        tasks = [asyncio.create_task(asyncio.sleep(60)) for _ in range(3)]
        await asyncio.sleep(0)
        return await cancel_and_wait(tasks, "sleepers", timeout=5)

    with caplog.at_level(logging.WARNING, logger="kvpush.router.stopping"):
        assert asyncio.run(main()) is True
    assert not caplog.records
    assert asyncio.run(cancel_and_wait([], "nothing")) is True
