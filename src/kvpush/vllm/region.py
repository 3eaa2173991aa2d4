"""vLLM's KV cache as one kvpush KV region.

vLLM 0.32 puts every layer's KV in one backing allocation; with its default CPU layout
(``LBHNC``) layer ``l``'s view is ``[block, kv_head, token, K|V of head_dim]``,
contiguous, at ``l * layer_bytes`` from the base: one layer of one block is one
contiguous range, so kvpush's descriptors (one per layer per run of consecutive block
ids) apply unchanged. The layout is announced as :data:`VLLM_LBHNC`; a peer with another
layout (a kvpush instance: ``head-major``) is refused at the handshake, naming both.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kvpush.config import dtype_name
from kvpush.errors import ConfigError
from kvpush.kv_cache.kv_region import KVLayout

#: vLLM's layer-compact CPU layout: [layer, block, kv_head, token, K|V (2 x head_dim)]
VLLM_LBHNC = "vllm-LBHNC:L,B,H,T,2D"


@dataclass(frozen=True)
class VllmRegion:
    """Where vLLM's KV cache lies and how a peer addresses it."""

    base: int
    nbytes: int
    layout: KVLayout
    layer_of: Mapping[str, int]  # vLLM's layer name -> layer index


def vllm_region(kv_caches: Mapping[str, torch.Tensor]) -> VllmRegion:
    """The region of ``kv_caches`` (``register_kv_caches``' argument); ConfigError when
    vLLM laid it out in a way kvpush cannot address."""
    if not kv_caches:
        raise ConfigError("kvpush connector: vLLM registered no KV cache")
    tensors = list(kv_caches.values())
    first = tensors[0]
    storage = first.untyped_storage()
    base, nbytes = storage.data_ptr(), storage.nbytes()
    if first.dim() != 4 or any(t.shape != first.shape or t.dtype != first.dtype
                               for t in tensors):
        raise ConfigError(f"kvpush connector: expected one [block, head, token, K|V] KV "
                          f"view per layer, got shapes {sorted({tuple(t.shape) for t in tensors})}")
    num_blocks, heads, tokens, content = first.shape
    elem = first.element_size()
    block_bytes = heads * tokens * content * elem
    layer_bytes = num_blocks * block_bytes
    layer_of: dict[str, int] = {}
    for name, t in kv_caches.items():
        offset = t.data_ptr() - base
        if (not t.is_contiguous() or t.untyped_storage().data_ptr() != base
                or offset % layer_bytes or content % 2):
            raise ConfigError(
                "kvpush connector: vLLM's KV cache is not layer-compact with contiguous "
                f"blocks (layer {name}: strides {t.stride()}, offset {offset}); run with "
                "the default CPU layout (VLLM_KV_CACHE_LAYOUT unset or LBHNC)")
        layer_of[name] = offset // layer_bytes
    num_layers = len(set(layer_of.values()))
    if sorted(set(layer_of.values())) != list(range(num_layers)) \
            or num_layers * layer_bytes > nbytes:
        raise ConfigError("kvpush connector: vLLM's layers do not tile its KV allocation "
                          f"({num_layers} layers of {layer_bytes} bytes in {nbytes})")
    layout = KVLayout(layout=VLLM_LBHNC, num_layers=num_layers, num_blocks=num_blocks,
                      block_size=tokens, num_kv_heads=heads, head_dim=content // 2,
                      dtype=dtype_name(first.dtype), block_bytes=block_bytes,
                      layer_bytes=layer_bytes)
    return VllmRegion(base, num_layers * layer_bytes, layout, layer_of)
