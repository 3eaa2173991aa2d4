"""LinkProxy: a user-space TCP proxy between two network namespaces, with delay and loss.

The kernels here have no netem, so a disturbed link is made in user space: the proxy
listens on ``host:port`` *inside* one namespace (where that address is on the loopback,
see fault_net.py) and forwards each connection to the same ``host:port`` *inside* another
namespace, where the real server listens. Addresses stay what the peers announce (the
side channel uses its address as its identity), so the proxy is invisible to them.

Each direction of each connection is a reader thread and a writer thread with a queue
between them; a chunk read at time t is written at ``max(t + delay, previous due)`` (order
kept), and a ``loss`` fraction of the chunks (the first one after ``set``, then every
1/loss-th, counted over the whole proxy so that a test knows it happened) is held a
further ``rto`` seconds: what a lost segment costs a TCP stream (TCP retransmits it after
at least 200 ms; nothing is lost, it is late). ``set`` changes ``delay`` and ``loss`` at
any time. Threads block on sockets and queues, never spin; ``close()`` stops everything.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time

from fault_net import socket_in_ns


class LinkProxy:
    def __init__(self, delay: float = 0.0, loss: float = 0.0, rto: float = 0.2) -> None:
        self.delay, self.loss, self.rto = delay, loss, rto
        self._acc = 0.0  # loss accumulator: a chunk is "lost" each time it reaches 1
        self._lock = threading.Lock()
        self._listeners: list[socket.socket] = []
        self._conns: set[socket.socket] = set()
        self._closed = False
        self.stats = {"connections": 0, "chunks": 0, "bytes": 0, "lost": 0, "refused": 0}

    def set(self, delay: float, loss: float) -> None:
        """Change the disturbance; with loss > 0 the next chunk is the first one lost."""
        with self._lock:
            self.delay, self.loss = delay, loss
            self._acc = 1.0 - loss

    def listen(self, listen_ns: str, host: str, port: int, target_ns: str) -> None:
        lsock = socket_in_ns(listen_ns)
        lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lsock.bind((host, port))
        lsock.listen(64)
        with self._lock:
            self._listeners.append(lsock)
        threading.Thread(target=self._accept, args=(lsock, host, port, target_ns),
                         name=f"proxy-{host}:{port}", daemon=True).start()

    def _accept(self, lsock: socket.socket, host: str, port: int, target_ns: str) -> None:
        while not self._closed:
            try:
                conn, _ = lsock.accept()
            except OSError:
                return  # closed
            up = socket_in_ns(target_ns)
            up.settimeout(5)
            try:
                up.connect((host, port))
            except OSError:
                self.stats["refused"] += 1
                conn.close()
                up.close()
                continue
            up.settimeout(None)
            for s in (conn, up):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if self._closed:
                    conn.close()
                    up.close()
                    return
                self._conns.update((conn, up))
                self.stats["connections"] += 1
            self._pump(conn, up)
            self._pump(up, conn)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        q: queue.SimpleQueue = queue.SimpleQueue()

        def reader() -> None:
            last = 0.0
            try:
                while True:
                    data = src.recv(65536)
                    if not data:
                        break
                    with self._lock:
                        self._acc += self.loss
                        extra = 0.0
                        if self._acc >= 1.0:
                            self._acc -= 1.0
                            extra = self.rto
                            self.stats["lost"] += 1
                        due = max(last, time.monotonic() + self.delay + extra)
                        self.stats["chunks"] += 1
                        self.stats["bytes"] += len(data)
                    last = due
                    q.put((due, data))
            except OSError:
                pass
            q.put(None)

        def writer() -> None:
            try:
                while True:
                    item = q.get()
                    if item is None:
                        with contextlib.suppress(OSError):
                            dst.shutdown(socket.SHUT_WR)
                        return
                    due, data = item
                    wait = due - time.monotonic()
                    if wait > 0:
                        time.sleep(wait)
                    dst.sendall(data)
            except OSError:  # the other side is gone: end both directions
                for s in (src, dst):
                    with contextlib.suppress(OSError):
                        s.shutdown(socket.SHUT_RDWR)

        threading.Thread(target=reader, daemon=True).start()
        threading.Thread(target=writer, daemon=True).start()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            socks = [*self._listeners, *self._conns]
            self._listeners.clear()
            self._conns.clear()
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
