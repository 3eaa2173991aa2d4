"""The engine core's request plane (engine/request_plane.py) and its front-side client
(engine/core_link.py: RemoteCore), against real engine core processes: a role=decode
core with a cluster secret (its transfer links in-process), fronts on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import signal
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import msgspec
import pytest
import zmq

from kvpush.config import EngineConfig, KVTransferConfig
from kvpush.engine.core_client import CoreClient
from kvpush.engine.core_link import RemoteCore, plane_keys
from kvpush.engine.outputs import FinishReason, RequestError
from kvpush.kv_transfer.params import WireKVParams
from kvpush.sampling_params import SamplingParams
from kvpush_testing.links import InProcLinks
from waits import wait_until

SECRET = b"request-plane-test-secret-0123456789"
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
WAIT_S = 20.0
#: long enough that a request of MAX_LEN tokens runs for many seconds
MAX_LEN = 2048


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def launch(model_dir, port: int = 0) -> CoreClient:
    kvt = KVTransferConfig(role="decode", engine_id=f"decode-{uuid.uuid4().hex[:6]}",
                           side_channel_secret=SECRET, request_plane_port=port)
    config = EngineConfig.build(model_dir, max_model_len=MAX_LEN, num_blocks=160,
                                block_size=16, max_num_batched_tokens=256, kv_transfer=kvt)
    return CoreClient.launch(config, log_level="WARNING", links=InProcLinks())


@pytest.fixture(scope="module")
def core(tiny_llama):
    client = launch(tiny_llama)
    try:
        yield client
    finally:
        client.close()


def run(local: CoreClient, main: Callable[[], Awaitable[None]]) -> None:
    """``main()`` on a fresh event loop, with the local front watching the core on it."""
    async def body() -> None:
        local.start()
        try:
            await asyncio.wait_for(main(), 60)
        finally:
            local._unwatch()  # (the next test's loop watches it again)

    asyncio.run(body())


async def tokens(front, rid: str, prompt: list[int], params: SamplingParams,
                 kv: WireKVParams | dict | None = None
                 ) -> tuple[list[int], str, FinishReason | None]:
    ids: list[int] = []
    text = ""
    reason = None
    async for out in front.generate(rid, prompt, params, kv):
        ids += out.new_token_ids
        text += out.new_text
        reason = out.finish_reason
    return ids, text, reason


async def remote(core: CoreClient, secret: bytes = SECRET) -> RemoteCore:
    link = RemoteCore(core.request_plane, plane_keys(secret), core.tokenizer)
    if secret == SECRET:
        assert await link.wait_connected(WAIT_S), link.health_problem()
        assert link.proven
    return link


async def free_blocks(core: CoreClient) -> int:
    return (await core.kv_info()).num_free_blocks


async def settle(core: CoreClient, want: int, wait_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + wait_s
    while (have := await free_blocks(core)) != want:
        assert time.monotonic() < deadline, f"{have} free blocks, want {want}"
        await asyncio.sleep(0.05)


def test_kv_info_and_hello_carry_the_request_plane(core):
    host, _, port = core.request_plane.rpartition(":")
    assert host == "127.0.0.1" and int(port) > 0

    async def main() -> None:
        info = await core.kv_info()
        assert info.request_plane == core.request_plane
        link = await remote(core)
        try:  # the utility call over the plane answers the same
            assert (await link.kv_info()).request_plane == core.request_plane
        finally:
            link.close()

    run(core, main)


def test_same_greedy_tokens_as_the_instances_own_front(core):
    """A decode core without kv params (the colocated path): token for token the same
    through the request plane as through the instance's API process."""
    async def main() -> None:
        link = await remote(core)
        try:
            here = await tokens(core, "a", PROMPT, greedy(12))
            there = await tokens(link, "a", PROMPT, greedy(12))
            assert there == here
            assert len(there[0]) == 12 and there[2] == FinishReason.LENGTH
            assert there[1]  # detokenized on the front's side
        finally:
            link.close()

    run(core, main)


