"""`kvpush bench`: benchmark an OpenAI-compatible server the way `vllm bench serve` does.

Only argparse is imported at module level: `kvpush --help` builds this parser and must
stay fast.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import Counter
from typing import Any

from kvpush import cli_types
from kvpush.bench.args import DATASET_CHOICES, add_multi_turn_args, multi_turn_kwargs

PROG = "kvpush bench"


def _rate(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number or 'inf': {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be positive (or inf), got {text}")
    return v


def _percentiles(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of numbers: {text!r}"
                                         ) from None
    if not values or any(not 0 <= v <= 100 for v in values):
        raise argparse.ArgumentTypeError(f"percentiles must be numbers in 0..100: {text!r}")
    return values


def _url(text: str) -> str:
    url = text.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    if not url.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"not an http(s) URL: {text!r}")
    if url.endswith("/v1"):
        url = url[:-3]
    return url


#: vLLM's --endpoint paths, by the kvpush --endpoint they mean
ENDPOINT_PATHS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


def _endpoint(text: str) -> str:
    return ENDPOINT_PATHS.get(text.strip().rstrip("/"), text)


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the `bench` sub-command on ``subparsers`` (from add_subparsers); returns
    its parser. ``--url`` is checked by the command, not by argparse, so that sub-commands
    added to this parser later need not take it."""
    p = subparsers.add_parser(
        "bench",
        help="benchmark an OpenAI-compatible server (TTFT, TPOT, ITL; vLLM's result format)",
        description=(
            "Send NUM_PROMPTS streaming requests of exactly INPUT_LEN prompt tokens (under "
            "the served model's tokenizer) and OUTPUT_LEN output tokens (ignore_eos, "
            "temperature 0) with Poisson arrivals at REQUEST_RATE, measure TTFT, TPOT, ITL "
            "and end-to-end latency on the client, print vLLM's result table and write "
            "vLLM's result JSON. Works against kvpush serve, the kvpush router and vLLM. "
            "A keyed endpoint gets $OPENAI_API_KEY, else $KVPUSH_API_KEY, as a bearer "
            "token."),
        epilog=(
            "Exit status: 0 when every request completed, 1 when any failed (the JSON is "
            "still written, with each error), 2 for bad settings. Example: kvpush bench "
            "--url http://127.0.0.1:8000 --dataset sonnet --input-len 2048 --output-len 128 "
            "--num-prompts 100 --request-rate 2 --out rate2.json"),
    )
    p.add_argument("--url", "--base-url", type=_url, metavar="URL",
                   help="the server, e.g. http://127.0.0.1:8000 (required; --base-url is "
                        "vLLM's name)")
    p.add_argument("--model", metavar="NAME",
                   help="served model name (default: the first one in GET /v1/models)")
    p.add_argument("--endpoint", choices=("completions", "chat"), type=_endpoint,
                   help="completions (/v1/completions) or chat (/v1/chat/completions; "
                        "vLLM's paths are taken too) (default: completions; chat for "
                        "--dataset multi-turn)")
    p.add_argument("--tokenizer", metavar="DIR_OR_MODEL",
                   help="tokenizer folder or kvpush model name (default: --model if it is "
                        "local, else the model root the server lists, if it is local)")
    d = p.add_argument_group("workload")
    d.add_argument("--dataset", "--dataset-name", choices=DATASET_CHOICES, default="random",
                   help="prompt source; multi-turn: conversations (see below) (default: "
                        "random)")
    d.add_argument("--input-len", "--random-input-len", type=cli_types.positive_int,
                   default=1024, metavar="TOKENS",
                   help="prompt tokens per request, exactly (default: 1024)")
    d.add_argument("--input-len-spread", type=float, default=0.0, metavar="FRACTION",
                   help="random data set: each prompt's length drawn uniformly from "
                        "input-len x [1 - F, 1 + F] (vLLM's --random-range-ratio, prompts "
                        "only; default: 0, exactly input-len)")
    d.add_argument("--output-len", "--random-output-len", type=cli_types.positive_int,
                   default=128, metavar="TOKENS",
                   help="output tokens per request (max_tokens, ignore_eos; default: 128)")
    d.add_argument("--prefix-len", type=cli_types.positive_int, metavar="TOKENS",
                   help="shared leading tokens: shared-prefix (default: input-len / 2); "
                        "sonnet: whole lines up to about this many (default: 200 or "
                        "input-len / 2)")
    d.add_argument("--prompt-type", choices=("auto", "text", "token-ids"), default="auto",
                   help="auto: token ids for random and shared-prefix on completions, else "
                        "text (default: auto)")
    d.add_argument("--num-prompts", type=cli_types.positive_int, default=100, metavar="N",
                   help="requests to send (default: 100)")
    d.add_argument("--seed", type=int, default=0, help="prompts and arrivals (default: 0)")
    load = p.add_argument_group("load and limits")
    load.add_argument("--request-rate", type=_rate, default=math.inf, metavar="RPS",
                      help="Poisson arrivals per second; inf sends all at once (default: inf)")
    load.add_argument("--max-concurrency", type=cli_types.positive_int, metavar="N",
                      help="most requests in flight at once (default: no limit)")
    load.add_argument("--timeout", type=cli_types.seconds, default=3600.0, metavar="SECONDS",
                      help="whole-run limit; requests still out then fail (default: 3600)")
    load.add_argument("--request-timeout", type=cli_types.seconds, default=600.0, metavar="SECONDS",
                      help="per-request limit (default: 600)")
    add_multi_turn_args(p)
    out = p.add_argument_group("output")
    out.add_argument("--out", metavar="FILE", help="write the result JSON here")
    out.add_argument("--save-result", action="store_true",
                     help="vLLM's: write the result JSON to --result-dir/--result-filename "
                          "(implied by either of them; default: off unless --out)")
    out.add_argument("--result-dir", metavar="DIR",
                     help="vLLM's: folder for the result JSON (default: the current one)")
    out.add_argument("--result-filename", metavar="NAME",
                     help="vLLM's: the result JSON's file name (default: "
                          "kvpush-<rate>qps[-concurrency<N>]-<model>-<date-time>.json)")
    out.add_argument("--label", help="a name for this run, stored in the JSON")
    out.add_argument("--percentiles", "--metric-percentiles", type=_percentiles,
                     default=(90.0, 99.0), metavar="LIST",
                     help="percentiles to report, comma-separated (default: 90,99)")
    out.add_argument("--no-progress", dest="progress", action="store_false",
                     help="no progress bar")
    cli_types.refuse_vllm_flags(p, cli_types.VLLM_BENCH_NOT_TAKEN)
    p.set_defaults(func=run_bench, _bench_parser=p)
    from kvpush.bench.compare import add_compare_parser
    from kvpush.bench.handoff import add_handoff_parser

    sub = p.add_subparsers(title="sub-commands", metavar="{compare,handoff}")
    add_compare_parser(sub)
    add_handoff_parser(sub)
    return p


