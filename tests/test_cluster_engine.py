"""The router's ClusterEngine placing legs on engine cores, with injected cores: a core
lost during a pull prefill sends the request to another prefill (new transfer id); a
decode whose core dropped its connection leaves the rotation and another decode serves
(issue 51.1: the HTTP legs' retries, kept on the core path)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from kvpush.discovery.instance_spec import parse_instance
from kvpush.engine.outputs import FinishReason, RequestOutput
from kvpush.kv_transfer.params import KVTransferParams
from kvpush.router.cluster_engine import ClusterEngine
from kvpush.router.config import RouterConfig
from kvpush.router.job import Job
from kvpush.router.legs import Legs
from kvpush.router.metrics import RouterMetrics
from kvpush.router.pool import Pool
from kvpush.sampling_params import SamplingParams


class FakeCore:
    """What ClusterEngine uses of a RemoteCore; ``lose``: the core goes away during
    the request (its stream ends with an error, the connection is down)."""

    def __init__(self, address: str, role: str, lose: bool = False,
                 connected: bool = True) -> None:
        self.address, self.role, self.lose = address, role, lose
        self.proven, self.connected = True, connected
        self.requests: list[tuple[str, dict | None]] = []
        self.aborted: list[str] = []
        self.closed = False
        self.open = 0  # streams open now
        self.on_lost: Any = None  # (set by ClusterEngine)

    def health_problem(self) -> str | None:
        return None if self.connected else "not connected"

    async def generate(self, request_id: str, prompt: list[int], params: Any,
                       kv: dict | None = None) -> AsyncIterator[RequestOutput]:
        self.requests.append((request_id, kv))
        self.open += 1
        try:
            async for out in self._outputs(request_id):
                yield out
        finally:
            self.open -= 1

    async def _outputs(self, request_id: str) -> AsyncIterator[RequestOutput]:
        await asyncio.sleep(0)
        if self.lose:  # as RemoteCore's drop: connected goes false, then on_lost
            self.connected = False
            if self.on_lost is not None:
                self.on_lost("the engine core connection was lost")
            yield RequestOutput(request_id, [], "", True, FinishReason.ERROR,
                                error="the engine core connection was lost")
            return
        if self.role == "prefill":
            lent = KVTransferParams(transfer_id=request_id, remote_block_ids=[1],
                                    remote_host="127.0.0.1", remote_port=9,
                                    remote_engine_id=self.address)
            yield RequestOutput(request_id, [7], "x", True, FinishReason.LENGTH,
                                kv_transfer_params=lent)
            return
        yield RequestOutput(request_id, [5], "a", False)
        yield RequestOutput(request_id, [6], "b", True, FinishReason.LENGTH)

    def has_streams(self) -> bool:
        return self.open > 0

    def abort_transfer(self, tid: str, why: str = "") -> None:
        self.aborted.append(tid)

    def close(self) -> None:
        self.closed = True


def _engine(mode: str, cores: dict[str, FakeCore]) -> tuple[ClusterEngine, Pool, Legs]:
    prefill = tuple(parse_instance(u) for u, c in cores.items() if c.role == "prefill")
    decode = tuple(parse_instance(u) for u, c in cores.items() if c.role == "decode")
    cfg = RouterConfig(mode=mode, prefill=prefill, decode=decode)  # type: ignore[arg-type]
    pool = Pool(cfg)
    for inst in pool.instances:
        inst.healthy = True
        inst.info = {"request_plane": cores[inst.url].address, "engine_id": inst.url}
    legs = Legs(cfg, pool, RouterMetrics(pool), client=None)  # type: ignore[arg-type]
    engine = ClusterEngine(legs, keys=None, tokenizer=None)  # type: ignore[arg-type]
    for inst in pool.instances:  # the injected links
        engine._adopt(inst, cores[inst.url])  # type: ignore[arg-type]  # noqa: SLF001
    return engine, pool, legs


async def _run(engine: ClusterEngine, rid: str = "r1") -> tuple[list[RequestOutput], Job]:
    job = Job(rid=rid, kind="completion", path="/v1/completions", body={}, stream=True,
              arrival=0.0)
    engine.jobs[rid] = job
    outs = [o async for o in engine.generate(rid, [1, 2, 3], SamplingParams(max_tokens=2))]
    return outs, job


def test_a_pull_prefill_core_lost_mid_request_goes_to_another_prefill():
    cores = {"http://p0:1": FakeCore("p0:7", "prefill", lose=True),
             "http://p1:1": FakeCore("p1:7", "prefill"),
             "http://d0:1": FakeCore("d0:7", "decode")}
    engine, pool, legs = _engine("pull", cores)

    outs, job = asyncio.run(_run(engine))

    assert [o.new_token_ids for o in outs] == [[5], [6]]
    assert job.attempts == 2 and job.prefill is not None and job.prefill.url == "http://p1:1"
    (p0,) = [i for i in pool.instances if i.url == "http://p0:1"]
    assert not p0.healthy  # out of rotation at once
    # decode got the second prefill's lend, under the second transfer id
    (rid, kv) = cores["http://d0:1"].requests[0]
    assert rid == job.transfer_id and kv is not None and kv["transfer_id"] == job.transfer_id
    assert legs.metrics.retries.labels("prefill")._value.get() == 1  # noqa: SLF001
    assert all(i.in_flight == 0 for i in pool.instances)


def test_a_decode_whose_core_dropped_leaves_the_rotation_and_another_serves():
    cores = {"http://p0:1": FakeCore("p0:7", "prefill"),
             "http://d0:1": FakeCore("d0:7", "decode"),
             "http://d1:1": FakeCore("d1:7", "decode")}
    engine, pool, legs = _engine("pull", cores)
    cores["http://d0:1"].connected = False  # dropped after it proved (usable() says no)
    (d0,) = [i for i in pool.instances if i.url == "http://d0:1"]
    pool._cursor["decode"] = d0.index  # noqa: SLF001 - round-robin would pick d0 next

    outs, job = asyncio.run(_run(engine))

    assert [o.new_token_ids for o in outs] == [[5], [6]]
    assert job.decode is not None and job.decode.url == "http://d1:1"
    assert not d0.healthy and cores["http://d0:1"].requests == []
    assert legs.metrics.retries.labels("decode")._value.get() == 1  # noqa: SLF001


def test_an_instance_that_leaves_the_pool_has_its_core_link_closed():
    cores = {"http://p0:1": FakeCore("p0:7", "prefill"),
             "http://d0:1": FakeCore("d0:7", "decode")}
    engine, pool, _ = _engine("pull", cores)

    pool.remove_instance("http://d0:1")

    assert cores["http://d0:1"].closed and not cores["http://p0:1"].closed
    assert engine.core(next(iter(pool.instances))) is cores["http://p0:1"]


def test_a_request_in_flight_on_a_leaving_instance_finishes_before_its_link_closes():
    cores = {"http://p0:1": FakeCore("p0:7", "prefill"),
             "http://d0:1": FakeCore("d0:7", "decode")}
    engine, pool, _ = _engine("pull", cores)
    d = cores["http://d0:1"]

    async def run() -> list[RequestOutput]:
        job = Job(rid="r1", kind="completion", path="/v1/completions", body={},
                  stream=True, arrival=0.0)
        engine.jobs["r1"] = job
        outs = []
        async for out in engine.generate("r1", [1, 2, 3], SamplingParams(max_tokens=2)):
            outs.append(out)
            if len(outs) == 1:  # decode is streaming: its instance drains and leaves
                pool.remove_instance("http://d0:1")
                assert not d.closed
        return outs

    outs = asyncio.run(run())

    assert [o.new_token_ids for o in outs] == [[5], [6]] and outs[-1].finished
    assert d.closed  # once its last request was over


def test_a_core_connection_that_drops_takes_its_instance_out_of_rotation_at_once():
    """The link's drop (on_lost) marks its instance failed, and only for the link the
    engine holds for it now (a replaced link's late drop changes nothing)."""
    cores = {"http://p0:1": FakeCore("p0:7", "prefill"),
             "http://d0:1": FakeCore("d0:7", "decode")}
    engine, pool, _ = _engine("pull", cores)
    assert engine.serves()
    d0, p0 = sorted(pool.instances, key=lambda i: i.url)
    old = cores["http://d0:1"]
    engine._adopt(d0, FakeCore("d0:7", "decode"))  # noqa: SLF001 - its link was remade
    old.on_lost("gone")
    assert d0.healthy
    cores["http://p0:1"].connected = False
    cores["http://p0:1"].on_lost("the engine core connection was lost")
    assert not p0.healthy and p0.last_error == "its engine core's connection was lost"
    assert engine.serves()  # what is healthy is usable: the cores path stays