def test_fronts_with_the_same_request_id_get_only_their_own_outputs(core):
    prompts = {"local": PROMPT, "r1": [20, 21, 22, 23, 24], "r2": [30, 31, 32]}

    async def main() -> None:
        links = [await remote(core), await remote(core)]
        try:
            alone = {k: (await tokens(core, "x", p, greedy(10)))[0] for k, p in prompts.items()}
            fronts = {"local": core, "r1": links[0], "r2": links[1]}
            # the same caller id on all three fronts at once (and an id that looks like
            # the plane's own on the local front)
            got = await asyncio.gather(*(tokens(fronts[k], "same", p, greedy(10))
                                         for k, p in prompts.items()),
                                       tokens(core, "~1/same#0", PROMPT, greedy(10)))
            for k, (ids, _, reason) in zip(prompts, got):
                assert ids == alone[k], k
                assert reason == FinishReason.LENGTH
            assert got[-1][0] == alone["local"]
        finally:
            for link in links:
                link.close()

    run(core, main)


async def link_free(link: RemoteCore, ok: Callable[[int], bool], what: str) -> int:
    """The link's view of the core's free blocks, once ``ok`` holds for it (bounded)."""
    for _ in range(int(WAIT_S / 0.01)):
        stats = link.latest_stats()
        if stats is not None and ok(stats.num_free_blocks):
            return stats.num_free_blocks
        await asyncio.sleep(0.01)
    raise AssertionError(f"the link never saw {what}: {link.latest_stats()}")


def test_an_idle_links_free_blocks_follow_the_core_while_its_own_front_drives_it(core):
    """A router's link that sends nothing but its Hello sees the core's free blocks as
    the instance's own API process takes and frees them: the core hands each new
    snapshot to every front, not only with that front's own outputs."""
    async def main() -> None:
        link = await remote(core)
        try:
            total = core.stats().num_total_blocks
            await link_free(link, lambda free: free == total, "every block free")
            outs = core.generate("long", PROMPT, greedy(MAX_LEN - len(PROMPT)))
            await anext(outs)  # running on the instance's own front: its blocks taken
            await link_free(link, lambda free: free < total - 1, "blocks taken")
            await outs.aclose()  # aborted: its blocks are free again
            await link_free(link, lambda free: free == total, "the blocks freed")
        finally:
            link.close()

    run(core, main)


@contextlib.contextmanager
def plane_alone(model) -> Iterator[tuple[Any, zmq.Socket]]:
    """A request plane over an inbox nothing reads (no secret), and one front's DEALER
    socket, not yet connected; both closed after."""
    from kvpush.engine.checks import RequestChecker
    from kvpush.engine.request_plane import RequestPlane

    config = EngineConfig.build(model, max_model_len=MAX_LEN)
    plane = RequestPlane(queue.SimpleQueue(), RequestChecker(config), "127.0.0.1", 0, None)
    plane.start()
    ctx = zmq.Context()
    front = ctx.socket(zmq.DEALER)
    front.setsockopt(zmq.LINGER, 0)
    front.setsockopt(zmq.RCVTIMEO, int(WAIT_S * 1000))
    try:
        yield plane, front
    finally:
        front.close()
        ctx.term()
        plane.close()


def test_the_plane_hands_each_new_snapshot_to_every_front_once(tiny_llama):
    """The plane alone: a front's Hello is answered with the latest snapshot; after it
    each new snapshot reaches it, one that equals the last is not sent again, and the
    local front gets every batch as it was."""
    from kvpush.engine.inputs import Hello
    from kvpush.engine.outputs import EngineOutputs, EngineSnapshot, EngineStats

    dec = msgspec.msgpack.Decoder(EngineOutputs)

    def snap(free: int) -> EngineOutputs:
        return EngineOutputs(snapshot=EngineSnapshot(EngineStats(0, 0, free, 9, 0, 0, 0)))

    def seen() -> int:
        got = dec.decode(front.recv())
        assert got.snapshot is not None and not got.outputs
        return got.snapshot.stats.num_free_blocks

    with plane_alone(tiny_llama) as (plane, front):
        assert plane.split(snap(9)) == snap(9)  # no front yet: the local front's alone
        front.connect(f"tcp://{plane.address}")
        front.send(msgspec.msgpack.encode(Hello()))
        assert seen() == 9
        for free in (7, 7, 5, 5, 3):
            assert plane.split(snap(free)) == snap(free)
        assert [seen(), seen(), seen()] == [7, 5, 3]  # (in order: no 7 or 5 twice)


