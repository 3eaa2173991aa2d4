"""Issue 40, finding 3: with the cluster secret an instance's KV-event stream is for
members only (CURVE on the PUB socket) and names blocks by keyed tags, so a non-member
can neither subscribe nor test a guessed prompt against it; the router, with the
derived keys, still finds a prompt's cached prefix."""

from __future__ import annotations

import asyncio
import time

import zmq

from kvpush.kv_cache.block_pool import hash_prompt_chain
from kvpush.kv_cache.event_keys import EventKeys
from kvpush.kv_cache.event_publisher import KVEventPublisher
from kvpush.kv_cache.events import TOPIC, BlockStored, decode_batch
from kvpush.kv_transfer.curve import make_client
from kvpush.router.kv_index import KVIndex, Snapshot

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
        assert pub.info()["keyed"] is True
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
    info = {"engine_id": "e1", "kv_events": pub.info()}
    raw = chain(PROMPT)

    async def fetch(url: str) -> Snapshot:
        s = pub.snapshot()
        return Snapshot(s.engine_id, s.seq, s.block_size, frozenset(s.hashes))

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
