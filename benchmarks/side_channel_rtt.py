"""Round trip of one small side-channel message between two SideChannels on 127.0.0.1,
without a secret and with one (issue 40: CURVE + the MAC; before it, the MAC alone).

    PYTHONPATH=src python benchmarks/side_channel_rtt.py [--n 2000] [--size 200]

Prints the median and p99 of ``n`` round trips (after 200 warm-up ones), one thread.
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvpush.kv_transfer.wire.side_channel import SideChannel


def round_trips(secret: bytes | None, n: int, size: int) -> tuple[float, float]:
    a = SideChannel("127.0.0.1", 0, secret=secret)
    b = SideChannel("127.0.0.1", 0, secret=secret)
    payload = b"x" * size

    def one() -> float:
        t0 = time.perf_counter()
        a.send(b.address, payload)
        for _ in range(1000):  # bounded: a message arrives within a second or fails
            if b.recv(1000):
                break
        b.send(a.address, payload)
        for _ in range(1000):
            if a.recv(1000):
                break
        return time.perf_counter() - t0

    try:
        for _ in range(200):
            one()
        xs = sorted(one() for _ in range(n))
    finally:
        a.close()
        b.close()
    return statistics.median(xs) * 1e6, xs[int(len(xs) * 0.99)] * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=2000)
    p.add_argument("--size", type=int, default=200)
    args = p.parse_args()
    for name, secret in (("no secret", None), ("secret", b"s" * 32)):
        med, p99 = round_trips(secret, args.n, args.size)
        print(f"{name}: round trip of a {args.size}-byte message: median {med:.0f} us, "
              f"p99 {p99:.0f} us")


if __name__ == "__main__":
    main()
