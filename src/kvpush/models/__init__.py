"""Models kvpush can run: the local model cache, SmolLM2 conversion, random test models.

Importing this package is cheap: its names load on first use (PEP 562), so
`kvpush --help`, which imports :mod:`kvpush.models.cli`, does not pull in torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DEFAULT_MODEL": "registry",
    "KNOWN_MODELS": "registry",
    "cache_root": "registry",
    "install_model": "registry",
    "installed_models": "registry",
    "models_dir": "registry",
    "resolve_model": "registry",
    "PRESETS": "random_model",
    "kv_bytes_per_token": "random_model",
    "make_random_model": "random_model",
    "preset_config": "random_model",
    "convert_smollm2": "convert",
    "find_smollm2_gguf": "convert",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
