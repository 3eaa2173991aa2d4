"""RemoteCore: a front's asyncio client of one engine core's request plane
(kvpush.engine.request_plane), for fronts other than the core's own API process (the
router). It is a FrontEnd: the same streams, detokenizers and stop strings, aborts on
close, errors; only the checks are the core's (the plane runs RequestChecker on each
``SubmitRequest``, with ``kv_transfer_params`` as the router signed them; a refusal comes
back as the RequestError the instance's own API would raise).

One DEALER, a CURVE client with the keys derived from the cluster secret; the event loop
watches its FD (``add_reader``: no thread, no timer) and drains it until EAGAIN. A socket
monitor says when a handshake succeeded (``proven``: the core holds the secret; the
first one sets it for good) and when the connection dropped: every open stream of this
core then ends at once with an error, and every utility call waiting fails. ZMQ
reconnects by itself (``connected`` again); requests sent meanwhile are refused with a
503 at once (``IMMEDIATE``: nothing queues for a connection that is not up). ZMTP
heartbeats close a connection to a core that went silent within a few seconds.

Each connection opens with a ``Hello``: the core answers with its latest snapshot and
sends every new one after it, whichever front's requests it runs, so ``latest_stats``
(its free blocks, running and waiting requests) follows the core while the link idles.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import zmq

from kvpush.crypto.curve import (
    HANDSHAKE_FAILED,
    REQUEST_PLANE_PURPOSE,
    CurveKeys,
    derive_curve_keys,
    handshake_reason,
    make_client,
)
from kvpush.engine.front import FrontEnd
from kvpush.engine.inputs import (
    AbortRemote,
    AbortRequests,
    FrontCommand,
    Hello,
    SubmitRequest,
    UtilityCall,
)
from kvpush.engine.outputs import (
    EngineOutput,
    EngineOutputs,
    EngineSnapshot,
    EngineStats,
    FinishReason,
    RequestError,
    RequestFailure,
)
from kvpush.engine.request_plane import HEARTBEAT, MAX_MESSAGE_BYTES
from kvpush.kv_info import KVInfo
from kvpush.kv_transfer.params import GivenKVParams, WireKVParams
from kvpush.kv_transfer.wire.link_watch import monitor_events
from kvpush.sampling_params import SamplingParams

log = logging.getLogger("kvpush.engine.core_link")

_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED
#: longest wait (ms) between two reconnection attempts
RECONNECT_IVL_MAX_MS = 1000
#: the snapshot until the core's first batch brings one
NO_SNAPSHOT = EngineSnapshot(EngineStats(0, 0, 0, 0, 0, 0, 0))


def plane_keys(secret: bytes) -> CurveKeys:
    """The request planes' CURVE keys, from the cluster secret."""
    return derive_curve_keys(secret, REQUEST_PLANE_PURPOSE)


