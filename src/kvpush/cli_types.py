"""argparse pieces shared by every `kvpush` sub-command (torch-free, import-cheap): the
parser class (no abbreviations; an unknown flag is reported by its own sub-command, with
a "did you mean"), the refusal of vLLM flags kvpush does not take, and value types."""

from __future__ import annotations

import argparse
import difflib
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn


class Parser(argparse.ArgumentParser):
    """kvpush's argument parser, and (through ``add_subparsers``) every sub-command's.

    * No abbreviations: ``--prefil`` is not ``--prefill`` (``allow_abbrev=False``).
    * An unknown flag is an error of the sub-command it was given to: that sub-command's
      usage, the flag, and the closest of its own flags ("did you mean"), exit status 2.
      Also when the unknown flag made another error (its value taken for a positional).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self._parsing: list[str] = []
        self._tail_dest: str | None = None
        self._unknown_hint: Callable[[str], str | None] | None = None

    def keep_tail(self, dest: str, unknown_hint: Callable[[str], str | None]) -> None:
        """Keep what follows the first ``--``, unparsed, as ``dest`` (a list; `kvpush up
        ... -- <serve flags>`), and say ``unknown_hint(flag)`` of an unknown flag instead
        of a "did you mean" (when it says something)."""
        self._tail_dest = dest
        self._unknown_hint = unknown_hint

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None,
                         ) -> tuple[argparse.Namespace, list[str]]:
        # A sub-command's parser is called with parse_known_args by its parent, which
        # would report what is left over under the top-level usage: report it here.
        self._parsing = list(sys.argv[1:] if args is None else args)
        tail: list[str] = []
        if self._tail_dest is not None and "--" in self._parsing:
            cut = self._parsing.index("--")
            self._parsing, tail = self._parsing[:cut], self._parsing[cut + 1:]
        namespace, extras = super().parse_known_args(self._parsing, namespace)
        if extras:
            self.error(unrecognized_message(self, extras))
        if self._tail_dest is not None:
            setattr(namespace, self._tail_dest, tail)
        return namespace, extras

    def error(self, message: str) -> NoReturn:
        if not message.startswith("unrecognized arguments"):
            unknown = unknown_flags(self, self._parsing)
            if unknown:  # the unknown flag is the cause (e.g. its value read as a command)
                message = unrecognized_message(self, unknown)
        super().error(message)


def _visible_flags(parser: argparse.ArgumentParser) -> list[str]:
    return [s for a in parser._actions if a.help is not argparse.SUPPRESS
            for s in a.option_strings]


def did_you_mean(parser: argparse.ArgumentParser, flag: str) -> str | None:
    """The flag of ``parser`` closest to the unknown ``flag`` (difflib), or None."""
    close = difflib.get_close_matches(flag, _visible_flags(parser), n=1, cutoff=0.6)
    return close[0] if close else None


def unknown_flags(parser: argparse.ArgumentParser, args: Sequence[str]) -> list[str]:
    """The flags in ``args`` that ``parser`` does not know, up to ``--`` or the first
    token naming one of its sub-commands (what follows is the sub-command's)."""
    commands: set[str] = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            commands.update(action.choices)
    out = []
    for tok in args:
        if tok == "--" or tok in commands:
            break
        if len(tok) < 2 or tok[0] not in parser.prefix_chars:
            continue
        if parser._negative_number_matcher.match(tok):
            continue
        name = tok.split("=", 1)[0]
        if name not in parser._option_string_actions:
            out.append(name)
    return out


def unrecognized_message(parser: argparse.ArgumentParser, extras: Sequence[str]) -> str:
    """argparse's "unrecognized arguments" message, with a "did you mean" per flag and
    the parser's hint, if it has one."""
    lines = [f"unrecognized arguments: {' '.join(extras)}"]
    hint = getattr(parser, "_unknown_hint", None)
    for flag in unknown_flags(parser, extras):
        line = hint(flag) if hint is not None else None
        match = did_you_mean(parser, flag) if line is None else None
        if line:
            lines.append(f"  {flag}: {line}")
        elif match:
            lines.append(f"  {flag}: did you mean {match}?")
    return "\n".join(lines)


class _Refused(argparse.Action):
    """A vLLM flag this command does not take: an error that says what to use instead."""

    def __init__(self, option_strings: list[str], dest: str, advice: str = "",
                 **kwargs: Any) -> None:
        kwargs.update(nargs="?", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        super().__init__(option_strings, argparse.SUPPRESS, **kwargs)
        self.advice = advice

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        parser.error(f"{parser.prog} does not take vLLM's {option_string}: "
                     f"{self.advice}")


_NO_TLS = ("kvpush serves plain HTTP: put a TLS proxy (nginx, envoy, caddy) in front of "
           "the router for clients outside the network (README, Two hosts)")

#: vLLM flags that kvpush does not take, each with what to use instead (or why none is
#: needed); :func:`refuse_vllm_flags` registers them on a parser
VLLM_NOT_TAKEN: dict[str, str] = {
    "--gpu-memory-utilization": "kvpush sizes the KV cache in bytes, not as a share of "
                                "the GPU's memory: use --kv-cache-memory SIZE (e.g. 8GiB)",
    "--pipeline-parallel-size": "pipeline parallelism is not implemented yet: a model "
                                "runs on one device; run more instances instead",
    "-pp": "pipeline parallelism is not implemented yet: a model runs on one device; run "
           "more instances instead",
    "--data-parallel-size": "run more instances instead (`kvpush up --prefill N "
                            "--decode M`, or several `kvpush serve` behind `kvpush "
                            "router`)",
    "-dp": "run more instances instead (`kvpush up --prefill N --decode M`, or several "
           "`kvpush serve` behind `kvpush router`)",
    "--swap-space": "kvpush does not swap KV blocks to CPU memory: size the KV cache with "
                    "--kv-cache-memory",
    "--cpu-offload-gb": "kvpush does not offload weights: the whole model lives on "
                        "--device",
    "--enforce-eager": "kvpush always runs eagerly (no CUDA graphs): drop the flag",
    "--trust-remote-code": "kvpush runs Llama and Qwen3 with its own code and never runs "
                           "a model's code: drop the flag",
    "--quantization": "quantized weights are not supported: use --dtype bfloat16, "
                      "float16 or float32",
    "-q": "quantized weights are not supported: use --dtype bfloat16, float16 or float32",
    "--download-dir": "kvpush downloads nothing: `kvpush models install NAME` builds a "
                      "model from files on this machine",
    "--disable-log-stats": "kvpush logs no periodic statistics (they are on /metrics): "
                           "drop the flag",
    "--generation-config": "kvpush applies no sampling defaults from the model's "
                           "generation_config.json (it reads only its EOS ids): a request's "
                           "own parameters and the OpenAI defaults apply, as with vLLM's "
                           "--generation-config vllm; drop the flag",
    "--ssl-keyfile": _NO_TLS,
    "--ssl-certfile": _NO_TLS,
    "--ssl-ca-certs": _NO_TLS,
}

#: vLLM's `vllm bench serve` flags that `kvpush bench` does not take
VLLM_BENCH_NOT_TAKEN: dict[str, str] = {
    "--backend": "kvpush bench speaks the OpenAI API: --endpoint completions (vLLM's "
                 "openai and vllm backends) or chat (openai-chat)",
    "--host": "use --base-url http://HOST:PORT",
    "--port": "use --base-url http://HOST:PORT",
    "--random-range-ratio": "every prompt has exactly --input-len tokens and every answer "
                            "--output-len",
    "--random-prefix-len": "use --dataset shared-prefix --prefix-len N (kvpush counts the "
                           "shared prefix inside --input-len)",
    "--dataset-path": "kvpush bench's data sets are built in (--dataset random, sonnet, "
                      "shared-prefix or multi-turn); it reads no files",
    "--percentile-metrics": "kvpush bench reports TTFT, TPOT, ITL and end-to-end latency "
                            "always",
}


def refuse_vllm_flags(parser: argparse.ArgumentParser,
                      flags: dict[str, str] | None = None) -> None:
    """Register ``flags`` (default :data:`VLLM_NOT_TAKEN`) on ``parser`` as errors that
    say what to use instead; hidden from --help, never a "did you mean" answer."""
    for flag, advice in (VLLM_NOT_TAKEN if flags is None else flags).items():
        if flag not in parser._option_string_actions:
            parser.add_argument(flag, action=_Refused, advice=advice)


#: what --threads means once an instance has ranks (`kvpush up`, `bench compare`)
THREADS_PER_RANK_HELP = (
    "torch CPU threads per rank process: an instance at tensor parallelism N runs N "
    "ranks with T threads each, N x T in all (default: the usable cores divided by the "
    "ranks of all instances together, at least 1; at TP 1 a rank is an instance)")


def add_role_tensor_parallel_args(group: Any, instances: str, note: str = "") -> None:
    """--tensor-parallel-size/-tp N for every instance and --prefill-tp/--decode-tp
    overrides (`kvpush up` and `kvpush bench compare`); :func:`role_tensor_parallel`
    reads them."""
    group.add_argument(
        "--tensor-parallel-size", "-tp", type=positive_int, default=1, metavar="N",
        help=f"vLLM's flag: split the model of {instances} over N rank processes "
             "(`kvpush serve -tp N`: attention and KV heads and MLP columns by rank; "
             "gloo on the CPU); --prefill-tp/--decode-tp override it per role. "
             f"{note}(default: 1)")
    group.add_argument(
        "--prefill-tensor-parallel-size", "--prefill-tp", dest="prefill_tp",
        type=positive_int, metavar="N",
        help="tensor parallelism of the prefill instances (default: -tp); it may differ "
             "from decode's: each prefill rank moves its own KV head slice to the decode "
             "ranks that hold those heads (docs/ARCHITECTURE.md, Tensor parallelism). "
             "P/D modes only")
    group.add_argument(
        "--decode-tensor-parallel-size", "--decode-tp", dest="decode_tp",
        type=positive_int, metavar="N",
        help="tensor parallelism of the decode instances (default: -tp). P/D modes only")


def role_tensor_parallel(args: Any, role: str) -> int:
    """The tensor parallelism of a ``role`` instance (prefill, decode or both) from the
    flags of :func:`add_role_tensor_parallel_args` (absent ones: 1), on their parsed
    namespace or anything with the same attributes (bench's CompareConfig)."""
    every = getattr(args, "tensor_parallel_size", None) or 1
    override = getattr(args, f"{role}_tp", None) if role in ("prefill", "decode") else None
    return override or every


def port(text: str) -> int:
    """A TCP port, 0 (pick a free one) to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid port {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0..65535, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """An integer ≥ 0 (bounds where 0 means none)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def positive_int(text: str) -> int:
    """An integer ≥ 1 (counts, lengths)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number ≥ 0 (weights)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number of 0 or more, got {text}")
    return value


def seconds(text: str) -> float:
    """A positive, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def parse_size(text: str, allow_zero: bool = False) -> int:
    """'512MiB', '2GiB', '1G', '1048576' → bytes (binary units for K/M/G/T); with
    ``allow_zero``, 0 (in any unit) too."""
    from kvpush.errors import ConfigError

    s = text.strip().upper().replace(" ", "")
    units = {
        "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40,
        "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
        "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "B": 1,
    }
    unit = next((u for u in units if s.endswith(u)), "")
    num, mult = (s[: -len(unit)], units[unit]) if unit else (s, 1)
    try:
        value = float(num)
    except ValueError:
        raise ConfigError(f"cannot read {text!r} as a size (e.g. 512MiB, 2GiB)") from None
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"size must be {'>= 0' if allow_zero else '> 0'}, got {text!r}")
    if value > 0 and int(value * mult) == 0:
        raise ConfigError(f"size {text!r} is less than one byte")
    return int(value * mult)


def size(text: str, allow_zero: bool = False) -> int:
    """argparse type for a memory size (see :func:`parse_size`)."""
    from kvpush.errors import ConfigError

    try:
        return parse_size(text, allow_zero)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def size_or_zero(text: str) -> int:
    """argparse type for a memory size where 0 means "none"."""
    return size(text, allow_zero=True)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address to bind or dial) only reaches this machine."""
    import ipaddress

    h = host.strip().strip("[]")
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False
