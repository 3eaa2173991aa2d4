"""The router's health checks: one check that only times out keeps a busy instance in
rotation (logged); a second in a row, or a refused connection, takes it out."""

from __future__ import annotations

import asyncio

import httpx

from kvpush.discovery.instance_spec import parse_instance
from kvpush.router.config import RouterConfig
from kvpush.router.pool import Pool

INFO = {"engine_id": "decode-x", "role": "decode", "kv_transfer": "push",
        "side_channel_host": "127.0.0.1", "side_channel_port": 5600}


def _run(behaviour: list[str]) -> list[bool]:
    """Health after each check, the instance answering per ``behaviour`` (ok, timeout,
    refused) in turn."""
    cfg = RouterConfig(mode="push", prefill=(parse_instance("127.0.0.1:9000"),),
                       decode=(parse_instance("127.0.0.1:9100"),))
    pool = Pool(cfg)
    d = pool.by_role["decode"][0]
    step = {"i": 0}

    def handler(request: httpx.Request) -> httpx.Response:
        what = behaviour[step["i"]]
        if what == "timeout":
            raise httpx.ReadTimeout("slow", request=request)
        if what == "refused":
            raise httpx.ConnectError("refused", request=request)
        if request.url.path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        return httpx.Response(200, json=INFO)

    async def main() -> list[bool]:
        out = []
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            for i in range(len(behaviour)):
                step["i"] = i
                await pool.check(client, d)
                out.append(d.healthy)
        return out

    return asyncio.run(main())


def test_one_timed_out_check_is_tolerated_two_are_not():
    assert _run(["ok", "timeout", "ok", "timeout", "timeout", "ok"]) == \
        [True, True, True, True, False, True]


def test_refused_connection_takes_it_out_at_once():
    assert _run(["ok", "refused", "ok"]) == [True, False, True]


def test_an_instance_out_of_rotation_stays_out_on_a_timeout():
    assert _run(["refused", "timeout", "ok"]) == [False, False, True]
