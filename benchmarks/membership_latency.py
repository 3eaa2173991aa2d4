"""How fast a router's pool follows etcd: from a card's put (or delete) being sent to the
instance being in (or out of) the pool of a router watching the prefix (kvpush.router.
discover). A real etcd on 127.0.0.1 (tests/etcd_helpers.py); no model. 30 joins and
leaves; prints the median and the maximum. docs/ROUTER.md, Membership, has a run.

    PYTHONPATH=src python benchmarks/membership_latency.py
"""
import asyncio
import pathlib
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))
from etcd_helpers import EtcdServer  # noqa: E402
from kvpush.discovery.card import card_from_info, encode, sign  # noqa: E402
from kvpush.discovery.etcd import EtcdClient  # noqa: E402
from kvpush.discovery.target import parse_target  # noqa: E402
from kvpush.router.config import RouterConfig  # noqa: E402
from kvpush.router.discover import EtcdLink  # noqa: E402
from kvpush.router.pool import Pool  # noqa: E402
from stand_in import make_kv_info  # noqa: E402

INFO = {"role": "decode", "engine_id": "d", "side_channel": "127.0.0.1:1",
        "kv_transfer": "push", "model": "m"}
SECRET = b"membership-latency-benchmark-secret"  # cards are signed with its card key
d = pathlib.Path(tempfile.mkdtemp())
s = EtcdServer(d / "data", d)


async def main() -> None:
    t = parse_target(s.url())
    pool = Pool(RouterConfig(mode="push", prefill=(), decode=(), discover=t,
                             kv_secret=SECRET))
    link = EtcdLink(pool, lambda i: None)
    link.start()
    await link.synced.wait()
    c = EtcdClient(t)
    join, leave = [], []
    for k in range(30):
        card = sign(card_from_info(f"http://127.0.0.1:{20000 + k}",
                                   make_kv_info(**{**INFO, "engine_id": f"d{k}"})), SECRET)
        key = f"/kvpush/instances/decode/d{k}"
        t0 = time.perf_counter()
        await c.put(key, encode(card))
        while pool.find(card.url) is None:  # bounded by the watch; polled every 0.5 ms
            await asyncio.sleep(0.0005)
        join.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        await c.delete(key)
        while pool.find(card.url) is not None:
            await asyncio.sleep(0.0005)
        leave.append(time.perf_counter() - t0)
    for name, xs in (("join", join), ("leave", leave)):
        ms = sorted(x * 1000 for x in xs)
        print(f"{name}: n={len(ms)} median {statistics.median(ms):.1f} ms, max "
              f"{ms[-1]:.1f} ms (from the put/delete being sent)")
    await c.aclose()
    await link.close()


try:
    asyncio.run(main())
finally:
    s.stop()
