"""``python -m kvpush_testing.serve (--die-when PATH | --faults JSON) MODEL_DIR [kvpush
serve options]``: kvpush's own ``serve``, whose engine core gets test links. With
``--die-when`` they kill its KV transfer thread on cue: the thread's side channel raises
from ``recv`` (called on every pass of its loop) once ``PATH`` exists, as a bug would.
With ``--faults`` (FaultPlan knobs as JSON, e.g. ``{"fail_posts": 1}``) NIXL and the
side channel misbehave as the plan says (``links.FaultyNixlLinks``). Tests see what a
real instance does then (a dead transfer thread: the engine core exits, the API process
fails its streams and exits 1) and what its peers do.

Nothing of this is in ``kvpush``: the links reach the engine core the way any caller's
do (``CoreClient.launch(links=...)``, pickled with its config; so the engine core runs
in its own process, serve's default). ``DyingLinks`` serves in-process engines too
(``LLMEngine(config, links=DyingLinks(path, InProcLinks()))``).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

from kvpush.kv_transfer.links import NixlLinks, TransferLinks
from kvpush.kv_transfer.transports.transport import KVTransport

#: what the dying channel raises (tests look for it in logs and errors)
CRASH = "injected crash of the KV transfer thread"


class DyingChannel:
    """A side channel whose ``recv`` raises once ``when`` (a path) exists; everything
    else is the wrapped channel's."""

    def __init__(self, channel, when: str) -> None:
        self._channel, self._when = channel, when

    def recv(self, timeout_ms: int) -> list[tuple[str, bytes]]:
        if os.path.exists(self._when):
            raise RuntimeError(f"{CRASH} ({self._when} exists)")
        return self._channel.recv(timeout_ms)

    def __getattr__(self, name: str):
        return getattr(self._channel, name)


@dataclass(frozen=True, eq=False)
class DyingLinks:
    """``inner``'s links (default NIXL's), the side channel a ``DyingChannel``."""

    when: str
    inner: TransferLinks = field(default_factory=NixlLinks)

    def transport(self, engine_id: str) -> KVTransport:
        return self.inner.transport(engine_id)

    def channel(self, host: str, port: int, secret: bytes | None):
        return DyingChannel(self.inner.channel(host, port, secret), self.when)


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in ("--die-when", "--faults"):
        print("usage: python -m kvpush_testing.serve (--die-when PATH | --faults JSON) "
              "MODEL_DIR [kvpush serve options]", file=sys.stderr)
        return 2
    # (by their module's names, not __main__'s: the engine core unpickles them)
    if argv[0] == "--die-when":
        from kvpush_testing.serve import DyingLinks

        links: TransferLinks = DyingLinks(os.path.abspath(argv[1]))
    else:  # FaultPlan knobs, e.g. {"fail_posts": 1}: NIXL and the side channel misbehave
        import json

        from kvpush_testing.links import FaultyNixlLinks

        links = FaultyNixlLinks(json.loads(argv[1]))
    from kvpush.cli import main as kvpush_main
    from kvpush.engine.core_client import CoreClient

    launch = CoreClient.launch.__func__

    def launch_with_links(cls, config, *args, **kw):
        return launch(cls, config, *args, **{**kw, "links": links})

    CoreClient.launch = classmethod(launch_with_links)  # this process only
    return kvpush_main(["serve", *argv[2:]])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
