"""Issue 40, finding 4: the router's operator views (/router/instances, /metrics: cache
sizes, per-request cached-token counts) behind a separate admin key; an API-key holder
no longer reads what other users' requests found cached."""

from __future__ import annotations

import httpx
import pytest

from kvpush.discovery.instance_spec import parse_instance
from kvpush.router.app import Router
from kvpush.router.app import build_app as build_router_app
from kvpush.router.config import RouterConfig
from kvpush.server.admin_key import resolve_admin_key

KEY, ADMIN = "client-key-123", "admin-key-456"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.anyio
async def test_operator_views_need_the_admin_key():
    cfg = RouterConfig(mode="colocated", prefill=(), decode=(parse_instance("127.0.0.1:9"),),
                       api_key=KEY, admin_key=ADMIN, startup_timeout_s=1)
    assert ADMIN not in repr(cfg)
    app = build_router_app(Router(cfg), manage=False)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://test", timeout=10) as c:
        for path in ("/router/instances", "/metrics"):
            for headers in ({}, bearer(KEY), bearer("wrong")):  # the API key: refused
                r = await c.get(path, headers=headers)
                assert r.status_code == 401, (path, headers, r.text)
                err = r.json()["error"]
                assert err["code"] == "invalid_admin_key" and err["type"] == \
                    "authentication_error"
            assert (await c.get(path, headers=bearer(ADMIN))).status_code == 200
        # the client paths still take the API key, not the admin key
        assert (await c.get("/v1/models", headers=bearer(ADMIN))).status_code == 401
        assert (await c.get("/health")).status_code in (200, 503)  # open


@pytest.mark.anyio
async def test_operator_views_are_closed_with_an_api_key_and_no_admin_key():
    cfg = RouterConfig(mode="colocated", prefill=(), decode=(parse_instance("127.0.0.1:9"),),
                       api_key=KEY, startup_timeout_s=1)
    app = build_router_app(Router(cfg), manage=False)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://test", timeout=10) as c:
        for path in ("/router/instances", "/metrics"):
            for headers in ({}, bearer(KEY)):
                r = await c.get(path, headers=headers)
                assert r.status_code == 403, (path, headers, r.text)
                assert r.json()["error"]["code"] == "operator_view_closed"
        assert (await c.get("/v1/models", headers=bearer("wrong"))).status_code == 401


def test_the_admin_key_comes_from_the_flag_or_the_environment():
    assert resolve_admin_key(None, {}) is None
    assert resolve_admin_key(None, {"KVPUSH_ADMIN_KEY": "e"}) == "e"
    assert resolve_admin_key("f", {"KVPUSH_ADMIN_KEY": "e"}) == "f"
    assert resolve_admin_key("", {}) is None


def test_the_admin_key_is_stripped_like_the_api_key():
    """A key from a secret mount or env file often ends in a newline. The API key is
    stripped; the admin key was not, and since a header cannot carry the newline (the
    token is stripped too) every operator request was a 401 (failed before)."""
    assert resolve_admin_key(None, {"KVPUSH_ADMIN_KEY": "s3cret-admin\n"}) == "s3cret-admin"
    assert resolve_admin_key(" s3cret-admin ", {}) == "s3cret-admin"
    assert resolve_admin_key(None, {"KVPUSH_ADMIN_KEY": " \n"}) is None