class RemoteCore(FrontEnd):
    def __init__(self, address: str, keys: CurveKeys | None, tokenizer: Any, *,
                 ctx: zmq.Context | None = None):
        """``address``: the core's request plane, "host:port" (its /kv/info's
        ``request_plane``); ``keys``: the request planes' CURVE keys (``plane_keys``:
        derived from the cluster secret); ``ctx``: a ZMQ context to share (default: one
        of its own, terminated by ``close``)."""
        super().__init__(None, tokenizer, NO_SNAPSHOT)
        self.address = address
        #: a handshake with the core succeeded once: it holds the cluster secret
        self.proven = False
        #: a connection to the core is up now
        self.connected = False
        #: called on the event loop when a connection that was up drops (its streams
        #: have failed already)
        self.on_lost: Callable[[str], None] | None = None
        self._refused: str | None = None  # why the last handshake failed
        self._own_ctx = ctx is None
        self._ctx = ctx if ctx is not None else zmq.Context(io_threads=1)
        sock = self._sock = self._ctx.socket(zmq.DEALER)
        for opt, value in [(zmq.LINGER, 0), (zmq.IMMEDIATE, 1),
                           (zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS),
                           (zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES), *HEARTBEAT]:
            sock.setsockopt(opt, value)
        if keys is not None:  # (None: a plain plane, a cluster without a secret)
            make_client(sock, keys)
        self._mon = sock.get_monitor_socket(_EVENTS, f"inproc://kvpush-core-link-{id(self)}")
        self._mon.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{address}")
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(EngineOutputs)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._up: asyncio.Event | None = None
        self._drain_due = False
        self._closed = False

    def __repr__(self) -> str:
        return f"RemoteCore({self.address})"

    # ---- life cycle -----------------------------------------------------------------
    def start(self) -> None:
        """Watch the sockets on the running event loop (once; ``wait_connected`` and
        ``generate`` call it)."""
        if self._loop is not None or self._closed:
            return
        loop = self._loop = asyncio.get_running_loop()
        self._up = asyncio.Event()
        loop.add_reader(self._sock.fileno(), self._drain)
        loop.add_reader(self._mon.fileno(), self._watch)
        self._watch()

    async def wait_connected(self, timeout: float) -> bool:
        """Whether a connection to the core is up (waiting at most ``timeout`` s)."""
        self.start()
        assert self._up is not None
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._up.wait(), timeout)
        return self.connected

    async def shutdown(self) -> None:
        self.close()

    def close(self) -> None:
        """End every open stream, close the connection (the core aborts what is left)."""
        if self._closed:
            return
        self._closed = True
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._sock.fileno())
            self._loop.remove_reader(self._mon.fileno())
        self.fail_all(f"the connection to the engine core at {self.address} was closed")
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disable_monitor()
        self._mon.close()
        self._sock.close()
        if self._own_ctx:
            self._ctx.term()

    def latest_stats(self) -> EngineStats | None:
        """The core's gauges as its latest snapshot says; None while no connection is
        up, or before the core's first snapshot on this one."""
        seen = self.connected and self._snapshot is not NO_SNAPSHOT
        return self._snapshot.stats if seen else None

    # ---- FrontEnd -------------------------------------------------------------------
    def _core_problem(self) -> str | None:
        if self._closed:
            return f"the connection to the engine core at {self.address} was closed"
        if self.connected:
            return None
        why = f" (its handshake failed: {self._refused})" if self._refused else ""
        return f"no connection to the engine core at {self.address}{why}"

    def _add(self, internal: str, prompt_token_ids: list[int], params: SamplingParams,
             kv_transfer_params: GivenKVParams | None
             ) -> tuple[FrontCommand, SamplingParams]:
        """The core checks it (its own instance's RequestChecker); a prefill leg's
        stream has one choice, as the core runs it (RequestChecker.leg_params)."""
        kv = kv_transfer_params
        if kv is not None and not isinstance(kv, WireKVParams):
            raise TypeError("RemoteCore takes kv_transfer_params as WireKVParams")
        add = SubmitRequest(internal, list(prompt_token_ids), params, kv)
        if kv is not None and kv.do_remote_decode:
            params = dataclasses.replace(params, n=1)
        return add, params

    def stream(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               kv_transfer_params: GivenKVParams | None = None
               ) -> AsyncIterator[EngineOutput]:
        """FrontEnd.stream, with ``kv_transfer_params`` as the router signed them."""
        self.start()
        return super().stream(request_id, prompt_token_ids, params, kv_transfer_params)

    async def kv_info(self) -> KVInfo:
        self.start()
        return await super().kv_info()

    def _send(self, cmd: FrontCommand) -> None:
        if isinstance(cmd, AbortRequests):  # in this front's ids
            cmd = AbortRemote(cmd.request_ids)
        frame = self._enc.encode(cmd)  # (an encoding error is the caller's)
        try:
            self._sock.send(frame, zmq.NOBLOCK)
        except zmq.ZMQError as e:  # EAGAIN: no connection up (or its queue is full)
            why = self._core_problem() or f"the engine core at {self.address}: {e}"
            self._refuse(cmd, why)
            return
        if not self._drain_due and self._loop is not None:
            # a send may take in what arrived, leaving the FD quiet: look at it again
            self._drain_due = True
            self._loop.call_soon(self._drain)

    def _refuse(self, cmd: Any, why: str) -> None:
        if isinstance(cmd, SubmitRequest):
            queue = self._streams.get(cmd.request_id)
            if queue is not None:
                queue.put_nowait(EngineOutput(
                    cmd.request_id, [], finish_reason=FinishReason.ERROR,
                    failure=RequestFailure(why, True, None, "unavailable", 503)))
        elif isinstance(cmd, UtilityCall):
            fut = self._calls.get(cmd.call_id)
            if fut is not None and not fut.done():
                fut.set_exception(RequestError(why, code="unavailable", status_code=503))
        else:
            log.info("%s: %s not sent: %s", self, type(cmd).__name__, why)

    def _loop_died(self, why: str) -> None:
        """The core's loop died: its streams fail, and its instance leaves the rotation
        as on a dropped connection."""
        super()._loop_died(why)
        if self.on_lost is not None:
            self.on_lost(why)

    # ---- the core's reports (event loop callbacks) ------------------------------------
    def _drain(self) -> None:
        self._drain_due = False
        if self._closed:
            return
        while True:
            try:
                frame = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                batch = self._dec.decode(frame)
            except msgspec.DecodeError:
                log.error("%s: a batch it cannot decode; dropped", self, exc_info=True)
                continue
            self.dispatch(batch)

    def _watch(self) -> None:
        """The monitor's events: handshakes and drops (what arrived before a drop is
        dispatched first: a stream that finished is not failed)."""
        if self._closed:
            return
        self._drain()
        assert self._up is not None
        for event, value in monitor_events(self._mon):
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                if not self.proven:
                    log.info("%s: connected, the core proved the cluster secret", self)
                self.proven = self.connected = True
                self._refused = None
                self.fatal = None  # (a core at this address again: a new one)
                self._up.set()
                self._sock.getsockopt(zmq.EVENTS)  # (attaches the connection's pipe)
                self._send(Hello())
            elif event == zmq.EVENT_DISCONNECTED:
                if self.connected:
                    self.connected = False
                    self._snapshot = NO_SNAPSHOT
                    self._up.clear()
                    why = self.fatal or f"the engine core connection was lost ({self.address})"
                    log.warning("%s", why)
                    self.fail_all(why)
                    if self.on_lost is not None:
                        self.on_lost(why)
            elif event & HANDSHAKE_FAILED:
                reason = handshake_reason(event, value)
                if reason != self._refused:
                    log.warning("%s: handshake refused (%s): not the cluster's secret?",
                                self, reason)
                self._refused = reason
