"""KV digests (``--kv-digest``): what a block holds, per block, to check that the KV
decode reads is the KV prefill computed.

A block's digest is a 128-bit hash of its bytes layer by layer, K and V, in the
region's storage order (``KVRegion.storage[layer, block]``, one contiguous range). Both
sides of a transfer have the same storage layout (same model, TP 1), so equal KV gives
equal digests. The hash is XXH3-128 where the ``xxhash`` package is installed (8 GB/s
on one core of the development host, against BLAKE2b's 0.8:
benchmarks/results/s63_kv_digest/), else
BLAKE2b from the standard library; prefill names the one it used and decode hashes its
blocks with that one. The check is against faults (late or misplaced WRITEs, a byte
changed in flight, a block reused too early), not an adversary: the signed params and
the CURVE side channel keep those out.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

DIGEST_SIZE = 16
#: the digest of a block prefill did not send (decode's check fails on it)
MISSING = bytes(DIGEST_SIZE)


def _hashers() -> dict[str, Callable[[], Any]]:
    found: dict[str, Callable[[], Any]] = {
        "blake2b": lambda: hashlib.blake2b(digest_size=DIGEST_SIZE)}
    try:
        import xxhash
    except ImportError:
        return found
    return {"xxh3_128": xxhash.xxh3_128, **found}


#: the hashes this process can compute, the preferred one first
HASHERS = _hashers()


class BlockDigests:
    """Digests of blocks of one region (``storage``: ``[layer, block, ...]``)."""

    def __init__(self, storage: Any) -> None:
        self.storage = storage
        self.num_layers = int(storage.shape[0])
        self.algorithm = next(iter(HASHERS))  # what we send

    def of(self, block_ids: Sequence[int], algorithm: str | None = None) -> list[bytes]:
        """One digest per block id, in order (``algorithm``: one of :data:`HASHERS`,
        by default ours)."""
        import torch

        new = HASHERS[algorithm or self.algorithm]
        out = []
        for block in block_ids:
            h = new()
            for layer in range(self.num_layers):
                t = self.storage[layer, block]
                if t.device.type != "cpu":
                    t = t.cpu()
                h.update(t.view(torch.uint8).numpy().data)
            out.append(h.digest())
        return out


def mismatches(want: Sequence[bytes] | None, got: Sequence[bytes]) -> list[int]:
    """Positions (0-based in ``got``) whose digest differs from ``want``'s; all of them
    when ``want`` is missing or of another length."""
    if want is None or len(want) != len(got):
        return list(range(len(got)))
    return [i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a != b]


def unusable(sent: bool, algorithm: str) -> str | None:
    """Why prefill's digests cannot be checked here, or None."""
    if not sent:
        return ("KV digest missing: this decode instance checks KV (--kv-digest) and the "
                "prefill instance sent no digest (start it with --kv-digest too)")
    if algorithm not in HASHERS:
        return (f"KV digest {algorithm[:32]!r} cannot be checked here (this instance has "
                f"{', '.join(HASHERS)}; pip install xxhash)")
    return None


def mismatch_reason(bad: Sequence[int], first: int, total: int) -> str:
    """The failure's words: which prompt blocks (``first``-based) failed the check."""
    shown = ", ".join(str(first + i) for i in bad[:8]) + (" ..." if len(bad) > 8 else "")
    return (f"KV digest mismatch in {len(bad)} of {total} block(s) (prompt block "
            f"{shown}): the KV that arrived is not the KV prefill computed")
