"""What the router puts on the wire: each leg's ``kv_transfer_params`` and their
signature."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from kvpush.router.pool import Instance

if TYPE_CHECKING:
    from kvpush.router.config import RouterKeys

logger = logging.getLogger("kvpush.router")


class LegSigner:
    """Signs each leg's ``kv_transfer_params`` for the kvpush instance it goes to
    (kvpush.crypto.auth), and for an instance named ``URL@ENGINE_ID@HOST:PORT`` (vLLM
    with kvpush's connector checks them; vLLM's own connectors ignore the two keys);
    other vLLM instances get them unsigned, as their own proxies send them. Without
    the cluster secret nothing is signed."""

    def __init__(self, keys: RouterKeys | None) -> None:
        from kvpush.crypto.auth import ParamsSigner

        self._signer = ParamsSigner.from_key(keys.grant_key) if keys else None

    def sign(self, params: dict[str, Any], to: Instance, role: str,
             peer: Instance | None = None) -> dict[str, Any]:
        if self._signer is None or (to.info is None and to.spec.explicit is None):
            return params
        return self._signer.sign(params, role=role, engine_id=to.engine_id,
                                 peer_engine_id=peer.engine_id if peer else None)


def prefill_params(tid: str) -> dict[str, Any]:
    """A prefill leg's KV instructions (vLLM's field names; the None fields are what
    vLLM's own proxies send)."""
    return {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid,
            "remote_engine_id": None, "remote_block_ids": None, "remote_host": None,
            "remote_port": None}


def push_decode_params(p: Instance, tid: str) -> dict[str, Any]:
    ident = p.identity
    assert ident is not None  # verified before it entered the rotation
    kv: dict[str, Any] = {
        "do_remote_prefill": True, "do_remote_decode": False, "transfer_id": tid,
        "remote_engine_id": ident.engine_id, "remote_host": ident.side_channel_host,
        "remote_port": ident.side_channel_port, "remote_request_id": tid,
    }
    if p.info is None:  # vLLM: its push proxy also sends P's parallel sizes
        kv.update(tp_size=1, pp_size=1)
    return kv
