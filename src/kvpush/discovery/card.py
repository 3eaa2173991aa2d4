"""An instance's card: what it writes in etcd so that routers find it.

Built from its own ``/kv/info`` (role, engine id, side channel, request plane, transfer
mode, model, KV layout, whether it acts only on signed kv_transfer_params) plus the HTTP
URL routers reach it at, signed with a key derived from the cluster secret (:func:`sign`). A router
drops a card whose signature does not verify (:func:`signature_problem`) before it
connects to anything the card names, and takes an instance into rotation only when the
instance has proved it holds the secret (kvpush.crypto.membership) and its ``/kv/info``
answers the same identity (:func:`mismatch`): a card is a claim, the instance's own
answer is the evidence.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlsplit

import msgspec

from kvpush.crypto.membership import card_key, card_mac, card_mac_holds
from kvpush.kv_info import KVInfo

CARD_VERSION = 1

#: the /kv/info fields a card copies, and that must still agree when a router checks
CHECKED_FIELDS = ("role", "engine_id", "side_channel", "request_plane", "kv_transfer",
                  "model", "block_size", "layout", "kv_params_signed")


class Card(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    version: int
    url: str
    role: str
    engine_id: str
    model: str
    kv_transfer: str | None = None
    side_channel: str | None = None
    #: the engine core's request plane, "host:port" (engine/request_plane.py)
    request_plane: str | None = None
    block_size: int | None = None
    layout: dict[str, Any] | None = None
    kv_params_signed: bool = False
    #: card_mac over the rest (canonical JSON), keyed from the cluster secret
    signature: str | None = None


class CardError(ValueError):
    """A card a router cannot use."""


def card_from_info(url: str, info: KVInfo) -> Card:
    return Card(version=CARD_VERSION, url=url.rstrip("/"), role=info.role,
                engine_id=info.engine_id, model=info.model, kv_transfer=info.kv_transfer,
                side_channel=info.side_channel, request_plane=info.request_plane,
                block_size=info.block_size, layout=info.layout,
                kv_params_signed=info.kv_params_signed is True)


def _signed_bytes(card: Card) -> bytes:
    body = msgspec.to_builtins(msgspec.structs.replace(card, signature=None))
    return json.dumps(body, sort_keys=True, separators=(",", ":"),
                      ensure_ascii=True).encode()


def sign(card: Card, secret: bytes) -> Card:
    """``card`` signed with the card key of the cluster secret."""
    return msgspec.structs.replace(card, signature=card_mac(card_key(secret),
                                                            _signed_bytes(card)))


def signature_problem(card: Card, key: bytes) -> str | None:
    """Why ``card`` was not signed with the card key ``key``, or None."""
    if card.signature is None:
        return "the card is not signed (an instance without the cluster secret?)"
    if not card_mac_holds(key, _signed_bytes(card), card.signature):
        return ("its signature does not verify: written by someone without this "
                "cluster's secret, or altered")
    return None


def encode(card: Card) -> bytes:
    return msgspec.json.encode(card)


def decode(data: bytes) -> Card:
    """The card in ``data`` (raises CardError: not a card, another version, a URL that
    is not http(s)://HOST:PORT)."""
    try:
        card = msgspec.json.decode(data, type=Card)
    except msgspec.DecodeError as e:
        raise CardError(f"not an instance card: {e}") from None
    if card.version != CARD_VERSION:
        raise CardError(f"card version {card.version}, this router reads {CARD_VERSION}")
    u = urlsplit(card.url)
    try:
        port = u.port
    except ValueError:
        port = None
    if u.scheme not in ("http", "https") or not u.hostname or port is None or u.path:
        raise CardError(f"card URL {card.url!r}: expected http://HOST:PORT")
    if card.role not in ("prefill", "decode", "both"):
        raise CardError(f"card role {card.role!r}")
    if not card.engine_id:
        raise CardError("card without an engine id")
    return card


def mismatch(card: Card, info: KVInfo) -> str | None:
    """Why an instance whose ``/kv/info`` is ``info`` is not the one ``card`` names, or
    None when they agree."""
    have = card_from_info(card.url, info)
    diffs = [f"{name}: card {getattr(card, name)!r}, /kv/info {getattr(have, name)!r}"
             for name in CHECKED_FIELDS if getattr(card, name) != getattr(have, name)]
    if not diffs:
        return None
    return "its card in etcd does not match its /kv/info (" + "; ".join(diffs) + ")"
