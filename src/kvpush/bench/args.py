"""The flags `kvpush bench` and its sub-commands (`bench compare`) share: the data set
choices and the multi-turn data set's flags. Only argparse is imported: `kvpush --help`
builds these parsers and must stay fast."""

from __future__ import annotations

import argparse
import math
from typing import Any

from kvpush import cli_types

#: every --dataset (conversations.MULTI_TURN last; not imported: this module stays light)
DATASET_CHOICES = ("random", "sonnet", "shared-prefix", "multi-turn")


def _think_time(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not (v >= 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"must be >= 0 seconds, got {text}")
    return v


def add_multi_turn_args(parser: Any) -> None:
    """The multi-turn data set's flags, on ``parser`` (an argument group): the same for
    `kvpush bench` and `kvpush bench compare`."""
    g = parser.add_argument_group(
        "multi-turn data set (--dataset multi-turn, on the chat endpoint; --output-len is "
        "each answer's length, --request-rate conversations started per second, and "
        "kvpush bench's --max-concurrency bounds the conversations in progress)")
    g.add_argument("--num-conversations", type=cli_types.positive_int, default=6,
                   metavar="N", help="conversations (default: 6)")
    g.add_argument("--turns", type=cli_types.positive_int, default=4, metavar="N",
                   help="questions per conversation; each turn resends the history with "
                        "the server's answers (default: 4)")
    g.add_argument("--system-prompt-len", type=cli_types.non_negative_int, default=120,
                   metavar="TOKENS",
                   help="tokens of the system prompt every conversation shares; 0: none "
                        "(default: 120)")
    g.add_argument("--question-len", type=cli_types.positive_int, default=40,
                   metavar="TOKENS", help="tokens of each question (default: 40)")
    g.add_argument("--think-time", type=_think_time, default=0.0, metavar="SECONDS",
                   help="pause between an answer's end and the next question (default: 0)")
    g.add_argument("--think-time-dist", choices=("exponential", "fixed"),
                   default="exponential",
                   help="exponential: each pause drawn with mean --think-time (from "
                        "--seed); fixed: exactly --think-time (default: exponential)")


def multi_turn_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The multi-turn flags as BenchConfig / CompareConfig keyword arguments."""
    return {name: getattr(args, name) for name in (
        "num_conversations", "turns", "system_prompt_len", "question_len", "think_time",
        "think_time_dist")}
