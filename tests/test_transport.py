"""KV transports: NIXL between two real processes, the in-process transport with its
faults, and the descriptor coalescing helper."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import select
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from kvpush.kv_cache.kv_map import block_indices, layer_block_descs, layer_rows, paired_runs
from kvpush.kv_cache.kv_region import KVLayout
from kvpush.kv_transfer.transports.transport import (
    KVTransport,
    TransferPostError,
    XferState,
    decode_metadata,
)
from kvpush_testing.faults import FaultPlan
from kvpush_testing.inproc_transport import InProcTransport

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

try:
    import nixl  # noqa: F401

    NIXL_MISSING = ""
except Exception as exc:  # pragma: no cover - nixl is installed in the dev venv
    NIXL_MISSING = f"nixl cannot be imported: {exc!r}"

requires_nixl = pytest.mark.skipif(bool(NIXL_MISSING), reason=NIXL_MISSING or "nixl present")


def region(nbytes: int, fill: int | None = None, seed: int | None = None) -> torch.Tensor:
    """A uint8 host tensor standing in for a KV region."""
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    return torch.full((nbytes,), fill or 0, dtype=torch.uint8)


def wait_done(t: KVTransport, handle: int, timeout: float = 10.0, idle: Callable | None = None):
    """Poll a transfer until it leaves PENDING (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        st = t.state(handle)
        if st is not XferState.PENDING:
            return st
        if idle:
            idle()
        assert time.monotonic() < deadline, "transfer did not finish in time"
        time.sleep(0.0005)


# -- NIXL across two processes -------------------------------------------------------

PEER_SCRIPT = textwrap.dedent(
    """
    import base64, hashlib, json, os, select, sys, time
    import torch
    from kvpush.kv_transfer.transports.nixl_transport import NixlTransport
    from kvpush.kv_transfer.transports.transport import TransferPostError, XferState

    size, name = int(sys.argv[1]), sys.argv[2]
    buf = torch.zeros(size, dtype=torch.uint8)
    t = NixlTransport(name)
    t.register_region(buf.data_ptr(), size)

    def out(obj):
        sys.stdout.write(json.dumps(obj) + "\\n")
        sys.stdout.flush()

    out({"md": base64.b64encode(t.metadata()).decode(), "base": buf.data_ptr()})
    pending = b""
    while True:
        r, _, _ = select.select([0], [], [], 0.002)
        t.progress()  # keep UCX going: a new initiator's wire-up needs it
        if not r:
            continue
        chunk = os.read(0, 1 << 20)
        if not chunk:
            break
        pending += chunk
        while b"\\n" in pending:
            line, pending = pending.split(b"\\n", 1)
            cmd = json.loads(line)
            op = cmd["op"]
            if op == "quit":
                t.close()
                out({"ok": True})
                sys.exit(0)
            elif op == "add":
                out({"peer": t.add_peer(base64.b64decode(cmd["md"]))})
            elif op == "sha":
                out({"sha": hashlib.sha256(buf.numpy().tobytes()).hexdigest()})
            elif op == "get":
                data = buf[cmd["off"]: cmd["off"] + cmd["len"]].numpy().tobytes()
                out({"data": base64.b64encode(data).decode()})
            elif op == "fill":
                g = torch.Generator().manual_seed(cmd["seed"])
                buf.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g))
                out({"ok": True})
            elif op == "post":
                try:
                    h = t.post(cmd["kind"], cmd["peer"], cmd["local"], cmd["remote"])
                except TransferPostError as exc:
                    out({"error": str(exc)})
                    continue
                deadline = time.monotonic() + 10
                while t.state(h) is XferState.PENDING and time.monotonic() < deadline:
                    pass
                out({"state": t.state(h).value})
                t.release(h)
    """
)


class PeerProcess:
    """A NixlTransport in a child process, driven by JSON lines over its stdin/stdout."""

    def __init__(self, size: int, name: str, local: KVTransport | None = None):
        env = dict(os.environ, UCX_NET_DEVICES="lo", NIXL_LOG_LEVEL="WARN", OMP_NUM_THREADS="1")
        self.local = local  # progressed while we wait for answers
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PEER_SCRIPT, str(size), name],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        self._buf = b""
        hello = self._read(60.0)
        self.metadata = base64.b64decode(hello["md"])
        self.base: int = hello["base"]
        self.size = size

    def _read(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            assert left > 0, "peer process did not answer in time"
            r, _, _ = select.select([fd], [], [], min(left, 0.002))
            if self.local is not None:
                self.local.progress()
            if r:
                chunk = os.read(fd, 1 << 20)
                assert chunk, f"peer process exited (rc={self.proc.poll()})"
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def call(self, timeout: float = 20.0, **cmd) -> dict:
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()
        return self._read(timeout)

    def sha(self) -> str:
        return self.call(op="sha")["sha"]

    def get(self, off: int, length: int) -> bytes:
        return base64.b64decode(self.call(op="get", off=off, len=length)["data"])

    def stop(self) -> None:
        try:
            if self.proc.poll() is None:
                self.call(op="quit", timeout=5.0)
        except (AssertionError, BrokenPipeError, OSError):
            pass
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait(5)


PEER_SIZE = 3 << 20  # deliberately not the same size as ours
LOCAL_SIZE = 1 << 20


@pytest.fixture(scope="module")
def nixl_pair() -> Iterator[tuple]:
    """(our NixlTransport, our region tensor, the peer process) with peers added both ways."""
    if NIXL_MISSING:
        pytest.skip(NIXL_MISSING)
    from kvpush.kv_transfer.transports.nixl_transport import NixlTransport

    buf = region(LOCAL_SIZE)
    ours = NixlTransport(f"test-local-{os.getpid()}")
    ours.register_region(buf.data_ptr(), LOCAL_SIZE)
    peer = PeerProcess(PEER_SIZE, f"test-peer-{os.getpid()}", local=ours)
    try:
        name = ours.add_peer(peer.metadata)
        ours_md = base64.b64encode(ours.metadata()).decode()
        assert peer.call(op="add", md=ours_md)["peer"] == ours.name
        yield ours, buf, peer, name
    finally:
        peer.stop()
        ours.close()


def expected_peer_bytes(writes: list[tuple[int, bytes]]) -> str:
    """sha256 of the peer region if it held zeros except for the given writes."""
    img = bytearray(PEER_SIZE)
    for off, data in writes:
        img[off : off + len(data)] = data
    return hashlib.sha256(bytes(img)).hexdigest()


@requires_nixl
def test_nixl_metadata_envelope_and_idempotent_add(nixl_pair):
    ours, buf, peer, name = nixl_pair
    meta = decode_metadata(peer.metadata, "nixl")
    assert meta.name == name and meta.region.base == peer.base
    assert meta.region.nbytes == PEER_SIZE and meta.region.device == "cpu" and meta.agent
    assert ours.add_peer(peer.metadata) == name  # same metadata again: no-op
    with pytest.raises(ValueError):
        decode_metadata(peer.metadata, "inproc")
    with pytest.raises(ValueError):
        ours.add_peer(b"not metadata")


@requires_nixl
def test_nixl_write_noncontiguous_then_read_back(nixl_pair):
    ours, buf, peer, name = nixl_pair
    g = torch.Generator().manual_seed(7)
    buf.copy_(torch.randint(0, 256, (LOCAL_SIZE,), dtype=torch.uint8, generator=g))
    pb, cb = buf.data_ptr(), peer.base
    # (local offset, remote offset, length): scattered, odd sizes, last byte of the peer
    pieces = [
        (0, 500, 4096),
        (10_000, 200_000, 123),
        (65_536, 300_001, 70_000),
        (LOCAL_SIZE - 1000, PEER_SIZE - 1000, 1000),
    ]
    local = [(pb + lo, n) for lo, _, n in pieces]
    remote = [(cb + ro, n) for _, ro, n in pieces]
    before = ours.stats.posts
    h = ours.post("WRITE", name, local, remote)
    assert wait_done(ours, h) is XferState.DONE
    ours.release(h)
    src = buf.numpy().tobytes()
    writes = [(ro, src[lo : lo + n]) for lo, ro, n in pieces]
    for ro, data in writes:
        assert peer.get(ro, len(data)) == data
    assert peer.sha() == expected_peer_bytes(writes)  # nothing else was touched
    assert ours.stats.posts == before + 1 and ours.stats.descs_posted >= len(pieces)

    # READ the same ranges back into a zeroed scratch area of our region
    scratch = 512 << 10
    buf[scratch:].zero_()
    back_local, off = [], scratch
    for _, _, n in pieces:
        back_local.append((pb + off, n))
        off += n
    h = ours.post("READ", name, back_local, remote)
    assert wait_done(ours, h) is XferState.DONE
    ours.release(h)
    got = buf.numpy().tobytes()
    for (addr, n), (_, data) in zip(back_local, writes):
        assert got[addr - pb : addr - pb + n] == data


@requires_nixl
def test_nixl_post_outside_regions_is_refused_and_writes_nothing(nixl_pair):
    ours, buf, peer, name = nixl_pair
    buf.fill_(0xAB)
    sha = peer.sha()
    pb, cb = buf.data_ptr(), peer.base
    fails = ours.stats.post_failures
    bad = [
        ("WRITE", name, [(pb, 4096)], [(cb + PEER_SIZE - 100, 4096)]),  # past the peer's end
        ("WRITE", name, [(pb, 4096)], [(cb - 4096, 4096)]),  # before the peer's base
        ("WRITE", name, [(pb + LOCAL_SIZE - 10, 64)], [(cb, 64)]),  # past our end
        ("READ", name, [(pb, 64)], [(cb + PEER_SIZE, 64)]),
        ("WRITE", name, [(pb, 64), (pb + 64, 64)], [(cb, 64)]),  # count mismatch
        ("WRITE", name, [(pb, 64)], [(cb, 65)]),  # length mismatch
        ("WRITE", name, [(pb, 0)], [(cb, 0)]),  # empty range
        ("WRITE", name, [], []),
        ("WRITE", "nobody", [(pb, 64)], [(cb, 64)]),
        ("COPY", name, [(pb, 64)], [(cb, 64)]),
    ]
    for op, p, loc, rem in bad:
        with pytest.raises(TransferPostError):
            ours.post(op, p, loc, rem)
    assert ours.stats.post_failures == fails + len(bad)
    # the peer's region is untouched; a good post still works afterwards
    assert peer.sha() == sha
    h = ours.post("WRITE", name, [(pb, 64)], [(cb, 64)])
    assert wait_done(ours, h) is XferState.DONE
    ours.release(h)
    assert peer.get(0, 64) == b"\xab" * 64


@requires_nixl
def test_nixl_peer_initiated_write_needs_our_progress(nixl_pair):
    """The child WRITEs into us; we only call progress() (inside PeerProcess._read)."""
    ours, buf, peer, name = nixl_pair
    buf.zero_()
    assert peer.call(op="fill", seed=3)["ok"]
    ans = peer.call(
        op="post",
        kind="WRITE",
        peer=ours.name,
        local=[[peer.base + 100, 5000]],
        remote=[[buf.data_ptr() + 7, 5000]],
    )
    assert ans == {"state": "DONE"}
    assert buf[7:5007].numpy().tobytes() == peer.get(100, 5000)
    assert int(buf[:7].sum()) == 0 and int(buf[5007:].sum()) == 0
    ans = peer.call(
        op="post",
        kind="WRITE",
        peer=ours.name,
        local=[[peer.base, 64]],
        remote=[[buf.data_ptr() + LOCAL_SIZE - 32, 64]],
    )
    assert "error" in ans


@requires_nixl
def test_nixl_prepared_lists_write_by_index_and_refuse_bad_posts(nixl_pair):
    """Posts by index into our prepared list and the peer's land exactly there; what
    cannot be posted is refused before anything is written."""
    ours, buf, peer, name = nixl_pair
    g = torch.Generator().manual_seed(11)
    buf.copy_(torch.randint(0, 256, (LOCAL_SIZE,), dtype=torch.uint8, generator=g))
    pb, cb, n = buf.data_ptr(), peer.base, 4096
    mine = ((pb, n, n, 16), (pb + (128 << 10), n, 2 * n, 8))  # 24 descriptors
    theirs = ((cb + 8192, n, n, 64),)
    descs, before = ours.stats.descs_posted, bytearray(peer.get(8192, 64 * n))
    li, ri = [0, 1, 2, 17], [5, 6, 7, 3]
    h = ours.post_prepared("WRITE", name, mine, li, theirs, ri)
    assert wait_done(ours, h) is XferState.DONE
    ours.release(h)
    assert ours.stats.descs_posted == descs + 4  # an index a descriptor (NIXL merges)
    src = buf.numpy().tobytes()
    local_off = [i * n if i < 16 else (128 << 10) + (i - 16) * 2 * n for i in li]
    writes = [(8192 + r * n, src[lo:lo + n]) for lo, r in zip(local_off, ri)]
    for off, data in writes:
        before[off - 8192:off - 8192 + n] = data
    assert peer.get(8192, 64 * n) == bytes(before)  # those blocks and nothing else

    sha, fails = peer.sha(), ours.stats.post_failures
    half = ((pb, n // 2, n, 16),)  # other lengths than the peer's
    bad = [
        ("WRITE", name, half, [0], theirs, [0]),
        ("WRITE", "nobody", mine, [0], theirs, [0]),
        ("WRITE", name, mine, [24], theirs, [0]),
        ("WRITE", name, mine, [0], theirs, [-1]),
        ("WRITE", name, mine, [0, 1], theirs, [0]),
        ("WRITE", name, mine, [], theirs, []),
        ("COPY", name, mine, [0], theirs, [0]),
        ("WRITE", name, ((pb, n, n, 257),), [0], theirs, [0]),  # past our region
        ("WRITE", name, mine, [0], ((cb - 1, 64, 64, 1),), [0]),  # before the peer's
        ("WRITE", name, (), [0], theirs, [0]),
    ]
    for args in bad:
        with pytest.raises(TransferPostError):
            ours.post_prepared(*args)
    assert ours.stats.post_failures == fails + len(bad)
    assert peer.sha() == sha
    h = ours.post_prepared("READ", name, mine, [3], theirs, [5])
    assert wait_done(ours, h) is XferState.DONE
    ours.release(h)
    assert buf[3 * n:4 * n].numpy().tobytes() == writes[0][1]


# -- descriptor coalescing -------------------------------------------------------------


def layout(num_blocks: int, num_layers: int = 3, block_bytes: int = 256) -> KVLayout:
    return KVLayout(
        layout="test",
        num_layers=num_layers,
        num_blocks=num_blocks,
        block_size=4,
        num_kv_heads=1,
        head_dim=8,
        dtype="float32",
        block_bytes=block_bytes,
        layer_bytes=block_bytes * num_blocks,
    )


def test_paired_runs_split_where_either_side_breaks():
    assert paired_runs([], []) == []
    assert paired_runs([1, 2, 3], [7, 8, 9]) == [(1, 7, 3)]
    assert paired_runs([1, 2, 3], [7, 9, 10]) == [(1, 7, 1), (2, 9, 2)]  # remote breaks
    assert paired_runs([1, 3, 4], [7, 8, 9]) == [(1, 7, 1), (3, 8, 2)]  # local breaks
    assert paired_runs([5, 4, 3], [0, 1, 2]) == [(5, 0, 1), (4, 1, 1), (3, 2, 1)]
    assert paired_runs([0, 1, 2, 3], [4, 5, 0, 1]) == [(0, 4, 2), (2, 0, 2)]
    with pytest.raises(ValueError):
        paired_runs([1, 2], [1])


def test_layer_block_descs_offsets_and_order():
    lo, ro = layout(10), layout(20)
    lb, rb = 1_000_000, 5_000_000
    local, remote = layer_block_descs(lb, lo, [2, 3, 4, 8], rb, ro, [10, 11, 15, 16], [0, 2])
    bb = 256
    # runs: (2,10,2) (4,15,1) (8,16,1); layer-major order
    assert local == [
        (lb + 2 * bb, 2 * bb),
        (lb + 4 * bb, bb),
        (lb + 8 * bb, bb),
        (lb + 2 * 10 * bb + 2 * bb, 2 * bb),
        (lb + 20 * bb + 4 * bb, bb),
        (lb + 20 * bb + 8 * bb, bb),
    ]
    assert remote == [
        (rb + 10 * bb, 2 * bb),
        (rb + 15 * bb, bb),
        (rb + 16 * bb, bb),
        (rb + 2 * 20 * bb + 10 * bb, 2 * bb),
        (rb + 40 * bb + 15 * bb, bb),
        (rb + 40 * bb + 16 * bb, bb),
    ]
    one, _ = layer_block_descs(lb, lo, list(range(10)), rb, ro, list(range(5, 15)), [1])
    assert one == [(lb + 10 * bb, 10 * bb)]  # fully consecutive: one descriptor per layer
    assert layer_block_descs(lb, lo, [], rb, ro, [], [0, 1]) == ([], [])
    with pytest.raises(ValueError):
        layer_block_descs(lb, lo, [1], rb, layout(20, block_bytes=512), [1], [0])
    with pytest.raises(IndexError):
        layer_block_descs(lb, lo, [9, 10], rb, ro, [0, 1], [0])  # block 10 not in local


# -- in-process transport -------------------------------------------------------------


@pytest.fixture
def inproc() -> Iterator[Callable[..., tuple[InProcTransport, torch.Tensor]]]:
    """make(name, nbytes, faults=None, seed=None) -> (transport, region); closes them all."""
    made: list[InProcTransport] = []

    def make(name: str, nbytes: int, faults: FaultPlan | None = None, seed: int | None = None):
        buf = region(nbytes, seed=seed)
        t = InProcTransport(f"{name}-{os.getpid()}-{len(made)}", faults=faults)
        t.register_region(buf.data_ptr(), nbytes)
        t._test_buf = buf  # keep the memory alive as long as the transport
        made.append(t)
        return t, buf

    yield make
    for t in made:
        t.close()


def connect(a: InProcTransport, b: InProcTransport) -> None:
    assert a.add_peer(b.metadata()) == b.name
    assert b.add_peer(a.metadata()) == a.name


def test_inproc_write_read_and_validation(inproc):
    a, abuf = inproc("a", 1 << 16, seed=1)
    b, bbuf = inproc("b", 1 << 15)
    connect(a, b)
    assert a.add_peer(b.metadata()) == b.name  # idempotent
    pa, pb = abuf.data_ptr(), bbuf.data_ptr()
    local, remote = [(pa, 100), (pa + 5000, 3000)], [(pb + 8, 100), (pb + 20_000, 3000)]
    h = a.post("WRITE", b.name, local, remote)
    assert a.state(h) is XferState.DONE
    a.release(h)
    assert torch.equal(bbuf[8:108], abuf[:100])
    assert torch.equal(bbuf[20_000:23_000], abuf[5000:8000])
    assert int(bbuf[:8].sum()) == 0 and int(bbuf[108:20_000].sum()) == 0
    # b READs from a
    h = b.post("READ", a.name, [(pb + 30_000, 500)], [(pa + 60_000, 500)])
    assert b.state(h) is XferState.DONE
    assert torch.equal(bbuf[30_000:30_500], abuf[60_000:60_500])
    snapshot = bbuf.clone()
    for loc, rem in [
        ([(pa, 64)], [(pb + (1 << 15) - 63, 64)]),
        ([(pa + (1 << 16), 1)], [(pb, 1)]),
        ([(pa, 64)], [(pb - 1, 64)]),
        ([(pa, 64)], [(pb, 32)]),
        ([(pa, 2**62)], [(pb, 2**62)]),
        ([(pa, 8), (pa, 8)], [(pb, 8)]),
    ]:
        with pytest.raises(TransferPostError):
            a.post("WRITE", b.name, loc, rem)
    with pytest.raises(TransferPostError):
        a.post("WRITE", "unknown", [(pa, 8)], [(pb, 8)])
    assert torch.equal(bbuf, snapshot)
    assert a.stats.post_failures == 7 and a.stats.done == 1
    with pytest.raises(KeyError):
        a.state(12345)


def test_inproc_injected_post_failure(inproc):
    plan = FaultPlan(fail_posts=1)
    a, abuf = inproc("a", 4096, plan, seed=2)
    b, bbuf = inproc("b", 4096)
    connect(a, b)
    args = ("WRITE", b.name, [(abuf.data_ptr(), 4096)], [(bbuf.data_ptr(), 4096)])
    with pytest.raises(TransferPostError):
        a.post(*args)
    assert plan.count("post_failures") == 1 and int(bbuf.sum()) == 0
    h = a.post(*args)  # only the next one failed
    assert a.state(h) is XferState.DONE and torch.equal(abuf, bbuf)


def test_inproc_injected_transfer_failure_writes_nothing(inproc):
    plan = FaultPlan()
    a, abuf = inproc("a", 4096, plan, seed=3)
    b, bbuf = inproc("b", 4096)
    connect(a, b)
    plan.arm(fail_transfers=1)
    args = ("WRITE", b.name, [(abuf.data_ptr(), 4096)], [(bbuf.data_ptr(), 4096)])
    h = a.post(*args)
    assert a.state(h) is XferState.FAILED and int(bbuf.sum()) == 0
    assert plan.count("transfer_failures") == 1 and a.stats.failed == 1
    assert a.state(a.post(*args)) is XferState.DONE


def test_inproc_transfer_delay_lands_only_when_done(inproc):
    plan = FaultPlan(transfer_delay_s=0.15)
    a, abuf = inproc("a", 4096, plan, seed=4)
    b, bbuf = inproc("b", 4096)
    connect(a, b)
    t0 = time.monotonic()
    h1 = a.post("WRITE", b.name, [(abuf.data_ptr(), 2048)], [(bbuf.data_ptr(), 2048)])
    h2 = a.post("WRITE", b.name, [(abuf.data_ptr() + 2048, 2048)], [(bbuf.data_ptr() + 2048, 2048)])
    assert a.state(h1) is XferState.PENDING and int(bbuf.sum()) == 0
    while a.state(h1) is XferState.PENDING:
        time.sleep(0.005)
        assert time.monotonic() - t0 < 2
    assert time.monotonic() - t0 >= 0.15
    a.progress()  # completes h2 as well, without asking for it
    assert torch.equal(abuf, bbuf) and plan.count("transfer_delays") == 2
    assert a.state(h2) is XferState.DONE


def test_inproc_release_aborts_and_closed_peer_fails(inproc):
    plan = FaultPlan(transfer_delay_s=0.05)
    a, abuf = inproc("a", 4096, plan, seed=5)
    b, bbuf = inproc("b", 4096)
    connect(a, b)
    args = ("WRITE", b.name, [(abuf.data_ptr(), 64)], [(bbuf.data_ptr(), 64)])
    h = a.post(*args)
    a.release(h)  # aborted while pending: never writes
    h2 = a.post(*args)
    b.close()  # the peer goes away while the transfer is in flight
    time.sleep(0.06)
    assert a.state(h2) is XferState.FAILED
    assert int(bbuf.sum()) == 0
    with pytest.raises(TransferPostError):
        a.post(*args)


def test_inproc_names_and_metadata_kinds(inproc):
    a, _ = inproc("a", 64)
    dup = InProcTransport(a.name)
    other = region(64)
    with pytest.raises(ValueError):
        dup.register_region(other.data_ptr(), 64)
    meta = decode_metadata(a.metadata(), "inproc")
    assert meta.region.nbytes == 64 and meta.agent == b""
    with pytest.raises(ValueError):
        decode_metadata(a.metadata(), "nixl")


def test_inproc_moves_kv_blocks_with_layer_block_descs(inproc):
    """A layer-major KV tensor on each side; push blocks of two layers and compare."""
    lay_p, lay_d = layout(8, num_layers=3, block_bytes=64), layout(12, num_layers=3, block_bytes=64)
    p, pbuf = inproc("p", 3 * 8 * 64, seed=6)
    d, dbuf = inproc("d", 3 * 12 * 64)
    connect(p, d)
    pblocks, dblocks, layers = [1, 2, 3, 6], [9, 10, 4, 5], [0, 2]
    local, remote = layer_block_descs(
        pbuf.data_ptr(), lay_p, pblocks, dbuf.data_ptr(), lay_d, dblocks, layers
    )
    assert len(local) == 3 * len(layers)  # runs (1,9,2) (3,4,1) (6,5,1)
    h = p.post("WRITE", d.name, local, remote)
    assert p.state(h) is XferState.DONE
    pk, dk = pbuf.view(3, 8, 64), dbuf.view(3, 12, 64)
    for layer in range(3):
        for pbk, dbk in zip(pblocks, dblocks):
            same = torch.equal(pk[layer, pbk], dk[layer, dbk])
            assert same == (layer in layers)
    touched = {(la, b) for la in layers for b in dblocks}
    for layer in range(3):
        for b in range(12):
            if (layer, b) not in touched:
                assert int(dk[layer, b].sum()) == 0


def test_inproc_prepared_lists_move_kv_blocks_and_go_with_the_peer(inproc):
    """Whole blocks by index (kv_map.layer_rows, block_indices) move what
    layer_block_descs does; a peer's list goes when the peer does."""
    lay_p, lay_d = layout(8, num_layers=3, block_bytes=64), layout(12, num_layers=3, block_bytes=64)
    p, pbuf = inproc("p", 3 * 8 * 64, seed=6)
    d, dbuf = inproc("d", 3 * 12 * 64)
    connect(p, d)
    pblocks, dblocks, layers = [1, 2, 3, 6], [9, 10, 4, 5], range(0, 2)
    mine, theirs = layer_rows(pbuf.data_ptr(), lay_p), layer_rows(dbuf.data_ptr(), lay_d)
    li, ri = block_indices(lay_p, pblocks, layers), block_indices(lay_d, dblocks, layers)
    h = p.post_prepared("WRITE", d.name, mine, li, theirs, ri)
    assert p.state(h) is XferState.DONE
    pk, dk = pbuf.view(3, 8, 64), dbuf.view(3, 12, 64)
    for layer in range(3):
        for b in range(12):
            src = pblocks[dblocks.index(b)] if b in dblocks and layer in layers else None
            assert torch.equal(dk[layer, b], pk[layer, src]) if src is not None \
                else int(dk[layer, b].sum()) == 0
    assert d.name in p._lists._lists
    p.remove_peer(d.name)
    assert d.name not in p._lists._lists  # the peer's list went with it
    with pytest.raises(TransferPostError):
        p.post_prepared("WRITE", d.name, mine, li, theirs, ri)
    connect(p, d)
    assert p.state(p.post_prepared("WRITE", d.name, mine, li, theirs, ri)) is XferState.DONE
    with pytest.raises(TransferPostError):  # past the peer's region
        p.post_prepared("WRITE", d.name, mine, li,
                        layer_rows(dbuf.data_ptr(), layout(13, block_bytes=64)), ri)
    with pytest.raises(ValueError):
        block_indices(lay_p, [8], layers)
    with pytest.raises(ValueError):
        block_indices(lay_p, [0], range(2, 4))


def test_package_imports_without_nixl_module():
    """kv_transfer modules other than nixl_transport never import nixl."""
    code = (
        "import sys; sys.modules['nixl'] = None; "
        "import kvpush.kv_transfer.transports.transport, kvpush_testing.inproc_transport, "
        "kvpush.kv_transfer.wire.side_channel, "
        "kvpush.kv_transfer.transports.nixl_transport; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == b"ok", out.stderr.decode()[-2000:]


@requires_nixl
def test_nixl_dead_peer_fails_bounded():
    """A peer process that dies: the next post raises (or the transfer ends FAILED)."""
    from kvpush.kv_transfer.transports.nixl_transport import NixlTransport

    buf = region(1 << 16, seed=9)
    ours = NixlTransport(f"test-dying-local-{os.getpid()}")
    ours.register_region(buf.data_ptr(), 1 << 16)
    peer = PeerProcess(1 << 16, f"test-dying-peer-{os.getpid()}", local=ours)
    try:
        name = ours.add_peer(peer.metadata)
        args = ("WRITE", name, [(buf.data_ptr(), 4096)], [(peer.base, 4096)])
        h = ours.post(*args)
        assert wait_done(ours, h) is XferState.DONE
        ours.release(h)
        peer.proc.kill()
        peer.proc.wait(10)
        deadline = time.monotonic() + 20
        while True:  # shows as a refused post (seen here) or as a FAILED transfer
            try:
                h = ours.post(*args)
            except TransferPostError:
                break
            st = wait_done(ours, h, timeout=20)
            ours.release(h)
            if st is XferState.FAILED:
                break
            assert time.monotonic() < deadline, "dead peer not detected"
            time.sleep(0.05)
        ours.remove_peer(name)
        with pytest.raises(TransferPostError):
            ours.post(*args)
    finally:
        peer.stop()
        ours.close()
    ours.close()  # idempotent


@requires_nixl
def test_loopback_pair_measures_real_transfers_and_stops_its_peer():
    """The set-up shared by the transfer micro-benchmark and `kvpush simulate
    calibrate`: descriptors as the engine builds them, timed WRITE and READ, peer gone."""
    from kvpush.sim.loopback import LoopbackPair

    with LoopbackPair(layers=3, heads=2, head_dim=8, dtype="float32", blocks=16,
                      block_size=4, name="t-loop") as pair:
        contiguous = pair.descs(range(8), range(8))
        assert len(contiguous[0]) == 3  # one run of 8 blocks per layer
        scattered = pair.descs([0, 2, 4, 6], [1, 3, 5, 7])
        assert len(scattered[0]) == 3 * 4
        for op in ("WRITE", "READ"):
            post_s, total_s = pair.time(op, *scattered, iters=2)
            assert 0 < post_s <= total_s < 30
        assert pair.tr.stats.descs_posted >= 2 * 2 * 12
        peer = pair._peer  # noqa: SLF001 - checking the clean-up
    assert not peer.is_alive()
