"""No cache oracle for API-key holders (issue 67, point 2).

A `kvpush serve` with an API key, an admin key and the cluster secret. A client with the
API key reads every endpoint it can before and after another tenant's request with a
long prefix: it sees the same answers (``/kv/cache_blocks`` is a 403, ``/kv/info`` has no
block counts). The member token derived from the secret (the router's) and the admin key
open both, and they do show the other tenant's blocks: the oracle the API key no longer
has.
"""

from __future__ import annotations

import time

import httpx
import pytest

from kvpush.crypto.membership import member_view_token
from kvpush.server.member_view import COUNT_FIELDS, MEMBER_HEADER
from server_helpers import TEST_KV_SECRET, ServerProcess

pytestmark = pytest.mark.timeout(180)

API_KEY = "tenant-key-0123"
ADMIN_KEY = "admin-key-4567"
#: what an API-key client can GET on an instance
PATHS = ("/health", "/v1/models", "/kv/info", "/kv/cache_blocks", "/metrics")
PREFIX = " ".join(f"word{i}" for i in range(100))


def _views(url: str, headers: dict[str, str]) -> dict[str, tuple[int, bytes]]:
    return {p: (r.status_code, r.content) for p in PATHS
            for r in [httpx.get(url + p, headers=headers, timeout=10)]}


def test_an_api_key_cannot_tell_what_another_tenant_cached(tiny_llama, tmp_path):
    server = ServerProcess(tiny_llama, "--api-key", API_KEY, "--admin-key", ADMIN_KEY,
                           log_dir=tmp_path)
    try:
        url = server.url
        tenant = {"Authorization": f"Bearer {API_KEY}"}
        member = {**tenant, MEMBER_HEADER: member_view_token(TEST_KV_SECRET.encode())}
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}

        def cached(headers: dict[str, str]) -> set:
            r = httpx.get(url + "/kv/cache_blocks", headers=headers, timeout=10)
            assert r.status_code == 200, r.text
            return {h for h in r.json()["hashes"]}

        before = _views(url, tenant)
        before_member, before_admin = cached(member), cached(admin)
        r = httpx.post(url + "/v1/completions", headers=tenant, timeout=60,
                       json={"prompt": PREFIX, "max_tokens": 2})  # the other tenant
        assert r.status_code == 200, r.text
        after = _views(url, tenant)

        assert after == before  # nothing an API key opens changed
        assert before["/kv/cache_blocks"][0] == 403
        assert b"member_view" in before["/kv/cache_blocks"][1]
        assert before["/metrics"][0] == 401  # the operator view, as before
        assert before["/kv/info"][0] == 200
        assert not any(f.encode() in before["/kv/info"][1] for f in COUNT_FIELDS)
        # the member token and the admin key open them, and there the prefix shows
        deadline = time.monotonic() + 10  # (its events are published after the step)
        while len(cached(member) - before_member) < 5:
            assert time.monotonic() < deadline, "the prefix's blocks never showed"
            time.sleep(0.05)
        assert cached(admin) == cached(member) != before_admin
        # (the admin key is not the API key, which /kv/info needs: /metrics has counts)
        info = httpx.get(url + "/kv/info", headers=member, timeout=10).json()
        assert all(isinstance(info[f], int) for f in COUNT_FIELDS)
        # a wrong member token opens nothing
        wrong = {**tenant, MEMBER_HEADER: "0" * 64}
        assert httpx.get(url + "/kv/cache_blocks", headers=wrong, timeout=10).status_code == 403
    finally:
        server.stop()
