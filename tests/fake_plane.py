"""A stand-in engine core's request plane, for router tests that script what an instance
answers: a plain (no secret) ZMQ ROUTER on 127.0.0.1 that records each
``SubmitRequest`` and answers it with what ``answer`` returns (a few token ids, finished;
or a refusal), on a thread of its own. Serve its ``address`` as the instance's
/kv/info ``request_plane`` (with ``request_plane_members: False``)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import msgspec
import zmq

from kvpush.engine.inputs import FrontCommand, SubmitRequest, UtilityCall
from kvpush.engine.outputs import (
    EngineOutput,
    EngineOutputs,
    FinishReason,
    RequestFailure,
    UtilityReply,
)

#: what a plane answers a request with: its output tokens, or a refusal
Answer = list[int] | RequestFailure


class FakePlane:
    def __init__(self, answer: Callable[[SubmitRequest], Answer]) -> None:
        self.answer = answer
        #: every request received, in order
        self.requests: list[SubmitRequest] = []
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"127.0.0.1:{port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="fake-plane")
        self._thread.start()

    def _run(self) -> None:
        dec = msgspec.msgpack.Decoder(FrontCommand)
        enc = msgspec.msgpack.Encoder()
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):  # (the stop flag's bound: tests only)
                continue
            who, frame = self._sock.recv_multipart()
            cmd = dec.decode(frame)
            if isinstance(cmd, UtilityCall):
                reply = EngineOutputs(replies=[UtilityReply(cmd.call_id)])
            elif isinstance(cmd, SubmitRequest):
                self.requests.append(cmd)
                reply = EngineOutputs(outputs=[self._outputs(cmd)])
            else:  # aborts: every request here has finished already
                continue
            self._sock.send_multipart([who, enc.encode(reply)])

    def _outputs(self, cmd: SubmitRequest) -> EngineOutput:
        got = self.answer(cmd)
        if isinstance(got, RequestFailure):
            return EngineOutput(cmd.request_id, [], finish_reason=FinishReason.ERROR,
                                failure=got)
        return EngineOutput(cmd.request_id, got, finish_reason=FinishReason.LENGTH,
                            num_prompt_tokens=len(cmd.prompt_token_ids),
                            num_output_tokens=len(got))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()
        self._ctx.term()