def test_outputs_go_to_the_front_they_name_not_by_their_ids(tiny_llama):
    """The plane alone: each output goes to the front its ``front`` field names (0: the
    local front), under the id that front gave it; the id's form decides nothing."""
    from kvpush.engine.inputs import Hello
    from kvpush.engine.outputs import EngineOutput, EngineOutputs

    dec = msgspec.msgpack.Decoder(EngineOutputs)
    with plane_alone(tiny_llama) as (plane, front):
        front.connect(f"tcp://{plane.address}")
        front.send(msgspec.msgpack.encode(Hello()))
        wait_until(lambda: plane.in_use, WAIT_S, "the Hello taken")
        local = EngineOutput("~1/looks-remote", [5])  # front 0 whatever its id says
        remote = EngineOutput("~1/r1", [6], front=1)
        kept = plane.split(EngineOutputs([local, remote]))
        assert kept is not None and kept.outputs == [local]
        got = dec.decode(front.recv())
        assert [(o.request_id, o.new_token_ids) for o in got.outputs] == [("r1", [6])]


def test_a_wrong_secret_never_proves_and_gets_nothing(core):
    async def main() -> None:
        start = await free_blocks(core)
        bad = await remote(core, secret=b"not-the-cluster-secret-at-all!!")
        try:
            assert not await bad.wait_connected(1.5)
            assert not bad.proven
            with pytest.raises(RequestError) as e:
                await asyncio.wait_for(tokens(bad, "b", PROMPT, greedy(4)), 5)
            assert e.value.status_code == 503
            assert "no connection to the engine core" in str(e.value)
            assert await free_blocks(core) == start  # nothing reached the core
            good = await remote(core)  # the core serves the cluster's fronts still
            try:
                assert len((await tokens(good, "g", PROMPT, greedy(4)))[0]) == 4
            finally:
                good.close()
        finally:
            bad.close()

    run(core, main)


FRONT = """
import asyncio, sys
from kvpush.engine.core_link import RemoteCore, plane_keys
from kvpush.models.tokenizer import load_tokenizer
from kvpush.sampling_params import SamplingParams

async def main():
    link = RemoteCore(sys.argv[1], plane_keys(sys.argv[2].encode()), load_tokenizer(sys.argv[3]))
    assert await link.wait_connected(20)
    params = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)
    outs = link.generate("long", [5, 6, 7, 8] * 8, params)
    first = asyncio.ensure_future(outs.__anext__())
    await asyncio.sleep(0.2)
    print("sent", flush=True)
    await first
    async for _ in outs:
        pass

asyncio.run(main())
"""


async def vanishing_front(address: str, model_dir) -> asyncio.subprocess.Process:
    """A front in its own process that has sent one long request ("long#0")."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", FRONT, address, SECRET.decode(), str(model_dir),
        stdout=asyncio.subprocess.PIPE)
    assert proc.stdout is not None
    assert await asyncio.wait_for(proc.stdout.readline(), WAIT_S) == b"sent\n"
    return proc


async def end(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    await proc.wait()


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_the_plane_aborts_what_a_vanished_front_sent(tiny_llama, how):
    """The plane alone (its inbox a queue nobody serves): a front killed (its
    connection closes) or stopped (silent: the ZMQ heartbeats end its connection in
    3 s, not sooner) has its live requests aborted, by the core's own ids."""
    from kvpush.engine.checks import RequestChecker
    from kvpush.engine.inputs import AbortRequests, AddRequest
    from kvpush.engine.request_plane import RequestPlane

    kvt = KVTransferConfig(role="decode", engine_id="decode-x", side_channel_secret=SECRET)
    config = EngineConfig.build(tiny_llama, max_model_len=MAX_LEN, kv_transfer=kvt)
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    plane = RequestPlane(inbox, RequestChecker(config), "127.0.0.1", 0, SECRET)
    plane.start()

    async def main() -> None:
        proc = await vanishing_front(plane.address, tiny_llama)
        try:
            add = inbox.get(timeout=WAIT_S)
            assert isinstance(add, AddRequest) and add.request_id == "~1/long#0"
            proc.send_signal(signal.SIGKILL if how == "killed" else signal.SIGSTOP)
            t0 = time.monotonic()
            abort = await asyncio.get_running_loop().run_in_executor(
                None, lambda: inbox.get(timeout=WAIT_S))
            took = time.monotonic() - t0
            assert abort == AbortRequests(["~1/long#0"])
            assert took < 1.0 if how == "killed" else 2.0 < took < 8.0
        finally:
            await end(proc)

    try:
        asyncio.run(main())
    finally:
        plane.close()


