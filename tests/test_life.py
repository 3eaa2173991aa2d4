"""The request life (kvpush.router.life) over injected engine-core links: a core lost
during a pull prefill sends the request to another prefill (new transfer id); a decode
whose core dropped its connection leaves the rotation and another decode serves; a
decode lost mid-stream has its request migrated, the client's stream going on from the
next token with usage counted once; links of instances that leave the pool close once
their streams are over."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvpush.discovery.instance_spec import parse_instance
from kvpush.engine.outputs import EngineOutput, FinishReason, RequestFailure, RequestOutput
from kvpush.kv_transfer.params import KVTransferParams, WireKVParams
from kvpush.router.config import RouterConfig
from kvpush.router.job import RequestRecord
from kvpush.router.life import Book, RequestLife
from kvpush.router.metrics import RouterMetrics
from kvpush.router.placement import Placement
from kvpush.router.pool import Pool
from kvpush.router.senders import CoreSender, Senders
from kvpush.router.wire import LegSigner
from kvpush.sampling_params import SamplingParams
from kvpush.server.errors import APIError
from kvpush.server.protocol import Job
from stand_in import make_kv_info


class Chars:
    """A tokenizer whose token ``i`` is the character ``chr(ord('a') + i % 26)``."""

    eos_token_id = None
    all_special_ids: list[int] = []

    def decode(self, ids: list[int], **_kw: Any) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self.decode([i]) for i in ids]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return "".join(tokens)


class FakeCore:
    """A link to an engine core. A decode answers ``len(prompt) + k`` as its k-th token
    (so an answer continued elsewhere from prompt + tokens goes on where it stopped);
    ``lose_after``: the link drops after that many tokens of a stream (connected goes
    false, on_lost, the stream ends with an error), as RemoteCore's does."""

    def __init__(self, address: str, role: str, lose_after: int | None = None,
                 connected: bool = True, dies: bool = False) -> None:
        self.address, self.role, self.lose_after = address, role, lose_after
        self.dies = dies  # at lose_after its core's loop dies (the link stays up)
        self.proven, self.connected = True, connected
        self.fatal: str | None = None
        self.requests: list[tuple[str, list[int], WireKVParams | None]] = []
        self.aborted: list[str] = []
        self.closed = False
        self.open = 0  # streams open now
        self.on_lost: Any = None  # (set by CoreSender)

    def health_problem(self) -> str | None:
        return None if self.connected else "not connected"

    async def stream(self, request_id: str, prompt: list[int], params: SamplingParams,
                     kv: WireKVParams | None = None) -> AsyncIterator[EngineOutput]:
        self.requests.append((request_id, list(prompt), kv))
        self.open += 1
        try:
            async for out in self._outputs(request_id, prompt, params):
                yield out
        finally:
            self.open -= 1

    def _lose(self, request_id: str) -> EngineOutput:
        if self.dies:  # as RemoteCore's _loop_died: fatal set, then on_lost
            self.fatal = "the KV transfer thread died"
        else:
            self.connected = False
        if self.on_lost is not None:
            self.on_lost(self.fatal or "the engine core connection was lost")
        return EngineOutput(request_id, [], finish_reason=FinishReason.ERROR,
                            failure=RequestFailure("the engine core connection was lost"))

    async def _outputs(self, request_id: str, prompt: list[int],
                       params: SamplingParams) -> AsyncIterator[EngineOutput]:
        await asyncio.sleep(0)
        if self.role == "prefill":
            if self.lose_after == 0:
                yield self._lose(request_id)
                return
            lent = KVTransferParams(transfer_id=request_id, remote_block_ids=[1],
                                    remote_host="127.0.0.1", remote_port=9,
                                    remote_engine_id=self.address)
            yield EngineOutput(request_id, [len(prompt)], finish_reason=FinishReason.LENGTH,
                               kv_transfer_params=lent)
            return
        n = params.max_tokens
        for k in range(n):
            if self.lose_after is not None and k == self.lose_after:
                yield self._lose(request_id)
                return
            await asyncio.sleep(0)
            yield EngineOutput(request_id, [len(prompt) + k],
                               finish_reason=FinishReason.LENGTH if k == n - 1 else None,
                               num_prompt_tokens=len(prompt), num_output_tokens=k + 1)

    def has_streams(self) -> bool:
        return self.open > 0

    def abort_transfer(self, tid: str, why: str = "") -> None:
        self.aborted.append(tid)

    def close(self) -> None:
        self.closed = True


