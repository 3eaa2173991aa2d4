"""Issue 40, finding 3: with the cluster secret an instance's KV-event stream is for
members only (CURVE on the PUB socket) and names blocks by keyed tags, so a non-member
can neither subscribe nor test a guessed prompt against it; the router, with the
derived keys, still finds a prompt's cached prefix."""

from __future__ import annotations

import asyncio
import time

import msgspec
import zmq

from kvpush.crypto.curve import make_client
from kvpush.kv_cache.block_pool import hash_prompt_chain
from kvpush.kv_cache.event_keys import EventKeys
from kvpush.kv_cache.event_publisher import KVEventPublisher
from kvpush.kv_cache.events import TOPIC, BlockStored, decode_batch
from kvpush.kv_info import CacheBlocks
from kvpush.router.kv_index import KVIndex
from stand_in import make_kv_info

SECRET = b"0123456789abcdef0123456789abcdef"
BS = 16
PROMPT = list(range(100, 100 + 4 * BS))


def chain(tokens: list[int]) -> list[bytes]:
    return hash_prompt_chain(tokens, BS)[: len(tokens) // BS]  # full blocks only


def subscriber(ctx: zmq.Context, endpoint: str, keys: EventKeys | None) -> zmq.Socket:
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SUBSCRIBE, TOPIC)
    if keys is not None:
        make_client(s, keys.curve)
    s.connect(endpoint)
    return s


def test_a_non_member_gets_nothing_and_a_member_gets_only_tags():
    keys = EventKeys.from_secret(SECRET)
    pub = KVEventPublisher("e1", BS, keys=keys)
    pub.start()
    ctx = zmq.Context()
    outsider = subscriber(ctx, pub.endpoint, None)
    wrong = subscriber(ctx, pub.endpoint, EventKeys.from_secret(b"x" * 32))
    member = subscriber(ctx, pub.endpoint, keys)
    raw = chain(PROMPT)
    try:
        got: list = []
        deadline = time.monotonic() + 10
        while not got:  # PUB drops until a subscriber is joined: publish until one lands
            assert time.monotonic() < deadline, "the member got no batch"
            pub.publish([BlockStored(raw)])
            if member.poll(50):
                got.append(decode_batch(member.recv_multipart()[1]))
        stored = got[0].events[0]
        assert stored.hashes == [keys.tag(h) for h in raw]  # tags, in chain order
        assert not set(stored.hashes) & set(raw)  # no raw hash a guess could be hashed to
        for sock in (outsider, wrong):
            assert sock.poll(300) == 0  # never joined: its handshake was refused
        snap = pub.snapshot()
        assert set(snap.hashes) == {keys.tag(h) for h in raw}
        assert pub.info().keyed is True
    finally:
        for s in (outsider, wrong, member):
            s.close(0)
        ctx.term()
        pub.close()


def test_the_router_index_follows_a_keyed_publisher():
    """KVIndex with the cluster's keys follows a keyed instance and matches the prompt's
    raw chain; without keys it does not follow it (and says so)."""
    keys = EventKeys.from_secret(SECRET)
    pub = KVEventPublisher("e1", BS, keys=keys)
    pub.start()
    info = make_kv_info(engine_id="e1", kv_events=msgspec.to_builtins(pub.info()))
    raw = chain(PROMPT)

    async def fetch(url: str) -> CacheBlocks:
        s = pub.snapshot()
        return CacheBlocks(s.engine_id, s.seq, s.block_size, [h.hex() for h in s.hashes])

    async def main() -> None:
        kv, blind = KVIndex(fetch, retry_s=0.05, keys=keys), KVIndex(fetch, retry_s=0.05)
        key = object()
        try:
            kv.update(key, "inst", info)
            blind.update(key, "inst", info)
            assert blind.index(key) is None  # keyed source, no keys: not followed
            deadline = time.monotonic() + 10
            while kv.longest_prefix(key, lambda bs: raw) < 3:
                assert time.monotonic() < deadline, kv.state(key)
                pub.publish([BlockStored(raw[:3])])
                await asyncio.sleep(0.02)
            assert kv.longest_prefix(key, lambda bs: raw) == 3
            other = chain(list(range(500, 500 + 4 * BS)))
            assert kv.longest_prefix(key, lambda bs: other) == 0
        finally:
            await kv.close()
            await blind.close()

    try:
        asyncio.run(main())
    finally:
        pub.close()


class _CountingKeys(EventKeys):
    calls = 0

    def tag(self, h: bytes) -> bytes:
        _CountingKeys.calls += 1
        return super().tag(h)


def test_a_prompt_chain_is_tagged_once_and_only_as_far_as_it_matches():
    """The router tags the prompt's chain to look it up in a keyed index. It tagged all
    of it, for every instance, on every look-up (a routing decision makes several per
    instance): 3 instances x 5 look-ups of a 512-block chain were 7,680 keyed BLAKE2b
    on the event loop before the first token (~1 us each; failed before). Now the tags
    are made as far as the walk goes, once for all keyed instances of a decision."""
    k = EventKeys.from_secret(SECRET)
    keys = _CountingKeys(k.hash_key, k.curve)
    raw = [bytes([i % 256, i // 256]) * 8 for i in range(512)]

    async def fetch(url: str) -> CacheBlocks:
        raise RuntimeError("not used")

    async def main() -> None:
        kv = KVIndex(fetch, retry_s=60, keys=keys)
        insts = [object() for _ in range(3)]
        try:
            for n, inst in enumerate(insts):
                kv.update(inst, f"http://i{n}", make_kv_info(engine_id=f"e{n}", kv_events={
                    "endpoint": f"tcp://127.0.0.1:{9 + n}", "block_size": BS,
                    "keyed": True}))
                kv._followers[inst].index.hashes.update(k.tag(h) for h in raw[:n + 1])
            _CountingKeys.calls = 0
            for _ in range(5):
                assert [kv.longest_prefix(i, lambda bs: raw) for i in insts] == [1, 2, 3]
            assert _CountingKeys.calls <= 4, _CountingKeys.calls
            other = list(reversed(raw))  # another prompt: its own tags
            assert kv.longest_prefix(insts[0], lambda bs: other) == 0
        finally:
            await kv.close()

    asyncio.run(main())
