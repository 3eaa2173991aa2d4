"""The router's configuration: plain data, parsed and checked once (no heavy imports).

Instances are :class:`~kvpush.discovery.instance_spec.InstanceSpec` (a base URL,
optionally with a KV identity for instances without ``/kv/info``), parsed by
:func:`kvpush.discovery.instance_spec.parse_instance`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from kvpush.crypto.auth import grant_key
from kvpush.crypto.curve import REQUEST_PLANE_PURPOSE, CurveKeys, derive_curve_keys
from kvpush.crypto.membership import card_key, member_view_token, proof_key
from kvpush.discovery.instance_spec import InstanceSpec
from kvpush.kv_cache.event_keys import EventKeys
from kvpush.server.member_view import member_header

if TYPE_CHECKING:
    from kvpush.discovery.target import EtcdTarget

Mode = Literal["push", "pull", "colocated"]
Policy = Literal["round-robin", "least-outstanding", "cache-aware"]
Role = Literal["prefill", "decode", "both"]

POLICIES: tuple[str, ...] = ("round-robin", "least-outstanding", "cache-aware")


@dataclass(frozen=True, repr=False)
class RouterKeys:
    """The router's share of the cluster secret: the grant key, the KV-event keys and
    the membership keys (to check cards and instances' proofs), nothing that lets it
    join the side channel (docs/SECURITY.md)."""

    grant_key: bytes
    events: EventKeys
    #: the request plane's CURVE keys (the router is a client of the engine cores')
    request_plane: CurveKeys
    proof_key: bytes
    card_key: bytes
    #: what opens an instance's member views (/kv/cache_blocks, /kv/info's block counts)
    member_view: str

    def __repr__(self) -> str:  # never show a key
        return "RouterKeys(...)"

    @classmethod
    def from_secret(cls, secret: bytes) -> RouterKeys:
        return cls(grant_key(secret), EventKeys.from_secret(secret),
                   derive_curve_keys(secret, REQUEST_PLANE_PURPOSE), proof_key(secret),
                   card_key(secret), member_view_token(secret))

    def member_header(self) -> dict[str, str]:
        """What the router sends an instance, beside its API key, for the member views
        (kvpush.server.member_view)."""
        return member_header(self.member_view)


class RouterConfigError(ValueError):
    """A configuration the router cannot run with (the CLI prints it and exits 2)."""


@dataclass(frozen=True)
class RouterConfig:
    """What ``kvpush router`` runs with: each value as its flag parsed and checked it
    (kvpush.router.cli); what no one flag can check is checked here."""

    mode: Mode
    prefill: tuple[InstanceSpec, ...]
    decode: tuple[InstanceSpec, ...]
    policy: Policy = "round-robin"
    fallback_local_prefill: bool = False
    #: seconds between health checks of every instance
    health_interval_s: float = 2.0
    #: bound of each health-check answer (/health, /kv/prove, /kv/info), read whole
    health_timeout_s: float = 2.0
    #: health checks in a row that may time out before an instance in rotation leaves
    #: it (a busy instance answers late; a refused connection or a bad answer takes it
    #: out at once). Never the last instance of a role for timeouts alone, and never one
    #: whose engine core link is up
    slow_checks_tolerated: int = 3
    #: times a request may move to another decode instance after losing its own
    #: (kvpush.router.life; 0: never, the client gets the error)
    migration_limit: int = 3
    #: how long start-up waits for the instances to answer
    startup_timeout_s: float = 60.0
    #: bound of connecting to an instance
    connect_timeout_s: float = 5.0
    #: bound of each read of an answer that has started (a stream's chunks): a stream
    #: silent for this long is ended with an error
    request_timeout_s: float = 60.0
    #: bound of the wait for an answer to start (a prefill leg, decode's token #1, a
    #: whole answer); a dead or frozen instance's legs end sooner, at its first failed
    #: health check (kvpush.router.watch)
    first_byte_timeout_s: float = 600.0
    #: requests held at once (arrival to the end of every leg); more get a 429. 512
    #: requests of two legs each fit the 1024 connections without waiting for one
    max_outstanding_requests: int = 512
    #: connections to all instances together (HTTP/1.1 keep-alive pool)
    max_connections: int = 1024
    #: a client's request line and headers must be complete within this many seconds
    #: of the connection opening (or of a later request's first byte): kvpush.server.door
    header_timeout_s: float = 10.0
    #: a client's body must be complete within this many seconds of its headers (408)
    body_timeout_s: float = 30.0
    #: client connections open at once; more are answered 503 and closed at once
    max_client_connections: int = 4096
    #: largest answer of an instance read whole (non-streaming, an error, a prefill
    #: leg's): past it the router stops reading and answers 502 (router/wire.py)
    max_answer_bytes: int = 32 << 20
    #: largest SSE frame of decode's stream held while its end has not come: past it the
    #: stream ends with an error frame (kvpush and vLLM frames are a few KiB)
    max_frame_bytes: int = 4 << 20
    #: clients must send ``Authorization: Bearer <api_key>``, and the router sends it to
    #: every instance (None: no key); never shown in reprs or logs
    api_key: str | None = field(default=None, repr=False)
    #: the operator views (/router/instances, /metrics) need this key instead of the API
    #: key (None: they take the API key; router/admin_key.py); never shown
    admin_key: str | None = field(default=None, repr=False)
    #: the cluster secret (the instances' side-channel secret): the router signs the
    #: kv_transfer_params of every leg with it (None: unsigned, for instances started
    #: with --insecure-kv-params); never shown in reprs or logs. Given as bytes, it is
    #: replaced at once by the keys derived from it (RouterKeys): the router keeps no
    #: raw secret, so it cannot join the side channel
    kv_secret: bytes | RouterKeys | None = field(default=None, repr=False)
    #: cache-aware: the tokenizer to load (None: the one of the instances' model, from
    #: their /v1/models)
    tokenizer: str | None = None
    #: cache-aware: decode computes the prompt itself (no prefill leg) when it lacks at
    #: most this many of its tokens (kvpush.router.decide)
    local_prefill_max_tokens: int = 128
    #: cache-aware: what one leg in flight on an instance weighs, in prompt tokens
    load_cost_tokens: int = 64
    #: cache-aware: what one KV token of a decode leg in flight on an instance weighs,
    #: in prompt tokens (kvpush.router.decide)
    load_weight: float = 1.0
    #: --discover: the etcd prefix instances register under (a
    #: kvpush.discovery.target.EtcdTarget; None: the static lists only)
    discover: EtcdTarget | None = None
    #: --discover: discovered instances taken at most; cards beyond are ignored (logged
    #: at a bounded rate) until places free up
    max_instances: int = 256

    def __post_init__(self) -> None:
        if not self.decode and self.discover is None:
            raise RouterConfigError("at least one decode instance is required (--decode URL)")
        if self.mode == "colocated":
            if self.prefill:
                raise RouterConfigError(
                    "--mode colocated forwards requests as they are to the --decode "
                    "instances (role=both); it takes no --prefill instances")
            if self.fallback_local_prefill:
                raise RouterConfigError("--fallback-local-prefill needs --mode push or pull")
        elif not self.prefill and self.discover is None:
            raise RouterConfigError(
                f"--mode {self.mode} needs at least one prefill instance (--prefill URL)")
        urls = [s.url for s in self.prefill + self.decode]
        dup = sorted({u for u in urls if urls.count(u) > 1})
        if dup:
            raise RouterConfigError(f"instance listed twice: {', '.join(dup)}")
        if isinstance(self.kv_secret, bytes):
            if len(self.kv_secret) < 16:
                raise RouterConfigError("the cluster secret must be at least 16 bytes "
                                        "(--kv-secret-file / KVPUSH_KV_SECRET)")
            object.__setattr__(self, "kv_secret", RouterKeys.from_secret(self.kv_secret))
        if self.discover is not None and self.kv_secret is None:
            raise RouterConfigError(
                "--discover needs the cluster secret (--kv-secret-file or KVPUSH_KV_SECRET): "
                "cards in etcd are signed with it, and instances prove they hold it before "
                "they get traffic")

    @property
    def keys(self) -> RouterKeys | None:
        """The keys derived from the cluster secret (None: the router has none)."""
        assert not isinstance(self.kv_secret, bytes)  # (replaced in __post_init__)
        return self.kv_secret

    @property
    def needs_prefill(self) -> bool:
        """Whether the router cannot serve without a healthy prefill instance."""
        return self.mode != "colocated" and not self.fallback_local_prefill
