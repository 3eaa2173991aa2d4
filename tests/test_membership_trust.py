"""Membership that cannot be steered by whoever writes cards (issue 53), without model
processes: the discovery view fed events directly, health checks answered by an
``httpx.MockTransport`` (an instance that holds the secret, or a fake that does not).

A card naming an admitted instance's URL with another identity is ignored, and the
instance keeps serving (53.2). Proof before traffic (53.1): unsigned and forged cards
are dropped; an instance that cannot prove the secret gets no API key and no traffic,
given statically or by a card; an instance proves only for its own URL.
"""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import msgspec
import pytest

from kvpush.crypto.membership import proof_key, proof_mac
from kvpush.discovery.card import card_from_info, encode, sign
from kvpush.discovery.etcd import WatchEvent
from kvpush.discovery.instance_spec import parse_instance
from kvpush.discovery.target import parse_target
from kvpush.kv_info import KVInfo
from kvpush.router.config import RouterConfig
from kvpush.router.discover import EtcdLink
from kvpush.router.pool import Pool
from stand_in import kv_info_body

SECRET = b"s" * 32
URL = "http://127.0.0.1:8001"
INFO = kv_info_body(role="decode", engine_id="decode-1", side_channel="127.0.0.1:5000",
                    kv_transfer="push", model="m", block_size=16,
                    layout={"num_layers": 2}, kv_params_signed=False,
                    request_plane="127.0.0.1:5001", request_plane_members=True)


