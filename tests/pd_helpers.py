"""A prefill and a decode LLMEngine in one process over the in-process transport, and a
driver that plays the router's two legs and steps both engines."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from kvpush.config import EngineConfig, KVTransferConfig
from kvpush.engine.llm_engine import LLMEngine
from kvpush.engine.outputs import FinishReason
from kvpush.sampling_params import SamplingParams
from kvpush_testing.faults import FaultPlan
from kvpush_testing.links import InProcLinks


def make_instance(model_dir, role: str, mode: str, faults: FaultPlan | None = None,
                  lease: float = 5.0, heartbeat: float = 0.1, policy: str = "fail",
                  links=None, prefix_hit_tail: str = "prefill",
                  fence_timeout: float = 300.0, layers_per_write: int = 0,
                  kv_digest: bool = False, **kw) -> LLMEngine:
    kw.setdefault("block_size", 16)
    kw.setdefault("num_blocks", 256)
    kw.setdefault("max_model_len", 1024)
    kvt = KVTransferConfig(
        role=role, mode=mode, engine_id=f"{role}-{uuid.uuid4().hex[:6]}",
        lease_timeout_s=lease, heartbeat_interval_s=heartbeat, load_failure_policy=policy,
        prefix_hit_tail=prefix_hit_tail, fence_timeout_s=fence_timeout,
        push_layers_per_write=layers_per_write, kv_digest=kv_digest,
    )
    if links is None:
        links = InProcLinks(faults)
    engine = LLMEngine(EngineConfig.build(model_dir, kv_transfer=kvt, **kw), links=links)
    engine.transfer_records = []  # what /metrics would observe, in order
    engine.connector.record_sink = engine.transfer_records.append
    return engine


@dataclass
class Leg:
    tokens: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    kv_transfer_params: dict | None = None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list = field(default_factory=list)
    rejected: bool = False  # refused as the client's mistake (the server answers 400)
    code: str | None = None  # the error's code (e.g. prefill_not_needed)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class PDDriver:
    """Sends each request's two legs like the router does, and steps both engines."""

    def __init__(self, prefill: LLMEngine, decode: LLMEngine):
        self.p, self.d = prefill, decode
        self.p_legs: dict[str, Leg] = {}
        self.d_legs: dict[str, Leg] = {}
        self._pull_waiting: dict[str, tuple[list[int], SamplingParams]] = {}
        self.mode = decode.config.kv_transfer.mode

    def d_params(self, tid: str) -> dict:
        host, port = self.p.connector.address.rsplit(":", 1)
        return {"do_remote_prefill": True, "transfer_id": tid, "remote_host": host,
                "remote_port": int(port), "remote_engine_id": self.p.connector.engine_id}

    @staticmethod
    def signed(to: LLMEngine, params: dict, peer: LLMEngine | None) -> dict:
        """``params`` as the router sends them to ``to``: signed when it checks
        signatures (it has the cluster secret), with its own signer."""
        signer = to.checker.signer
        if signer is None:
            return params
        return signer.sign(params, role=to.connector.role, engine_id=to.connector.engine_id,
                           peer_engine_id=peer.connector.engine_id if peer else None)

    def send_prefill(self, rid: str, prompt: list[int], params: SamplingParams) -> None:
        self.p_legs[rid] = Leg()
        self.p.add_request(f"p-{rid}", prompt, params, self.signed(
            self.p, {"do_remote_decode": True, "transfer_id": rid}, None))

    def send_decode(self, rid: str, prompt: list[int], params: SamplingParams,
                    kv_params: dict | None = None) -> None:
        self.d_legs[rid] = Leg()
        self.d.add_request(f"d-{rid}", prompt, params,
                           self.signed(self.d, kv_params or self.d_params(rid), self.p))

    def submit(self, rid: str, prompt: list[int], params: SamplingParams,
               decode_first: bool = False) -> None:
        if self.mode == "pull":  # P first; D once P's answer carries its block ids
            self.send_prefill(rid, prompt, params)
            self._pull_waiting[rid] = (prompt, params)
        elif decode_first:
            self.send_decode(rid, prompt, params)
            self.send_prefill(rid, prompt, params)
        else:
            self.send_prefill(rid, prompt, params)
            self.send_decode(rid, prompt, params)

    def submit_registered(self, rid: str, prompt: list[int], params: SamplingParams,
                          timeout: float = 10.0) -> None:
        """Push: decode's leg first, and prefill's only once decode's registration is
        waiting on prefill, so prefill writes each block as it computes it."""
        self.send_decode(rid, prompt, params)
        deadline = time.monotonic() + timeout
        while self.p.connector.worker.table.get(rid) is None:  # (its early registration)
            if time.monotonic() > deadline:
                raise TimeoutError(f"decode's registration of {rid} did not reach prefill")
            outs = self.d.process_inbox()
            if self.d.has_work():
                outs += self.d.step()
            self._absorb(outs, self.d_legs)
            self._absorb(self.p.process_inbox(), self.p_legs)
            time.sleep(0.001)
        self.send_prefill(rid, prompt, params)

    def _absorb(self, outs, legs: dict[str, Leg]) -> None:
        for o in outs:
            leg = legs.get(o.request_id[2:])
            if leg is None:
                continue
            leg.tokens += o.new_token_ids
            leg.logprobs += o.new_logprobs or []
            leg.top_logprobs += o.new_top_logprobs or []
            if o.finished:
                leg.finish_reason = o.finish_reason
                leg.error = o.failure.message if o.failure is not None else None
                ktp = o.kv_transfer_params  # as the server's answer carries it
                leg.kv_transfer_params = ktp.to_wire() if ktp is not None else None
                leg.rejected = o.failure is not None and o.failure.rejected
                leg.code = o.failure.code if o.failure is not None else None

    def pump(self) -> bool:
        """One round of both engines; True if either computed something."""
        busy = False
        for eng, legs in ((self.p, self.p_legs), (self.d, self.d_legs)):
            # as AsyncEngine does: what the inbox produced goes out before the step
            self._absorb(eng.process_inbox(), legs)
            if eng.has_work():
                busy = True
                self._absorb(eng.step(), legs)
        for rid in list(self._pull_waiting):
            leg = self.p_legs[rid]
            if leg.finished:
                prompt, params = self._pull_waiting.pop(rid)
                if leg.kv_transfer_params is not None:
                    self.send_decode(rid, prompt, params, leg.kv_transfer_params)
        return busy

    def run(self, until=None, timeout: float = 30.0) -> None:
        """Pump until every decode leg finished (or ``until()`` is true)."""
        done = until or (lambda: all(leg.finished for leg in self.d_legs.values())
                         and not self._pull_waiting)
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"P/D did not finish in {timeout} s: p={self.p_legs} d={self.d_legs}")
            if not self.pump():
                time.sleep(0.001)

    def settle(self, timeout: float = 10.0) -> None:
        """Pump until both instances hold no blocks and track no transfers."""
        def idle(e: LLMEngine) -> bool:
            s = e.stats()
            c = e.connector
            return (s.num_free_blocks == s.num_total_blocks and not e.scheduler.requests
                    and not c.holds.by_tid and not len(c.worker.table))
        self.run(until=lambda: idle(self.p) and idle(self.d), timeout=timeout)

    def close(self) -> None:
        self.p.shutdown()
        self.d.shutdown()


def writes_posted(p: LLMEngine, tid: str, blocks: int) -> bool:
    """Whether prefill ``p`` stated ``blocks`` blocks of push ``tid`` computed and its
    transfer thread posted WRITEs for them (read across threads: a polling condition)."""
    hold = p.connector.holds.by_tid.get(tid)
    rec = p.connector.worker.table.get(tid)
    return (hold is not None and hold.stated >= blocks and rec is not None
            and rec.num_descriptors > 0)
