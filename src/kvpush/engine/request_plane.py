"""The engine core's request plane: other fronts (routers) send it the engine's typed
requests and read its outputs, with no HTTP (cores with a cluster secret, and P/D cores
of a cluster run without one on a trusted network: --insecure-kv-params, plain TCP).

    front (RemoteCore: DEALER) ──CURVE/TCP──▶ ROUTER, ``kvpush-request-plane`` thread:
      SubmitRequest: RequestChecker, then AddRequest("~<n>/<its id>") ─▶ engine.inbox
    EngineOutputs, one per turn and front ◀── its queue ◀── ``split`` (on the step loop)
    EngineSnapshot, each new one, to every front ◀──┘ (Hello: the latest, at once)

CURVE keys come from the cluster secret (purpose ``request plane``) and ZAP admits only
the cluster's client key: an endpoint that cannot finish the handshake reaches nothing.
Each connection is a front numbered ``n``, whose requests run as ``~<n>/<its id>``
(FrontEnd never starts an id with ``~``) with ``AddRequest.front = n``, which their
outputs carry back (``EngineOutput.front``). ``split`` takes the remote outputs and utility
replies (negative call ids, assigned here) out of each batch and hands them over through
a queue and an eventfd, with each snapshot that differs from the last one handed over
(at most one per ``core_loop.SNAPSHOT_S`` while the core is busy, and one when it
idles): every front gets it, so a router's view of the core's gauges (its free blocks)
follows the core whichever front drives it. The local API process gets the rest.
Only that queue and the inbox cross threads. A front that vanishes (its connection
closes, or is silent past the ZMTP heartbeat timeout) or stops reading (``SNDHWM``) has
its live requests aborted. (ROUTER_NOTIFY is a draft option, not in pyzmq's libzmq: the monitor's
DISCONNECTED event, its value the fd, names the front whose first message had that
ZMQ_SRCFD.)
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import threading
from dataclasses import dataclass, field

import msgspec
import zmq

from kvpush.crypto.curve import REQUEST_PLANE_PURPOSE, ZapGuard, derive_curve_keys, make_server
from kvpush.engine.checks import RequestChecker
from kvpush.engine.inputs import (
    REMOTE_MARK,
    AbortRemote,
    AbortRequests,
    AbortTransfer,
    AddRequest,
    Hello,
    PlaneCommand,
    SubmitRequest,
    UtilityCall,
    request_of,
    submitted_id,
)
from kvpush.engine.outputs import EngineOutputs, EngineSnapshot, rejected
from kvpush.errors import RequestError
from kvpush.kv_transfer.wire.link_watch import monitor_events
from kvpush.ratelog import LogBudget

log = logging.getLogger("kvpush.engine.request_plane")

#: the CURVE keys' purpose (derive_curve_keys): other keys than the side channel's
PURPOSE = REQUEST_PLANE_PURPOSE
#: ZMTP heartbeats (ms), both ends: a PING a second, a connection silent 3 s is closed
HEARTBEAT = [(zmq.HEARTBEAT_IVL, 1000), (zmq.HEARTBEAT_TIMEOUT, 3000),
             (zmq.HEARTBEAT_TTL, 3000)]
#: the largest batch a front takes from the core
MAX_MESSAGE_BYTES = 16 << 20
#: what a command may hold beside its prompt's token ids and block hashes: sampling
#: parameters (their stop strings, logit bias and stop ids are capped by the request
#: limits), the rest of its signed kv_transfer_params
COMMAND_OVERHEAD_BYTES = 1 << 20


def command_cap(max_model_len: int, block_size: int) -> int:
    """The largest command a front may send (a bigger one closes its connection, before
    any of it is decoded): a prompt of ``max_model_len`` token ids (at most 9 bytes each
    in msgpack), a block hash per block of it (hex, with its framing: 80 bytes) and the
    rest. The front checks the length first: a longer prompt is its 400."""
    return max_model_len * 9 + (max_model_len // block_size + 1) * 80 + COMMAND_OVERHEAD_BYTES

#: batches queued for one front before it counts as gone (it stopped reading): a
#: front that reads nothing holds at most this many in the core's memory
SNDHWM = 1_000
#: commands ZMQ queues from one front before it stops reading its connection (the
#: plane's thread reads them as they come: this bounds only a burst)
RCVHWM = 64
#: frames read per wake-up at most (the outputs' queue is served in between)
MAX_BATCH = 1024
#: ids of fronts seen gone, remembered so that their late frames are dropped
MAX_GONE = 4096


@dataclass(eq=False)
class _Front:
    n: int
    ident: bytes
    fd: int
    live: set[str] = field(default_factory=set)  # its ids of requests in the core

    @property
    def prefix(self) -> str:  # of its requests' ids in the core
        return f"{REMOTE_MARK}{self.n}/"


class RequestPlane:
    def __init__(self, inbox: queue.SimpleQueue, checker: RequestChecker, host: str,
                 port: int, secret: bytes | None):
        """``secret``: the cluster secret (CURVE, members only); None: a plain plane,
        for a cluster that runs without one (--insecure-kv-params: a trusted network)."""
        self._inbox = inbox
        self._checker = checker
        self._queue: queue.SimpleQueue[EngineOutputs | None] = queue.SimpleQueue()
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._ctx = zmq.Context(io_threads=1)
        keys = derive_curve_keys(secret, PURPOSE) if secret else None
        self._zap = ZapGuard(self._ctx, keys) if keys is not None else None
        sock = self._sock = self._ctx.socket(zmq.ROUTER)
        for opt, value in [(zmq.LINGER, 500),
                           (zmq.MAXMSGSIZE, command_cap(checker.max_model_len, checker.block_size)),
                           (zmq.SNDHWM, SNDHWM), (zmq.RCVHWM, RCVHWM),
                           (zmq.ROUTER_MANDATORY, 1),
                           *HEARTBEAT]:
            sock.setsockopt(opt, value)
        if keys is not None:
            make_server(sock, keys)
        self._mon = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED,
                                            f"inproc://kvpush-request-plane-{id(self)}")
        try:
            sock.bind(f"tcp://{host}:{port or '*'}")
        except zmq.ZMQError:
            self._close_sockets()
            os.close(self._wake)
            raise
        bound = str(sock.last_endpoint, "ascii")  # type: ignore[arg-type]  # (bytes)
        self.address = f"{host}:{bound.rsplit(':', 1)[1]}"
        #: set by the plane's thread before a front's first command reaches the inbox:
        #: until then ``split`` hands every batch to the local front untouched
        self.in_use = False
        #: the newest snapshot of a batch ``split`` saw (a Hello's answer), and the last
        #: one it handed over (the step loop's)
        self._latest: EngineSnapshot | None = None
        self._handed: EngineSnapshot | None = None
        self._thread = threading.Thread(target=self._run, name="kvpush-request-plane",
                                        daemon=True)
        self._fronts: dict[bytes, _Front] = {}  # (the rest: the plane thread's own)
        self._by_n: dict[int, _Front] = {}
        self._by_fd: dict[int, _Front] = {}
        self._gone: dict[bytes, None] = {}  # oldest first
        self._calls: dict[int, tuple[int, int]] = {}  # our call id -> (front n, its id)
        self._seq = itertools.count(1)
        self._call_seq = itertools.count(1)
        self._dec = msgspec.msgpack.Decoder(PlaneCommand)
        self._undecodable = LogBudget(log)
        self._enc = msgspec.msgpack.Encoder()

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, stop the thread, close the socket (after the step loop)."""
        if not self._thread.is_alive():
            if self._thread.ident is None:  # never started
                self._close_sockets()
            os.close(self._wake)
            return
        self._queue.put(None)
        os.eventfd_write(self._wake, 1)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            os.close(self._wake)

    # ---- the step loop's side ---------------------------------------------------------
    def split(self, batch: EngineOutputs) -> EngineOutputs | None:
        """Hand the remote fronts' outputs and replies of ``batch`` to the plane's thread;
        returns the rest, for the local front (None: nothing for it), with the request
        metrics of every front's requests (the instance's /metrics exports them)."""
        snapshot = batch.snapshot
        if snapshot is not None:
            self._latest = snapshot  # (before ``in_use`` is read: a Hello sees it)
        if not self.in_use:
            return batch
        mine = [o for o in batch.outputs if o.front]
        calls = [r for r in batch.replies if r.call_id < 0]
        new = snapshot is not None and snapshot != self._handed
        if mine or calls or new or batch.fatal is not None:
            if new:
                self._handed = snapshot
            self._queue.put(EngineOutputs(mine, [], calls, snapshot if new else None,
                                          batch.fatal))
            os.eventfd_write(self._wake, 1)
        if not mine and not calls:
            return batch
        outputs = [o for o in batch.outputs if not o.front]
        replies = [r for r in batch.replies if r.call_id >= 0]
        if not (outputs or replies or batch.transfers or batch.snapshot is not None
                or batch.fatal is not None or batch.stats is not None):
            return None
        return EngineOutputs(outputs, batch.transfers, replies, batch.snapshot, batch.fatal,
                             batch.stats)

    # ---- the plane's thread -----------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        for s in (self._mon, self._sock, self._wake):
            poller.register(s, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if self._mon in ready:
                    self._events()
                if self._sock in ready:
                    self._read()
                if self._wake in ready:
                    with contextlib.suppress(BlockingIOError):
                        os.eventfd_read(self._wake)
                    if not self._deliver():
                        return
        except Exception:
            log.exception("the request plane's thread died; remote fronts are cut off")
        finally:
            self._close_sockets()

    def _close_sockets(self) -> None:
        self._mon.close(linger=0)
        self._sock.close()  # lingers (500 ms) for the last outputs
        if self._zap is not None:
            self._zap.stop()
        self._ctx.term()

    def _events(self) -> None:
        for event, fd in monitor_events(self._mon):
            front = self._by_fd.get(fd) if event == zmq.EVENT_DISCONNECTED else None
            if front is not None:
                self._drop(front, "its connection closed")

    def _read(self) -> None:
        for _ in range(MAX_BATCH):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frames) != 2:  # (not from a RemoteCore)
                continue
            ident = frames[0].bytes
            front = self._fronts.get(ident)
            if front is None and ident not in self._gone:  # a new connection
                self._events()  # first the closes of older ones: their fd may be its
                fd = frames[1].get(zmq.SRCFD)
                if fd in self._by_fd:  # (a close missed: its fd is another's now)
                    self._drop(self._by_fd[fd], "its connection closed")
                front = _Front(next(self._seq), ident, fd)
                self._fronts[ident] = self._by_n[front.n] = self._by_fd[fd] = front
                log.info("request plane %s: front ~%d connected", self.address, front.n)
            if front is not None:
                self._handle(front, frames[1].bytes)

    def _drop(self, front: _Front, why: str) -> None:
        self._fronts.pop(front.ident, None)
        self._by_n.pop(front.n, None)
        if self._by_fd.get(front.fd) is front:
            del self._by_fd[front.fd]
        self._gone[front.ident] = None
        if len(self._gone) > MAX_GONE:
            del self._gone[next(iter(self._gone))]
        if front.live:
            self._inbox.put(AbortRequests([front.prefix + rid for rid in front.live]))
        log.info("request plane %s: front ~%d gone (%s); %d of its requests aborted",
                 self.address, front.n, why, len(front.live))
        front.live.clear()

    def _handle(self, front: _Front, payload: bytes) -> None:
        try:
            cmd = self._dec.decode(payload)
        except msgspec.DecodeError as e:  # ValidationError too: e.g. bad sampling params
            rid = submitted_id(payload)
            if rid is not None:  # its front waits for an answer
                self._send(front, EngineOutputs([rejected(rid, RequestError(str(e)))]))
            self._undecodable.log(logging.WARNING, "request plane: front ~%d sent what it "
                                  "cannot decode: %s", front.n, e)
            return
        match cmd:
            case Hello():
                self.in_use = True  # (before ``_latest`` is read: split hands on the rest)
                if self._latest is not None:
                    self._send(front, EngineOutputs(snapshot=self._latest), drop=False)
            case SubmitRequest():
                self._submit(front, cmd)
            case AbortRemote(request_ids=ids):
                ids = [front.prefix + rid for rid in ids if request_of(rid) in front.live]
                if ids:
                    self._inbox.put(AbortRequests(ids))
            case AbortTransfer():
                self._inbox.put(cmd)
            case UtilityCall(call_id=call_id, method=method):
                ours = -next(self._call_seq)
                self._calls[ours] = (front.n, call_id)
                self.in_use = True
                self._inbox.put(UtilityCall(ours, method))

    def _submit(self, front: _Front, cmd: SubmitRequest) -> None:
        rid = cmd.request_id
        try:
            if rid in front.live:
                raise RequestError(f"request id {rid!r} is already in use", "request_id")
            if request_of(rid) != rid:  # a choice's id names another request's choice
                raise RequestError("a request id may not hold NUL", "request_id")
            kv, params = self._checker.check(cmd.prompt_token_ids, cmd.params,
                                             cmd.kv_transfer_params)
        except Exception as e:  # noqa: BLE001 - a malformed request is the front's 400
            err = e if isinstance(e, RequestError) else RequestError(str(e))
            self._send(front, EngineOutputs([rejected(rid, err)]))
            return
        front.live.add(rid)
        self.in_use = True
        self._inbox.put(AddRequest(front.prefix + rid, cmd.prompt_token_ids, params, kv,
                                   front=front.n))

    def _deliver(self) -> bool:
        """Send each front its part of the batches queued; False once told to stop."""
        while True:
            try:
                batch = self._queue.get_nowait()
            except queue.Empty:
                return True
            if batch is None:
                return False
            per: dict[int, EngineOutputs] = {}
            for out in batch.outputs:
                front = self._by_n.get(out.front)
                if front is not None:  # (else gone: its requests were aborted)
                    rid = out.request_id[len(front.prefix):]
                    if out.request_finished:
                        front.live.discard(rid)
                    part = per.get(front.n) or per.setdefault(
                        front.n, EngineOutputs([], [], [], batch.snapshot))
                    part.outputs.append(msgspec.structs.replace(out, request_id=rid))
            for reply in batch.replies:
                n, call_id = self._calls.pop(reply.call_id, (0, 0))
                if n in self._by_n:
                    part = per.get(n) or per.setdefault(
                        n, EngineOutputs([], [], [], batch.snapshot))
                    part.replies.append(msgspec.structs.replace(reply, call_id=call_id))
            if batch.fatal is not None:  # the loop died: every front hears why
                for n in self._by_n:
                    part = per.setdefault(n, EngineOutputs([], [], [], batch.snapshot))
                    part.fatal = batch.fatal
            for n, part in per.items():
                self._send(self._by_n[n], part)
            if batch.snapshot is not None:  # every other front: the snapshot alone
                alone = EngineOutputs(snapshot=batch.snapshot)
                for n in [n for n in self._by_n if n not in per]:
                    self._send(self._by_n[n], alone, drop=False)

    def _send(self, front: _Front, batch: EngineOutputs, drop: bool = True) -> None:
        """``drop``: a front that stopped reading is gone (else, for a snapshot alone,
        it is skipped: the next one will do)."""
        try:
            self._sock.send_multipart([front.ident, self._enc.encode(batch)], zmq.NOBLOCK)
        except zmq.Again:
            if not drop:
                return
            log.warning("request plane %s: front ~%d stopped reading (%d batches queued)",
                        self.address, front.n, SNDHWM)
            self._drop(front, "it stopped reading")
        except zmq.ZMQError as e:  # EHOSTUNREACH: gone before its DISCONNECTED arrived
            self._drop(front, str(e))

