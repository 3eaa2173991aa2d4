"""The engine core in its own process (``kvpush serve`` starts it; vLLM v1's layout).

    API process (parent)                         engine core (this process)
    CoreClient ── commands: PUSH ipc:// ───────▶ PULL, ``kvpush-core-input`` thread
                                                     └─ LLMEngine.inbox
    dispatch ◀── EngineOutputs: PULL ipc:// ──── PUSH, posted by ``kvpush-step-loop``
    (the event loop watches the PULL socket's FD)
    other fronts ◀── CURVE over TCP ──▶ ROUTER, ``kvpush-request-plane`` thread (with a
                                        cluster secret: engine/request_plane.py)

Messages are msgspec msgpack: kvpush.engine.inputs one way, kvpush.engine.outputs the
other; the first message out is :class:`CoreReady` (or :class:`CoreFailed`: the
engine could not be built, e.g. a port in use). The parent writes the
:class:`CoreSetup` (config included, so the cluster secret never appears on a command
line) pickled on this process's stdin. This process holds the model, the KV region,
the scheduler, the KV transfer thread and the KV event publisher; the parent holds
none of them.

Life: SIGINT is ignored (Ctrl-C reaches the whole process group; the parent stops this
process with a Shutdown once HTTP has drained); SIGTERM ends the loop the same way; the
kernel kills this process if the parent dies (PR_SET_PDEATHSIG, set by the parent's
fork: kvpush.cluster.launcher).
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import zmq

from kvpush.config import EngineConfig
from kvpush.engine.inputs import EngineCommand, Shutdown
from kvpush.engine.outputs import EngineOutputs, EngineSnapshot
from kvpush.kv_transfer.links import TransferLinks
from kvpush.logs import setup_logging

if TYPE_CHECKING:
    from kvpush.engine.request_plane import RequestPlane

log = logging.getLogger("kvpush.engine.core")

@dataclass(frozen=True)
class CoreSetup:
    config: EngineConfig
    #: the parent's bound sockets: commands to the core, outputs from it
    input_address: str
    output_address: str
    log_level: str = "INFO"
    #: how the engine reaches its peers (None: NIXL and a ZMQ side channel)
    links: TransferLinks | None = None


class CoreReady(msgspec.Struct, tag=True, frozen=True):
    engine_id: str
    side_channel: str | None
    snapshot: EngineSnapshot
    pid: int
    #: the request plane's "host:port" (None: role both, or no cluster secret)
    request_plane: str | None = None


class CoreFailed(msgspec.Struct, tag=True, frozen=True):
    message: str


Hello = CoreReady | CoreFailed


#: the core's GIL switch interval (Python's default: 5 ms). The request plane's and the
#: transfer thread's hand-offs wait for the GIL while the step loop runs Python between
#: torch ops; a waiting thread gets it within about this long
SWITCH_INTERVAL_S = 0.0002


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    setup: CoreSetup = pickle.load(sys.stdin.buffer)
    sys.stdin.close()
    setup_logging(setup.log_level)  # the API process's format
    ctx = zmq.Context()
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.SNDHWM, 0)  # never drop or block a batch
    out.setsockopt(zmq.LINGER, 5000)
    out.connect(setup.output_address)
    inp = ctx.socket(zmq.PULL)
    inp.setsockopt(zmq.RCVHWM, 0)
    inp.setsockopt(zmq.LINGER, 0)
    inp.connect(setup.input_address)
    enc = msgspec.msgpack.Encoder()

    from kvpush.engine.core_loop import CoreLoop

    def failed(message: str) -> int:
        out.send(enc.encode(CoreFailed(message)))
        out.close()
        inp.close()
        ctx.term()
        return 1

    try:
        core = CoreLoop(setup.config, links=setup.links)
    except Exception as e:  # noqa: BLE001 - the parent reports it and exits non-zero
        log.debug("engine core failed to start", exc_info=True)
        return failed(str(e) or type(e).__name__)
    inbox = core.engine.inbox
    try:
        plane = _request_plane(setup.config, inbox)
    except zmq.ZMQError as e:
        if core.kv_events is not None:
            core.kv_events.close()
        core.engine.shutdown()
        kvt = setup.config.kv_transfer
        return failed(f"cannot bind the request plane on {kvt.side_channel_host}:"
                      f"{kvt.request_plane_port}: {e}")
    if plane is not None:
        core.request_plane = plane.address
        plane.start()
    signal.signal(signal.SIGTERM, lambda *_: inbox.put(Shutdown()))
    if core.kv_events is not None:
        core.kv_events.start()
    out.send(enc.encode(CoreReady(core.engine_id, core.side_channel,
                                  core.engine.snapshot(), os.getpid(), core.request_plane)))

    def read_commands() -> None:
        dec = msgspec.msgpack.Decoder(EngineCommand)
        while True:
            try:
                frame = inp.recv()
            except zmq.ZMQError:  # the context is ending (ETERM)
                inp.close()
                return
            try:
                inbox.put(dec.decode(frame))
            except msgspec.DecodeError:
                log.error("engine core: a command it cannot decode; ignored", exc_info=True)

    threading.Thread(target=read_commands, name="kvpush-core-input", daemon=True).start()

    def post(batch: EngineOutputs) -> None:  # on the step loop
        local: EngineOutputs | None = batch
        if plane is not None:  # the remote fronts' part goes to the plane's thread
            local = plane.split(batch)
            if local is None:
                return
        out.send(enc.encode(local))  # (zero-copy costs more than it saves here)

    step = threading.Thread(target=core.run, args=(post,), name="kvpush-step-loop")
    step.start()
    step.join()
    if plane is not None:  # after the step loop: its last outputs go out
        plane.close()
    if core.kv_events is not None:  # after the step loop: its last events go out
        core.kv_events.close()
    out.close()  # lingers until the last batch is sent (or 5 s)
    ctx.term()  # ends the input thread's recv, which closes its socket
    return 1 if core.fatal is not None else 0


def _request_plane(config: EngineConfig, inbox) -> RequestPlane | None:
    """The request plane of a core with a cluster secret, or of one run without it on a
    trusted network (--insecure-kv-params: a plain plane), not started; else None."""
    kvt = config.kv_transfer
    if not kvt.side_channel_secret and not kvt.accept_unsigned_params:
        return None
    from kvpush.engine.checks import RequestChecker
    from kvpush.engine.request_plane import RequestPlane

    return RequestPlane(inbox, RequestChecker(config), kvt.side_channel_host,
                        kvt.request_plane_port, kvt.side_channel_secret)


if __name__ == "__main__":
    sys.exit(main())
