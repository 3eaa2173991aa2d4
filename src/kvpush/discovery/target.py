"""Where the membership lives: ``etcd://HOST:PORT/PREFIX``, and how to log in.

Credentials come from flags or the environment, never from the URL (a URL is logged and
shows in ``ps``): ``--etcd-user`` / ``$KVPUSH_ETCD_USER``, the password from
``--etcd-password-file`` / ``$KVPUSH_ETCD_PASSWORD_FILE`` (or ``$KVPUSH_ETCD_PASSWORD``),
TLS from ``--etcd-ca`` / ``--etcd-cert`` / ``--etcd-key`` (``$KVPUSH_ETCD_CA`` ...). With
a CA or client certificate the client speaks https. The password is kept out of reprs.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

ENV_USER = "KVPUSH_ETCD_USER"
ENV_PASSWORD = "KVPUSH_ETCD_PASSWORD"
ENV_PASSWORD_FILE = "KVPUSH_ETCD_PASSWORD_FILE"
ENV_CA, ENV_CERT, ENV_KEY = "KVPUSH_ETCD_CA", "KVPUSH_ETCD_CERT", "KVPUSH_ETCD_KEY"


class TargetError(ValueError):
    """An etcd address or credential the CLI cannot use (printed, exit 2)."""


@dataclass(frozen=True)
class EtcdAuth:
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    @property
    def tls(self) -> bool:
        return bool(self.ca_file or self.cert_file)


@dataclass(frozen=True)
class EtcdTarget:
    host: str
    port: int
    #: the membership prefix, "/" at both ends ("/kvpush/" by default)
    prefix: str
    auth: EtcdAuth = EtcdAuth()

    @property
    def endpoint(self) -> str:
        scheme = "https" if self.auth.tls else "http"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{host}:{self.port}"

    def __str__(self) -> str:  # what logs show: no credentials
        return f"etcd://{self.host}:{self.port}{self.prefix}"


def parse_target(text: str, auth: EtcdAuth = EtcdAuth()) -> EtcdTarget:
    """``etcd://HOST:PORT/PREFIX`` (PREFIX default ``kvpush``)."""
    u = urlsplit(text.strip())
    if u.scheme != "etcd":
        raise TargetError(f"{text!r}: expected etcd://HOST:PORT/PREFIX")
    if u.username or u.password:
        raise TargetError("etcd credentials do not go in the URL (it is logged): use "
                          "--etcd-user and --etcd-password-file, or $KVPUSH_ETCD_USER and "
                          "$KVPUSH_ETCD_PASSWORD_FILE")
    try:
        port = u.port
    except ValueError:
        raise TargetError(f"{text!r}: invalid port") from None
    if not u.hostname or port is None:
        raise TargetError(f"{text!r}: expected etcd://HOST:PORT/PREFIX")
    if u.query or u.fragment:
        raise TargetError(f"{text!r}: no query or fragment allowed")
    prefix = u.path.strip("/") or "kvpush"
    return EtcdTarget(u.hostname, port, f"/{prefix}/", auth)


def add_etcd_auth_args(group: argparse._ArgumentGroup) -> None:
    """The credential flags shared by `serve --register`, `router --discover`, `up`."""
    group.add_argument("--etcd-user", metavar="USER",
                       help=f"etcd user (default: ${ENV_USER}; unset: no auth)")
    group.add_argument("--etcd-password-file", metavar="PATH",
                       help=f"file holding the etcd user's password (default: "
                            f"${ENV_PASSWORD_FILE}, else ${ENV_PASSWORD})")
    group.add_argument("--etcd-ca", metavar="PATH",
                       help=f"CA bundle of etcd's server certificate: speak https "
                            f"(default: ${ENV_CA})")
    group.add_argument("--etcd-cert", metavar="PATH",
                       help=f"client certificate for etcd (default: ${ENV_CERT})")
    group.add_argument("--etcd-key", metavar="PATH",
                       help=f"the client certificate's key (default: ${ENV_KEY})")


def _readable(path: str, what: str) -> str:
    if not Path(path).is_file():
        raise TargetError(f"{what} {path!r}: no such file")
    return path


def resolve_auth(args: argparse.Namespace, env: dict[str, str] | None = None) -> EtcdAuth:
    """The credentials from the flags of :func:`add_etcd_auth_args`, else the
    environment (raises TargetError)."""
    env = dict(os.environ) if env is None else env
    user = getattr(args, "etcd_user", None) or env.get(ENV_USER) or None
    pw_file = getattr(args, "etcd_password_file", None) or env.get(ENV_PASSWORD_FILE)
    password = None
    if pw_file:
        try:
            password = Path(pw_file).read_text().strip()
        except OSError as e:
            raise TargetError(f"cannot read the etcd password file {pw_file!r}: "
                              f"{e.strerror or e}") from None
        if not password:
            raise TargetError(f"the etcd password file {pw_file!r} is empty")
    elif env.get(ENV_PASSWORD):
        password = env[ENV_PASSWORD]
    if password and not user:
        raise TargetError(f"an etcd password without a user: give --etcd-user (or ${ENV_USER})")
    if user and not password:
        raise TargetError(f"etcd user {user!r} without a password: give --etcd-password-file "
                          f"(or ${ENV_PASSWORD_FILE})")
    ca = getattr(args, "etcd_ca", None) or env.get(ENV_CA)
    cert = getattr(args, "etcd_cert", None) or env.get(ENV_CERT)
    key = getattr(args, "etcd_key", None) or env.get(ENV_KEY)
    if bool(cert) != bool(key):
        raise TargetError("--etcd-cert and --etcd-key go together")
    return EtcdAuth(user=user, password=password,
                    ca_file=_readable(ca, "--etcd-ca") if ca else None,
                    cert_file=_readable(cert, "--etcd-cert") if cert else None,
                    key_file=_readable(key, "--etcd-key") if key else None)
