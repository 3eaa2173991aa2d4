"""A 1P1D cluster plus router, each on its own namespace "host" (fault_net.Net), for the
fault matrix. Instances are `kvpush serve` processes started with ``ip netns exec``,
bound to their host's address, UCX forced over the veth (UCX_TLS=tcp,
UCX_NET_DEVICES=<veth>); the side channel between P and D goes through a LinkProxy;
the router is `kvpush router` on host R. Every wait is bounded; ``stop()`` ends every
process it started."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from fault_net import Net
from fault_proxy import LinkProxy

HTTP_PORT = 8000
LEASE_S = 3.0
HEARTBEAT_S = 0.3
ENGINE = ("--block-size", "16", "--num-blocks", "256", "--max-model-len", "2048",
          "--threads", "1", "--log-level", "warning", "--dtype", "float32")
START_TIMEOUT = 120.0
#: the cluster secret of the instances and the router (they sign and check it)
CLUSTER_SECRET = os.urandom(16).hex()


def wait_until(cond, timeout: float, what: str, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if cond():
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(interval)


def metric(text: str, name: str, labels: str = "") -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name)] in " {" and labels in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


class NsProcess:
    """One process in a namespace, in its own session (killpg reaches all of it)."""

    def __init__(self, net: Net, host: str, argv: list[str], env: dict, log_path: Path,
                 health_url: str) -> None:
        self.host, self.health_url, self.log_path = host, health_url, log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([*net.exec_prefix(host), *argv], stdout=self._log,
                                     stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"{host} exited {self.proc.returncode}:\n{self.tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(health_url, timeout=1).status_code == 200:
                    return
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"{host} not healthy in {START_TIMEOUT} s:\n{self.tail()}")
            time.sleep(0.2)

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-n:])
        except OSError:
            return ""

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.proc.wait(15)
        self._log.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()


class Cluster:
    def __init__(self, net: Net, proxy: LinkProxy, model: Path, mode: str, log_dir: Path,
                 policy: str = "fail") -> None:
        self.net, self.proxy, self.model, self.mode = net, proxy, model, mode
        self.log_dir, self.policy = log_dir, policy
        self.side_port = {"P": 5600 if mode == "push" else 6600,
                          "D": 5700 if mode == "push" else 6700}
        self.procs: dict[str, NsProcess] = {}
        self.starts = 0
        try:
            with ThreadPoolExecutor(2) as ex:
                futs = {h: ex.submit(self._start_instance, h) for h in ("P", "D")}
                for h, f in futs.items():
                    self.procs[h] = f.result()
            self.router = self._start_router()
        except Exception:
            self.stop()
            raise
        self.total = {h: self.info(h)["num_total_blocks"] for h in ("P", "D")}

    # ---- processes -------------------------------------------------------------------
    def url(self, host: str) -> str:
        return f"http://{self.net.ip(host)}:{HTTP_PORT}"

    def _start_instance(self, host: str, faults: dict | None = None,
                        policy: str | None = None) -> NsProcess:
        """``faults``: FaultPlan knobs its engine core runs with (kvpush_testing.serve)."""
        # a fresh side-channel port for each start (a restarted instance is a new peer)
        self.side_port[host] += 1
        port = self.side_port[host]
        peer = "D" if host == "P" else "P"
        self.proxy.listen(self.net.ns[peer], self.net.side_ip(host), port, self.net.ns[host])
        role = "prefill" if host == "P" else "decode"
        serve = (["-m", "kvpush", "serve"] if faults is None else
                 ["-m", "kvpush_testing.serve", "--faults", json.dumps(faults)])
        argv = [sys.executable, *serve, str(self.model), "--role", role,
                "--kv-transfer", self.mode, "--host", self.net.ip(host), "--port",
                str(HTTP_PORT), "--side-channel-host", self.net.side_ip(host),
                "--side-channel-port", str(port), "--lease-timeout", str(LEASE_S),
                "--heartbeat-interval", str(HEARTBEAT_S), "--kv-load-failure-policy",
                policy or self.policy, *ENGINE]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "NIXL_LOG_LEVEL": "WARN",
               "UCX_TLS": "tcp", "KVPUSH_KV_SECRET": CLUSTER_SECRET,
               "UCX_NET_DEVICES": self.net.veth[host]}
        self.starts += 1
        log = self.log_dir / f"{self.mode}-{host}-{self.starts}.log"
        return NsProcess(self.net, host, argv, env, log, self.url(host) + "/health")

    def _start_router(self) -> NsProcess:
        ip = self.net.ip("R")
        # round-robin: every request takes the P/D path whose faults are injected (the
        # cache-aware default would serve these short prompts on decode alone)
        argv = [sys.executable, "-m", "kvpush", "router", "--mode", self.mode,
                "--policy", "round-robin",
                "--prefill", self.url("P"), "--decode", self.url("D"), "--host", ip,
                "--port", str(HTTP_PORT), "--health-interval", "0.5", "--health-timeout",
                "1", "--connect-timeout", "2", "--request-timeout", "30",
                "--startup-timeout", "60", "--log-level", "warning"]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "KVPUSH_KV_SECRET": CLUSTER_SECRET}
        self.starts += 1
        return NsProcess(self.net, "R", argv, env, self.log_dir / f"{self.mode}-router.log",
                         f"http://{ip}:{HTTP_PORT}/health")

    def signed(self, params: dict, host: str, peer: str | None = None) -> dict:
        """kv_transfer_params as the router would sign them for instance ``host``."""
        from kvpush.crypto.auth import ParamsSigner

        role = "prefill" if host == "P" else "decode"
        return ParamsSigner(CLUSTER_SECRET.encode()).sign(
            params, role=role, engine_id=self.info(host)["engine_id"],
            peer_engine_id=self.info(peer)["engine_id"] if peer else None)

    @property
    def router_url(self) -> str:
        return f"http://{self.net.ip('R')}:{HTTP_PORT}"

    def restart(self, host: str, faults: dict | None = None,
                policy: str | None = None) -> None:
        """Start ``host`` again (after a kill), and wait until the router uses it."""
        old = self.procs.pop(host, None)
        if old is not None:
            old.stop()
        self.procs[host] = self._start_instance(host, faults, policy)
        self.wait_in_rotation(host)

    def wait_in_rotation(self, host: str, timeout: float = 20) -> None:
        """Until the router has ``host`` (as it runs now) healthy in rotation."""
        engine = self.info(host)["engine_id"]
        wait_until(lambda: self._router_sees(host, engine), timeout,
                   f"the router using {host}")

    def _router_sees(self, host: str, engine: str) -> bool:
        states = httpx.get(self.router_url + "/router/instances", timeout=5).json()
        for s in states["instances"]:
            if s["url"] == self.url(host):
                return s["healthy"] and s["engine_id"] == engine
        return False

    def stop(self) -> None:
        procs = list(self.procs.values())
        if getattr(self, "router", None) is not None:
            procs.append(self.router)
        for p in procs:
            p.stop()

    # ---- observations ------------------------------------------------------------------
    def info(self, host: str) -> dict:
        return httpx.get(self.url(host) + "/kv/info", timeout=5).json()

    def free(self, host: str) -> int:
        return self.info(host)["num_free_blocks"]

    def metrics(self, host: str) -> str:
        url = self.router_url if host == "R" else self.url(host)
        return httpx.get(url + "/metrics", timeout=5).text

    def wait_all_free(self, hosts=("P", "D"), timeout: float = LEASE_S + 7) -> float:
        """Seconds until every block of ``hosts`` is free again (AssertionError if not
        within ``timeout``)."""
        t0 = time.monotonic()
        for h in hosts:
            left = max(0.1, timeout - (time.monotonic() - t0))
            wait_until(lambda h=h: self.free(h) == self.total[h], left,
                       f"{h}: all {self.total[h]} blocks free (now {self.free(h)})")
        return time.monotonic() - t0