def answering(info: dict, secret: bytes | None = SECRET, prove: bool = True,
              seen: list | None = None, proved: dict | None = None) -> httpx.AsyncClient:
    """A client whose every instance answers /health 200, /kv/info ``info`` and, with
    ``prove``, /kv/prove: with ``secret`` (a real instance), else with a made-up MAC (a
    fake), for the identity in ``proved`` (default: ``info``); ``seen`` collects (path,
    Authorization header) of each request."""
    def handle(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append((request.url.path, request.headers.get("authorization")))
        if request.url.path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        if request.url.path == "/kv/info":
            return httpx.Response(200, json=info)
        if request.url.path == "/kv/prove" and prove:
            c, who = json.loads(request.content), proved or info
            ident = {"url": c["url"], "engine_id": who["engine_id"], "role": who["role"],
                     "side_channel": who.get("side_channel")}
            mac = (proof_mac(proof_key(secret), nonce=c["nonce"], **ident)
                   if secret is not None else "0" * 64)
            return httpx.Response(200, json={**ident, "mac": mac})
        return httpx.Response(404)

    return httpx.AsyncClient(transport=httpx.MockTransport(handle))


def link_and_pool() -> tuple[EtcdLink, Pool]:
    target = parse_target("etcd://127.0.0.1:1/t")
    pool = Pool(RouterConfig(mode="push", prefill=(), decode=(), discover=target,
                             kv_secret=SECRET))
    return EtcdLink(pool, lambda inst: None), pool


def put(key: str, info: dict, revision: int, url: str = URL,
        secret: bytes | None = SECRET) -> WatchEvent:
    card = card_from_info(url, msgspec.convert(info, KVInfo))
    return WatchEvent("put", key, encode(sign(card, secret) if secret else card), revision)


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


def test_unsigned_and_forged_cards_are_dropped_before_connecting(caplog):
    caplog.set_level(logging.INFO, "kvpush.router")
    link, pool = link_and_pool()
    link._apply([put("/t/instances/decode/a", INFO, 2, secret=None),
                 put("/t/instances/decode/b", INFO, 3, secret=b"another cluster secret")])
    forged = sign(card_from_info(URL, msgspec.convert(INFO, KVInfo)), SECRET)
    forged = encode(forged).replace(b"decode-1", b"decode-9")  # altered after signing
    link._apply([WatchEvent("put", "/t/instances/decode/c", forged, 4)])
    assert pool.instances == [] and link.cards == {}
    text = caplog.text
    assert "/t/instances/decode/a ignored: the card is not signed" in text
    assert text.count("signature does not verify") == 2


@pytest.mark.parametrize("how", ["no proof", "a wrong MAC", "the real one's copy"])
def test_a_fake_is_never_admitted_statically_or_by_a_card(how):
    """A fake whose /kv/info copies a real instance's: no /kv/prove, a MAC made up, or
    one computed for another cluster. Given on the command line or by a (signed) card, it
    stays out of rotation and never sees the API key."""
    secret = {"no proof": None, "a wrong MAC": None, "the real one's copy": b"x" * 32}[how]

    async def go() -> None:
        seen: list = []
        fake = answering(INFO, secret=secret, prove=how != "no proof", seen=seen)
        static = Pool(RouterConfig(mode="push", prefill=(parse_instance("127.0.0.1:8002"),),
                                   decode=(parse_instance(URL),),
                                   kv_secret=SECRET, api_key="the-api-key"))
        link, found = link_and_pool()
        link._apply([put("/t/instances/decode/decode-1", INFO, 2)])
        for pool in (static, found):
            inst = pool.find(URL)
            for _ in range(3):
                await pool.check(fake, inst)
                assert not inst.healthy and inst.proven is None
            assert "secret" in (inst.misconfigured or ""), inst.misconfigured
            assert pool.pick("decode") is None
        assert all(auth is None for _, auth in seen), seen
        assert {p for p, _ in seen} <= {"/health", "/kv/prove", "/kv/info"}
        await fake.aclose()

    asyncio.run(go())


def test_a_proven_instance_gets_the_key_and_a_vllm_one_only_from_the_command_line():
    async def go() -> None:
        seen: list = []
        real = answering(INFO, seen=seen)
        pool = Pool(RouterConfig(mode="push", prefill=(parse_instance("127.0.0.1:8002"),),
                                   decode=(parse_instance(URL),),
                                 kv_secret=SECRET, api_key="the-api-key"))
        inst = pool.find(URL)
        await pool.check(real, inst)
        assert inst.healthy and inst.proven is not None
        assert seen == [("/health", None), ("/kv/prove", None),
                        ("/kv/info", "Bearer the-api-key")]
        # proved at every check, the key only after the proof
        await pool.check(real, inst)
        assert inst.healthy and [p for p, _ in seen[3:]] == ["/health", "/kv/prove",
                                                             "/kv/info"]
        # another server at its address, no failed check between: out at the next check
        await pool.check(answering(INFO, secret=None), inst)
        assert not inst.healthy and "did not prove" in inst.misconfigured
        await pool.check(real, inst)
        assert inst.healthy
        # its /kv/info names another identity than it proved: out
        await pool.check(answering({**INFO, "engine_id": "other"}, proved=INFO), inst)
        assert not inst.healthy and "not the identity it proved" in inst.misconfigured
        # no /kv/prove and no /kv/info (vLLM): from the command line only
        def vllm(request: httpx.Request) -> httpx.Response:
            return httpx.Response(200 if request.url.path == "/health" else 404)

        client = httpx.AsyncClient(transport=httpx.MockTransport(vllm))
        await pool.check(client, inst)
        assert inst.healthy and inst.info is None and inst.proven is None
        link, found = link_and_pool()
        link._apply([put("/t/instances/decode/decode-1", INFO, 2)])
        await found.check(client, found.find(URL))
        assert not found.find(URL).healthy
        assert "never from etcd" in found.find(URL).misconfigured
        await client.aclose()
        await real.aclose()

    asyncio.run(go())


def test_a_malformed_kv_info_fails_the_check_and_says_why():
    """An instance's /kv/info is untrusted input, decoded once as a whole (KVInfo): an
    answer that is not a kvpush instance's keeps it out of rotation, the reason naming
    what is wrong, until a check reads a good one."""
    async def go() -> None:
        pool = Pool(RouterConfig(mode="push", prefill=(parse_instance("127.0.0.1:8002"),),
                                 decode=(parse_instance(URL),), kv_secret=SECRET))
        inst = pool.find(URL)
        missing = {k: v for k, v in INFO.items() if k != "max_model_len"}
        for bad, says in ((missing, "max_model_len"),
                          ({**INFO, "block_size": "16"}, "block_size"),
                          ({**INFO, "side_channel_port": 0}, "side_channel_port"),
                          ({**INFO, "kv_events": {"endpoint": 5}}, "kv_events.endpoint"),
                          ([INFO], "object")):
            client = answering(bad, proved=INFO)
            await pool.check(client, inst)
            await client.aclose()
            assert not inst.healthy and inst.info is None
            assert inst.misconfigured is not None
            assert "malformed /kv/info" in inst.misconfigured, inst.misconfigured
            assert says in inst.misconfigured, inst.misconfigured
        good = answering(INFO)
        await pool.check(good, inst)
        await good.aclose()
        assert inst.healthy and inst.misconfigured is None
        assert inst.info is not None and inst.info.model == "m"

    asyncio.run(go())


def test_an_instance_proves_only_for_its_own_url():
    from kvpush.server.prove import ProveError, Prover

    prover = Prover(SECRET, advertise_url="http://decode-0.example:8000/")

    async def info() -> KVInfo:
        return msgspec.convert(INFO, KVInfo)

    async def go() -> None:
        here = ("127.0.0.1", 8001)
        nonce = "ab" * 32
        for url in ("http://127.0.0.1:8001", "http://localhost:8001",
                    "http://decode-0.example:8000"):
            body = json.dumps({"nonce": nonce, "url": url}).encode()
            got = await prover.answer(body, here, info)
            assert got["mac"] == proof_mac(proof_key(SECRET), nonce=nonce, url=url,
                                           engine_id="decode-1", role="decode",
                                           side_channel="127.0.0.1:5000")
        # a relayed challenge names the relay's URL: no proof for it
        for url in ("http://127.0.0.1:9999", "http://10.1.2.3:8001", "http://h:x"):
            with pytest.raises(ProveError) as e:
                await prover.answer(json.dumps({"nonce": nonce, "url": url}).encode(),
                                    here, info)
            assert e.value.status == 403
        for bad in (b"[]", b"{", json.dumps({"nonce": "ab", "url": URL}).encode(),
                    b"x" * 2000):
            with pytest.raises(ProveError):
                await prover.answer(bad, here, info)

    asyncio.run(go())