def _life(mode: str, cores: dict[str, FakeCore], **kw: Any
          ) -> tuple[RequestLife, Pool, Senders]:
    prefill = tuple(parse_instance(u) for u, c in cores.items() if c.role == "prefill")
    decode = tuple(parse_instance(u) for u, c in cores.items() if c.role == "decode")
    cfg = RouterConfig(mode=mode, prefill=prefill, decode=decode, **kw)  # type: ignore[arg-type]
    pool = Pool(cfg)
    by_address = {c.address: c for c in cores.values()}
    for inst in pool.instances:
        inst.healthy = True
        inst.info = make_kv_info(request_plane=cores[inst.url].address, engine_id=inst.url,
                                 side_channel_host="127.0.0.1", side_channel_port=9)
    # every instance here answers /kv/info: kvpush instances, over their cores only
    sender = Senders(CoreSender(pool, by_address.__getitem__), http=None)  # type: ignore[arg-type]
    assert sender.serves()  # every healthy instance linked
    book = Book(cfg, Placement(pool), RouterMetrics(pool))
    return RequestLife(cfg, book, sender, LegSigner(None), Chars()), pool, sender


def _streamed(rid: str) -> RequestRecord:
    """A streamed completion's record, as the front leaves it once parsed."""
    return RequestRecord(rid=rid, kind="completion", arrival=0.0,
                         parsed=Job(rid, [1, 2, 3], SamplingParams(), 0.0, True, False))


async def _run(life: RequestLife, max_tokens: int = 2, rid: str = "r1", n: int = 1
               ) -> tuple[list[RequestOutput], RequestRecord]:
    job = _streamed(rid)
    outs = [o async for o in life.run(job, [1, 2, 3],
                                      SamplingParams(max_tokens=max_tokens, n=n))]
    return outs, job


def _metric(life: RequestLife, name: str, label: str) -> float:
    return getattr(life.metrics, name).labels(label)._value.get()  # noqa: SLF001


def test_a_pull_prefill_core_lost_mid_request_goes_to_another_prefill():
    cores = {"http://p0:1": FakeCore("p0:7", "prefill", lose_after=0),
             "http://p1:1": FakeCore("p1:7", "prefill"),
             "http://d0:1": FakeCore("d0:7", "decode")}
    life, pool, _ = _life("pull", cores)

    outs, job = asyncio.run(_run(life))

    assert [o.new_token_ids for o in outs] == [[3], [4]]
    assert job.attempts == 2 and job.prefill is not None and job.prefill.url == "http://p1:1"
    (p0,) = [i for i in pool.instances if i.url == "http://p0:1"]
    assert not p0.healthy  # out of rotation at once
    # decode got the second prefill's lend, under the second transfer id
    (rid, _, kv) = cores["http://d0:1"].requests[0]
    assert rid == job.transfer_id and kv is not None and kv.transfer_id == job.transfer_id
    assert _metric(life, "retries", "prefill") == 1
    assert all(i.in_flight == 0 for i in pool.instances)


def test_a_decode_whose_core_dropped_leaves_the_rotation_and_another_serves():
    cores = {"http://p0:1": FakeCore("p0:7", "prefill"),
             "http://d0:1": FakeCore("d0:7", "decode"),
             "http://d1:1": FakeCore("d1:7", "decode")}
    life, pool, _ = _life("pull", cores)
    cores["http://d0:1"].connected = False  # dropped after it proved (usable() says no)
    (d0,) = [i for i in pool.instances if i.url == "http://d0:1"]
    pool._cursor["decode"] = d0.index  # noqa: SLF001 - round-robin would pick d0 next

    outs, job = asyncio.run(_run(life))

    assert [o.new_token_ids for o in outs] == [[3], [4]]
    assert job.decode is not None and job.decode.url == "http://d1:1"
    assert not d0.healthy and cores["http://d0:1"].requests == []
    assert _metric(life, "retries", "decode") == 1


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_a_decode_lost_mid_stream_is_migrated_and_the_stream_goes_on(mode):
    cores = {"http://p0:1": FakeCore("p0:7", "prefill"),
             "http://d0:1": FakeCore("d0:7", "decode", lose_after=3),
             "http://d1:1": FakeCore("d1:7", "decode")}
    life, pool, _ = _life(mode, cores)

    outs, job = asyncio.run(_run(life, max_tokens=8))

    tokens = [t for o in outs for t in o.new_token_ids]
    assert tokens == list(range(3, 11))  # none lost, none repeated
    assert "".join(o.new_text for o in outs) == Chars().decode(tokens)
    assert outs[-1].finished and outs[-1].finish_reason is FinishReason.LENGTH
    assert (outs[-1].num_prompt_tokens, outs[-1].num_output_tokens) == (3, 8)  # usage
    assert not any(o.error for o in outs)
    # the second decode continued from the prompt plus the 3 tokens made, 5 to go
    (_, prompt, _) = cores["http://d1:1"].requests[-1]
    assert prompt == [1, 2, 3, 3, 4, 5]
    assert job.migrations == 1 and job.outcome == "ok"
    assert _metric(life, "migrations", "connection_lost") == 1
    assert all(i.in_flight == 0 for i in pool.instances)


