"""How kvpush's processes log: one record per line on stderr, stamped with the wall clock
(UTC, ISO 8601, milliseconds), as text or, with ``--log-format json``, as one JSON
object (``time``, ``level``, ``logger``, ``message``, ``exception``); uvicorn's records
go through the same handler. The access log leaves out the probe endpoints (the router's
and ``kvpush up``'s: ``/health``, ``/kv/prove``, ``/kv/info``) unless told otherwise
(vLLM's ``--disable-access-log-for-endpoints``).

A process's children (the engine core, its rank processes) log alike: the format
travels in ``KVPUSH_LOG_FORMAT``. ``KVPUSH_DEBUG_LOGGERS`` (comma-separated logger
names) puts those loggers at DEBUG whatever the level (``kvpush bench handoff`` reads
the hand-off timelines, ``kvpush.kv_transfer.handoff``, that way).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable
from datetime import datetime, timezone

LOG_FORMATS = ("text", "json")
LOG_FORMAT_ENV = "KVPUSH_LOG_FORMAT"
DEBUG_LOGGERS_ENV = "KVPUSH_DEBUG_LOGGERS"
#: endpoints the access log leaves out by default: the router's and `kvpush up`'s probes
PROBE_ENDPOINTS = ("/health", "/kv/prove", "/kv/info")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def wall_time(created: float) -> str:
    return datetime.fromtimestamp(created, timezone.utc).isoformat(timespec="milliseconds")


class TextFormatter(logging.Formatter):
    """``TEXT_FORMAT`` with the wall-clock UTC time."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return wall_time(record.created)


class JsonFormatter(logging.Formatter):
    """One JSON object per record."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": wall_time(record.created), "level": record.levelname,
               "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def setup_logging(level: str, log_format: str | None = None) -> None:
    """The root logger at ``level`` with one stderr handler in ``log_format`` (None: the
    parent's, ``KVPUSH_LOG_FORMAT``, else text), handed on to child processes."""
    fmt = log_format or os.environ.get(LOG_FORMAT_ENV) or "text"
    if fmt not in LOG_FORMATS:
        fmt = "text"
    os.environ[LOG_FORMAT_ENV] = fmt
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    for name in os.environ.get(DEBUG_LOGGERS_ENV, "").split(","):
        if name.strip():
            logging.getLogger(name.strip()).setLevel(logging.DEBUG)


class EndpointFilter(logging.Filter):
    """Drops uvicorn access records (args: client, method, path, HTTP version, status)
    whose path, without its query, is one of ``paths``."""

    def __init__(self, paths: Iterable[str]) -> None:
        super().__init__()
        self.paths = frozenset(paths)

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            return args[2].split("?", 1)[0] not in self.paths
        return True


def quiet_access_log(paths: Iterable[str]) -> None:
    """Leave ``paths`` out of uvicorn's access log."""
    paths = [p for p in paths if p]
    if paths:
        logging.getLogger("uvicorn.access").addFilter(EndpointFilter(paths))


def endpoint_list(text: str) -> list[str]:
    """--disable-access-log-for-endpoints: comma-separated paths ("": none)."""
    return [p.strip() for p in text.split(",") if p.strip()]


_PROBE_LINE = re.compile(r'"(?:GET|POST|HEAD) (?:' + "|".join(
    re.escape(p) for p in PROBE_ENDPOINTS) + r')[ ?]')


def is_probe_line(line: str) -> bool:
    """Whether a log line (text or JSON) is an access-log line of a probe."""
    return _PROBE_LINE.search(line.replace('\\"', '"')) is not None
