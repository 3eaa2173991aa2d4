"""The instances behind the router: identity, health, in-flight counts, and the pick of
one for each leg.

Every instance is checked at start-up and every ``health_interval_s`` after, each on its
own, each answer read whole within ``health_timeout_s`` and a size cap
(kvpush.router.answers): ``GET /health`` must answer 200; with the cluster secret the
instance is admitted first, at every check (kvpush.router.admit); ``GET /kv/info`` must
show the identity proved and the role and transfer mode the router uses it for. An
instance that fails a check, or on which a request hits a connection error, leaves the
rotation at once (but for checks that only time out, ``slow_checks_tolerated`` in a
row, or while its engine core link is up); the next check that passes brings it back,
its identity read again. A failed check also ends every leg still waiting on the
instance (kvpush.router.watch).

All state is touched from the event loop only, so picks need no lock.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

from kvpush.discovery.instance_spec import Identity, InstanceSpec
from kvpush.kv_info import KVInfo, MalformedAnswer, decode_kv_info
from kvpush.router.admit import NotAdmitted, Proven, admit, identity_problem
from kvpush.router.answers import fetch
from kvpush.router.config import RouterConfig, RouterConfigError, RouterKeys
from kvpush.router.watch import LegWatch, end_all
from kvpush.server.auth import auth_header

if TYPE_CHECKING:
    from kvpush.engine.outputs import EngineStats

logger = logging.getLogger("kvpush.router")

#: checks of instances out of rotation that run at once (a flood of cards naming dead
#: addresses waits here; checks of instances in rotation never do)
CHECKS_AT_ONCE = 32
#: the longest wait between checks of a discovered instance that has never passed one
#: (it doubles from --health-interval with each failed check)
MAX_BACKOFF_S = 30.0


class RouterStartupError(RuntimeError):
    """The instances did not become usable within the start-up timeout."""


@dataclass(eq=False)
class Instance:
    spec: InstanceSpec
    #: what the router uses it for: "prefill" or "decode" (colocated: "decode")
    role: str
    index: int
    healthy: bool = False
    #: why the last check failed, or the last connection error a request hit
    last_error: str | None = "not checked yet"
    #: a role or mode the router cannot use (kept out of rotation until it changes)
    misconfigured: str | None = None
    #: the last /kv/info answer; None when the instance has no /kv/info (vLLM)
    info: KVInfo | None = None
    in_flight: int = 0
    #: KV tokens (prompt + answer bound) of the cache-aware router's decode legs in
    #: flight on it: its load in kvpush.router.decide's cost
    tokens_in_flight: int = 0
    requests: int = 0
    failures: int = 0
    #: bumped whenever a request marks it failed, so that a health check that started
    #: before the failure cannot put it back in rotation on stale evidence
    epoch: int = 0
    checked_at: float = field(default=0.0)
    #: health checks in a row that timed out while the instance was in rotation
    slow_checks: int = 0
    #: a discovered instance that has never passed a check is checked again only from
    #: then on (backing off: a card naming a dead address costs little)
    next_check_at: float = 0.0
    failed_checks: int = 0
    #: the identity it proved holding the cluster secret at its last check
    #: (kvpush.router.admit); None until it has, and after a failed check or request
    proven: Proven | None = None
    #: the legs waiting on it now (ended when a health check fails)
    watches: set[LegWatch] = field(default_factory=set)
    #: its cards in etcd, newest first, when it joined through discovery
    #: (kvpush.router.discover): its /kv/info must agree with one of them before it
    #: gets traffic (several: a restarted instance's new card beside its old one, or a
    #: card someone else wrote for its URL, which cannot take it out of rotation)
    cards: tuple[Any, ...] = ()

    @property
    def kvpush(self) -> bool:
        """Whether it is a kvpush instance (it answers /kv/info; a vLLM one does not):
        reached over its engine core, its KV in kvpush's layout."""
        return self.info is not None

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def identity(self) -> Identity | None:
        """Engine id and side-channel address: from /kv/info, else from the URL spec."""
        if self.info is not None:
            return identity_from_info(self.info)
        return self.spec.explicit

    @property
    def engine_id(self) -> str:
        if self.info is not None and self.info.engine_id:
            return self.info.engine_id
        if self.spec.explicit is not None:
            return self.spec.explicit.engine_id
        return self.url

    def state(self, stats: EngineStats | None) -> dict[str, Any]:  # (Pool.core_stats)
        return {"url": self.url, "role": self.role, "engine_id": self.engine_id,
                "healthy": self.healthy, "in_flight": self.in_flight,
                "tokens_in_flight": self.tokens_in_flight,
                "requests": self.requests, "failures": self.failures,
                "last_error": None if self.healthy else self.last_error,
                "misconfigured": self.misconfigured,
                "num_free_blocks": stats.num_free_blocks if stats is not None else None,
                "num_total_blocks": stats.num_total_blocks if stats is not None else None}


