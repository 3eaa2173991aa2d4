"""A tensor-parallel rank other than 0 (``python -m kvpush.engine.rank_proc``), started
by rank 0's RankGroup (kvpush.engine.tp.group) with a RankSetup pickled on stdin.

It loads its part of the model and its KV region slice (a ModelRunner at its rank),
times its matmul kernels at its thread count (``--threads``: each rank's), reports
``ready`` in rank 0's store (or ``failed`` and why) once it has sent the instance's
token on each of its sockets (rank 0 checks it before any plan), joins the process
group, then runs each RankStep it receives on its ZMQ socket (``ModelRunner.run_chunks``, no logits)
until a RankStop. It owns no request, no block and no output: rank 0 does.

Life: SIGINT and SIGTERM are ignored (they reach the whole process group; rank 0 stops
the ranks once it stops); the kernel kills it if rank 0 dies (PR_SET_PDEATHSIG); a step
that fails here ends this process with code 1, which ends the instance (rank 0 sees it),
and so does its KV transfer thread's death (P/D).
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys

import msgspec
import torch
import zmq

from kvpush.engine.model_runner import ModelRunner
from kvpush.engine.tp.group import (
    failed_key,
    join_group,
    leave_group,
    open_store,
    rank_socket,
    ready_key,
)
from kvpush.engine.tp.kv_ranks import RankKVServer, encode_rank_kv, kv_key
from kvpush.engine.tp.plan import RankMessage, RankSetup, RankStop
from kvpush.logs import setup_logging

log = logging.getLogger("kvpush.engine.tp")


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    setup: RankSetup = pickle.load(sys.stdin.buffer)
    sys.stdin.close()
    setup_logging(setup.log_level)  # the API process's format
    config, rank = setup.config, setup.rank
    store = open_store(setup.store_path, config.tensor_parallel_size)
    ctx = zmq.Context()
    sock = rank_socket(ctx)
    kv: RankKVServer | None = None
    try:
        if config.device.startswith("cuda"):
            torch.cuda.set_device(config.device)
        torch.set_num_threads(1)  # loading; the steps run at config.threads
        runner = ModelRunner(config, rank=rank)
        torch.set_num_threads(config.threads or 1)
        runner.model.ensure_linears()  # timed at the steps' thread count
        sock.connect(setup.plan_address)
        sock.send(setup.token)  # (queued until connected)
        if setup.kv_address is not None:  # P/D: this rank moves its own KV heads
            kv = kv_server(setup, ctx, runner)
            store.set(kv_key(rank), encode_rank_kv(  # type: ignore[arg-type]  # (bytes too)
                runner.kv_region.base_address, kv.transport.metadata()))
    except Exception as e:  # noqa: BLE001 - rank 0 reports it and does not start
        log.exception("tensor-parallel rank %d could not start", rank)
        store.set(failed_key(rank), str(e) or type(e).__name__)
        return 1
    store.set(ready_key(rank), "1")
    join_group(store, rank, config.tensor_parallel_size, config.device,
               config.tp_collective_timeout_s)
    log.debug("tensor-parallel rank %d ready (%s)", rank, runner.shard)
    dec = msgspec.msgpack.Decoder(RankMessage)
    try:
        while True:
            msg = dec.decode(sock.recv())
            if isinstance(msg, RankStop):
                return 0
            runner.run_chunks(msg.chunks, logits=False)
    except Exception:
        log.exception("tensor-parallel rank %d: a step failed; the instance stops", rank)
        return 1
    finally:
        if kv is not None:
            kv.close()
        leave_group()
        sock.close()
        ctx.term()


def kv_server(setup: RankSetup, ctx: zmq.Context, runner: ModelRunner) -> RankKVServer:
    """This rank's KV transport (its own NIXL agent and region) and its server thread."""
    from kvpush.kv_transfer.links import NixlLinks

    assert setup.kv_address is not None  # (P/D ranks only)
    links = setup.links if setup.links is not None else NixlLinks()
    transport = links.transport(f"{setup.engine_id}.rank{setup.rank}")
    try:
        region = runner.kv_region
        transport.register_region(region.base_address, region.nbytes, setup.config.device)
        return RankKVServer(transport, ctx, setup.kv_address, setup.rank, setup.token,
                            on_death=lambda: os._exit(1))  # (the instance ends)
    except BaseException:
        transport.close()
        raise


if __name__ == "__main__":
    sys.exit(main())