def _error(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def _error_summary(errors: list[str], limit: int = 5) -> list[str]:
    counts = Counter(e[:300] for e in errors if e)
    lines = [f"  {n} x {msg}" for msg, n in counts.most_common(limit)]
    if len(counts) > limit:
        lines.append(f"  ... and {len(counts) - limit} other error(s)")
    return lines


def _wants_result_file(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "save_result", False) or getattr(args, "result_dir", None)
                or getattr(args, "result_filename", None))


def result_path(args: argparse.Namespace, result: dict[str, Any],
                now: float | None = None) -> str | None:
    """Where the result JSON goes: --out, else (vLLM's way) --result-dir/--result-filename
    with vLLM's kind of default name, else nowhere."""
    import time
    from pathlib import Path

    if args.out:
        return str(args.out)
    if not _wants_result_file(args):
        return None
    name = args.result_filename
    if not name:
        rate = result.get("request_rate", "inf")
        conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
        model = str(result.get("model_id") or "model").rstrip("/").split("/")[-1]
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
        name = f"kvpush-{rate}qps{conc}-{model}-{stamp}.json"
    return str(Path(args.result_dir or ".") / name)


def run_bench(args: argparse.Namespace) -> int:
    if args.url is None:
        return _error("--url is required (or vLLM's --base-url: the server, e.g. "
                      "http://127.0.0.1:8000)")
    if args.out and _wants_result_file(args):
        return _error("--out FILE, or --save-result/--result-dir/--result-filename: "
                      "not both")
    from kvpush.bench.client import run_benchmark
    from kvpush.bench.datasets import DatasetError
    from kvpush.bench.settings import BenchConfig, BenchError

    endpoint = args.endpoint or ("chat" if args.dataset == "multi-turn" else "completions")
    config = BenchConfig(
        url=args.url, model=args.model, dataset=args.dataset, input_len=args.input_len,
        input_len_spread=args.input_len_spread,
        output_len=args.output_len, num_prompts=args.num_prompts,
        request_rate=args.request_rate, max_concurrency=args.max_concurrency,
        seed=args.seed, endpoint=endpoint, **multi_turn_kwargs(args),
        prefix_len=args.prefix_len,
        tokenizer=args.tokenizer, prompt_type=args.prompt_type, timeout=args.timeout,
        request_timeout=args.request_timeout, percentiles=args.percentiles,
        label=args.label, progress=args.progress)
    try:
        result = run_benchmark(config)
    except (BenchError, DatasetError) as e:
        return _error(str(e))
    print(result.table())
    if result.failed:
        print(f"{result.failed} request(s) failed:")
        print("\n".join(_error_summary([r.error for r in result.outputs])))
    for w in result.warnings:
        print(f"warning: {w}", file=sys.stderr)
    out = result_path(args, result.to_dict())
    if out:
        path = result.save(out)
        print(f"result written to {path}")
    return 1 if result.failed else 0
