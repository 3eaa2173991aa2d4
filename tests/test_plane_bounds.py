"""The request plane's bounds on what one front may cost the core (issue 67, point 6).

A RequestPlane on 127.0.0.1 in this process (no core behind it: its inbox is a queue)
and a CURVE DEALER as the front: a command over the cap sized from ``max_model_len``
closes the front's connection before anything is decoded; a prompt over the context is
refused by its length before any per-token check; undecodable frames are logged at a
bounded rate.
"""

from __future__ import annotations

import logging
import queue

import msgspec
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvpush.config import EngineConfig
from kvpush.crypto.curve import make_client
from kvpush.engine.checks import RequestChecker
from kvpush.engine.core_link import plane_keys
from kvpush.engine.inputs import SubmitRequest
from kvpush.engine.outputs import EngineOutputs
from kvpush.engine.request_plane import RequestPlane, command_cap
from kvpush.errors import RequestError
from kvpush.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(120)

SECRET = b"plane-bounds-test-secret-0123456789"
MAX_LEN = 256


@pytest.fixture
def plane(tiny_llama):
    config = EngineConfig.build(tiny_llama, max_model_len=MAX_LEN, num_blocks=64,
                                block_size=16)
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    p = RequestPlane(inbox, RequestChecker(config), "127.0.0.1", 0, SECRET)
    p.start()
    ctx = zmq.Context()
    front = ctx.socket(zmq.DEALER)
    front.setsockopt(zmq.LINGER, 0)
    make_client(front, plane_keys(SECRET))
    mon = front.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
    front.connect(f"tcp://{p.address}")
    try:
        yield p, inbox, front, mon
    finally:
        front.disable_monitor()
        mon.close(linger=0)
        front.close(linger=0)
        ctx.term()
        p.close()


def _event(mon: zmq.Socket, timeout_ms: int = 5000) -> int:
    assert mon.poll(timeout_ms), "no monitor event"
    return recv_monitor_message(mon)["event"]


def _submit(rid: str, ids: list[int]) -> bytes:
    return msgspec.msgpack.encode(SubmitRequest(rid, ids, SamplingParams(max_tokens=4)))


def test_a_command_over_the_cap_closes_the_connection_undecoded(plane):
    p, inbox, front, mon = plane
    assert _event(mon) == zmq.EVENT_HANDSHAKE_SUCCEEDED
    cap = command_cap(MAX_LEN, 16)
    assert cap < 2 << 20  # not the 16 MiB it was
    front.send(_submit("big", [1] * (cap + 1)))  # 1-byte ints: just over the cap
    assert _event(mon) == zmq.EVENT_DISCONNECTED
    assert inbox.empty()


def test_a_prompt_over_the_context_is_refused_by_its_length_first(plane, tiny_llama):
    p, inbox, front, mon = plane
    # over the context and with an id out of the vocabulary: the length is judged first
    front.send(_submit("long", [10] * MAX_LEN + [10 ** 9]))
    assert front.poll(5000)
    out = msgspec.msgpack.decode(front.recv(), type=EngineOutputs).outputs[0]
    assert out.request_id == "long" and out.failure.code == "context_length_exceeded"
    assert inbox.empty()
    config = EngineConfig.build(tiny_llama, max_model_len=MAX_LEN, num_blocks=64)
    with pytest.raises(RequestError, match="maximum context length"):
        RequestChecker(config).check(["x"] * (MAX_LEN + 1), SamplingParams(max_tokens=1))


def test_undecodable_frames_are_logged_at_a_bounded_rate(plane, caplog):
    p, inbox, front, mon = plane
    with caplog.at_level(logging.WARNING, logger="kvpush.engine"):
        for _ in range(200):
            front.send(b"\xc1 not msgpack")
        front.send(_submit("after", [10, 11, 12]))  # the plane is still there
        for _ in range(50):  # (its answer comes after every frame before it was read)
            cmd = inbox.get(timeout=5)
            if getattr(cmd, "request_id", "").endswith("/after"):
                break
        else:
            pytest.fail("the request after the garbage never reached the inbox")
    lines = [r for r in caplog.records if "cannot decode" in r.getMessage()]
    assert 1 <= len(lines) <= 25, len(lines)  # the budget's burst, not one per frame
