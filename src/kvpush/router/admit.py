"""Proof before traffic: an instance gets no API key, no prompt and no grant until it
has shown that it holds the cluster secret (kvpush.crypto.membership).

:func:`admit` sends ``POST /kv/prove`` with a fresh nonce and the URL the router reaches
the instance at, without the API key, and checks the MAC of the answer (engine id,
role, side channel) with the router's proof key. The pool (kvpush.router.pool) proves an
instance at every health check, before it reads its ``/kv/info`` with the API key, and
checks that ``/kv/info`` names the identity proved (:func:`identity_problem`): a
restarted instance, or another server now at its address, is caught at the next check.

Instances that cannot prove (``/kv/prove`` answers 404: vLLM, or a kvpush instance
without the secret) are admitted only from the router's own command line, and then
only when ``/kv/info`` answers 404 too (not kvpush: taken on the operator's word, as
before); a card in etcd never admits one.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
from msgspec import UNSET

from kvpush.crypto.membership import new_nonce, proof_holds
from kvpush.kv_info import KVInfo
from kvpush.router.answers import Answer, fetch
from kvpush.server.prove import PROVE_PATH


@dataclass(frozen=True)
class Proven:
    """The identity an instance proved."""

    engine_id: str
    role: str
    side_channel: str | None


class NotAdmitted(Exception):
    """Why an instance gets no traffic: it did not prove that it holds the cluster
    secret, or cannot and may not be taken on the operator's word."""


def _failed(why: str) -> NotAdmitted:
    return NotAdmitted(f"it did not prove that it holds the cluster secret: {why}")


async def admit(client: httpx.AsyncClient, url: str, key: bytes, timeout: float,
                discovered: bool) -> Proven | None:
    """Challenge the instance at ``url``: its proven identity, or None for one that
    cannot prove (``/kv/prove`` 404) and is not kvpush (``/kv/info`` 404 without the
    key: vLLM) from the command line (not ``discovered``), taken on the operator's
    word. Raises NotAdmitted, or httpx errors (a failed check)."""
    nonce = new_nonce()
    r = await fetch(client, "POST", url + PROVE_PATH, timeout,
                    json={"nonce": nonce, "url": url})
    if r.status_code == 404:
        if discovered:
            raise NotAdmitted("it cannot prove that it holds the cluster secret "
                              "(/kv/prove: 404), and instances that cannot prove are "
                              "admitted only from the router's own command line, never "
                              "from etcd")
        if (await fetch(client, "GET", url + "/kv/info", timeout)).status_code == 404:
            return None
        raise NotAdmitted("it answers /kv/info like a kvpush instance but cannot prove "
                          "that it holds the cluster secret (/kv/prove: 404): give it the "
                          "router's secret (--kv-secret-file), or it is not the instance "
                          "it claims to be")
    if r.status_code != 200:
        raise _failed(f"{PROVE_PATH} answered HTTP {r.status_code}: {_message(r)}")
    try:
        body = r.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise _failed(f"{PROVE_PATH} did not answer a JSON object")
    engine_id, role, side = body.get("engine_id"), body.get("role"), body.get("side_channel")
    if not (isinstance(engine_id, str) and isinstance(role, str)
            and (side is None or isinstance(side, str))):
        raise _failed(f"{PROVE_PATH} answered a malformed proof")
    if body.get("url") != url or not proof_holds(
            key, body.get("mac"), nonce=nonce, url=url, engine_id=engine_id, role=role,
            side_channel=side):
        raise _failed("its proof does not verify: it does not hold this cluster's "
                      "secret (or answered for another URL)")
    return Proven(engine_id, role, side)


def identity_problem(proven: Proven, info: KVInfo) -> str | None:
    """Why ``/kv/info`` does not name the identity proved, or None."""
    side = info.side_channel
    host, port = info.side_channel_host, info.side_channel_port
    if (host is not UNSET or port is not UNSET) and f"{host}:{port}" != side:
        return (f"its /kv/info names side channel {side!r} and {host}:{port}: "
                "not one address")
    have = (info.engine_id, info.role, side)
    if have != (proven.engine_id, proven.role, proven.side_channel):
        return (f"its /kv/info (engine {have[0]!r}, role {have[1]}, side channel "
                f"{have[2]!r}) is not the identity it proved (engine "
                f"{proven.engine_id!r}, role {proven.role}, side channel "
                f"{proven.side_channel!r})")
    return None


def _message(r: Answer) -> str:
    try:
        err = r.json().get("error")
        return str(err.get("message") if isinstance(err, dict) else err)[:200]
    except (ValueError, AttributeError):
        return r.text[:200]
