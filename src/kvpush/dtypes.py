"""The dtypes kvpush computes and caches KV in, by name.

Configuration, ``/kv/info`` and the API process use :class:`Dtype` (a name and a byte
width) and never import torch; the engine core maps it to a ``torch.dtype``
(:meth:`Dtype.torch`) where it builds the model and the KV region.
"""

from __future__ import annotations

import enum
from typing import Any


class Dtype(enum.StrEnum):
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return 4 if self is Dtype.FLOAT32 else 2

    def torch(self) -> Any:
        """The ``torch.dtype`` (imports torch)."""
        import torch

        return getattr(torch, self.value)

    @classmethod
    def of(cls, value: Any) -> Dtype:
        """A Dtype from itself, its name, or a ``torch.dtype`` of the same name."""
        if isinstance(value, cls):
            return value
        return cls(str(value).removeprefix("torch."))


#: the names ``--dtype`` / ``--kv-dtype`` take (vLLM's ``float`` and ``half`` included)
NAMES: dict[str, Dtype] = {
    "float32": Dtype.FLOAT32,
    "fp32": Dtype.FLOAT32,
    "float": Dtype.FLOAT32,
    "half": Dtype.FLOAT16,
    "bfloat16": Dtype.BFLOAT16,
    "bf16": Dtype.BFLOAT16,
    "float16": Dtype.FLOAT16,
    "fp16": Dtype.FLOAT16,
}
