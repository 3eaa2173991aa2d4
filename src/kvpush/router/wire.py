"""What the router puts on the wire: each leg's ``kv_transfer_params`` and their
signature: a kvpush instance's as its request plane carries them (WireKVParams), a
vLLM instance's as JSON."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvpush.kv_transfer.params import WireKVParams
from kvpush.router.pool import Instance

if TYPE_CHECKING:
    from kvpush.router.config import RouterKeys

#: a leg's kv_transfer_params: a kvpush instance's struct, a vLLM instance's JSON
LegKV = WireKVParams | dict[str, Any]


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
             peer: Instance | None = None) -> LegKV:
        """``params`` for ``to``: a kvpush instance's the fields it reads, signed as
        such; a vLLM instance's as they are."""
        if to.kvpush:
            params = WireKVParams.of(params).wire()
        if self._signer is not None and (to.kvpush or to.spec.explicit is not None):
            params = self._signer.sign(params, role=role, engine_id=to.engine_id,
                                       peer_engine_id=peer.engine_id if peer else None)
        return WireKVParams.of(params) if to.kvpush else params


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
