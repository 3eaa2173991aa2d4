"""The router's health checks do not cascade: checks that only time out keep a busy
instance in rotation (logged) up to --slow-checks-tolerated in a row, and always when it
is the last of its role; a refused connection takes it out at once, unless its engine
core link is up (the HTTP probe does not judge it then)."""

from __future__ import annotations

import asyncio

import httpx

from kvpush.discovery.instance_spec import parse_instance
from kvpush.engine.outputs import EngineStats
from kvpush.router.config import RouterConfig
from kvpush.router.pool import Pool
from stand_in import push_kv_info

INFO = push_kv_info("decode", "decode-x", 5600, request_plane="127.0.0.1:5601")


def _run(behaviour: list[str], tolerated: int = 1, alone: bool = False,
         link_up: bool = False) -> list[bool]:
    """Health after each check, the instance answering per ``behaviour`` (ok, timeout,
    refused) in turn; another decode instance is healthy unless ``alone``."""
    decodes = ("127.0.0.1:9100",) if alone else ("127.0.0.1:9100", "127.0.0.1:9101")
    cfg = RouterConfig(mode="push", prefill=(parse_instance("127.0.0.1:9000"),),
                       decode=tuple(parse_instance(u) for u in decodes),
                       slow_checks_tolerated=tolerated)
    pool = Pool(cfg)
    stats = EngineStats(0, 0, 1, 1, 0, 0, 0)  # (a link up has its core's gauges)
    pool.core_stats = lambda inst: stats if link_up else None
    d = pool.by_role["decode"][0]
    if not alone:
        pool.by_role["decode"][1].healthy = True
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


def test_timeouts_tolerated_as_configured():
    assert _run(["ok", "timeout", "timeout", "timeout", "timeout", "ok"], tolerated=3) == \
        [True, True, True, True, False, True]


def test_the_last_instance_of_a_role_never_leaves_on_timeouts_alone():
    assert _run(["ok", *["timeout"] * 6], alone=True) == [True] * 7
    assert _run(["ok", "refused", "ok"], alone=True) == [True, False, True]


def test_an_instance_whose_core_link_is_up_is_not_judged_by_its_probe():
    assert _run(["ok", "refused", "timeout", "timeout", "ok"], link_up=True) == [True] * 5


def test_refused_connection_takes_it_out_at_once():
    assert _run(["ok", "refused", "ok"]) == [True, False, True]


def test_an_instance_out_of_rotation_stays_out_on_a_timeout():
    assert _run(["refused", "timeout", "ok"]) == [False, False, True]
