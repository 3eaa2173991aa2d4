"""Membership that cannot be steered by whoever writes cards (issue 53), without model
processes: the discovery view fed events directly, health checks answered by an
``httpx.MockTransport``.

A card naming an admitted instance's URL with another identity is ignored, and the
instance keeps serving.
"""

from __future__ import annotations

import asyncio
import logging

import httpx

from kvpush.discovery.card import card_from_info, encode
from kvpush.discovery.etcd import WatchEvent
from kvpush.discovery.target import parse_target
from kvpush.router.config import RouterConfig
from kvpush.router.discover import EtcdLink
from kvpush.router.pool import Pool

URL = "http://127.0.0.1:8001"
INFO = {"role": "decode", "engine_id": "decode-1", "side_channel": "127.0.0.1:5000",
        "kv_transfer": "push", "model": "m", "block_size": 16,
        "layout": {"num_layers": 2}, "kv_params_signed": False}


def answering(info: dict) -> httpx.AsyncClient:
    """A client whose every instance answers /health 200 and /kv/info ``info``."""
    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        if request.url.path == "/kv/info":
            return httpx.Response(200, json=info)
        return httpx.Response(404)

    return httpx.AsyncClient(transport=httpx.MockTransport(handle))


def link_and_pool() -> tuple[EtcdLink, Pool]:
    target = parse_target("etcd://127.0.0.1:1/t")
    pool = Pool(RouterConfig(mode="push", prefill=(), decode=(), discover=target))
    return EtcdLink(target, pool, "push", lambda inst: None), pool


def put(key: str, info: dict, revision: int, url: str = URL) -> WatchEvent:
    return WatchEvent("put", key, encode(card_from_info(url, info)), revision)


def test_a_card_for_an_admitted_url_with_another_identity_is_ignored(caplog):
    caplog.set_level(logging.INFO, "kvpush.router")

    async def go() -> None:
        link, pool = link_and_pool()
        client = answering(INFO)
        link._apply([put("/t/instances/decode/decode-1", INFO, 2)])
        inst = pool.find(URL)
        assert inst is not None
        await pool.check(client, inst)
        assert inst.healthy and inst.misconfigured is None
        # someone writes a newer card naming the same URL as another engine, side
        # channel and role: the instance stays in rotation, nothing else joins
        for k, other in enumerate(({**INFO, "engine_id": "evil"},
                                   {**INFO, "side_channel": "10.0.0.9:1"},
                                   {**INFO, "role": "prefill", "engine_id": "evil-p"})):
            link._apply([put(f"/t/instances/x/evil-{k}", other, 3 + k)])
            await pool.check(client, inst)
            assert inst.healthy and inst.misconfigured is None, inst.last_error
            assert pool.find(URL) is inst and [i.url for i in pool.instances] == [URL]
            assert pool.pick("decode") is inst
            Pool.release(inst)
        ignored = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
        assert len(ignored) == 3 and all(URL in m for m in ignored), ignored
        # again the same cards: no more lines
        link._apply([put("/t/instances/x/evil-0", {**INFO, "engine_id": "evil"}, 9)])
        assert len([r for r in caplog.records if "ignored" in r.getMessage()]) == 3
        # the real card goes (drained): the others do not keep it in rotation
        link._apply([WatchEvent("delete", "/t/instances/decode/decode-1", b"", 10)])
        await pool.check(client, inst)
        assert not inst.healthy and "does not match" in (inst.misconfigured or "")
        # a restart: the instance answers as the engine its new card names
        restarted = {**INFO, "engine_id": "decode-2"}
        link._apply([put("/t/instances/decode/decode-2", restarted, 11)])
        await pool.check(answering(restarted), inst)
        assert inst.healthy and inst.engine_id == "decode-2"
        await client.aclose()

    asyncio.run(go())
