"""KVConnector: the step-loop half of KV transfer (the transfer thread is worker.py).

It decides, per request, whether the instance sends KV (prefill role), receives it
(decode role) or serves the request locally; it owns every block a transfer holds and
turns transfer events into request progress. All its methods run on the step-loop
thread; only ``TransferWorker.submit`` crosses to the transfer thread.

Push, prefill side (``PushSend``)::

    AWAITING_REGISTRATION ──PushRegister──▶ SENDING ──prefill done──▶ DRAINING
      │ (prefill may finish first: blocks    (each layer's new full      │ last WRITEs,
      │  held under a lease until D          blocks WRITten while the    │ then PushDone
      │  registers)                          forward pass goes on)       ▼ (token #1)
      └── lease expires / abort ──────────────────────────────────▶ RELEASED (blocks freed)

Push, decode side (``DecodeRecv``)::

    PENDING_BLOCKS ──blocks──▶ AWAITING_KV ──PushDone(token #1)──▶ request RUNNING
       │  (PushRegister sent; or a full prefix hit: computed here)   (no recompute)
       └── failure: fail the request, or recompute it locally (policy)
    abort while AWAITING_KV ──▶ QUARANTINED (blocks kept until AbortAck/PushDone/lease)

Pull: prefill finishes with max_tokens=1 and lends its blocks (``LENT``) under a lease
until PullDone; decode allocates, posts a READ *on its step loop*, waits, then computes
the last prompt token itself to get token #1.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvpush.config import EngineConfig
from kvpush.engine.outputs import RequestError
from kvpush.kv_cache.kv_region import KVRegion
from kvpush.kv_transfer import messages as m
from kvpush.kv_transfer.transport import TransferPostError
from kvpush.kv_transfer.worker import TransferWorker
from kvpush.scheduler.request import Request
from kvpush.scheduler.scheduler import Scheduler, StepPlan

log = logging.getLogger(__name__)

#: Re-sends of a registration that prefill says it never got, before decode gives up.
MAX_REGISTER_RESENDS = 3


class SendState(enum.Enum):
    AWAITING_REGISTRATION = "awaiting_registration"
    SENDING = "sending"
    DRAINING = "draining"
    LENT = "lent"  # pull: blocks lent to decode until PullDone


class RecvState(enum.Enum):
    PENDING_BLOCKS = "pending_blocks"
    AWAITING_KV = "awaiting_kv"
    QUARANTINED = "quarantined"


@dataclass
class PushSend:
    tid: str
    request_id: str
    state: SendState = SendState.AWAITING_REGISTRATION
    reg: m.PushRegister | None = None
    written_blocks: int = 0  # leading prompt blocks whose every layer is posted
    finished: bool = False  # prefill done, token #1 known, blocks held here
    block_ids: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0
    first: tuple[int, float | None] = (-1, None)
    retired: list[list[int]] = field(default_factory=list)  # blocks of a preempted run


@dataclass
class DecodeRecv:
    tid: str
    request_id: str
    mode: str
    address: str  # prefill's side channel
    remote_engine_id: str
    remote_block_ids: list[int] = field(default_factory=list)
    state: RecvState = RecvState.PENDING_BLOCKS
    held: list[int] = field(default_factory=list)  # quarantined blocks
    register: m.PushRegister | None = None  # kept to re-send if it was lost
    resends: int = 0
    t_start: float = field(default_factory=time.perf_counter)


@dataclass
class TransferRecord:
    """One finished transfer, for /metrics and logs."""

    transfer_id: str
    role: str
    mode: str
    ok: bool
    num_bytes: int = 0
    num_descriptors: int = 0
    post_s: float = 0.0
    transfer_s: float = 0.0
    error: str | None = None


def run_pairs(local: list[int], remote: list[int]) -> list[tuple[int, int, int]]:
    """(local_first, remote_first, count) runs where both sides are consecutive."""
    runs: list[tuple[int, int, int]] = []
    for lb, rb in zip(local, remote):
        if runs and runs[-1][0] + runs[-1][2] == lb and runs[-1][1] + runs[-1][2] == rb:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((lb, rb, 1))
    return runs


def parse_kv_params(params: dict, role: str) -> dict:
    """Check the wire fields (vLLM's names) a request brings; RequestError if malformed."""
    if not isinstance(params, dict):
        raise RequestError("kv_transfer_params must be an object", "kv_transfer_params")

    def get(name, typ, required=True, default=None):
        v = params.get(name, default)
        if v is None:
            if required:
                raise RequestError(f"kv_transfer_params.{name} is required",
                                   "kv_transfer_params")
            return default
        if typ is int and isinstance(v, bool) or not isinstance(v, typ):
            raise RequestError(
                f"kv_transfer_params.{name} must be {typ.__name__}", "kv_transfer_params"
            )
        return v

    out = {
        "do_remote_decode": get("do_remote_decode", bool, False, False),
        "do_remote_prefill": get("do_remote_prefill", bool, False, False),
        "transfer_id": get("transfer_id", str, False),
    }
    if role == "decode" and out["do_remote_prefill"]:
        out["remote_host"] = get("remote_host", str)
        out["remote_port"] = get("remote_port", int)
        if not 0 < out["remote_port"] < 65536:
            raise RequestError("kv_transfer_params.remote_port out of range",
                               "kv_transfer_params")
        out["remote_engine_id"] = get("remote_engine_id", str, False, "")
        out["remote_request_id"] = get("remote_request_id", str, False)
        blocks = get("remote_block_ids", list, False, None)
        if blocks is not None and not all(
            isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in blocks
        ):
            raise RequestError("kv_transfer_params.remote_block_ids must be block ids",
                               "kv_transfer_params")
        out["remote_block_ids"] = blocks
    return out


class KVConnector:
    """Step-loop side of KV transfer for one instance (see module docstring)."""

    def __init__(
        self,
        config: EngineConfig,
        region: KVRegion,
        scheduler: Scheduler,
        post_event: Callable[[tuple], None],
        faults=None,
    ):
        cfg = config.kv_transfer
        self.cfg = cfg
        self.role = cfg.role
        self.mode = cfg.mode
        self.engine_id = cfg.engine_id
        self.region = region
        self.layout = region.layout
        self.scheduler = scheduler
        self.block_size = config.cache.block_size
        self.transport = _make_transport(cfg.transport, cfg.engine_id, faults)
        self.transport.register_region(region.base_address, region.nbytes, config.device)
        from kvpush.kv_transfer.side_channel import SideChannel

        self.channel = SideChannel(
            cfg.side_channel_host, cfg.side_channel_port, faults=faults, type_of=m.type_name
        )
        self.address = self.channel.address
        lay = self.layout
        self.hello = m.Hello(
            version=m.PROTOCOL_VERSION,
            engine_id=cfg.engine_id,
            role=cfg.role,
            address=self.address,
            transport=cfg.transport,
            agent_metadata=self.transport.metadata(),
            model=config.model.fingerprint(),
            dtype=lay.dtype,
            block_size=lay.block_size,
            layout=lay.layout,
            num_layers=lay.num_layers,
            num_kv_heads=lay.num_kv_heads,
            head_dim=lay.head_dim,
            kv_transfer=cfg.mode,
            base_address=region.base_address,
            num_blocks=lay.num_blocks,
            block_bytes=lay.block_bytes,
            layer_bytes=lay.layer_bytes,
        )
        self.worker = TransferWorker(
            self.hello,
            self.channel,
            self.transport,
            post_event,
            cfg.lease_timeout_s,
            cfg.heartbeat_interval_s,
        )
        self.peers: dict[str, m.Hello] = {}  # address -> the peer's Hello (ready peers)
        self.refused: dict[str, str] = {}
        self.sends: dict[str, PushSend] = {}  # tid -> prefill-side transfer
        self.lent: dict[str, list[int]] = {}  # pull: tid -> blocks lent to decode
        self.recvs: dict[str, DecodeRecv] = {}  # tid -> decode-side transfer
        self.pending: deque[str] = deque()  # decode: tids waiting for blocks
        self.early_regs: dict[str, m.PushRegister] = {}  # registrations before the request
        self.ended: OrderedDict[str, str] = OrderedDict()  # recently ended tids -> why
        self.by_request: dict[str, str] = {}  # request id -> tid
        self.records: deque[TransferRecord] = deque(maxlen=1024)
        # called (on the step loop) with each finished transfer, e.g. by /metrics
        self.record_sink: Callable[[TransferRecord], None] | None = None
        self.counters = {"transfers_ok": 0, "transfers_failed": 0, "leases_expired": 0,
                         "aborts_sent": 0, "aborts_received": 0}
        self._step_writes: list[tuple[PushSend, list[tuple[int, int, int]]]] = []
        # what the engine must do next: ("abort"|"fail", request_id, why),
        # ("first_token", request_id)
        self.actions: list[tuple] = []
        self._stalled = False

    def has_pending_work(self) -> bool:
        """Whether before_schedule() could make progress now (no spinning: after a pass
        that could not, this stays False until an event or a finish changes things)."""
        return bool(self.pending) and not self._stalled

    def take_actions(self) -> list[tuple]:
        actions, self.actions = self.actions, []
        return actions

    # ---- life cycle -------------------------------------------------------------------
    def start(self) -> None:
        self.worker.start()

    def shutdown(self) -> None:
        self.worker.stop()

    def info(self) -> dict:
        host, port = self.address.rsplit(":", 1)
        return {
            "engine_id": self.engine_id,
            "role": self.role,
            "kv_transfer": self.mode,
            "side_channel": self.address,
            "side_channel_host": host,
            "side_channel_port": int(port),
            "transport": self.cfg.transport,
            "model_fingerprint": self.hello.model,
            "kv_load_failure_policy": self.cfg.load_failure_policy,
            "lease_timeout_s": self.cfg.lease_timeout_s,
        }

    # ---- requests -------------------------------------------------------------------
    def add_request(self, req: Request, raw_params: dict | None) -> bool:
        """Take charge of a request that sends or receives KV; False: a local request."""
        if raw_params is None:
            return False
        p = parse_kv_params(raw_params, self.role)
        tid = p["transfer_id"] or req.request_id
        if self.role == "prefill" and p["do_remote_decode"]:
            if tid in self.sends or tid in self.lent:
                raise RequestError(f"transfer id {tid!r} is already in use", "kv_transfer_params")
            # prefill's leg ends with token #1; its logprob travels with the KV
            req.params = dataclasses.replace(req.params, max_tokens=1, logprobs=True)
            self.by_request[req.request_id] = tid
            if self.mode == "push":
                send = self.sends[tid] = PushSend(tid, req.request_id)
                reason = self.ended.pop(tid, None)
                reg = self.early_regs.pop(tid, None)
                if reason is not None:
                    raise RequestError(f"transfer {tid} already ended: {reason}",
                                       "kv_transfer_params")
                if reg is not None:
                    self._registered(send, reg)
                else:
                    self.worker.submit("track", tid, None)
            self.scheduler.add_request(req)
            return True
        if self.role == "decode" and p["do_remote_prefill"]:
            if self.mode == "pull" and p["remote_block_ids"] is None:
                raise RequestError("pull needs kv_transfer_params.remote_block_ids",
                                   "kv_transfer_params")
            if self.mode == "pull":
                tid = p["transfer_id"] or p["remote_request_id"] or tid
                n_needed = -(-(req.num_prompt_tokens - 1) // self.block_size)
                if len(p["remote_block_ids"]) < n_needed:
                    raise RequestError(
                        f"kv_transfer_params.remote_block_ids has {len(p['remote_block_ids'])}"
                        f" blocks; the prompt needs {n_needed}", "kv_transfer_params")
            if tid in self.recvs:
                raise RequestError(f"transfer id {tid!r} is already in use", "kv_transfer_params")
            address = f"{p['remote_host']}:{p['remote_port']}"
            recv = DecodeRecv(tid, req.request_id, self.mode, address, p["remote_engine_id"],
                              list(p["remote_block_ids"] or []))
            self.recvs[tid] = recv
            self.by_request[req.request_id] = tid
            self.scheduler.add_remote_request(req)
            self.pending.append(tid)
            self.worker.submit("ensure_peer", address)
            self.worker.submit("track", tid, address)
            return True
        return False

    # ---- decode: blocks for pending transfers ----------------------------------------------
    def before_schedule(self) -> None:
        """Give pending decode-side transfers blocks, register them (push) or post their
        READ (pull, on this thread as the baseline does)."""
        skipped: list[str] = []
        while self.pending:
            tid = self.pending[0]
            recv = self.recvs.get(tid)
            if recv is None:
                self.pending.popleft()
                continue
            if recv.address in self.refused:
                self.pending.popleft()
                self._recv_failed(recv, self.refused[recv.address])
                continue
            if recv.address not in self.peers:
                skipped.append(self.pending.popleft())  # handshake still going
                continue
            req = self.scheduler.requests[recv.request_id]
            if not self.scheduler.allocate_remote(req):
                break
            self.pending.popleft()
            self._allocated(recv, req)
        self.pending.extendleft(reversed(skipped))
        self._stalled = bool(self.pending)

    def _allocated(self, recv: DecodeRecv, req: Request) -> None:
        bs = self.block_size
        n = req.num_prompt_tokens
        hit = req.num_computed_tokens
        skip = hit // bs
        if recv.mode == "push":
            full_hit = skip > 0 and skip == (n - 1) // bs
            recv.register = m.PushRegister(
                recv.tid, self.engine_id, self.address, list(req.block_ids), skip, n, full_hit)
            self.worker.submit("send", recv.address, recv.register)
            if full_hit:  # everything prefill could send is here already: compute the rest
                self._end_recv(recv, ok=True, why="full prefix hit on decode")
                self.scheduler.remote_kv_arrived(req.request_id, hit, None)
                return
            recv.state = RecvState.AWAITING_KV
            return
        # pull: READ prefill's blocks for tokens [hit, n - 1); the last token is recomputed
        last = -(-(n - 1) // bs)
        peer = self.peers[recv.address]
        pairs = run_pairs(req.block_ids[skip:last], recv.remote_block_ids[skip:last])
        local, remote = self._descs(pairs, peer, range(self.layout.num_layers))
        if not local:
            self._end_recv(recv, ok=True, why="nothing to read")
            self.worker.submit("send", recv.address, m.PullDone(recv.tid))
            self.scheduler.remote_kv_arrived(req.request_id, n - 1, None)
            return
        t0 = time.perf_counter()
        try:
            with self.worker.transport_lock:
                handle = self.transport.post("READ", peer.engine_id, local, remote)
        except TransferPostError as e:
            self.worker.submit("send", recv.address, m.PullDone(recv.tid, ok=False))
            self._recv_failed(recv, f"READ failed to post: {e}")
            return
        post_s = time.perf_counter() - t0
        self._record(TransferRecord(recv.tid, "decode", "pull", True,
                                           sum(x[1] for x in local), len(local), post_s))
        recv.state = RecvState.AWAITING_KV
        self.worker.submit("watch_read", recv.tid, handle, recv.address)

    def _descs(self, pairs, peer: m.Hello, layers) -> tuple[list, list]:
        lay = self.layout
        local, remote = [], []
        for layer in layers:
            lbase = self.region.base_address + layer * lay.layer_bytes
            rbase = peer.base_address + layer * peer.layer_bytes
            for lb, rb, count in pairs:
                local.append((lbase + lb * lay.block_bytes, count * lay.block_bytes))
                remote.append((rbase + rb * peer.block_bytes, count * peer.block_bytes))
        return local, remote

    # ---- prefill: push writes -------------------------------------------------------------
    def _registered(self, send: PushSend, reg: m.PushRegister) -> None:
        peer = self.peers.get(reg.address)
        if peer is None:  # the Hello always precedes the registration on one socket
            self._drop_send(send, f"registration from unknown decode {reg.address}")
            return
        bad = [b for b in reg.block_ids if not 0 <= b < peer.num_blocks]
        if bad or reg.skip_blocks < 0:
            self.worker.submit("send", reg.address, m.PushDone(
                send.tid, ok=False, error=f"registration has invalid block ids {bad[:4]}"))
            self._drop_send(send, "invalid registration")
            return
        send.reg = reg
        send.state = SendState.SENDING
        self.worker.submit("track", send.tid, reg.address)
        if reg.full_hit:
            self._drop_send(send, "decode has the whole prompt cached")
            return
        req = self.scheduler.requests.get(send.request_id)
        if send.finished:
            self._flush(send, final=True)
        elif req is not None:
            # blocks computed before the registration arrived go now, every layer
            self._post_blocks(send, req.block_ids, req.num_computed_tokens // self.block_size,
                              range(self.layout.num_layers))

    def _post_blocks(self, send: PushSend, block_ids: list[int], upto: int, layers) -> None:
        reg = send.reg
        start = max(send.written_blocks, reg.skip_blocks)
        upto = min(upto, len(reg.block_ids), len(block_ids))
        if upto <= start:
            return
        pairs = run_pairs(block_ids[start:upto], reg.block_ids[start:upto])
        local, remote = self._descs(pairs, self.peers[reg.address], layers)
        self.worker.submit("write", send.tid, reg.address, local, remote)
        send.written_blocks = upto

    def _flush(self, send: PushSend, final: bool) -> None:
        """Prefill done: WRITE what is left (partial last block included), then PushDone."""
        n_blocks = -(-send.num_prompt_tokens // self.block_size)
        self._post_blocks(send, send.block_ids, n_blocks, range(self.layout.num_layers))
        send.state = SendState.DRAINING
        tok, lp = send.first
        self.worker.submit("finalize", send.tid, send.reg.address,
                           m.PushDone(send.tid, ok=True, first_token=tok, first_logprob=lp))

    def layer_hook(self, plan: StepPlan) -> Callable[[int], None] | None:
        """Per-layer WRITE of the blocks this step completes, for registered push sends."""
        self._step_writes = []
        if self.role != "prefill" or not self.sends:
            return None
        bs = self.block_size
        for chunk in plan.chunks:
            tid = self.by_request.get(chunk.request_id)
            send = self.sends.get(tid) if tid else None
            if send is None or send.state is not SendState.SENDING:
                continue
            reg = send.reg
            start = max(send.written_blocks, reg.skip_blocks)
            upto = min((chunk.start_pos + len(chunk.token_ids)) // bs, len(reg.block_ids))
            if upto > start:
                pairs = run_pairs(chunk.block_ids[start:upto], reg.block_ids[start:upto])
                self._step_writes.append((send, pairs))
                send.written_blocks = upto
        if not self._step_writes:
            return None
        cuda = self.region.kv.is_cuda

        def on_layer(layer: int) -> None:
            if cuda:  # the WRITE must not read the layer before the GPU wrote it
                torch.cuda.current_stream().synchronize()
            for send, pairs in self._step_writes:
                local, remote = self._descs(pairs, self.peers[send.reg.address], (layer,))
                self.worker.submit("write", send.tid, send.reg.address, local, remote)

        return on_layer

    def on_preempt(self, req: Request) -> bool:
        """A push sender losing its blocks keeps them out of the pool while WRITEs from
        them may be in flight; its blocks are written again after the recompute."""
        tid = self.by_request.get(req.request_id)
        send = self.sends.get(tid) if tid else None
        if send is None or send.written_blocks == 0:
            return False
        send.retired.append(list(req.block_ids))
        send.written_blocks = 0
        return True

    def on_finish(self, req: Request, ok: bool, error: str | None) -> tuple[bool, dict | None]:
        """A request ends. Returns (connector keeps its blocks, kv_transfer_params for the
        response)."""
        self._stalled = False  # blocks may come free
        tid = self.by_request.pop(req.request_id, None)
        if tid is None:
            return False, None
        if tid in self.sends:
            send = self.sends[tid]
            if not ok:
                return self._send_aborted(send, req, error or "prefill request aborted"), None
            send.finished = True
            send.block_ids = list(req.block_ids)
            send.num_prompt_tokens = req.num_prompt_tokens
            lp = req.output_logprobs[0] if req.output_logprobs else None
            send.first = (req.output_token_ids[0], lp)
            if send.state is SendState.SENDING:
                self._flush(send, final=True)
            return True, None
        if self.role == "prefill" and self.mode == "pull":
            if not ok:
                return False, None
            self.lent[tid] = list(req.block_ids)
            self.worker.submit("track", tid, None)
            return True, {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "transfer_id": tid,
                "remote_block_ids": list(req.block_ids),
                "remote_engine_id": self.engine_id,
                "remote_host": self.address.rsplit(":", 1)[0],
                "remote_port": int(self.address.rsplit(":", 1)[1]),
                "remote_request_id": req.request_id,
                "tp_size": 1,
            }
        recv = self.recvs.get(tid)
        if recv is None or recv.state is RecvState.QUARANTINED:
            return False, None
        if ok or recv.state is RecvState.PENDING_BLOCKS:
            self._end_recv(recv, ok=ok, why=error)
            if not ok:
                self.worker.submit("send", recv.address, m.Abort(tid, error or "aborted"))
                self.counters["aborts_sent"] += 1
            return False, None
        # aborted while KV may be landing in its blocks: hold them until the peer is done
        recv.state = RecvState.QUARANTINED
        recv.held = list(req.block_ids)
        if recv.mode == "push":
            self.worker.submit("send", recv.address, m.Abort(tid, error or "aborted"))
            self.counters["aborts_sent"] += 1
        return True, None

    def _send_aborted(self, send: PushSend, req: Request, why: str) -> bool:
        if send.state is SendState.SENDING:  # WRITEs may be in flight: drain, then tell D
            send.block_ids = list(req.block_ids)
            send.state = SendState.DRAINING
            self.worker.submit("finalize", send.tid, send.reg.address,
                               m.PushDone(send.tid, ok=False, error=why))
            return True
        self._drop_send(send, why, free=False)
        return False

    def _drop_send(self, send: PushSend, why: str, free: bool = True) -> None:
        """End a push send that has nothing in flight; frees what it holds."""
        self.sends.pop(send.tid, None)
        self.worker.submit("untrack", send.tid)
        self._remember_ended(send.tid, why)
        if send.request_id in self.scheduler.requests:
            self.actions.append(("abort", send.request_id, why))
        elif free and send.finished:
            self.scheduler.pool.free(send.block_ids)
        for blocks in send.retired:
            self.scheduler.pool.free(blocks)
        send.retired.clear()

    def _remember_ended(self, tid: str, why: str) -> None:
        self.ended[tid] = why
        while len(self.ended) > 4096:
            self.ended.popitem(last=False)

    # ---- decode: endings -----------------------------------------------------------------
    def _end_recv(self, recv: DecodeRecv, ok: bool, why: str | None = None) -> None:
        self.recvs.pop(recv.tid, None)
        self.by_request.pop(recv.request_id, None)
        self.worker.submit("untrack", recv.tid)
        if recv.held:
            self.scheduler.pool.free(recv.held)
            recv.held = []
        if not ok:
            self.counters["transfers_failed"] += 1

    def _recv_failed(self, recv: DecodeRecv, why: str) -> None:
        """Remote KV will not come: fail the request or prefill it here (policy)."""
        source = recv.remote_engine_id or recv.address
        msg = f"KV transfer {recv.tid} from prefill {source} failed: {why}"
        log.warning(msg)
        self._end_recv(recv, ok=False)
        self._record(TransferRecord(recv.tid, "decode", recv.mode, False, error=why))
        if recv.request_id not in self.scheduler.requests:
            return
        if self.cfg.load_failure_policy == "recompute":
            self.scheduler.remote_kv_failed(recv.request_id)
        else:
            self.actions.append(("fail", recv.request_id, msg))

    def _kv_arrived(self, recv: DecodeRecv, num_computed: int,
                    first: tuple[int, float | None] | None, record: TransferRecord) -> None:
        self._end_recv(recv, ok=True)
        self.counters["transfers_ok"] += 1
        record.transfer_s = time.perf_counter() - recv.t_start
        self._record(record)
        if recv.request_id in self.scheduler.remote_waiting:
            self.scheduler.remote_kv_arrived(recv.request_id, num_computed, first)
            if first is not None:
                self.actions.append(("first_token", recv.request_id))

    # ---- events from the transfer thread ----------------------------------------------
    def handle_event(self, ev: tuple) -> None:
        self._stalled = False
        getattr(self, "_ev_" + ev[0])(*ev[1:])

    def _ev_peer_ready(self, address: str, hello: m.Hello) -> None:
        self.peers[address] = hello

    def _ev_peer_refused(self, address: str, reason: str) -> None:
        self.refused[address] = reason
        for recv in [r for r in self.recvs.values() if r.address == address]:
            if recv.state is RecvState.QUARANTINED:
                self._end_recv(recv, ok=False)
            else:
                self._recv_failed(recv, reason)

    def _ev_register(self, reg: m.PushRegister) -> None:
        send = self.sends.get(reg.transfer_id)
        if send is None:
            why = self.ended.get(reg.transfer_id)
            if why is not None:  # prefill already gave up on it: tell decode at once
                self.worker.submit("send", reg.address,
                                   m.PushDone(reg.transfer_id, ok=False, error=why))
                return
            # the request has not arrived yet; it should come about when decode's did, so
            # this wait has a fixed deadline (decode's heartbeats do not extend it)
            self.early_regs[reg.transfer_id] = reg
            self.worker.submit("track", reg.transfer_id, reg.address, False)
            return
        if send.reg is None:
            self._registered(send, reg)

    def _ev_awaiting_registration(self, tids: list[str]) -> None:
        """Prefill has no registration for these: re-send ours (it was lost)."""
        for tid in tids:
            recv = self.recvs.get(tid)
            if recv is None or recv.register is None or recv.state is not RecvState.AWAITING_KV:
                continue
            recv.resends += 1
            if recv.resends > MAX_REGISTER_RESENDS:
                why = f"registration lost {MAX_REGISTER_RESENDS + 1} times"
                self.worker.submit("send", recv.address, m.Abort(tid, why))
                self._recv_failed(recv, why)
            else:
                self.worker.submit("send", recv.address, recv.register)

    def _ev_writes_done(self, tid: str, failed: str | None, ndesc: int, nbytes: int,
                        post_s: float, elapsed: float) -> None:
        send = self.sends.pop(tid, None)
        if send is None:
            return
        self.worker.submit("untrack", tid)
        ok = failed is None and send.finished
        self.counters["transfers_ok" if ok else "transfers_failed"] += 1
        self._record(TransferRecord(tid, "prefill", "push", ok, nbytes, ndesc,
                                           post_s, elapsed, failed))
        self._remember_ended(tid, failed or "done")
        self.scheduler.pool.free(send.block_ids)
        for blocks in send.retired:
            self.scheduler.pool.free(blocks)

    def _ev_push_done(self, done: m.PushDone) -> None:
        recv = self.recvs.get(done.transfer_id)
        if recv is None:
            return
        if recv.state is RecvState.QUARANTINED:
            self._end_recv(recv, ok=False)
            return
        if not done.ok:
            self._recv_failed(recv, done.error or "prefill reported a failure")
            return
        req = self.scheduler.requests.get(recv.request_id)
        record = TransferRecord(recv.tid, "decode", "push", True, done.num_bytes,
                                done.num_descriptors)
        self._kv_arrived(recv, req.num_prompt_tokens, (done.first_token, done.first_logprob),
                         record)

    def _ev_read_done(self, tid: str, ok: bool) -> None:
        recv = self.recvs.get(tid)
        if recv is None:
            return
        if recv.state is RecvState.QUARANTINED:
            self._end_recv(recv, ok=False)
            return
        if not ok:
            self._recv_failed(recv, "READ failed")
            return
        req = self.scheduler.requests[recv.request_id]
        record = TransferRecord(tid, "decode", "pull", True)
        self._kv_arrived(recv, req.num_prompt_tokens - 1, None, record)

    def _ev_pull_done(self, done: m.PullDone) -> None:
        blocks = self.lent.pop(done.transfer_id, None)
        if blocks is not None:
            self.worker.submit("untrack", done.transfer_id)
            self.scheduler.pool.free(blocks)
            self.counters["transfers_ok" if done.ok else "transfers_failed"] += 1

    def _ev_abort(self, ab: m.Abort) -> None:
        tid = ab.transfer_id
        self.counters["aborts_received"] += 1
        if tid in self.sends:  # decode gave up: stop, drain, acknowledge
            send = self.sends[tid]
            address = send.reg.address if send.reg else None
            if send.state in (SendState.SENDING, SendState.DRAINING) and address:
                self.worker.submit("cancel_writes", tid, address)
                if send.request_id in self.scheduler.requests:
                    self.actions.append(("abort", send.request_id, f"decode: {ab.reason}"))
                return
            self._drop_send(send, f"aborted by decode: {ab.reason}")
            return
        if tid in self.early_regs:
            reg = self.early_regs.pop(tid)
            self.worker.submit("untrack", tid)
            self._remember_ended(tid, f"aborted by decode: {ab.reason}")
            self.worker.submit("send", reg.address, m.AbortAck(tid))
            return
        if tid in self.lent:
            self._ev_pull_done(m.PullDone(tid, ok=False))
            return
        recv = self.recvs.get(tid)
        if recv is not None:  # prefill gave up; nothing of it is in flight any more
            if recv.state is RecvState.QUARANTINED:
                self._end_recv(recv, ok=False)
            else:
                self._recv_failed(recv, f"aborted by prefill: {ab.reason}")

    def _ev_abort_ack(self, ack: m.AbortAck) -> None:
        recv = self.recvs.get(ack.transfer_id)
        if recv is not None and recv.state is RecvState.QUARANTINED:
            self._end_recv(recv, ok=False)

    def _ev_lease_expired(self, tid: str) -> None:
        self.counters["leases_expired"] += 1
        if tid in self.sends:
            send = self.sends[tid]
            if send.state is SendState.DRAINING:
                return  # the WRITEs' own completion (or failure) ends it
            self._drop_send(send, "lease expired: decode never registered")
        elif tid in self.early_regs:
            del self.early_regs[tid]
            self._remember_ended(tid, "lease expired: the request never reached prefill")
        elif tid in self.lent:
            self.scheduler.pool.free(self.lent.pop(tid))
        elif tid in self.recvs:
            recv = self.recvs[tid]
            if recv.state is RecvState.QUARANTINED:
                self._end_recv(recv, ok=False)
            else:
                self._recv_failed(recv, "lease expired: prefill stopped answering")

    def _ev_worker_died(self) -> None:
        for recv in list(self.recvs.values()):
            self._recv_failed(recv, "the transfer thread died")

    # ---- visibility --------------------------------------------------------------------
    def _record(self, rec: TransferRecord) -> None:
        self.records.append(rec)
        if self.record_sink is not None:
            try:
                self.record_sink(rec)
            except Exception:  # metrics must never break a transfer
                log.exception("transfer record sink failed")

    def stats(self) -> dict:
        return {
            **self.counters,
            **{f"worker_{k}": v for k, v in self.worker.counters.items()},
            "sends_in_flight": len(self.sends),
            "recvs_in_flight": len(self.recvs),
            "blocks_lent": sum(len(b) for b in self.lent.values()),
        }


def _make_transport(kind: str, name: str, faults):
    if kind == "inproc":
        from kvpush.kv_transfer.inproc_transport import InProcTransport

        return InProcTransport(name, faults=faults)
    from kvpush.kv_transfer.nixl_transport import NixlTransport

    return NixlTransport(name)
