"""``/kv/prove`` proves only for the advertised URL or an IP URL of the instance (issue
67, point 6): a caller-chosen host name is never looked up, and refusals are logged at a
bounded rate."""

from __future__ import annotations

import asyncio
import json
import logging
import socket

import pytest

from kvpush.kv_info import KVInfo
from kvpush.server.prove import ProveError, Prover
from stand_in import make_kv_info

SECRET = b"prove-names-test-secret-0123456789"
INFO = make_kv_info(engine_id="decode-1", role="decode", side_channel="127.0.0.1:5000")


def test_a_host_name_is_refused_without_a_lookup(monkeypatch, caplog):
    looked_up: list = []

    def lookup(*a, **kw):
        looked_up.append(a)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", 8001))]

    monkeypatch.setattr(socket, "getaddrinfo", lookup)
    prover = Prover(SECRET)

    async def info() -> KVInfo:
        return INFO

    async def go() -> None:
        loop = asyncio.get_running_loop()
        monkeypatch.setattr(loop, "getaddrinfo", lambda *a, **kw: lookup(*a, **kw))
        here, nonce = ("127.0.0.1", 8001), "cd" * 32
        ok = await prover.answer(json.dumps({"nonce": nonce, "url": "http://127.0.0.1:8001"})
                                 .encode(), here, info)
        assert ok["engine_id"] == "decode-1"
        with caplog.at_level(logging.WARNING, logger="kvpush.server"):
            for i in range(50):  # names that would resolve to this address
                body = json.dumps({"nonce": nonce, "url": f"http://n{i}.example:8001"})
                with pytest.raises(ProveError, match="not an IP URL") as e:
                    await prover.answer(body.encode(), here, info)
                assert e.value.status == 403
        assert looked_up == []
        lines = [r for r in caplog.records if "refused to prove" in r.getMessage()]
        assert 1 <= len(lines) <= 6, len(lines)

    asyncio.run(go())