def identity_from_info(info: KVInfo) -> Identity | None:
    host, port = info.side_channel_host, info.side_channel_port
    if isinstance(host, str) and host and isinstance(port, int):
        return Identity(info.engine_id, host, port)
    return None


def describe_error(exc: BaseException) -> str:
    """A short, readable form of an httpx error (their str() is often empty)."""
    text = str(exc).strip()
    name = type(exc).__name__
    return f"{name}: {text}" if text else name


class Pool:
    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.by_role: dict[str, list[Instance]] = {
            "prefill": [Instance(s, "prefill", i) for i, s in enumerate(cfg.prefill)],
            "decode": [Instance(s, "decode", i) for i, s in enumerate(cfg.decode)],
        }
        self._cursor = {"prefill": 0, "decode": 0}
        self._by_url = {i.url: i for i in self.instances}
        #: set once start-up is over (from then on, problems are logged, not raised)
        self.running = False
        #: called with each instance whose check passed, its /kv/info just read (the
        #: router's KV index follows the instance's event source from it)
        self.on_info: list[Callable[[Instance], None]] = []
        #: called with each instance that left the pool (remove_instance): the KV index,
        #: the link to its engine core
        self.on_remove: list[Callable[[Instance], None]] = []
        #: a kvpush instance's gauges (free blocks, requests: not /kv/info's) as its
        #: engine core's latest snapshot says, over a link that is up (the router's
        #: CoreSender; None: no such link, or vLLM)
        self.core_stats: Callable[[Instance], EngineStats | None] = lambda _inst: None
        self._check_slots = asyncio.Semaphore(CHECKS_AT_ONCE)
        #: the checks running now, by instance (start_checks)
        self._checks: dict[Instance, asyncio.Task] = {}

    @property
    def instances(self) -> list[Instance]:
        return self.by_role["prefill"] + self.by_role["decode"]

    # ------------------------------------------------------------------ membership

    def find(self, url: str) -> Instance | None:
        return self._by_url.get(url)

    def add_instance(self, spec: InstanceSpec, role: str,
                     cards: tuple[Any, ...] = ()) -> Instance:
        """A new instance, out of rotation until a health check passes (the caller starts
        one). Raises ValueError if its URL is in the pool already."""
        if self.find(spec.url) is not None:
            raise ValueError(f"instance {spec.url} is in the pool already")
        group = self.by_role[role]
        inst = Instance(spec, role, len(group), cards=cards)
        group.append(inst)
        self._by_url[spec.url] = inst
        return inst

    def remove_instance(self, url: str) -> Instance | None:
        """Take an instance out of the pool: no new legs; legs in flight on it go on (a
        drained instance finishes them). Its KV index goes (``on_remove``)."""
        inst = self.find(url)
        if inst is None:
            return None
        group = self.by_role[inst.role]
        group.remove(inst)
        del self._by_url[url]
        for k, other in enumerate(group):
            other.index = k
        self._cursor[inst.role] = self._cursor[inst.role] % len(group) if group else 0
        inst.healthy = False
        inst.last_error = "left the pool"
        for listener in self.on_remove:
            listener(inst)
        return inst

    # ------------------------------------------------------------------ selection

    def has_healthy(self, role: str) -> bool:
        return any(i.healthy for i in self.by_role[role])

    def choose(self, role: str, exclude: Iterable[Instance] = (),
               cost: Callable[[Instance], float] | None = None) -> Instance | None:
        """The healthy instance ``pick`` would take now, without taking it.

        With ``cost`` (the cache-aware policy, kvpush.router.decide): the lowest cost,
        ties broken in round-robin order. Else round-robin: the next healthy one after
        the last pick; least-outstanding: the fewest legs in flight, ties round-robin."""
        group = self.by_role[role]
        skip = set(exclude)
        n = len(group)
        start = self._cursor[role]
        order = [group[(start + k) % n] for k in range(n)]
        cands = [i for i in order if i.healthy and i not in skip]
        if not cands:
            return None
        if cost is not None:
            costs = [cost(i) for i in cands]
            return cands[costs.index(min(costs))]
        if self.cfg.policy == "least-outstanding":
            least = min(i.in_flight for i in cands)
            return next(i for i in cands if i.in_flight == least)
        return cands[0]

    def pick(self, role: str, exclude: Iterable[Instance] = (),
             cost: Callable[[Instance], float] | None = None) -> Instance | None:
        """A healthy instance for one leg (see ``choose``), its in-flight count taken
        (``release`` it)."""
        chosen = self.choose(role, exclude, cost)
        if chosen is None:
            return None
        self._cursor[role] = (chosen.index + 1) % len(self.by_role[role])
        chosen.in_flight += 1
        chosen.requests += 1
        return chosen

    @staticmethod
    def release(inst: Instance) -> None:
        inst.in_flight = max(0, inst.in_flight - 1)

    def mark_failed(self, inst: Instance, why: str) -> None:
        """A request could not reach the instance: out of rotation until a check passes."""
        inst.proven = None
        inst.failures += 1
        inst.epoch += 1
        inst.last_error = why
        if inst.healthy:
            inst.healthy = False
            logger.warning("%s instance %s (%s) out of rotation: %s", inst.role, inst.url,
                           inst.engine_id, why)

    # ------------------------------------------------------------------ health checks

    def verify(self, inst: Instance, info: KVInfo | None) -> str | None:
        """Why the router cannot use an instance with this /kv/info, or None."""
        mode = self.cfg.mode
        mixed = self._mixed(inst, info)
        if mixed is not None:
            return mixed
        if info is None:  # no /kv/info: not kvpush (vLLM); trust the command line
            if inst.role == "prefill" and mode == "push" and inst.spec.explicit is None:
                return ("it has no /kv/info (not a kvpush instance?) and its URL names no "
                        "identity; in push mode decode must know prefill's engine id and "
                        "side channel before prefill answers: give it as "
                        "URL@ENGINE_ID@SIDE_HOST:SIDE_PORT")
            return None
        if inst.cards:  # one of its cards must name it as it is
            from kvpush.discovery.card import mismatch

            bads = [mismatch(card, info) for card in inst.cards]
            if None not in bads:
                return bads[0]
        role, kvt = info.role, info.kv_transfer
        want = "both" if mode == "colocated" else inst.role
        if role != want:
            flag = "--decode" if inst.role == "decode" else "--prefill"
            return (f"its /kv/info says role={role!r}, but as a {flag} instance of a "
                    f"--mode {mode} router it must be role={want!r} "
                    f"(kvpush serve --role {want})")
        if mode != "colocated" and kvt != mode:
            return (f"its /kv/info says kv_transfer={kvt!r}, but the router runs "
                    f"--mode {mode} (kvpush serve --kv-transfer {mode})")
        if inst.role == "prefill" and mode == "push" and identity_from_info(info) is None:
            return "its /kv/info has no side_channel_host/side_channel_port"
        if not info.request_plane:
            return ("its /kv/info names no request plane: the router reaches a kvpush "
                    "instance over its engine core (is it a kvpush older than the router?)")
        if info.request_plane_members and self.cfg.keys is None:
            return ("its request plane admits the cluster's members only, and the router "
                    "has no secret: give the router the instances' secret (kvpush router "
                    "--kv-secret-file PATH, or KVPUSH_KV_SECRET), or run the instances "
                    "with --insecure-kv-params")
        return None

    def _mixed(self, inst: Instance, info: KVInfo | None) -> str | None:
        """Why ``inst`` cannot pair with the healthy instances of the other role: a
        kvpush instance (it has /kv/info) and a vLLM one keep the KV in different layouts
        (kvpush's region, vLLM's paged blocks), and no transfer maps one onto the other,
        so a cluster's prefill and decode instances are of one kind."""
        if self.cfg.mode == "colocated":
            return None
        other = "decode" if inst.role == "prefill" else "prefill"
        kinds = {i.kvpush for i in self.by_role[other] if i.healthy}
        mine = info is not None  # (inst.kvpush once this answer is kept)
        if not kinds or mine in kinds:
            return None
        names = ("a vLLM", "kvpush") if not mine else ("a kvpush", "vLLM")
        return (f"it is {names[0]} instance and the {other} instances are {names[1]} ones: "
                "their KV layouts differ and no transfer maps one onto the other; run "
                "prefill and decode instances of one kind")

    async def check(self, client: httpx.AsyncClient, inst: Instance) -> None:
        """One health check: /health then /kv/info; updates the instance in place.

        Checks of instances out of rotation run at most CHECKS_AT_ONCE at once."""
        if inst.healthy:
            await self._check(client, inst)
            return
        async with self._check_slots:
            if inst in self.by_role[inst.role]:  # (not gone while it waited)
                await self._check(client, inst)

    async def _check(self, client: httpx.AsyncClient, inst: Instance) -> None:
        epoch = inst.epoch
        timeout = self.cfg.health_timeout_s
        try:
            r = await fetch(client, "GET", inst.url + "/health", timeout)
            if r.status_code != 200:
                self._down(inst, f"/health answered HTTP {r.status_code}")
                return
            keys = self.cfg.keys
            if isinstance(keys, RouterKeys):
                # no API key, no prompt, no grant before the proof (kvpush.router.admit);
                # proved at every check: another server at its address is caught there
                inst.proven = None
                try:
                    inst.proven = await admit(client, inst.url, keys.proof_key, timeout,
                                              discovered=bool(inst.cards))
                except NotAdmitted as e:
                    self._refuse(inst, str(e))
                    return
            info: KVInfo | None = None  # none: not kvpush (vLLM)
            # (an instance that could not prove answered /kv/info 404 already: admit)
            if not isinstance(keys, RouterKeys) or inst.proven is not None:
                members = keys.member_header() if isinstance(keys, RouterKeys) else {}
                k = await fetch(client, "GET", inst.url + "/kv/info", timeout,
                                headers=auth_header(self.cfg.api_key) | members)
                if k.status_code == 200:
                    try:
                        info = decode_kv_info(k.content)
                    except MalformedAnswer as e:  # not what a kvpush instance answers
                        self._refuse(inst, str(e))
                        return
                elif k.status_code != 404:
                    self._down(inst, f"/kv/info answered HTTP {k.status_code}")
                    return
        except (httpx.HTTPError, ValueError) as e:
            why = f"not answering: {describe_error(e)}"
            if inst.epoch == epoch and self._spared(inst, e):
                inst.slow_checks += 1
                if inst.healthy:
                    logger.warning("%s instance %s (%s) did not answer a health check "
                                   "(%s); kept in rotation", inst.role, inst.url,
                                   inst.engine_id, describe_error(e))
                else:  # out already (a leg failed on it): it stays out
                    inst.checked_at, inst.last_error = time.monotonic(), why
                return
            self._down(inst, why)
            return
        if inst not in self.by_role[inst.role]:  # left the pool while it was checked
            return
        inst.slow_checks = 0
        inst.checked_at = time.monotonic()
        inst.failed_checks = 0
        bad = self.verify(inst, info)
        if bad is None and inst.proven is not None:
            bad = identity_problem(inst.proven, info) if info is not None else (
                "it proved an identity, then its /kv/info answered 404")
        if bad is not None:
            self._refuse(inst, bad)
            return
        inst.misconfigured = None
        if inst.epoch != epoch:  # a request failed on it meanwhile: wait for the next check
            return
        old = inst.engine_id if inst.info is not None else None
        inst.info = info
        for listener in self.on_info:
            listener(inst)
        if not inst.healthy:
            inst.healthy = True
            inst.last_error = None
            logger.info("%s instance %s (engine %s) in rotation", inst.role, inst.url,
                        inst.engine_id)
        elif old is not None and old != inst.engine_id:
            logger.info("%s instance %s restarted: engine %s -> %s", inst.role, inst.url, old,
                        inst.engine_id)

    def _spared(self, inst: Instance, e: Exception) -> bool:
        """Whether a check that failed with ``e`` leaves ``inst`` in rotation: its engine
        core link is up (the HTTP probe does not judge it), or the check only timed out
        (a busy instance answers late: its event loop shares the CPU with the engine)
        and either fewer than ``slow_checks_tolerated`` did in a row or it is the last
        healthy instance of its role. A refused connection, a bad answer or a failed
        request still takes it out at once."""
        if not inst.healthy:
            return False
        if isinstance(e, httpx.HTTPError) and self.core_stats(inst) is not None:
            return True
        if not isinstance(e, httpx.TimeoutException):
            return False
        others = any(i.healthy for i in self.by_role[inst.role] if i is not inst)
        return inst.slow_checks < self.cfg.slow_checks_tolerated or not others

    def _refuse(self, inst: Instance, bad: str) -> None:
        """Out of rotation until a later check finds it usable (logged once a reason)."""
        if inst.misconfigured != bad and self.running:  # start-up raises it instead
            logger.error("%s instance %s kept out of rotation: %s", inst.role, inst.url, bad)
        inst.misconfigured = bad
        self._down(inst, bad, quiet=True)

    def _down(self, inst: Instance, why: str, quiet: bool = False) -> None:
        inst.proven = None  # proved again at its next check (a restart, another server)
        inst.slow_checks = 0
        inst.checked_at = time.monotonic()
        inst.last_error = why
        if inst.cards and inst.info is None:  # discovered, never admitted: back off
            inst.failed_checks += 1
            inst.next_check_at = inst.checked_at + min(
                MAX_BACKOFF_S, self.cfg.health_interval_s * 2 ** min(inst.failed_checks, 16))
        if inst.healthy:
            inst.healthy = False
            if not quiet:
                logger.warning("%s instance %s (%s) out of rotation: %s", inst.role, inst.url,
                               inst.engine_id, why)
        ended = end_all(inst.watches, f"the {inst.role} instance stopped answering "
                                      f"(a health check failed: {why})")
        if ended:
            logger.warning("%s instance %s (%s): ended %d leg(s) in flight on it", inst.role,
                           inst.url, inst.engine_id, ended)

    def engine_ids(self) -> list[str]:
        """Every engine id the pool knows (to keep them out of client-facing errors)."""
        ids = {i.spec.explicit.engine_id for i in self.instances if i.spec.explicit}
        ids.update(i.info.engine_id for i in self.instances
                   if i.info is not None and i.info.engine_id)
        return sorted(ids)

    def start_checks(self, client: httpx.AsyncClient) -> list[asyncio.Task]:
        """Start a check of every instance that is due and has none running (each its
        own task: one that is slow to answer delays no other); returns those started."""
        now = time.monotonic()
        started = []
        for inst in self.instances:
            if inst.next_check_at <= now and inst not in self._checks:
                task = asyncio.create_task(self.check(client, inst),
                                           name=f"kvpush-check {inst.url}")
                self._checks[inst] = task
                task.add_done_callback(functools.partial(self._check_done, inst))
                started.append(task)
        return started

    def _check_done(self, inst: Instance, task: asyncio.Task) -> None:
        self._checks.pop(inst, None)
        if not task.cancelled() and task.exception() is not None:
            logger.error("health check of %s failed", inst.url, exc_info=task.exception())

    async def check_all(self, client: httpx.AsyncClient) -> None:
        """Check every due instance and wait for those checks."""
        started = self.start_checks(client)
        if started:
            await asyncio.wait(started)

    def ready(self) -> bool:
        """Whether requests can be served: a healthy decode, and a healthy prefill unless
        the router runs without one (colocated, or --fallback-local-prefill)."""
        return self.has_healthy("decode") and (
            not self.cfg.needs_prefill or self.has_healthy("prefill"))

    async def wait_ready(self, client: httpx.AsyncClient, timeout: float) -> None:
        """Start-up: check every instance until the router can serve.

        Raises RouterConfigError at once when an answering instance has the wrong role or
        transfer mode, and RouterStartupError when the router still cannot serve after
        ``timeout`` seconds. Instances still down once it can serve join later, through
        the periodic checks."""
        deadline = time.monotonic() + timeout
        while True:
            await self.check_all(client)
            bad = [i for i in self.instances if i.misconfigured]
            if bad:
                raise RouterConfigError("\n".join(
                    f"{i.role} instance {i.url}: {i.misconfigured}" for i in bad))
            if self.ready():
                self.running = True
                for i in self.instances:
                    if not i.healthy:
                        logger.warning("%s instance %s not in rotation yet: %s", i.role,
                                       i.url, i.last_error)
                return
            left = deadline - time.monotonic()
            if left <= 0:
                lines = [f"  {i.role} {i.url}: {i.last_error}" for i in self.instances
                         if not i.healthy]
                need = ("a decode and a prefill instance" if self.cfg.needs_prefill
                        else "a decode instance")
                raise RouterStartupError(
                    f"the router needs {need}, and none was usable within {timeout:g} s:\n"
                    + "\n".join(lines))
            await asyncio.sleep(min(0.25, left))

    async def health_loop(self, client: httpx.AsyncClient) -> None:
        """Start a check of every instance every ``health_interval_s``, but of one whose
        last check still runs (runs until cancelled; cancels the checks running then)."""
        self.running = True
        try:
            while True:
                await asyncio.sleep(self.cfg.health_interval_s)
                self.start_checks(client)
        finally:
            for task in list(self._checks.values()):
                task.cancel()