def test_a_decode_whose_core_died_is_left_and_its_request_migrated():
    """A decode whose core's loop died (its transfer thread, say) while its connection
    stays up: it leaves the rotation at once and the request goes on elsewhere."""
    cores = {"http://p0:1": FakeCore("p0:7", "prefill"),
             "http://d0:1": FakeCore("d0:7", "decode", lose_after=2, dies=True),
             "http://d1:1": FakeCore("d1:7", "decode")}
    life, pool, sender = _life("push", cores)

    outs, job = asyncio.run(_run(life, max_tokens=5))

    assert [t for o in outs for t in o.new_token_ids] == list(range(3, 8))
    (d0,) = [i for i in pool.instances if i.url == "http://d0:1"]
    assert not d0.healthy and not sender.usable(d0)
    assert _metric(life, "migrations", "core_died") == 1 and job.outcome == "ok"


def test_migration_gives_up_at_its_limit_and_with_no_decode_left():
    cores = {"http://p0:1": FakeCore("p0:7", "prefill"),
             "http://d0:1": FakeCore("d0:7", "decode", lose_after=2),
             "http://d1:1": FakeCore("d1:7", "decode", lose_after=1)}
    life, _, _ = _life("push", cores)
    with pytest.raises(APIError) as e:
        asyncio.run(_run(life, max_tokens=8))
    assert e.value.status_code == 502 and "no other decode" in e.value.message
    assert _metric(life, "migrations", "connection_lost") == 1  # d0 -> d1, then none

    cores = {"http://p0:1": FakeCore("p0:7", "prefill"),
             "http://d0:1": FakeCore("d0:7", "decode", lose_after=2),
             "http://d1:1": FakeCore("d1:7", "decode")}
    life, _, _ = _life("push", cores, migration_limit=0)
    with pytest.raises(APIError) as e:
        asyncio.run(_run(life, max_tokens=8))
    assert "stopped answering" in e.value.message
    assert _metric(life, "migrations", "connection_lost") == 0


def test_an_n_choices_request_is_not_migrated(caplog):
    """Its choices' tokens were on the lost decode: the client gets the 502."""
    cores = {"http://p0:1": FakeCore("p0:7", "prefill"),
             "http://d0:1": FakeCore("d0:7", "decode", lose_after=2),
             "http://d1:1": FakeCore("d1:7", "decode")}
    life, _, _ = _life("push", cores)
    with pytest.raises(APIError) as e:
        asyncio.run(_run(life, max_tokens=8, n=2))
    assert e.value.status_code == 502 and "stopped answering" in e.value.message
    assert "an n > 1 request's choices" in caplog.text  # the logged detail
    assert _metric(life, "migrations", "connection_lost") == 0


def test_an_instance_that_leaves_the_pool_has_its_core_link_closed():
    cores = {"http://p0:1": FakeCore("p0:7", "prefill"),
             "http://d0:1": FakeCore("d0:7", "decode")}
    _, pool, sender = _life("pull", cores)

    pool.remove_instance("http://d0:1")

    assert cores["http://d0:1"].closed and not cores["http://p0:1"].closed
    assert sender.cores.link(next(iter(pool.instances))) is cores["http://p0:1"]


def test_a_request_in_flight_on_a_leaving_instance_finishes_before_its_link_closes():
    cores = {"http://p0:1": FakeCore("p0:7", "prefill"),
             "http://d0:1": FakeCore("d0:7", "decode")}
    life, pool, _ = _life("pull", cores)
    d = cores["http://d0:1"]

    async def run() -> list[RequestOutput]:
        job = _streamed("r1")
        outs = []
        async for out in life.run(job, [1, 2, 3], SamplingParams(max_tokens=2)):
            outs.append(out)
            if len(outs) == 1:  # decode is streaming: its instance drains and leaves
                pool.remove_instance("http://d0:1")
                assert not d.closed
        return outs

    outs = asyncio.run(run())

    assert [o.new_token_ids for o in outs] == [[3], [4]] and outs[-1].finished
    assert d.closed  # once its last request was over


def test_a_core_connection_that_drops_takes_its_instance_out_of_rotation_at_once():
    """The link's drop (on_lost) marks its instance failed, and only for the link the
    sender holds for it now (a replaced link's late drop changes nothing)."""
    cores = {"http://p0:1": FakeCore("p0:7", "prefill"),
             "http://d0:1": FakeCore("d0:7", "decode")}
    _, pool, sender = _life("pull", cores)
    d0, p0 = sorted(pool.instances, key=lambda i: i.url)
    old = cores["http://d0:1"]
    d0.info = make_kv_info(request_plane="d0:8", engine_id=d0.url)  # restarted: a new plane
    new = FakeCore("d0:8", "decode")
    sender.cores._connect = {"d0:8": new}.__getitem__  # noqa: SLF001
    assert sender.cores.link(d0) is new and old.closed
    old.on_lost("gone")
    assert d0.healthy
    cores["http://p0:1"].connected = False
    cores["http://p0:1"].on_lost("the engine core connection was lost")
    assert not p0.healthy and "connection was lost" in (p0.last_error or "")
    assert not sender.serves()  # pull mode: no prefill left to send a leg to
