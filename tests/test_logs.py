"""Quiet, structured logs (issue 66, point 4): an instance's access log leaves out the
router's probes (/health, /kv/prove, /kv/info) unless told otherwise
(--disable-access-log-for-endpoints), every record carries the wall-clock UTC time,
--log-format json writes one JSON object per line (serve, router, up's children alike),
hand-off timelines are DEBUG, and `kvpush up`'s crash tail has no probe lines."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

from kvpush.cli import build_parser
from kvpush.cluster.cli import router_argv, serve_argv
from kvpush.cluster.launcher import Child, ChildSpec
from kvpush.logs import EndpointFilter, JsonFormatter, TextFormatter, is_probe_line
from server_helpers import ServerProcess


def _access(path: str) -> logging.LogRecord:
    """A record as uvicorn's access logger makes it."""
    return logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1,
                             '%s - "%s %s HTTP/%s" %d',
                             ("127.0.0.1:5000", "GET", path, "1.1", 200), None)


def test_probe_endpoints_leave_the_access_log():
    f = EndpointFilter(["/health", "/kv/info", "/kv/prove"])
    assert not f.filter(_access("/health")) and not f.filter(_access("/kv/info?x=1"))
    assert f.filter(_access("/v1/completions")) and f.filter(_access("/healthz"))
    assert f.filter(logging.LogRecord("uvicorn.error", logging.INFO, "", 1, "x", None, None))


def test_formats_carry_the_wall_clock():
    rec = _access("/v1/completions")
    obj = json.loads(JsonFormatter().format(rec))
    assert obj["level"] == "INFO" and obj["logger"] == "uvicorn.access"
    assert obj["message"] == '127.0.0.1:5000 - "GET /v1/completions HTTP/1.1" 200'
    t = datetime.fromisoformat(obj["time"])
    assert t.tzinfo is not None and abs(t.timestamp() - rec.created) < 0.002
    text = TextFormatter().format(rec)
    assert text.startswith(obj["time"] + " INFO uvicorn.access: 127.0.0.1:5000")


def test_setup_logging_json_children_and_debug_loggers():
    """In a fresh interpreter: JSON lines, the format handed on to child processes, and
    KVPUSH_DEBUG_LOGGERS raising one logger to DEBUG (the hand-off timeline)."""
    code = textwrap.dedent("""
        import logging, os
        from kvpush.logs import setup_logging
        from kvpush.kv_transfer.timeline import HandoffTimeline
        setup_logging("info", "json")
        print(os.environ["KVPUSH_LOG_FORMAT"], flush=True)
        logging.getLogger("kvpush.x").debug("not shown")
        logging.getLogger("kvpush.x").info("shown")
        t = HandoffTimeline("prefill")
        t.begin("tid-1", "p_added")
        t.emit("tid-1")
    """)
    env = {"KVPUSH_DEBUG_LOGGERS": "kvpush.kv_transfer.handoff", "PATH": "/usr/bin"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "json"
    lines = [json.loads(x) for x in r.stderr.splitlines()]
    assert [x["message"].split(" ")[0] for x in lines] == ["shown", "handoff"]
    assert lines[1]["level"] == "DEBUG" and "transfer=tid-1" in lines[1]["message"]
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, env={"PATH": "/usr/bin"})
    assert [json.loads(x)["message"] for x in r.stderr.splitlines()] == ["shown"]


def test_up_hands_the_format_on(tmp_path):
    args = build_parser().parse_args(["up", "--log-format", "json"])
    assert "--log-format json" in " ".join(serve_argv(args, "m", "decode", 9000, 1))
    rargv = router_argv(args, 9001, ["127.0.0.1:9002"], ["127.0.0.1:9003"])
    assert build_parser().parse_args(rargv[rargv.index("router"):]).log_format == "json"
    sargv = serve_argv(args, "m", "decode", 9000, 1)
    assert build_parser().parse_args(sargv[sargv.index("serve"):]).log_format == "json"
    plain = build_parser().parse_args(["up"])
    assert "--log-format" not in serve_argv(plain, "m", "decode", 9000, 1)


def test_up_crash_tail_has_no_probe_lines(tmp_path: Path):
    log = tmp_path / "decode-0.log"
    probes = ['INFO:     127.0.0.1:1 - "GET /health HTTP/1.1" 200',
              '2026-01-01T00:00:00.000+00:00 INFO uvicorn.access: 127.0.0.1:1 - '
              '"POST /kv/prove HTTP/1.1" 200',
              json.dumps({"message": '127.0.0.1:1 - "GET /kv/info HTTP/1.1" 200'})]
    assert all(is_probe_line(p) for p in probes)
    log.write_text("\n".join(["started", *probes * 30, "Traceback: boom", *probes]) + "\n")
    child = Child(ChildSpec("decode-0", "decode", [], 1), log, None)  # type: ignore[arg-type]
    assert child.log_tail().splitlines() == ["started", "Traceback: boom"]


def test_an_instance_logs_json_without_the_probes(tiny_llama, tmp_path):
    srv = ServerProcess(tiny_llama, "--log-level", "info", "--log-format", "json",
                        log_dir=tmp_path)
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            for _ in range(3):
                assert c.get("/health").status_code == 200
            assert c.get("/kv/info").status_code == 200
            r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200
            assert c.get("/v1/models").status_code == 200
        deadline = time.monotonic() + 10
        while '"GET /v1/models' not in srv.log_path.read_text():
            assert time.monotonic() < deadline, srv.log_path.read_text()
            time.sleep(0.05)
    finally:
        srv.stop()
    lines = [json.loads(x) for x in srv.log_path.read_text().splitlines() if x.strip()]
    messages = [x["message"] for x in lines]
    assert any('"POST /v1/completions HTTP/1.1" 200' in m for m in messages), messages
    assert not any("/health" in m or "/kv/info" in m for m in messages), messages
    loggers = {x["logger"] for x in lines}
    assert {"uvicorn.access", "uvicorn.error", "kvpush.server"} <= loggers, loggers
    assert any(x["logger"].startswith("kvpush.engine") for x in lines), loggers  # the core
    now = datetime.now(timezone.utc).timestamp()
    assert all(now - 300 < datetime.fromisoformat(x["time"]).timestamp() <= now + 1
               for x in lines)