def test_a_front_killed_mid_stream_frees_its_blocks(core, tiny_llama):
    """End to end: its request holds blocks, the front is killed, every block is free
    again within a second (the request alone would run for seconds more)."""
    async def main() -> None:
        start = await free_blocks(core)
        proc = await vanishing_front(core.request_plane, tiny_llama)
        try:
            assert await free_blocks(core) < start  # its request holds blocks
            proc.kill()
            t0 = time.monotonic()
            await settle(core, start, WAIT_S)
            assert time.monotonic() - t0 < 1.0
        finally:
            await end(proc)

    run(core, main)


def test_a_refusal_is_the_request_error_the_instance_would_raise(core):
    async def main() -> None:
        link = await remote(core)
        try:
            with pytest.raises(RequestError) as e:
                await tokens(link, "long", [5] * (MAX_LEN - 10), greedy(20))
            assert e.value.status_code == 400 and e.value.code == "context_length_exceeded"
            with pytest.raises(RequestError) as e:  # the router did not sign them
                await tokens(link, "unsigned", PROMPT, greedy(4),
                             WireKVParams(do_remote_prefill=True, transfer_id="t",
                                          remote_host="127.0.0.1", remote_port=1))
            assert e.value.status_code == 403
            with pytest.raises(RequestError) as local:
                await tokens(core, "unsigned", PROMPT, greedy(4),
                             {"do_remote_prefill": True, "transfer_id": "t",
                              "remote_host": "127.0.0.1", "remote_port": 1})
            assert (local.value.status_code, local.value.code) == (403, e.value.code)
            # the front goes on serving
            assert len((await tokens(link, "ok", PROMPT, greedy(3)))[0]) == 3
        finally:
            link.close()

    run(core, main)


def test_the_core_killed_mid_stream_ends_the_stream_with_an_error(tiny_llama):
    """The core killed: the open stream ends with an error within a second, requests
    are refused (503) while no core answers, and once a core is back at the address
    the front reconnects by itself and serves again."""
    victim = launch(tiny_llama)
    port = int(victim.request_plane.rpartition(":")[2])
    victim.on_death = lambda why: None

    async def main() -> None:
        link = await remote(victim)
        try:
            outs = []
            killed_at = None
            async for out in link.generate("k", PROMPT, greedy(2000)):
                outs.append(out)
                if len(outs) == 3:
                    victim.proc.kill()
                    killed_at = time.monotonic()
            assert killed_at is not None and time.monotonic() - killed_at < 1.0
            last = outs[-1]
            assert last.finish_reason == FinishReason.ERROR
            assert "engine core connection was lost" in last.error
            assert not link.connected and link.health_problem()
            with pytest.raises(RequestError) as e:
                await tokens(link, "k2", PROMPT, greedy(3))
            assert e.value.status_code == 503
            loop = asyncio.get_running_loop()
            again = await loop.run_in_executor(None, launch, tiny_llama, port)
            try:
                assert await link.wait_connected(WAIT_S)
                assert len((await tokens(link, "k3", PROMPT, greedy(3)))[0]) == 3
            finally:
                again.close()
        finally:
            link.close()

    try:
        run(victim, main)
    finally:
        victim.close()
