"""LoopbackPair: two NIXL agents in two processes on this host, for measuring transfers.

The initiator (this process) and a spawned peer each hold a KV region of kvpush's layout
(``kv[layer, block, K/V, token, kv_head, head_dim]``) registered with a
:class:`~kvpush.kv_transfer.transports.nixl_transport.NixlTransport`; descriptors come from
``layer_block_descs`` exactly as the engine builds them. Used by the transfer
micro-benchmark (``benchmarks/transfer_micro.py``) and by ``kvpush simulate calibrate``.

    with LoopbackPair(layers=30, heads=3, head_dim=64, dtype="float32", blocks=64) as pair:
        local, remote = pair.descs(range(16), range(16))
        post_s, total_s = pair.time("WRITE", local, remote, iters=3)

Over loopback UCX copies with cma: the copy happens inside ``post()``.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from collections.abc import Iterable, Sequence
from typing import Any

BLOCK = 32  # tokens per block (kvpush's default)


def kv_region(layers: int, blocks: int, heads: int, head_dim: int, dtype: str,
              block_size: int = BLOCK) -> Any:
    """A KV tensor of kvpush's layout, its pages faulted in before anything is timed."""
    import torch

    t = torch.empty((layers, blocks, 2, block_size, heads, head_dim),
                    dtype=getattr(torch, dtype))
    t.view(torch.uint8).fill_(1)
    return t


def layout_of(t: Any) -> Any:
    """The :class:`KVLayout` of a tensor made by :func:`kv_region`."""
    from kvpush.kv_cache.kv_region import LAYOUT_NAME, KVLayout

    layers, blocks, _, bs, heads, dim = t.shape
    block_bytes = 2 * bs * heads * dim * t.element_size()
    return KVLayout(LAYOUT_NAME, layers, blocks, bs, heads, dim, str(t.dtype), block_bytes,
                    blocks * block_bytes)


def _peer_main(conn: Any, shape: tuple) -> None:
    import torch

    torch.set_num_threads(1)
    from kvpush.kv_transfer.transports.nixl_transport import NixlTransport

    kv = kv_region(*shape)
    tr = NixlTransport("loopback-peer")
    tr.register_region(kv.data_ptr(), kv.numel() * kv.element_size())
    conn.send(tr.metadata())
    # progress (1 ms naps on the pipe) until told to stop: a WRITE or READ the initiator
    # posts may need this side's progress (UCX's handshakes; not only at wire-up: a
    # second WRITE once hung 60 s on a busy host when this side stopped after the first)
    while not (conn.poll(0.001) and conn.recv() == "stop"):  # ("connected" passes)
        tr.progress()
    tr.close()


def wait_done(tr: Any, handle: int, timeout: float = 60.0) -> None:
    """Wait for a posted transfer (bench use: over cma it is done when posted)."""
    from kvpush.kv_transfer.transports.transport import XferState

    deadline = time.monotonic() + timeout
    while (st := tr.state(handle)) is XferState.PENDING:
        if time.monotonic() > deadline:
            raise TimeoutError("transfer did not complete")
        time.sleep(0.0001)
    if st is not XferState.DONE:
        raise RuntimeError(f"transfer ended {st}")
    tr.release(handle)


class LoopbackPair:
    """The two agents, wired up; a context manager (leaving it stops the peer)."""

    def __init__(self, *, layers: int, heads: int, head_dim: int, dtype: str, blocks: int,
                 block_size: int = BLOCK, name: str = "loopback"):
        self.shape = (layers, blocks, heads, head_dim, dtype, block_size)
        self.name = name
        self.tr: Any = None
        self.kv: Any = None
        self.layout: Any = None
        self.peer_name = ""
        self.remote_base = 0
        self._peer: Any = None
        self._conn: Any = None

    def __enter__(self) -> LoopbackPair:
        import torch

        from kvpush.kv_transfer.transports.nixl_transport import NixlTransport

        torch.set_num_threads(1)
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._peer = ctx.Process(target=_peer_main, args=(child, self.shape), daemon=True)
        self._peer.start()
        try:
            self.kv = kv_region(*self.shape)
            self.layout = layout_of(self.kv)
            self.tr = NixlTransport(f"{self.name}-init")
            self.tr.register_region(self.kv.data_ptr(), self.kv.numel() * self.kv.element_size())
            if not self._conn.poll(120):
                raise TimeoutError("loopback pair: the peer process did not start")
            self.peer_name = self.tr.add_peer(self._conn.recv())
            self.remote_base = self.tr.peer_region(self.peer_name).base
            local, remote = self.descs([0], [0], layers=[0])
            wait_done(self.tr, self.tr.post("WRITE", self.peer_name, local, remote))
            self._conn.send("connected")
        except BaseException:
            self.__exit__()
            raise
        return self

    def descs(self, local_blocks: Sequence[int], remote_blocks: Sequence[int],
              layers: Iterable[int] | None = None) -> tuple[list, list]:
        """(local, remote) descriptors for these blocks, every layer unless given."""
        from kvpush.kv_cache.kv_map import layer_block_descs

        return layer_block_descs(self.kv.data_ptr(), self.layout, list(local_blocks),
                                 self.remote_base, self.layout, list(remote_blocks),
                                 range(self.layout.num_layers) if layers is None else layers)

    def time(self, op: str, local: list, remote: list, iters: int) -> tuple[float, float]:
        """Median seconds of (post, post -> done) over ``iters`` transfers."""
        posts, totals = [], []
        for _ in range(iters):
            t0 = time.perf_counter()
            h = self.tr.post(op, self.peer_name, local, remote)
            t1 = time.perf_counter()
            wait_done(self.tr, h)
            posts.append(t1 - t0)
            totals.append(time.perf_counter() - t0)
        return statistics.median(posts), statistics.median(totals)

    def __exit__(self, *exc: object) -> None:
        if self.tr is not None:
            self.tr.close()
            self.tr = None
        peer = self._peer
        if peer is not None and peer.is_alive():
            self._conn.send("stop")
            peer.join(10)
        if peer is not None and peer.is_alive():
            peer.kill()
            peer.join(5)
