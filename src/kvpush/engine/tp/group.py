"""Rank 0's side of tensor parallelism: the rank processes, the process group, the plan.

Rank 0 is the engine core's step loop. :class:`RankGroup` starts ranks ``1..N-1`` as
child processes (``python -m kvpush.engine.rank_proc``, each with PR_SET_PDEATHSIG: the
kernel kills them if the core dies), from a thread of its own that then watches their
pidfds and lives as long as they do (PDEATHSIG fires when the forking *thread* exits).
Each rank loads its part of the model, reports ``ready`` (or ``failed`` with why) in rank
0's store, and all join one torch.distributed process group: gloo on CPU (over loopback),
NCCL on CUDA (rank r on device ``cuda:(i+r)``).

Privacy: the ranks' sockets and the store live in a private folder of rank 0's
(``core_dir.make_core_dir``, mode 0700: another uid can neither list nor connect), as
``ipc://`` filesystem sockets, and the store is a ``FileStore`` there (a TCPStore would
listen on loopback, open to every local user; prefixing its keys with a secret would
still let anyone connect, flood it, or hold the rendezvous). Each rank socket is a ZMQ
PAIR: one peer at a time, a second one gets nothing. A rank proves it is the one rank 0
started before any plan goes out: its first message on each of its sockets is the
instance's random token, which it got in its RankSetup on stdin (``_admit``).

Per step rank 0 sends the plan (``plan.py``) on each rank's ZMQ socket, then runs its
own forward pass; the all-reduces of the row-parallel projections keep the ranks in
step. A rank waits for the next plan on its socket, never inside a collective, so an
idle instance has no collective that could time out; inside a step the ranks run the
same work, so a collective that waits ``EngineConfig.tp_collective_timeout_s`` for a
peer means the peer missed the plan or stopped, and the step fails then.

Death: a rank that exits while rank 0 did not ask it to is a :class:`RankDied` in the
engine's inbox (the watcher's callback), and a collective that fails mid-step raises
one from the step; either ends the step loop, which fails every request with the reason
and exits 1. Any other failure of a step at TP > 1 ends the instance too: the ranks
could no longer agree on their collectives. ``close`` stops the ranks (a ``RankStop``,
then SIGKILL after ``STOP_TIMEOUT_S``, at once after a failure) and leaves the group.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hmac
import logging
import os
import pickle
import secrets
import select
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import torch
import torch.distributed as dist
import zmq

from kvpush.config import ConfigError, EngineConfig, KVTransferConfig, tp_kv_heads
from kvpush.engine.core_dir import make_core_dir
from kvpush.engine.tp.kv_ranks import RankProxy, decode_rank_kv, kv_key
from kvpush.engine.tp.plan import RankSetup, RankStep, RankStop, StepChunk
from kvpush.kv_cache.kv_map import RankKV
from kvpush.procs import describe_exit, pdeathsig_preexec

log = logging.getLogger("kvpush.engine.tp")

#: how long the ranks may take to load their part of the model
START_TIMEOUT_S = 600.0
#: how long stopping ranks may take before they are killed
STOP_TIMEOUT_S = 10.0
#: how long a failed step waits for the watcher to name a rank that died
DEATH_GRACE_S = 1.0
#: how long a rank that reported ready may take to prove itself on its sockets
ADMIT_TIMEOUT_S = 5.0
#: the store's file in the group's private folder
STORE_FILE = "store"


class RankDied(Exception):
    """A tensor-parallel rank died, or a step failed so that the ranks are out of step:
    put in the engine's inbox or raised by the step; the step loop ends."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def rank_device(device: str, rank: int) -> str:
    """Rank ``rank``'s device: the CPU for all, or the ``rank``-th CUDA device from
    ``device`` on."""
    if not device.startswith("cuda"):
        return device
    return f"cuda:{int(device.partition(':')[2] or 0) + rank}"


def join_group(store: dist.Store, rank: int, size: int, device: str,
               collective_timeout_s: float) -> None:
    """Join the instance's process group (every rank calls it once all are ready); a
    collective fails after ``collective_timeout_s`` (EngineConfig.tp_collective_timeout_s)."""
    backend = backend_for(device)
    if backend == "gloo":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one host: loopback only
    dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=collective_timeout_s))


def all_reduce(t: torch.Tensor) -> None:
    """Sum ``t`` over the ranks, in place (the row-parallel projections' outputs)."""
    dist.all_reduce(t)


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def rank_socket(ctx: zmq.Context) -> zmq.Socket:
    """One end of a rank's socket (rank 0 binds, the rank connects): a PAIR, one peer at a
    time, that never drops a message."""
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    return sock


