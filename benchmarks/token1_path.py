"""Token #1 to decode: the side-channel message against the last WRITE's NIXL notification
(issue 37, point 4).

Push ends with prefill's last WRITEs and a ``PushDone`` (token #1, its logprobs) for
decode. Two ways to carry that ``PushDone``:

* **side channel** (what kvpush does): the WRITE completes (over cma inside its post),
  then the transfer thread sends ``PushDone`` on the ZMQ side channel; decode's transfer
  thread sleeps in the side channel's poll and wakes on the message.
* **NIXL notification**: the ``PushDone`` rides on the last WRITE as its ``notif_msg``;
  decode learns of it only when it calls ``get_new_notifs()``. NIXL gives no file
  descriptor to sleep on, so decode must poll: every millisecond (what the transfer
  thread does while it waits for a completion), or in a tight loop (a core spinning
  per idle decode, as NIXL's own progress thread does).

Two processes on this host (prefill: this one; decode: a spawned one), each with a
:class:`~kvpush.kv_transfer.transports.nixl_transport.NixlTransport` over UCX and a
:class:`~kvpush.kv_transfer.wire.side_channel.SideChannel` with a cluster secret (CURVE and
message MACs, as a ``kvpush up`` cluster runs). Each measured hand-off: decode starts
waiting, prefill waits a random 0-3 ms (so the phase against a poll tick is random),
stamps ``t0``, posts the last WRITE (``--blocks`` blocks of every layer, SmolLM2's
shape) and, in the side-channel mode, sends ``PushDone``; decode stamps the moment it
holds the decoded ``PushDone``. One clock (CLOCK_MONOTONIC) for both processes. The
modes alternate hand-off by hand-off; decode's CPU time per hand-off (its whole
process) is reported beside the latency.

    UCX_NET_DEVICES=lo PYTHONPATH=src .venv/bin/python benchmarks/token1_path.py [--n 300]

Needs NIXL. Prints one table (median, p90, p99 in microseconds).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import statistics
import time
from typing import Any

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

SHAPE = (30, 64, 3, 64, "float32")  # SmolLM2-135M: layers, blocks, kv heads, head dim
SECRET = b"token1-path-bench-secret-32bytes"
MODES = ("side channel", "notif, polled every 1 ms", "notif, spinning")


def _notifs(tr: Any) -> list[bytes]:
    """The NIXL notifications that arrived (the agent is the transport's: a benchmark may
    reach into it; kvpush itself discards notifications)."""
    with tr._lock:
        got = tr._agent.get_new_notifs()
    return [n for msgs in got.values() for n in msgs]


def _write(tr: Any, peer: str, local: Any, remote: Any, notif: bytes) -> None:
    """A WRITE with a notification: NixlTransport.post plus ``notif_msg`` (bench only)."""
    import numpy as np

    from kvpush.kv_transfer.transports.transport import validate_post

    with tr._lock:
        meta = tr._peers[peer]
        loc, rem = validate_post("WRITE", local, remote, tr._region, meta.region)
        ld = np.zeros((len(loc), 3), dtype=np.uint64)
        ld[:, :2] = loc
        rd = np.zeros((len(rem), 3), dtype=np.uint64)
        rd[:, :2] = rem
        agent = tr._agent
        xh = agent.initialize_xfer("WRITE", agent.get_xfer_descs(ld, "DRAM"),
                                   agent.get_xfer_descs(rd, "DRAM"), peer, notif)
        state = agent.transfer(xh, notif)
        for _ in range(100_000):  # over cma DONE at once; bounded all the same
            if state == "DONE":
                break
            if state == "ERR":
                raise RuntimeError("WRITE failed")
            state = agent.check_xfer_state(xh)
        xh.release()


def _decode_main(conn: Any) -> None:
    import torch

    torch.set_num_threads(1)
    from kvpush.kv_transfer.transports.nixl_transport import NixlTransport
    from kvpush.kv_transfer.wire import messages as m
    from kvpush.kv_transfer.wire.side_channel import SideChannel
    from kvpush.sim.loopback import kv_region

    kv = kv_region(*SHAPE)
    # two agents: a WRITE with a notification leaves work on its endpoint that only the
    # target's progress finishes, which would stall the next plain WRITE behind it
    tr = NixlTransport("token1-decode")
    trn = NixlTransport("token1-decode-notif")
    for agent in (tr, trn):
        agent.register_region(kv.data_ptr(), kv.numel() * kv.element_size())
    chan = SideChannel("127.0.0.1", 0, secret=SECRET)
    conn.send((tr.metadata(), trn.metadata(), chan.address))
    while not conn.poll(0.001):  # progress until prefill is wired up
        tr.progress()
        trn.progress()
    conn.recv()
    try:
        while True:
            mode = conn.recv()
            if mode is None:
                return
            conn.send("waiting")
            c0 = time.process_time()
            done = None
            for _ in range(2_000_000):  # bounded: a hand-off arrives within seconds
                if mode == MODES[0]:  # as the transfer thread waits: 20 ms, then progress
                    got = [p for _, p in chan.recv(20)]
                    if not got:
                        tr.progress()
                elif mode == MODES[1]:
                    chan.recv(1)  # the transfer thread's 1 ms wait while it awaits
                    got = _notifs(trn)
                else:
                    got = _notifs(trn)
                if got:
                    done = m.decode(got[0])
                    break
            t1 = time.perf_counter()
            cpu = time.process_time() - c0
            if not isinstance(done, m.PushDone):
                raise RuntimeError(f"{mode}: no PushDone arrived")
            conn.send((t1 - float(done.transfer_id), cpu))
    finally:
        chan.close()
        tr.close()
        trn.close()


def run(n: int, blocks: int) -> dict[str, tuple[list[float], list[float]]]:
    import torch

    torch.set_num_threads(1)
    from kvpush.kv_cache.kv_map import layer_block_descs
    from kvpush.kv_transfer.transports.nixl_transport import NixlTransport
    from kvpush.kv_transfer.wire import messages as m
    from kvpush.kv_transfer.wire.side_channel import SideChannel
    from kvpush.sim.loopback import kv_region, layout_of, wait_done

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_decode_main, args=(child,), daemon=True)
    proc.start()
    kv = kv_region(*SHAPE)
    layout = layout_of(kv)
    tr = NixlTransport("token1-prefill")
    trn = NixlTransport("token1-prefill-notif")
    for agent in (tr, trn):
        agent.register_region(kv.data_ptr(), kv.numel() * kv.element_size())
    chan = SideChannel("127.0.0.1", 0, secret=SECRET)
    out: dict[str, tuple[list[float], list[float]]] = {mode: ([], []) for mode in MODES}
    try:
        if not conn.poll(120):
            raise TimeoutError("the decode process did not start")
        meta, meta_n, address = conn.recv()
        peer = tr.add_peer(meta)
        peer_n = trn.add_peer(meta_n)
        base = tr.peer_region(peer).base
        ids = list(range(blocks))
        local, remote = layer_block_descs(kv.data_ptr(), layout, ids, base, layout, ids,
                                          range(layout.num_layers))
        for _ in range(20):  # UCX's wire-up completes while decode progresses
            wait_done(tr, tr.post("WRITE", peer, local, remote))
            wait_done(trn, trn.post("WRITE", peer_n, local, remote))
        conn.send("connected")
        order = [MODES[i % len(MODES)] for i in range(n * len(MODES))]
        for i, mode in enumerate(order):
            conn.send(mode)
            if conn.recv() != "waiting":
                raise RuntimeError("decode out of step")
            time.sleep(random.uniform(0, 0.003))
            t0 = time.perf_counter()
            done = m.encode(m.PushDone(repr(t0), ok=True, first_token=1234,
                                       first_logprob=-0.5))
            if mode == MODES[0]:
                wait_done(tr, tr.post("WRITE", peer, local, remote))
                chan.send(address, done)
            else:
                _write(trn, peer_n, local, remote, done)
            if not conn.poll(10):
                raise TimeoutError(f"{mode}: decode never got hand-off {i}")
            latency, cpu = conn.recv()
            if i >= 3 * len(MODES):  # warm-up: CURVE handshake, first notifications
                out[mode][0].append(latency)
                out[mode][1].append(cpu)
        conn.send(None)
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
        chan.close()
        tr.close()
        trn.close()
    return out


def _q(xs: list[float], f: float) -> float:
    return xs[min(len(xs) - 1, int(len(xs) * f))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=300, help="hand-offs per mode (after 3 warm-up)")
    p.add_argument("--blocks", type=int, default=4, help="blocks in the last WRITE")
    args = p.parse_args()
    res = run(args.n + 3, args.blocks)
    print(f"last WRITE: {args.blocks} blocks x {SHAPE[0]} layers (SmolLM2 fp32 shape); "
          f"{args.n} hand-offs per mode, modes alternating")
    print("| token #1 carried by | t0 -> decode holds PushDone, median / p90 / p99 (us) "
          "| decode's CPU per hand-off, median (us) |")
    print("|---|---:|---:|")
    for mode, (lat, cpu) in res.items():
        lat = sorted(x * 1e6 for x in lat)
        print(f"| {mode} | {statistics.median(lat):.0f} / {_q(lat, 0.9):.0f} / {_q(lat, 0.99):.0f} "
              f"| {statistics.median(cpu) * 1e6:.0f} |")


if __name__ == "__main__":
    main()
