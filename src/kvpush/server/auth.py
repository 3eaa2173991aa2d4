"""Optional API key for the HTTP fronts (``kvpush serve``, ``kvpush router``).

OpenAI style: clients send ``Authorization: Bearer KEY``. A missing or wrong key is a
401 with an OpenAI error body (``type: authentication_error``, ``code:
invalid_api_key``); keys are compared in constant time (``hmac.compare_digest``) and
never logged. ``/health`` stays open (load balancers and ``kvpush up`` probe it);
everything else, ``/metrics``, ``/kv/*`` and the OpenAPI pages included, needs the key
(Prometheus sends it with ``authorization: {credentials: KEY}``).

The check is a plain ASGI middleware (not Starlette's BaseHTTPMiddleware, which would
buffer streams and hide client disconnects from the handlers).
"""

from __future__ import annotations

import hmac
import json
import os
from collections.abc import Callable, Mapping

from starlette.types import ASGIApp, Receive, Scope, Send

#: Environment variable read when --api-key is not given.
API_KEY_ENV = "KVPUSH_API_KEY"

#: Paths served without the key (/kv/prove: a router sends its key to an instance only
#: once the instance has proved it holds the cluster secret, kvpush.server.prove).
OPEN_PATHS = frozenset({"/health", "/kv/prove"})

#: Reasons a request is refused (label of the rejection counters).
REJECT_REASONS = ("missing", "invalid")


def resolve_api_key(flag: str | None, env: Mapping[str, str] | None = None) -> str | None:
    """The key from ``--api-key`` or else ``$KVPUSH_API_KEY``; None (no auth) if neither
    is set or the value is empty."""
    environ: Mapping[str, str] = os.environ if env is None else env
    key = flag if flag is not None else environ.get(API_KEY_ENV)
    if key is None:
        return None
    key = key.strip()
    return key or None


def auth_header(key: str | None) -> dict[str, str]:
    """The header a client (the router, ``kvpush up``) sends to an instance."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def unauthorized_body(message: str) -> dict:
    return {"error": {"message": message, "type": "authentication_error",
                      "param": None, "code": "invalid_api_key"}}


def check_bearer(header: bytes | None, key: bytes) -> str | None:
    """None if ``header`` (the raw Authorization value) carries ``key``; else the reason
    (``missing`` or ``invalid``). Constant time in the key's content."""
    if not header:
        return "missing"
    scheme, _, token = header.partition(b" ")
    if scheme.lower() != b"bearer":
        return "invalid"
    # compare_digest on bytes of any length: time depends on length only
    return None if hmac.compare_digest(token.strip(), key) else "invalid"


class APIKeyMiddleware:
    """Refuse HTTP requests without ``Authorization: Bearer <key>`` (see module docs).

    ``on_reject(reason)`` is called once per refused request (for /metrics).
    """

    def __init__(self, app: ASGIApp, key: str,
                 on_reject: Callable[[str], None] | None = None,
                 open_paths: frozenset[str] = OPEN_PATHS) -> None:
        self.app = app
        self.key = key.encode()
        self.on_reject = on_reject
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in self.open_paths:
            await self.app(scope, receive, send)
            return
        header = None
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                header = value
                break
        reason = check_bearer(header, self.key)
        if reason is None:
            await self.app(scope, receive, send)
            return
        if self.on_reject is not None:
            self.on_reject(reason)
        message = ("missing API key: send the header 'Authorization: Bearer <key>'"
                   if reason == "missing" else "invalid API key")
        body = json.dumps(unauthorized_body(message)).encode()
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b'Bearer realm="kvpush"'),
        ]})
        await send({"type": "http.response.body", "body": body})


# ---- the side-channel secret (kvpush serve, kvpush up) ------------------------------

#: Environment variable holding the side-channel secret itself.
KV_SECRET_ENV = "KVPUSH_KV_SECRET"


class SecretError(ValueError):
    """The side-channel secret could not be read (the CLI prints it, exit 2)."""


def resolve_kv_secret(path: str | None, env: Mapping[str, str] | None = None,
                      allow_loose: bool = False) -> tuple[bytes | None, str | None]:
    """(secret, warning) from ``--kv-secret-file PATH`` or else ``$KVPUSH_KV_SECRET``.

    The file's content is the secret (surrounding whitespace stripped). A file that
    group or others can read (or write) is refused (SecretError), unless
    ``allow_loose`` (``--allow-loose-secret-file``): then ``warning`` says so. No
    secret: (None, None).
    """
    environ: Mapping[str, str] = os.environ if env is None else env
    if path is not None:
        try:
            st = os.stat(path)
            with open(path, "rb") as f:
                secret = f.read().strip()
        except OSError as e:
            raise SecretError(f"cannot read --kv-secret-file {path}: {e.strerror}") from None
        if not secret:
            raise SecretError(f"--kv-secret-file {path} is empty")
        warning = None
        if st.st_mode & 0o077:
            warning = (f"--kv-secret-file {path} is readable by other users "
                       f"(mode {st.st_mode & 0o777:o}); chmod 600 it")
            if not allow_loose:
                raise SecretError(f"{warning} (or pass --allow-loose-secret-file)")
        return secret, warning
    value = environ.get(KV_SECRET_ENV, "").strip()
    return (value.encode() if value else None), None


def write_kv_secret(path: str, force: bool = False) -> None:
    """Write a fresh random cluster secret (256 bits, hex) to ``path``, readable by its
    owner only (``kvpush make-secret``). OSError if it exists (unless ``force``)."""
    import secrets

    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if force else os.O_EXCL)
    fd = os.open(path, flags, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(secrets.token_hex(32) + "\n")


def add_make_secret_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "make-secret", help="write a random cluster secret to a file",
        description="Write a fresh random cluster secret (256 bits) to PATH, mode 600. "
                    "Give the same file to every `kvpush serve --role prefill/decode` and "
                    "to `kvpush router` (--kv-secret-file PATH): it signs side-channel "
                    "messages and the router's kv_transfer_params. Copy it to other hosts "
                    "over a channel you trust (scp, a secrets manager).")
    p.add_argument("path", metavar="PATH", help="file to create")
    p.add_argument("--force", action="store_true", help="overwrite PATH if it exists")
    p.set_defaults(func=_run_make_secret)


def _run_make_secret(args) -> int:
    import sys

    try:
        write_kv_secret(args.path, args.force)
    except FileExistsError:
        print(f"kvpush make-secret: error: {args.path} exists (--force overwrites it)",
              file=sys.stderr)
        return 2
    except OSError as e:
        print(f"kvpush make-secret: error: cannot write {args.path}: {e.strerror}",
              file=sys.stderr)
        return 2
    print(f"wrote a new cluster secret to {args.path} (mode 600)")
    return 0
