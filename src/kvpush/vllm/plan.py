"""The scheduler half of the connector, without vLLM: which requests send or receive
KV, and the facts each engine step hands the worker half (:class:`ConnectorStep`, the
content of the connector's metadata).

Prefill (push): a request whose ``kv_transfer_params`` say ``do_remote_decode`` is
``Begin`` (its prompt's hash chain) when its blocks are allocated; each step names the
blocks its chunk completes (:class:`StepWrite`), which the worker states per layer
group as the forward pass goes; its finish states the rest (the partial last block)
and ``Prefilled`` with token #1, and the connector keeps its blocks until the transfer
is over. Pull: the finish lends the blocks and answers the params decode READs with.
Decode: a request with ``do_remote_prefill`` waits for the KV (vLLM's asynchronous
load): ``Begin`` names the prefill, ``BlocksReady`` its block table past the blocks
vLLM's prefix cache holds. Params are checked once (kvpush's ``KVTransferParams.parse``:
with a secret, the router's signature); refused ones fail the request at its load.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvpush.config import KVTransferConfig
from kvpush.crypto.auth import ParamsSigner
from kvpush.errors import RequestError
from kvpush.kv_cache.block_pool import hash_prompt_chain
from kvpush.kv_transfer import commands as c
from kvpush.kv_transfer.params import KVTransferParams, chain_problem
from kvpush.kv_transfer.wire import messages as m

log = logging.getLogger("kvpush.vllm")


@dataclass(frozen=True, slots=True)
class StepWrite:
    """Push prefill: this step computes the KV of ``blocks`` (prompt blocks
    ``first_block`` on) of transfer ``tid``."""

    tid: str
    first_block: int
    blocks: list[int]


@dataclass(frozen=True, slots=True)
class ConnectorStep:
    """What one engine step hands the worker half."""

    facts: tuple[c.Fact, ...] = ()  # stated before the forward pass, in order
    writes: tuple[StepWrite, ...] = ()  # stated per layer group during it
    begun: tuple[tuple[str, str], ...] = ()  # (request id, transfer id) of new transfers
    held: tuple[str, ...] = ()  # finished requests whose blocks wait for their transfer
    refused: tuple[tuple[str, str], ...] = ()  # decode: (request id, why) failed at load


@dataclass(slots=True)
class _Transfer:
    tid: str
    num_prompt_tokens: int
    chain: tuple[bytes, ...]
    stated: int = 0  # push prefill: leading prompt blocks stated to the worker
    open: bool = True  # decode: the KV has not been reported in yet


@dataclass
class SchedulerPlan:
    cfg: KVTransferConfig
    block_size: int
    num_layers: int
    clock_ms: Callable[[], int] = field(default=lambda: int(time.time() * 1000))

    def __post_init__(self) -> None:
        cfg = self.cfg
        self.role, self.push = cfg.role, cfg.mode == "push"
        self.signer = ParamsSigner(cfg.side_channel_secret) if cfg.params_signed else None
        self.transfers: dict[str, _Transfer] = {}  # by request id
        self.params: dict[str, KVTransferParams | str | None] = {}  # str: why refused
        self._local: dict[str, int] = {}  # decode: tokens vLLM's prefix cache holds
        self._facts: list[c.Fact] = []
        self._begun: list[tuple[str, str]] = []
        self._held: list[str] = []
        self._refused: list[tuple[str, str]] = []

    # ---- requests -----------------------------------------------------------------------
    def _checked(self, rid: str, raw: object) -> KVTransferParams | str | None:
        """The request's params checked once: typed, None (no transfer), or why refused."""
        if rid not in self.params:
            if raw is None:
                self.params[rid] = None
            else:
                try:
                    self.params[rid] = KVTransferParams.parse(raw, self.role, self.signer,
                                                              self.cfg.engine_id)
                except RequestError as e:
                    log.warning("request %s: kv_transfer_params refused: %s", rid, e)
                    self.params[rid] = f"kv_transfer_params refused: {e}"
        return self.params[rid]

    def matched(self, rid: str, prompt: Sequence[int], raw: object,
                num_computed: int) -> tuple[int, bool]:
        """``get_num_new_matched_tokens``: decode loads the rest of a remote prefill's
        prompt asynchronously (a refused one too: its load fails)."""
        if self.role != "decode" or rid in self.transfers:
            return 0, False
        p = self._checked(rid, raw)
        wanted = isinstance(p, str) or (p is not None and p.do_remote_prefill)
        n = len(prompt) - num_computed
        if not wanted or n <= 0:
            return 0, False
        self._local[rid] = num_computed  # what vLLM's prefix cache holds
        return n, True

    def allocated(self, rid: str, prompt: Sequence[int], raw: object, block_ids: list[int],
                  num_external: int) -> None:
        """``update_state_after_alloc`` (``block_ids``: the request's whole table)."""
        p = self._checked(rid, raw)
        if self.role == "decode":
            if num_external > 0 and rid not in self.transfers:
                self._receive(rid, prompt, p, block_ids, self._local.pop(rid, 0))
            return
        known = self.transfers.get(rid)
        if known is not None:  # rescheduled after a preemption: state its blocks again
            known.stated = 0
        elif isinstance(p, KVTransferParams) and p.do_remote_decode:
            tid = p.transfer_id or rid
            chain = tuple(hash_prompt_chain(prompt, self.block_size))
            self.transfers[rid] = _Transfer(tid, len(prompt), chain)
            self._begun.append((rid, tid))
            if self.push:
                self._facts.append(c.Begin(tid, len(prompt), chain))

    def _receive(self, rid: str, prompt: Sequence[int], p: KVTransferParams | str | None,
                 block_ids: list[int], num_computed: int) -> None:
        bs = self.block_size
        chain = tuple(hash_prompt_chain(prompt, bs))
        why = p if isinstance(p, str) else None
        if why is None and p is not None and not self.push:
            if p.remote_block_ids is None:
                why = "pull needs kv_transfer_params.remote_block_ids"
            elif len(p.remote_block_ids) < -(-(len(prompt) - 1) // bs):
                why = (f"kv_transfer_params.remote_block_ids has {len(p.remote_block_ids)} "
                       f"blocks; the prompt needs {-(-(len(prompt) - 1) // bs)}")
            elif p.prompt_hashes is not None:
                why = chain_problem(p.prompt_hashes, chain, "prefill's", "decode's")
        tid = (p.transfer_id or p.remote_request_id or rid) if isinstance(p, KVTransferParams) \
            else rid
        self.transfers[rid] = _Transfer(tid, len(prompt), chain)
        if why is not None or not isinstance(p, KVTransferParams):
            self._refused.append((rid, why or "no kv_transfer_params"))
            return
        self._begun.append((rid, tid))
        lent = tuple(p.remote_block_ids or ()) if not self.push else ()
        self._facts.append(c.Begin(tid, len(prompt), chain if self.push else (), c.PeerRef(
            p.remote_address, p.remote_engine_id, lent,
            None if self.push else p.lend_expires_ms)))
        self._facts.append(c.BlocksReady(tid, num_computed // bs, list(block_ids)))

    def finished(self, rid: str, ok: bool, output_token_ids: Sequence[int],
                 block_ids: list[int]) -> tuple[bool, dict | None]:
        """``request_finished``: (the connector keeps the blocks, params for the answer)."""
        self.params.pop(rid, None)
        self._local.pop(rid, None)
        t = self.transfers.pop(rid, None)
        if t is None:
            return False, None
        if self.role == "decode":
            if not t.open:
                return False, None
            self._facts.append(c.End(t.tid, "the request ended before its KV came"))
            self._held.append(rid)
            return True, None
        if not ok or not output_token_ids:
            self._facts.append(c.End(t.tid, "the prefill request was aborted"))
            self._held.append(rid)
            return True, None
        n_blocks = -(-t.num_prompt_tokens // self.block_size)
        if not self.push:
            self._facts.append(c.Prefilled(t.tid))
            self._held.append(rid)
            host, port = self.cfg.side_channel_host, self.cfg.side_channel_port
            return True, KVTransferParams(
                do_remote_prefill=True, transfer_id=t.tid, remote_host=host,
                remote_port=port, remote_engine_id=self.cfg.engine_id,
                remote_request_id=t.tid, remote_block_ids=list(block_ids[:n_blocks]),
                prompt_hashes=list(t.chain),
                lend_expires_ms=self.clock_ms() + int(self.cfg.lease_timeout_s * 1000),
            ).to_wire()
        if n_blocks > t.stated:
            self._facts.append(c.BlocksReady(t.tid, t.stated, list(block_ids[t.stated:n_blocks]),
                                             range(self.num_layers)))
        self._facts.append(c.Prefilled(t.tid, m.PushDone(t.tid, ok=True,
                                                         first_token=int(output_token_ids[0]))))
        self._held.append(rid)
        return True, None

    def reported(self, finished_recving: Sequence[str]) -> None:
        """The worker said these receives are in (``update_connector_output``)."""
        for rid in finished_recving:
            t = self.transfers.get(rid)
            if t is not None:
                t.open = False

    # ---- steps --------------------------------------------------------------------------
    def step(self, scheduled: Sequence[tuple[str, int, int]],
             block_ids_of: Callable[[str], list[int]]) -> ConnectorStep:
        """``build_connector_meta``: ``scheduled`` is (request id, tokens computed before
        this step, tokens it computes) of each request in the step."""
        writes = []
        if self.role == "prefill" and self.push:
            bs = self.block_size
            for rid, before, n in scheduled:
                t = self.transfers.get(rid)
                if t is None:
                    continue
                upto = min(before + n, t.num_prompt_tokens) // bs
                if upto > t.stated:
                    writes.append(StepWrite(t.tid, t.stated, block_ids_of(rid)[t.stated:upto]))
                    t.stated = upto
        step = ConnectorStep(tuple(self._facts), tuple(writes), tuple(self._begun),
                             tuple(self._held), tuple(self._refused))
        self._facts, self._begun, self._held, self._refused = [], [], [], []
        return step
