"""`kvpush router --discover etcd://HOST:PORT/PREFIX`: the pool follows the instances
registered under PREFIX (kvpush.discovery.register).

Lifecycle of the view (:class:`EtcdLink`)::

    CONNECTING -> WATCHING -> UNREACHABLE -> WATCHING -> ...

CONNECTING/UNREACHABLE: read every card under the prefix (a range; a card that is not
signed with the cluster secret's card key is dropped, logged, before anything connects
to what it names), make the pool agree with them, then WATCHING: a watch from the
range's revision on applies each change as it comes (a card put: the instance joins,
out of rotation until its health check passes, it has proved that it holds the cluster
secret and its ``/kv/info`` agrees with the card; a key deleted, by drain or lease expiry: it
leaves, its legs in flight go on). etcd is probed every ``PROBE_S`` while watching; when
the watch breaks or the probe fails the router keeps its last view (UNREACHABLE, shown
in ``/health`` and logged once), retries every ``RETRY_S``, and on reconnecting reads
the whole prefix again, so changes missed meanwhile (or compacted away) are caught up.

Every card naming a URL stays with that URL's instance; the instance is in rotation
while its ``/kv/info`` agrees with one of them. So a card naming a working instance's
URL as another engine, side channel or role (stale, or someone else's) is ignored,
logged once, and takes nothing out of rotation; a restarted instance's new card is
followed as soon as the instance answers as it.

Several routers may watch one prefix: the view is read-only. Instances given on the
command line (--prefill/--decode) stay as they are; a card naming one of their URLs is
ignored (logged).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvpush.discovery.card import Card, CardError, decode, mismatch, signature_problem
from kvpush.discovery.etcd import EtcdClient, EtcdError, KeyValue, WatchEvent
from kvpush.discovery.instance_spec import InstanceSpec
from kvpush.ratelog import LogBudget
from kvpush.router.config import RouterKeys
from kvpush.router.pool import Instance, Pool
from kvpush.router.stopping import cancel_and_wait

logger = logging.getLogger("kvpush.router")

#: seconds between liveness probes of etcd while watching
PROBE_S = 1.0
#: seconds between tries to reach etcd again
RETRY_S = 0.5
#: (key or URL, reason) pairs remembered so that each is logged once; past this many
#: the memory starts again (a flood of ever new cards cannot grow it without bound)
MAX_REMEMBERED = 4096


class LinkState(enum.Enum):
    CONNECTING = "connecting"
    WATCHING = "watching"
    UNREACHABLE = "unreachable"


@dataclass(frozen=True)
class _Entry:
    revision: int
    card: Card


def group_for(mode: str, role: str) -> str | None:
    """The pool group a card's role goes to under the router's mode (None: not used)."""
    if mode == "colocated":
        return "decode" if role == "both" else None
    return role if role in ("prefill", "decode") else None


class EtcdLink:
    """The pool's view of the instances registered under its ``--discover`` prefix."""

    def __init__(self, pool: Pool, on_join: Callable[[Instance], None]) -> None:
        cfg = pool.cfg
        assert cfg.discover is not None
        self.target, self.pool, self.mode, self.on_join = cfg.discover, pool, cfg.mode, on_join
        self.max_instances = cfg.max_instances
        #: URLs with usable cards left out because the pool holds max_instances
        #: discovered instances already (taken in, oldest first, as places free up)
        self.waiting: dict[str, None] = {}
        #: joins, leaves and ignored cards, logged at a bounded rate
        self.log = LogBudget(logger)
        self.client = EtcdClient(self.target)
        self.state = LinkState.CONNECTING
        self.last_error: str | None = None
        self.since = time.time()
        #: every card under the prefix, by key, and by the URL it names
        self.cards: dict[str, _Entry] = {}
        self.by_url: dict[str, dict[str, _Entry]] = {}
        #: the instances this link added, by URL
        self.owned: dict[str, Instance] = {}
        self._ignored: set[tuple[str, str]] = set()
        self._task: asyncio.Task | None = None
        #: set after each reconciliation with etcd (tests)
        self.synced = asyncio.Event()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kvpush-discover")

    async def close(self) -> None:
        await cancel_and_wait([self._task], "the discovery link")
        self._task = None
        await self.client.aclose()

    def health(self, detail: bool = False) -> dict[str, Any]:
        """The link's state for ``/health`` (public: no etcd address, no raw error) or,
        with ``detail``, for the operator view ``/router/instances``."""
        out: dict[str, Any] = {"state": self.state.value, "since": self.since,
                               "instances": len(self.owned),
                               "over_max_instances": len(self.waiting)}
        if detail:
            out.update(etcd=str(self.target), error=self.last_error)
        else:
            out["error"] = ("etcd did not answer (details: /router/instances)"
                            if self.last_error else None)
        return out

    # ------------------------------------------------------------------ the loop

    async def _run(self) -> None:
        while True:
            try:
                rev, kvs = await self.client.get_prefix(self._instances_prefix)
                self._replace(kvs)
                if self.state is LinkState.UNREACHABLE:
                    logger.warning("etcd %s answers again: view caught up (%d instances)",
                                   self.target, len(self.owned))
                self._set(LinkState.WATCHING, None)
                await self._watch(rev + 1)
            except EtcdError as e:
                if self.state is not LinkState.UNREACHABLE:
                    logger.warning("etcd %s unreachable (%s): keeping the last view of %d "
                                   "instances, retrying every %g s", self.target, e,
                                   len(self.owned), RETRY_S)
                self._set(LinkState.UNREACHABLE, str(e))
            except Exception:  # noqa: BLE001 - the loop must survive anything
                logger.exception("discovery on %s failed; retrying", self.target)
                self._set(LinkState.UNREACHABLE, "internal error (see the log)")
            await asyncio.sleep(RETRY_S)

    @property
    def _instances_prefix(self) -> str:
        return f"{self.target.prefix}instances/"

    def _set(self, state: LinkState, error: str | None) -> None:
        if state is not self.state:
            self.since = time.time()
        self.state, self.last_error = state, error

    async def _watch(self, start: int) -> None:
        watch = asyncio.create_task(self._consume(start))
        try:
            while True:
                done, _ = await asyncio.wait({watch}, timeout=PROBE_S)
                if done:
                    watch.result()  # raises why it ended
                    return
                if not await self.client.healthy():
                    raise EtcdError(f"{self.target}: not answering", unreachable=True)
        finally:
            watch.cancel()
            await asyncio.wait({watch})

    async def _consume(self, start: int) -> None:
        async for events in self.client.watch_prefix(self._instances_prefix, start):
            self._apply(events)

    # ------------------------------------------------------------------ the view

    def _replace(self, kvs: list[KeyValue]) -> None:
        touched = set(self.owned) | set(self.by_url)
        self.cards, self.by_url, self.waiting = {}, {}, {}
        for kv in kvs:
            touched |= self._put(kv.key, kv.value, kv.mod_revision)
        self._reconcile(touched)

    def _apply(self, events: list[WatchEvent]) -> None:
        touched: set[str] = set()
        for ev in events:
            if ev.kind == "delete":
                touched |= self._drop(ev.key)
            else:
                touched |= self._put(ev.key, ev.value, ev.revision)
        self._reconcile(touched)

    def _drop(self, key: str) -> set[str]:
        """Forget the card under ``key``; the URL it named (to reconcile)."""
        entry = self.cards.pop(key, None)
        if entry is None:
            return set()
        url = entry.card.url
        of_url = self.by_url.get(url, {})
        of_url.pop(key, None)
        if not of_url:
            self.by_url.pop(url, None)
        return {url}

    def _put(self, key: str, value: bytes, revision: int) -> set[str]:
        touched = self._drop(key)
        try:
            card = decode(value)
            keys = self.pool.cfg.keys
            bad = (signature_problem(card, keys.card_key) if isinstance(keys, RouterKeys)
                   else "the router has no cluster secret to check its signature with")
            if bad is not None:
                raise CardError(bad)
        except CardError as e:
            if self._first_time(key, str(e)):
                self.log.warning("etcd key %s ignored: %s", key, e)
            return touched
        entry = _Entry(revision, card)
        self.cards[key] = entry
        self.by_url.setdefault(card.url, {})[key] = entry
        return touched | {card.url}

    def _reconcile(self, urls: set[str]) -> None:
        """Make the instances this link owns agree with the cards of ``urls``."""
        for url in sorted(urls):
            self._settle(url)
        while self.waiting and len(self.owned) < self.max_instances:
            url = next(iter(self.waiting))
            del self.waiting[url]
            self._settle(url)
        self.synced.set()

    def _usable(self, url: str) -> list[Card]:
        """The cards naming ``url`` whose role the router's mode uses, newest first."""
        entries = sorted(self.by_url.get(url, {}).values(), key=lambda e: -e.revision)
        usable = []
        for e in entries:
            if group_for(self.mode, e.card.role) is None:
                self._note_ignored(url, f"role {e.card.role} is not used by a --mode "
                                        f"{self.mode} router")
            else:
                usable.append(e.card)
        return usable

    def _settle(self, url: str) -> None:
        """One URL: the instance joins, leaves, or takes its new cards.

        Every card naming the URL with the instance's role stays with it, and the
        instance is in rotation while its /kv/info agrees with any one of them: a
        restarted instance's new card (its old one's lease still running) and a card
        someone else wrote for the URL (another engine id, side channel or role) sit
        beside each other, and the latter cannot take a working instance out of
        rotation (it is logged, once, as ignored)."""
        usable = self._usable(url)
        inst = self.owned.get(url)
        if inst is not None:
            same = tuple(c for c in usable if group_for(self.mode, c.role) == inst.role)
            if same:
                self._update(inst, same, usable)
                return
            del self.owned[url]
            self.pool.remove_instance(url)
            self.log.info("%s instance %s (%s) left the pool (its key is gone from %s)",
                          inst.role, url, inst.engine_id, self.target)
        self.waiting.pop(url, None)
        if not usable:
            return
        if self.pool.find(url) is not None:
            self._note_ignored(url, "it is on the command line already")
            return
        if len(self.owned) >= self.max_instances:
            self.waiting[url] = None
            self.log.warning("registered instance %s ignored: the router takes at most "
                             "%d discovered instances (--max-instances); %d card URL(s) "
                             "wait for a place", url, self.max_instances, len(self.waiting))
            return
        group = group_for(self.mode, usable[0].role)
        assert group is not None
        cards = tuple(c for c in usable if group_for(self.mode, c.role) == group)
        inst = self.pool.add_instance(InstanceSpec(url), group, cards=cards)
        self.owned[url] = inst
        self.log.info("%s instance %s (engine %s) joined from %s; checking it", group, url,
                      cards[0].engine_id, self.target)
        self.on_join(inst)

    def _update(self, inst: Instance, same: tuple[Card, ...], usable: list[Card]) -> None:
        for card in usable:
            if group_for(self.mode, card.role) != inst.role:
                self._note_ignored(inst.url, f"a card names it as role {card.role}, but it "
                                             f"is in the pool as {inst.role}")
        if same == inst.cards:
            return
        new = [c for c in same if c not in inst.cards]
        inst.cards = same
        if not new:
            return
        for card in new:
            bad = mismatch(card, inst.info) if inst.info is not None else None
            if bad is not None:
                self._note_ignored(inst.url, f"a card names it as engine {card.engine_id} "
                                             f"(side channel {card.side_channel}), but it "
                                             f"answers as engine {inst.engine_id}: kept as it "
                                             "is while it does")
            else:
                self.log.info("%s instance %s registered again (engine %s)", inst.role,
                              inst.url, card.engine_id)
        self.on_join(inst)

    def _note_ignored(self, url: str, why: str) -> None:
        if self._first_time(url, why):
            self.log.info("registered instance %s ignored: %s", url, why)

    def _first_time(self, what: str, why: str) -> bool:
        if (what, why) in self._ignored:
            return False
        if len(self._ignored) >= MAX_REMEMBERED:
            self._ignored.clear()
        self._ignored.add((what, why))
        return True