def open_store(path: str, size: int) -> dist.Store:
    """The group's store: a file in rank 0's private folder (see the module's docs)."""
    return dist.FileStore(path, size)


def ready_key(rank: int) -> str:
    return f"kvpush/ready/{rank}"


def failed_key(rank: int) -> str:
    return f"kvpush/failed/{rank}"


class RankGroup:
    """Rank 0's handle on ranks 1..N-1 (see the module's docstring)."""

    def __init__(self, config: EngineConfig, log_level: str = "INFO", links: Any = None):
        """``links``: a P/D instance's (kv_transfer.links; default NIXL): each rank builds
        its own KV transport with them (kv_ranks.py)."""
        self.size = config.tensor_parallel_size
        self.config = config
        #: P/D: ranks 1..N-1's regions and agents, and rank 0's proxies to their posts
        self.kv_ranks: list[tuple[RankKV, RankProxy]] = []
        self._kv_socks: list[zmq.Socket] = []
        self.device = config.device
        #: why the group is dead (a rank exited unasked); None while it lives
        self.dead: str | None = None
        self._lock = threading.Lock()
        self._died = threading.Event()
        self._on_death: Callable[[str], None] | None = None
        self._stopping = False
        self._failed = False
        self._closed = False
        self._procs: list[subprocess.Popen] = []
        #: the private folder of the ranks' sockets and the store
        self.folder = make_core_dir()
        store_path = os.path.join(self.folder, STORE_FILE)
        self.store = open_store(store_path, self.size)
        self._ctx = zmq.Context()
        self._socks: list[zmq.Socket] = []
        #: what each rank sends first on each of its sockets (``_admit``)
        self._token = secrets.token_bytes(32)
        rank_config = dataclasses.replace(config, kv_transfer=KVTransferConfig())
        setups = []
        for r in range(1, self.size):
            sock = rank_socket(self._ctx)
            sock.setsockopt(zmq.MAXMSGSIZE, 1 << 16)  # (a rank sends only its token)
            address = f"ipc://{self.folder}/plan-{r}"
            sock.bind(address)
            self._socks.append(sock)
            kv_address = None
            if config.kv_transfer.enabled:
                kv_sock = rank_socket(self._ctx)
                kv_sock.setsockopt(zmq.MAXMSGSIZE, 1 << 16)  # its token, then KVStates
                kv_address = f"ipc://{self.folder}/kv-{r}"
                kv_sock.bind(kv_address)
                self._kv_socks.append(kv_sock)
            setups.append(RankSetup(
                dataclasses.replace(rank_config, device=rank_device(config.device, r)),
                r, store_path, address, self._token, log_level, kv_address, links,
                config.kv_transfer.engine_id))
        self._enc = msgspec.msgpack.Encoder()
        spawned = threading.Event()
        self._thread = threading.Thread(target=self._own_ranks, args=(setups, spawned),
                                        name="kvpush-tp-ranks", daemon=True)
        self._thread.start()
        spawned.wait()
        if self.dead is not None:
            why = self.dead
            self.close()
            raise ConfigError(why)

    # ---- the watcher thread --------------------------------------------------------
    def _own_ranks(self, setups: list[RankSetup], spawned: threading.Event) -> None:
        """Start the ranks, then wait for their exits (this thread lives as long as they
        do: their PDEATHSIG is tied to it)."""
        try:
            for s in setups:
                proc = subprocess.Popen([sys.executable, "-m", "kvpush.engine.rank_proc"],
                                        stdin=subprocess.PIPE, preexec_fn=pdeathsig_preexec())
                self._procs.append(proc)
                assert proc.stdin is not None
                pickle.dump(s, proc.stdin)
                proc.stdin.close()
        except OSError as e:
            self._report(f"tensor-parallel rank {len(self._procs)} did not start: {e}")
        finally:
            spawned.set()
        fds = {os.pidfd_open(p.pid): (r, p) for r, p in enumerate(self._procs, 1)}
        while fds:
            ready, _, _ = select.select(list(fds), [], [])
            for fd in ready:
                r, proc = fds.pop(fd)
                os.close(fd)
                code = proc.wait()
                if not self._stopping:
                    self._report(f"tensor-parallel rank {r} {describe_exit(code)}", r)

    def _report(self, why: str, rank: int = 0) -> None:
        with self._lock:
            for kv, proxy in self.kv_ranks:  # its posts fail at once (kv_ranks.py)
                if kv.rank == rank:
                    proxy.dead = why
            if self.dead is not None:
                return
            self.dead = why
            callback = self._on_death
        log.error("%s: this instance cannot serve any more", why)
        self._died.set()
        if callback is not None:
            callback(why)

    def set_on_death(self, callback: Callable[[str], None]) -> None:
        """``callback(why)`` once, on the watcher thread, when a rank dies unasked (at
        once if one already has)."""
        with self._lock:
            self._on_death = callback
            dead = self.dead
        if dead is not None:
            callback(dead)

    # ---- start-up ------------------------------------------------------------------
    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        """Wait until every rank has loaded its part, then join the process group
        (ConfigError: a rank could not start, and why; ``close`` then kills the ranks at
        once: they may wait in the rendezvous rank 0 never joins)."""
        try:
            self._wait_ready(timeout)
        except BaseException:
            self._failed = True
            raise

    def _wait_ready(self, timeout: float) -> None:
        pending = set(range(1, self.size))
        deadline = time.monotonic() + timeout
        while pending:
            for r in sorted(pending):
                if self.store.check([failed_key(r)]):
                    why = self.store.get(failed_key(r)).decode(errors="replace")
                    raise ConfigError(f"tensor-parallel rank {r} could not start: {why}")
                if self.store.check([ready_key(r)]):
                    pending.discard(r)
            if not pending:
                break
            if self.dead is not None:
                raise ConfigError(f"{self.dead} while starting (see its log above)")
            if time.monotonic() > deadline:
                raise ConfigError(f"tensor-parallel ranks {sorted(pending)} were not ready "
                                  f"in {timeout:.0f} s")
            self._died.wait(0.05)
        self._admit()
        for r, sock in enumerate(self._kv_socks, 1):
            base, metadata = decode_rank_kv(self.store.get(kv_key(r)))
            heads = tp_kv_heads(self.config.model, self.size, r)
            self.kv_ranks.append((RankKV(r, heads.start, heads.stop, base, metadata),
                                  RankProxy(sock, r)))
        join_group(self.store, 0, self.size, self.device,
                   self.config.tp_collective_timeout_s)

    def _admit(self) -> None:
        """Each rank's first message on each of its sockets must be the instance's token
        (it was sent before the rank reported ready); ConfigError if not: whatever is at
        the other end is not the rank this process started, and gets no plan."""
        socks = [(r, s, "plan") for r, s in enumerate(self._socks, 1)]
        socks += [(r, s, "KV") for r, s in enumerate(self._kv_socks, 1)]
        deadline = time.monotonic() + ADMIT_TIMEOUT_S
        for r, sock, what in socks:
            if not sock.poll(int(max(0.0, deadline - time.monotonic()) * 1000)):
                raise ConfigError(f"tensor-parallel rank {r} did not prove itself on its "
                                  f"{what} socket in {ADMIT_TIMEOUT_S:.0f} s")
            if not hmac.compare_digest(sock.recv(zmq.NOBLOCK), self._token):
                raise ConfigError(f"tensor-parallel rank {r}'s {what} socket: its peer is "
                                  "not the rank this instance started (wrong token)")

    # ---- steps ---------------------------------------------------------------------
    def send_step(self, chunks: list[StepChunk]) -> None:
        """The step's plan to every other rank (before rank 0 runs it)."""
        if self.dead is not None:
            raise RankDied(self.dead)
        frame = self._enc.encode(RankStep(chunks))
        for r, sock in enumerate(self._socks, 1):
            try:
                sock.send(frame, zmq.NOBLOCK)
            except zmq.Again:
                raise RankDied(f"tensor-parallel rank {r} is not connected") from None

    def failure(self, e: BaseException) -> RankDied:
        """What a failed step at TP > 1 means: the rank that died (the watcher names it
        within ``DEATH_GRACE_S``), else rank 0's own failure; either way the ranks can
        no longer agree, so the instance ends."""
        self._failed = True
        self._died.wait(DEATH_GRACE_S)
        if self.dead is not None:
            return RankDied(self.dead)
        return RankDied(f"a tensor-parallel step failed on rank 0 ({type(e).__name__}: {e});"
                        " the ranks are out of step, so the instance stops")

    # ---- the end -------------------------------------------------------------------
    def close(self) -> None:
        """Stop the ranks (cleanly unless a step failed or a rank died; killed after
        ``STOP_TIMEOUT_S``) and leave the process group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stopping = True
        if not self._failed and self.dead is None:
            frame = self._enc.encode(RankStop())
            for sock in self._socks:
                with contextlib.suppress(zmq.Again):
                    sock.send(frame, zmq.NOBLOCK)
            deadline = time.monotonic() + STOP_TIMEOUT_S
            for proc in self._procs:
                try:
                    proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.error("tensor-parallel rank did not stop in %.0f s; killing it",
                              STOP_TIMEOUT_S)
                    break
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
        self._thread.join(STOP_TIMEOUT_S)
        leave_group()
        for sock in self._socks + self._kv_socks:
            sock.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self.folder, ignore_errors=True)
