"""OpenAI-compatible HTTP front end (`kvpush serve`).

``build_app(engine)`` (in :mod:`kvpush.server.app`) is re-exported lazily so that
importing this package, as ``kvpush --help`` does, stays cheap.
"""

from __future__ import annotations

from typing import Any

__all__ = ["build_app"]


def __getattr__(name: str) -> Any:
    if name == "build_app":
        from kvpush.server.app import build_app

        return build_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
