"""`kvpush` command line: one entry point, a sub-command per job.

Sub-commands live with the package they drive and are imported lazily, so
`kvpush --help` answers without importing torch.
"""

from __future__ import annotations

import argparse
import sys

from kvpush import __version__
from kvpush.cli_types import Parser


def build_parser() -> argparse.ArgumentParser:
    """Every sub-command's parser is a :class:`kvpush.cli_types.Parser` (through
    ``add_subparsers``): no abbreviations, unknown flags reported by their sub-command."""
    parser = Parser(
        prog="kvpush",
        description=(
            "kvpush: prefill/decode-disaggregated LLM serving whose KV cache moves by "
            "push. Start with `kvpush up` (a prefill and a decode instance of the default "
            "model and the router, on this host), or `kvpush serve MODEL` for one plain "
            "instance."
        ),
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    # in the README's order: what a first session runs first
    from kvpush.cluster.cli import add_up_parser; add_up_parser(sub)  # noqa: E702, I001
    from kvpush.server.cli import add_serve_parser; add_serve_parser(sub)  # noqa: E702, I001
    from kvpush.router.cli import add_router_parser; add_router_parser(sub)  # noqa: E702, I001
    from kvpush.bench.cli import add_bench_parser; add_bench_parser(sub)  # noqa: E702, I001
    from kvpush.models.cli import add_models_parser; add_models_parser(sub)  # noqa: E702, I001
    from kvpush.sim.cli import add_simulate_parser; add_simulate_parser(sub)  # noqa: E702, I001
    from kvpush.server.auth import add_make_secret_parser; add_make_secret_parser(sub)  # noqa: E702, I001
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
