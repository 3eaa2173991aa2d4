"""An instance's door has the router's defences (issue 53, point 4): `kvpush serve`'s app
served by uvicorn with kvpush.server.door on 127.0.0.1 over a fake engine. 1,100
half-sent requests do not keep a normal client out: those beyond the connection bound
are answered 503 at once, the rest are closed at the header deadline, and then a normal
client is served; a body sent too slowly is a 408. Every loop is bounded in count and
time; every socket opened here is closed here."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from fake_engine import FakeEngine, make_test_model
from kvpush.server.app import build_app
from kvpush.server.cli import add_serve_parser
from kvpush.server.door import default_max_connections, uvicorn_options
from server_helpers import closed_by_peer, raised_descriptor_limit

pytestmark = pytest.mark.timeout(120)

BODY = json.dumps({"prompt": "hello", "max_tokens": 2}).encode()


@pytest.fixture(autouse=True)
def enough_descriptors() -> Iterator[None]:
    """This process holds both ends of every connection (up to ~2,300 descriptors)."""
    with raised_descriptor_limit(2400):
        yield


class Instance:
    """The instance's app over a FakeEngine, served on a thread with the door."""

    def __init__(self, tmp_path, header_timeout_s: float, max_connections: int,
                 body_timeout_s: float = 30.0) -> None:
        import uvicorn

        config, tokenizer = make_test_model(tmp_path / "m")
        app = build_app(FakeEngine(config, tokenizer), body_timeout_s=body_timeout_s)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(
            app, log_level="warning", access_log=False, timeout_graceful_shutdown=2,
            **uvicorn_options(header_timeout_s, max_connections)))
        self.thread = threading.Thread(target=self.server.run,
                                       kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "not started"
            time.sleep(0.02)

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", int(self.url.rsplit(":", 1)[1])),
                                        timeout=10)

    def post(self, **kw: Any) -> httpx.Response:
        return httpx.post(self.url + "/v1/completions", content=BODY, timeout=10,
                          headers={"Content-Type": "application/json"}, **kw)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()
        assert not self.thread.is_alive()


def test_half_sent_requests_do_not_keep_a_normal_client_out(tmp_path):
    # the header deadline is long enough that the server (a thread of this process,
    # sharing its GIL with the connecting loop) has accepted all 1,100 before it closes
    # the first, even on a loaded host (idle, that takes well under a second)
    inst = Instance(tmp_path, header_timeout_s=15.0, max_connections=1000)
    conns: list[socket.socket] = []
    try:
        assert inst.post().status_code == 200
        for _ in range(1100):
            s = inst.connect()
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: i\r\nContent-Ty")
            conns.append(s)
        t0 = time.monotonic()
        answers = [closed_by_peer(s, 20) for s in conns]
        elapsed = time.monotonic() - t0
        assert all(a is not None for a in answers), sum(a is None for a in answers)
        refused = [a for a in answers if a.startswith(b"HTTP/1.1 503")]
        assert len(refused) >= 100, len(refused)  # beyond the bound: refused at once
        assert all(b"too_many_connections" in a for a in refused)
        assert elapsed < 30, elapsed  # the rest: closed at the 15 s header deadline
        for s in conns:
            s.close()
        conns.clear()
        deadline = time.monotonic() + 10  # the server's ends of them close too
        while (r := inst.post()).status_code == 503:
            assert time.monotonic() < deadline, r.text
            time.sleep(0.05)
        assert r.status_code == 200, r.text
    finally:
        for s in conns:
            s.close()
        inst.stop()


def test_a_body_sent_too_slowly_is_a_408_and_the_instance_keeps_serving(tmp_path):
    inst = Instance(tmp_path, header_timeout_s=5.0, max_connections=64, body_timeout_s=0.5)
    s = inst.connect()
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: i\r\nContent-Type: "
                  b"application/json\r\nContent-Length: %d\r\n\r\n" % len(BODY) + BODY[:5])
        answer = closed_by_peer(s, 10) or b""
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert b"request_timeout" in answer
        assert inst.post().status_code == 200
    finally:
        s.close()
        inst.stop()


def test_serve_has_the_door_flags_with_a_bound_below_the_descriptor_limit():
    import argparse
    import resource

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(["serve", "m"])
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert (args.header_timeout, args.body_timeout) == (10.0, 30.0)
    assert args.max_client_connections == default_max_connections()
    if soft != resource.RLIM_INFINITY:
        assert args.max_client_connections < max(soft, 320)
    args = parser.parse_args(["serve", "m", "--header-timeout", "2", "--body-timeout", "3",
                              "--max-client-connections", "50"])
    assert (args.header_timeout, args.body_timeout, args.max_client_connections) == (2, 3, 50)
