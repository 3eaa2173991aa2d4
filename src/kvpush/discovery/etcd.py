"""A small asyncio etcd v3 client over etcd's gRPC-JSON gateway (``/v3/...`` on the
client port), with httpx.

Only what membership needs: leases (grant, keep-alive, revoke), put / delete / range of
a prefix, and a prefix watch. Why the gateway rather than a gRPC client: httpx is
already kvpush's HTTP client (nothing to install, no gRPC or protobuf pins to fight), it
is asyncio-native, and the gateway has the same v3 API on etcd 3.4 and 3.5. Keys and
values travel base64-encoded and int64 fields as JSON strings (the gateway's protobuf
JSON mapping). With a user, the client authenticates once and sends the token in the
``Authorization`` header, authenticating again when etcd says it expired.

Every call is bounded by ``timeout`` but the watch stream, whose liveness the caller
checks with :meth:`EtcdClient.healthy`.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx

from kvpush.discovery.target import EtcdTarget


class EtcdError(RuntimeError):
    """etcd answered with an error, or could not be reached (``unreachable``)."""

    def __init__(self, message: str, unreachable: bool = False) -> None:
        super().__init__(message)
        self.unreachable = unreachable


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: bytes
    mod_revision: int
    lease: int


@dataclass(frozen=True)
class WatchEvent:
    #: "put" or "delete"
    kind: str
    key: str
    value: bytes
    revision: int


def _b64(data: str | bytes) -> str:
    raw = data.encode() if isinstance(data, str) else data
    return base64.b64encode(raw).decode()


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def prefix_end(prefix: str) -> str:
    """The range end that selects every key starting with ``prefix``."""
    raw = bytearray(prefix.encode())
    for i in range(len(raw) - 1, -1, -1):
        if raw[i] < 0xFF:
            raw[i] += 1
            return _b64(bytes(raw[: i + 1]))
    return _b64(b"\0")


def _kv(obj: dict[str, Any]) -> KeyValue:
    return KeyValue(key=_unb64(obj.get("key")).decode(errors="replace"),
                    value=_unb64(obj.get("value")),
                    mod_revision=int(obj.get("mod_revision") or 0),
                    lease=int(obj.get("lease") or 0))


def describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class EtcdClient:
    def __init__(self, target: EtcdTarget, timeout: float = 2.0) -> None:
        self.target = target
        self.timeout = timeout
        a = target.auth
        verify: Any = True
        if a.tls:
            import ssl

            verify = ssl.create_default_context(cafile=a.ca_file)
            if a.cert_file and a.key_file:
                verify.load_cert_chain(a.cert_file, a.key_file)
        self._http = httpx.AsyncClient(base_url=target.endpoint, verify=verify,
                                       timeout=timeout, trust_env=False)
        self._token: str | None = None

    async def aclose(self) -> None:
        await self._http.aclose()

    # ------------------------------------------------------------------ plumbing

    async def _authenticate(self) -> None:
        a = self.target.auth
        r = await self._http.post("/v3/auth/authenticate",
                                  json={"name": a.user, "password": a.password})
        if r.status_code != 200:
            # the body names the reason ("authentication failed, invalid user ID or
            # password"), never the password
            raise EtcdError(f"etcd refused user {a.user!r}: {self._reason(r)}")
        self._token = self._json(r, "/v3/auth/authenticate").get("token")

    def _headers(self) -> dict[str, str]:
        return {"Authorization": self._token} if self._token else {}

    @staticmethod
    def _reason(r: httpx.Response) -> str:
        try:
            body = r.json()
            return str(body.get("message") or body.get("error") or r.text)[:200]
        except ValueError:
            return f"HTTP {r.status_code}"

    async def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST one v3 gateway call; raises EtcdError."""
        try:
            if self.target.auth.user and self._token is None:
                await self._authenticate()
            r = await self._http.post(path, json=body, headers=self._headers())
            expired = r.status_code == 401 or (r.status_code != 200 and "auth token" in r.text)
            if expired and self.target.auth.user:  # once more with a new token
                await self._authenticate()
                r = await self._http.post(path, json=body, headers=self._headers())
        except (httpx.HTTPError, OSError) as e:  # (an SSL alert after the handshake, such
            # as a refused client certificate under TLS 1.3, is a bare ssl.SSLError)
            raise EtcdError(f"{self.target}: {describe(e)}", unreachable=True) from None
        if r.status_code != 200:
            raise EtcdError(f"{self.target} {path}: {self._reason(r)}",
                            unreachable=r.status_code >= 500)
        return self._json(r, path)

    def _json(self, r: httpx.Response, path: str) -> dict[str, Any]:
        """A 200 answer's JSON object; EtcdError when it is none (not etcd there)."""
        try:
            out = r.json()
        except ValueError:
            raise EtcdError(f"{self.target} {path}: the answer is not etcd's JSON "
                            f"({r.headers.get('content-type', 'no content type')})",
                            unreachable=True) from None
        return out if isinstance(out, dict) else {}

    # ------------------------------------------------------------------ API

    async def healthy(self) -> bool:
        """Whether etcd answers a read now (a range of one key)."""
        try:
            await self.call("/v3/kv/range", {"key": _b64(self.target.prefix), "limit": 1})
        except EtcdError:
            return False
        return True

    async def grant(self, ttl_s: int) -> int:
        out = await self.call("/v3/lease/grant", {"TTL": ttl_s})
        if "ID" not in out:
            raise EtcdError(f"{self.target} /v3/lease/grant: no lease in the answer")
        return int(out["ID"])

    async def keepalive(self, lease: int) -> int:
        """Renew ``lease`` once; its TTL now (0 or less: the lease is gone)."""
        out = await self.call("/v3/lease/keepalive", {"ID": lease})
        return int(out.get("result", {}).get("TTL") or 0)

    async def revoke(self, lease: int) -> None:
        await self.call("/v3/lease/revoke", {"ID": lease})

    async def put(self, key: str, value: bytes, lease: int = 0) -> int:
        out = await self.call("/v3/kv/put", {"key": _b64(key), "value": _b64(value),
                                             "lease": lease})
        return int(out.get("header", {}).get("revision") or 0)

    async def delete(self, key: str) -> None:
        await self.call("/v3/kv/deleterange", {"key": _b64(key)})

    async def get_prefix(self, prefix: str) -> tuple[int, list[KeyValue]]:
        """(the store's revision, every key under ``prefix``)."""
        out = await self.call("/v3/kv/range", {"key": _b64(prefix),
                                               "range_end": prefix_end(prefix)})
        rev = int(out.get("header", {}).get("revision") or 0)
        return rev, [_kv(k) for k in out.get("kvs", [])]

    async def watch_prefix(self, prefix: str, start_revision: int
                           ) -> AsyncIterator[list[WatchEvent]]:
        """The changes under ``prefix`` from ``start_revision`` on, a batch at a time,
        until the stream breaks (raises EtcdError) or the caller stops iterating."""
        req = {"create_request": {"key": _b64(prefix), "range_end": prefix_end(prefix),
                                  "start_revision": start_revision}}
        try:
            if self.target.auth.user and self._token is None:
                await self._authenticate()
            timeout = httpx.Timeout(self.timeout, read=None)
            async with self._http.stream("POST", "/v3/watch", json=req, timeout=timeout,
                                         headers=self._headers()) as r:
                if r.status_code != 200:
                    await r.aread()
                    raise EtcdError(f"{self.target} watch: {self._reason(r)}")
                async for line in r.aiter_lines():
                    if not line.strip():
                        continue
                    msg = json.loads(line)
                    if "error" in msg:
                        raise EtcdError(f"{self.target} watch: {msg['error']}")
                    res = msg.get("result", {})
                    if res.get("canceled"):
                        raise EtcdError(f"{self.target} watch cancelled: "
                                        f"{res.get('cancel_reason') or 'compacted'}")
                    events = [WatchEvent(kind="delete" if e.get("type") == "DELETE" else "put",
                                         key=_unb64(e["kv"].get("key")).decode(errors="replace"),
                                         value=_unb64(e["kv"].get("value")),
                                         revision=int(e["kv"].get("mod_revision") or 0))
                              for e in res.get("events", [])]
                    if events:
                        yield events
        except (httpx.HTTPError, OSError) as e:  # (ssl.SSLError: see call)
            raise EtcdError(f"{self.target} watch: {describe(e)}", unreachable=True) from None
        except ValueError as e:
            raise EtcdError(f"{self.target} watch: bad answer: {e}") from None
        raise EtcdError(f"{self.target} watch: the stream ended", unreachable=True)
