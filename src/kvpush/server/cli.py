"""`kvpush serve MODEL_DIR`: load a model and serve it over the OpenAI-compatible API.

Only argparse is imported at module level: `kvpush --help` builds this parser and must
not pay for torch, transformers or FastAPI.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from kvpush import cli_types
from kvpush.logs import LOG_FORMATS, PROBE_ENDPOINTS
from kvpush.server.admin_key import ADMIN_KEY_HELP
from kvpush.server.door import add_door_args

if TYPE_CHECKING:
    from kvpush.engine.async_engine import AsyncEngine
    from kvpush.engine.core_client import CoreClient

#: Seconds uvicorn lets open requests finish on Ctrl-C / SIGTERM before cancelling them
#: (the engine then aborts them and the process exits).
GRACEFUL_SHUTDOWN_S = 10

LOG_LEVELS = ("debug", "info", "warning", "error")

#: kvpush.server.admission.DEFAULT_MAX_WAITING_REQUESTS, repeated so that building this
#: parser imports nothing heavy (a test checks that they agree)
DEFAULT_MAX_WAITING_REQUESTS = 1024


VLLM_EPILOG = (
    "vLLM's flags: --tensor-parallel-size/-tp, --enable-prefix-caching, "
    "--no-enable-prefix-caching, --kv-cache-dtype, --tokenizer (the model's own), "
    "--chat-template, --kv-transfer-config, --disable-log-requests, "
    "--enable-chunked-prefill, --disable-access-log-for-endpoints, dtypes half, float "
    "and bf16, and a Hugging Face id of an installed model are taken as vLLM takes them. "
    "--gpu-memory-utilization is not: use --kv-cache-memory SIZE.")

#: vLLM's kv_connector names, by the --kv-transfer they mean
VLLM_CONNECTORS = {"NixlConnector": "pull", "NixlPushConnector": "push"}
#: vLLM's kv_role names, by the --role they mean
VLLM_KV_ROLES = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}



def vllm_kv_cache_dtype(text: str) -> str | None:
    """--kv-cache-dtype: vLLM's auto is "the model's dtype" (None: --dtype's)."""
    if text.strip().lower() == "auto":
        return None
    if text.strip().lower().startswith("fp8"):
        raise argparse.ArgumentTypeError(
            f"{text}: an fp8 KV cache is not implemented; use float32, bfloat16 or float16 "
            "(or auto: the --dtype)")
    return text


#: the keys of vLLM's KVTransferConfig kvpush does not take, and what to use instead
VLLM_KV_KEYS_REFUSED = {
    "kv_buffer_size": "the KV region is sized by --kv-cache-memory (or --num-blocks)",
    "kv_rank": "instances are paired by the router, any number of each: drop it "
               "(kv_role gives the side)",
    "kv_parallel_size": "instances are paired by the router, any number of each: drop it",
    "kv_ip": "the side channel's address is --side-channel-host (vLLM's NixlConnector: "
             "VLLM_NIXL_SIDE_CHANNEL_HOST)",
    "kv_port": "the side channel's port is --side-channel-port (vLLM's NixlConnector: "
               "VLLM_NIXL_SIDE_CHANNEL_PORT)",
    "kv_connector_module_path": "kvpush's connectors are built in: kv_connector "
                                "NixlConnector (pull) or NixlPushConnector (push)",
    "kv_connector_extra_config": "kvpush's KV transfer settings are flags (see --help, "
                                 "prefill/decode disaggregation)",
    "enable_permute_local_kv": "kvpush maps between KV layouts itself: drop it",
}
#: vLLM's defaults of the refused keys (a config dumped from vLLM carries them: taken)
VLLM_KV_DEFAULTS: dict[str, Any] = {
    "kv_buffer_size": 1e9, "kv_rank": None, "kv_parallel_size": 1, "kv_ip": "127.0.0.1",
    "kv_port": 14579, "kv_connector_module_path": None, "kv_connector_extra_config": {},
    "enable_permute_local_kv": False,
}
#: the keys it takes: each sets the flag named
VLLM_KV_KEYS_TAKEN = {
    "kv_connector": "--kv-transfer", "kv_role": "--role", "engine_id": "--engine-id",
    "kv_buffer_device": "--device (must match it)",
    "kv_load_failure_policy": "--kv-load-failure-policy",
}
#: vLLM's kv_load_failure_policy values (kvpush's --kv-load-failure-policy has the same)
KV_LOAD_FAILURE_POLICIES = ("fail", "recompute")
#: why kv_role kv_both is not a P/D instance here
KV_BOTH_ADVICE = ("kvpush needs kv_producer or kv_consumer for prefill/decode "
                  "disaggregation (kv_producer: the prefill instance, kv_consumer: the "
                  "decode one); kv_both is a plain instance with no KV transfer")


def _vllm_default(key: str, value: Any) -> bool:
    default = VLLM_KV_DEFAULTS[key]
    return value is default or (type(value) is type(default) and value == default)


def parse_kv_transfer_config(text: str) -> dict[str, str]:
    """vLLM's --kv-transfer-config JSON as kvpush settings: ``kv_transfer``, ``kv_role``
    (vLLM's) and, when given, ``engine_id``, ``kv_buffer_device`` and
    ``kv_load_failure_policy`` (ValueError: what is wrong and what to use instead)."""
    import json

    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError("must be a JSON object")
    refused = [k for k in cfg if k in VLLM_KV_KEYS_REFUSED and not _vllm_default(k, cfg[k])]
    if refused:
        raise ValueError("; ".join(f"{k} is not taken: {VLLM_KV_KEYS_REFUSED[k]}"
                                   for k in refused))
    unknown = sorted(set(cfg) - set(VLLM_KV_KEYS_TAKEN) - set(VLLM_KV_KEYS_REFUSED))
    if unknown:
        raise ValueError(f"kvpush does not take {', '.join(unknown)} (it takes "
                         f"{', '.join(VLLM_KV_KEYS_TAKEN)})")
    connector = cfg.get("kv_connector")
    if connector not in VLLM_CONNECTORS:
        raise ValueError(f"kv_connector {connector!r}: kvpush moves KV with NIXL only: "
                         f"{' or '.join(VLLM_CONNECTORS)}")
    role = cfg.get("kv_role")
    if role not in VLLM_KV_ROLES:
        raise ValueError(f"kv_role {role!r}: one of {', '.join(VLLM_KV_ROLES)}")
    out = {"kv_transfer": VLLM_CONNECTORS[connector], "kv_role": role}
    for key in ("engine_id", "kv_buffer_device"):
        if cfg.get(key) is not None:
            if not isinstance(cfg[key], str) or not cfg[key]:
                raise ValueError(f"{key} must be a non-empty string")
            out[key] = cfg[key]
    policy = cfg.get("kv_load_failure_policy")
    if policy is not None:
        if policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(f"kv_load_failure_policy {policy!r}: one of "
                             f"{', '.join(KV_LOAD_FAILURE_POLICIES)}")
        out["kv_load_failure_policy"] = policy
    return out


class KVTransferConfigAction(argparse.Action):
    """--kv-transfer-config: sets --kv-transfer, --role (and --engine-id,
    --kv-load-failure-policy) from vLLM's JSON, so that it is an alias of those flags, not
    a second way to configure. kv_both sets no role: :func:`kv_both_problem` says what it
    meant once every flag is parsed."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        try:
            cfg = parse_kv_transfer_config(values)
        except ValueError as e:
            parser.error(f"argument {option_string}: {e}")
        namespace.kv_transfer = cfg["kv_transfer"]
        namespace.vllm_kv_role = cfg["kv_role"]
        if cfg["kv_role"] != "kv_both":
            namespace.role = VLLM_KV_ROLES[cfg["kv_role"]]
        if "engine_id" in cfg:
            namespace.engine_id = cfg["engine_id"]
        if "kv_load_failure_policy" in cfg:
            namespace.kv_load_failure_policy = cfg["kv_load_failure_policy"]
        namespace.kv_buffer_device = cfg.get("kv_buffer_device")


def kv_both_problem(args: argparse.Namespace) -> str | None:
    """Why vLLM's kv_role kv_both cannot stand with the parsed flags (a P/D --role), or
    None; a plain instance with it is warned at start (:data:`KV_BOTH_ADVICE`)."""
    if getattr(args, "vllm_kv_role", None) == "kv_both" and args.role != "both":
        return (f"--kv-transfer-config: kv_role kv_both with --role {args.role}: "
                f"{KV_BOTH_ADVICE}; use kv_role "
                f"{'kv_producer' if args.role == 'prefill' else 'kv_consumer'}")
    return None


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the `serve` sub-command on ``subparsers`` (from add_subparsers)."""
    p = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description=(
            "Load a Llama or Qwen3 model and serve /v1/completions, /v1/chat/completions, "
            "/v1/models, /health and /metrics (Prometheus) over HTTP."
        ),
        epilog=VLLM_EPILOG,
    )
    p.add_argument(
        "model", metavar="MODEL_DIR",
        help="model folder (config.json, tokenizer, *.safetensors), the name of a model "
             "installed with `kvpush models install`, or the Hugging Face id of one "
             "(HuggingFaceTB/SmolLM2-135M-Instruct: smollm2-135m)",
    )
    net = p.add_argument_group("HTTP")
    net.add_argument("--host", default="127.0.0.1",
                     help="address to listen on (default: 127.0.0.1; 0.0.0.0 for all)")
    net.add_argument("--port", type=cli_types.port, default=8000, help="TCP port (default: 8000)")
    net.add_argument("--served-model-name", metavar="NAME",
                     help="model name clients must send in `model` (default: the registered "
                          "model name, or the model folder's name)")
    net.add_argument("--log-level", choices=LOG_LEVELS, default="info",
                     help="logging level (default: info)")
    net.add_argument("--disable-log-requests", action="store_true",
                     help="no log line per HTTP request (uvicorn's access log; on by "
                          "default, at --log-level info)")
    net.add_argument("--disable-access-log-for-endpoints", metavar="PATHS",
                     default=",".join(PROBE_ENDPOINTS),
                     help="comma-separated paths the access log leaves out (default: "
                          "the router's probes, " + ",".join(PROBE_ENDPOINTS) + "; '': "
                          "log every request)")
    net.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                     help="text: one line per record, wall-clock UTC time first "
                          "(default); json: one JSON object per line")
    net.add_argument("--api-key", metavar="KEY",
                     help="require 'Authorization: Bearer KEY' on every path but /health "
                          "(default: $KVPUSH_API_KEY; unset: no key). Prefer the "
                          "environment variable: a flag shows in the process list")
    net.add_argument("--admin-key", metavar="KEY", default=None, help=ADMIN_KEY_HELP)

    mdl = p.add_argument_group("model and KV cache")
    mdl.add_argument("--max-model-len", type=int, metavar="TOKENS",
                     help="longest prompt + completion, in tokens (default: the model's "
                          "max_position_embeddings)")
    mdl.add_argument("--block-size", type=int, metavar="TOKENS",
                     help="tokens per KV-cache block, a power of two (default: 32)")
    kv = mdl.add_mutually_exclusive_group()
    kv.add_argument("--kv-cache-memory", type=cli_types.size, metavar="SIZE",
                    help="memory for the KV cache in all, e.g. 512MiB, 2GiB, 1G (binary "
                         "units) or bytes (default: 1GiB): the KV blocks and, on an "
                         "instance that decodes with the dense decode cache, that cache "
                         "(by default half of it, at most what max-num-seqs x "
                         "max-model-len positions need; a prefill instance, or one with "
                         "--decode-attention paged, gives it all to blocks). The split is "
                         "logged at start-up and shown in /kv/info")
    kv.add_argument("--num-blocks", type=int, metavar="N",
                    help="size the KV cache in blocks instead of bytes (the dense decode "
                         "cache then comes on top: by default as large as the blocks)")
    mdl.add_argument("--decode-cache-memory", type=cli_types.size_or_zero, metavar="SIZE",
                     help="size of the dense decode cache, taken out of --kv-cache-memory "
                          "(an error if the rest cannot hold one --max-model-len request): "
                          "decode attention reads each decoding request's KV from a "
                          "contiguous copy instead of gathering its blocks every step. On "
                          "CPU an instance that decodes (role both or decode) allocates "
                          "and touches all of it at start-up; 0 turns the copy off "
                          "(default: the share described under --kv-cache-memory)")
    mdl.add_argument("--decode-attention", choices=("auto", "dense", "paged"),
                     default="auto",
                     help="how decode attention reads the KV: dense (the dense decode "
                          "cache), paged (straight from the KV blocks through the block "
                          "tables, no dense copy: all of --kv-cache-memory goes to "
                          "blocks) or auto: paged on CUDA, dense on CPU (default: auto)")
    mdl.add_argument("--dtype", default="auto", metavar="DTYPE",
                     help="weight and activation dtype: auto, float32 (or float, fp32), "
                          "bfloat16 (bf16) or float16 (half, fp16). auto: bfloat16 on a "
                          "CPU with AVX512-BF16 or AMX and "
                          "on a CUDA device that supports it, float32 elsewhere; P and D "
                          "must agree, so give it explicitly when they run on different "
                          "kinds of machine (default: auto)")
    mdl.add_argument("--kv-dtype", metavar="DTYPE",
                     help="KV-cache dtype, same choices (default: --dtype)")
    mdl.add_argument("--kv-cache-dtype", dest="kv_dtype", type=vllm_kv_cache_dtype,
                     metavar="DTYPE",
                     help="vLLM's name for --kv-dtype; its auto means the --dtype (fp8 "
                          "is not implemented)")
    mdl.add_argument("--tensor-parallel-size", "-tp", type=cli_types.positive_int,
                     default=1, metavar="N",
                     help="split the model over N rank processes (attention heads, KV "
                          "heads and MLP columns; torch.distributed: gloo on CPU, NCCL on "
                          "CUDA with one device per rank from --device on). --threads and "
                          "--kv-cache-memory are then each rank's (default threads: "
                          "torch's count divided by N). With --role prefill or decode on "
                          "the CPU, prefill and decode may differ (default: 1)")
    mdl.add_argument("--tokenizer", metavar="DIR_OR_NAME",
                     help="the tokenizer: only the model's own is supported (the model "
                          "folder, its name or its Hugging Face id; another is refused: "
                          "prefill, decode and the router all tokenize with the model "
                          "folder's)")
    mdl.add_argument("--chat-template", metavar="FILE_OR_TEMPLATE",
                     help="the Jinja chat template for /v1/chat/completions, a file or the "
                          "template itself (default: the tokenizer's, from the model "
                          "folder). Give every instance of a P/D pair the same one")
    mdl.add_argument("--device", default="cpu",
                     help="cpu or cuda[:N] (default: cpu)")
    mdl.add_argument("--engine-core", choices=("process", "thread"), default="process",
                     help="process: the engine core (model, KV, scheduler, KV transfer) "
                     "runs in a child process and this one serves HTTP, tokenizes and "
                     "detokenizes (ZMQ ipc://); thread: both in one process (default: "
                     "process)")
    mdl.add_argument("--threads", type=int, metavar="N",
                     help="CPU threads for torch (default: torch's own choice, usually one "
                          "per physical core); with --tensor-parallel-size N, each rank's "
                          "(default: torch's choice divided by N)")
    mdl.add_argument("--seed", type=int, default=0,
                     help="engine random seed; requests may also send their own (default: 0)")

    sch = p.add_argument_group("scheduler")
    sch.add_argument("--max-num-seqs", type=int, default=64, metavar="N",
                     help="most requests in the running batch (default: 64)")
    sch.add_argument("--max-num-batched-tokens", type=int, default=1024, metavar="TOKENS",
                     help="most tokens (prefill chunks + decodes) in one engine step "
                          "(default: 1024)")
    add_door_args(net)
    sch.add_argument("--max-waiting-requests", type=cli_types.non_negative_int,
                     default=DEFAULT_MAX_WAITING_REQUESTS, metavar="N",
                     help="most requests waiting for their first token (queued, being "
                          "prefilled, or awaiting their KV); more are refused at once with "
                          "HTTP 429 (a P/D pair's second leg is admitted anyway: its peer "
                          "holds blocks for it). 0: no bound (default: "
                          f"{DEFAULT_MAX_WAITING_REQUESTS})")
    sch.add_argument("--no-chunked-prefill", "--no-enable-chunked-prefill",
                     dest="enable_chunked_prefill", action="store_false",
                     help="prefill each prompt in one step (then --max-num-batched-tokens "
                          "must be at least --max-model-len); chunked prefill is on by "
                          "default")
    sch.add_argument("--enable-chunked-prefill", dest="enable_chunked_prefill",
                     action="store_true", default=True,
                     help="prefill long prompts in chunks of --max-num-batched-tokens (the "
                          "default)")
    sch.add_argument("--no-prefix-caching", "--no-enable-prefix-caching",
                     dest="enable_prefix_caching", action="store_false",
                     help="do not reuse KV blocks of shared prompt prefixes (on by default)")
    sch.add_argument("--enable-prefix-caching", dest="enable_prefix_caching",
                     action="store_true", default=True,
                     help="reuse KV blocks of shared prompt prefixes (the default)")
    sch.add_argument("--shuffle-free-blocks", type=int, metavar="SEED", nargs="?", const=0,
                     help="hand out KV blocks in a random order (seeded) instead of by id, "
                          "so a request's block ids are scattered: measures transfers of "
                          "fragmented KV, as on a server that has run for a while")
    pd = p.add_argument_group(
        "prefill/decode disaggregation",
        "Run as one side of a P/D pair; the router (or any vLLM-style proxy) sends each "
        "request's legs with kv_transfer_params.")
    pd.add_argument("--role", choices=("both", "prefill", "decode"), default="both",
                    help="both: a plain single instance (default); prefill: compute prompts "
                         "and send (push) or lend (pull) their KV; decode: receive KV and "
                         "generate")
    pd.add_argument("--kv-transfer", choices=("push", "pull"), default="push",
                    help="push: decode pre-allocates and prefill WRITEs the KV as it is "
                         "computed, token #1 travels with it (default); pull: decode READs "
                         "prefill's blocks after prefill finished (vLLM NixlConnector)")
    pd.add_argument("--kv-transfer-config", action=KVTransferConfigAction, metavar="JSON",
                    help="vLLM's JSON, as --kv-transfer and --role: kv_connector "
                         "NixlConnector (pull) or NixlPushConnector (push); kv_role "
                         "kv_producer (prefill) or kv_consumer (decode) (kv_both: a plain "
                         "instance, no KV transfer, with a warning; refused with a P/D "
                         "--role); optional engine_id (--engine-id), "
                         "kv_load_failure_policy (--kv-load-failure-policy) and "
                         "kv_buffer_device (must be --device's kind); its other keys are "
                         "refused with what to use. A later --role or --kv-transfer "
                         "overrides it")
    pd.add_argument("--engine-id", metavar="ID",
                    help="this instance's id in transfers (default: ROLE-<random>)")
    pd.add_argument("--side-channel-host", default="127.0.0.1", metavar="HOST",
                    help="address peers reach this instance's side channel at "
                         "(default: 127.0.0.1). UCX (the KV data path) listens on the "
                         "same interface: UCX_NET_DEVICES is set to it unless set "
                         "already (0.0.0.0: left unset, all interfaces)")
    pd.add_argument("--side-channel-port", type=cli_types.port, default=0, metavar="PORT",
                    help="side-channel port (default: 0, a free port; /kv/info shows it)")
    pd.add_argument("--request-plane-port", type=cli_types.port, default=0, metavar="PORT",
                    help="port of the engine core's request plane on --side-channel-host: "
                         "routers send requests straight to the engine core there (ZMQ, "
                         "CURVE keys from the cluster secret; only with a secret). Default: "
                         "0, a free port; /kv/info shows it as request_plane")
    pd.add_argument("--kv-secret-file", metavar="PATH",
                    help="file holding a secret (16+ bytes) shared by every prefill and "
                         "decode instance: each side-channel message is signed with it and "
                         "unsigned or wrongly signed ones are refused (default: "
                         "$KVPUSH_KV_SECRET; unset: unsigned, for trusted networks only)")
    pd.add_argument("--allow-loose-secret-file", action="store_true",
                    help="use a --kv-secret-file that group or others can read (refused "
                         "otherwise; chmod 600 it instead)")
    pd.add_argument("--insecure-kv-params", action="store_true",
                    help="act on kv_transfer_params that the router did not sign, and allow "
                         "--role prefill/decode without a cluster secret: only on a network "
                         "where every client and host is trusted, or behind a proxy that "
                         "does not sign (vLLM's). Without it a prefill/decode instance needs "
                         "the secret (--kv-secret-file; `kvpush make-secret PATH` writes one) "
                         "and answers 403 to kv_transfer_params not signed by the router")
    pd.add_argument("--kv-load-failure-policy", choices=("fail", "recompute"),
                    default="fail",
                    help="decode side, when the KV does not arrive: fail the request with "
                         "a clear error (default) or prefill it locally")
    pd.add_argument("--push-layers-per-write", type=int, default=0, metavar="N",
                    help="push, prefill side: layers whose new KV goes in one WRITE while "
                         "the forward pass runs; the group ending with the last layer goes "
                         "with token #1 (default: 0, auto: 1 on CUDA, so WRITEs overlap "
                         "the layers still to compute; on CPU a group closes at the first "
                         "layer boundary 50 ms of compute after the last, because each "
                         "mid-step hand-off to the transfer thread costs the step about "
                         "0.5 ms (measured: docs/ARCHITECTURE.md) and must stay near 1%% of "
                         "its group: steps under 50 ms write once, at their end)")
    pd.add_argument("--prefix-hit-tail", choices=("prefill", "decode"), default="prefill",
                    help="push, decode side, when decode's prefix cache holds every full "
                         "block of the prompt: prefill computes the short uncached tail and "
                         "writes just that block (default; decode's steps stay pure "
                         "decode), or decode computes it itself and prefill's leg is "
                         "dropped (first token sooner when prefill lacks the prefix, "
                         "slower decode steps for the others)")
    pd.add_argument("--lease-timeout", type=float, default=15.0, metavar="SECONDS",
                    help="blocks held for a transfer are freed when the peer has not been "
                         "heard from for this long (default: 15)")
    pd.add_argument("--heartbeat-interval", type=float, default=1.0, metavar="SECONDS",
                    help="how often peers confirm the transfers they hold (default: 1)")
    pd.add_argument("--kv-digest", action="store_true",
                    help="check every transferred block: prefill sends a digest of each "
                         "block it writes (pull: lends) with the completion, decode checks "
                         "it before the request's first step; a mismatch fails the "
                         "receive (--kv-load-failure-policy: fail or recompute) and counts "
                         "in kvpush_kv_digest_mismatches_total. Both roles need it; TP 1 "
                         "only")
    pd.add_argument("--fence-timeout", type=float, default=300.0, metavar="SECONDS",
                    help="push, decode side: blocks a prefill may still WRITE into after "
                         "their request ended (its lease expired, the client left) stay "
                         "out of the pool until prefill answers or its connection drops, "
                         "or at most this long (default: 300)")
    from kvpush.discovery.cli_args import add_register_args

    add_register_args(p)
    cli_types.refuse_vllm_flags(p)
    p.set_defaults(func=run_serve)
    return p


def _fail(message: str) -> int:
    print(f"kvpush serve: error: {message}", file=sys.stderr)
    return 2


def bind_listener(host: str, port: int) -> socket.socket:
    """The server's TCP socket, bound now: before the model loads (seconds to minutes), so
    that a port in use is an error at once, and a port probed free by `kvpush up` is
    held from the start. uvicorn listens on it (``Server.run(sockets=...)``).

    Its protocol is named (IPPROTO_TCP) and it has TCP_NODELAY, which accepted
    connections inherit: asyncio turns Nagle's algorithm off only on sockets whose
    ``proto`` says TCP, and with it on, a streamed chunk written after the response
    headers waited for the client's delayed ACK (the router's first token reached
    clients late by that delay on loopback: docs/MEASURED.md)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def cannot_listen(host: str, port: int, err: OSError) -> str:
    """The message for a :func:`bind_listener` that failed (serve and router)."""
    return (f"cannot listen on {host}:{port}: {err.strerror or err}; choose another --port "
            "(0: a free one)")


def _resolve_model(name_or_dir: str) -> tuple[str, str | None]:
    """(model folder, default served name or None for "the folder's name")."""
    try:
        from kvpush.models.registry import resolve_model
    except ModuleNotFoundError as e:  # registry not there (yet): MODEL_DIR is a folder
        if e.name not in ("kvpush.models", "kvpush.models.registry"):
            raise
        return name_or_dir, None
    path = str(resolve_model(name_or_dir))
    # A registered name is served under that name, not under its cache folder's name.
    return path, (None if Path(name_or_dir).exists() else name_or_dir)


def _check_tokenizer(tokenizer: str | None, model: str, model_dir: str) -> None:
    """--tokenizer: only the model's own (ConfigError for another): the engine, the
    detokenizer and the router's cache-aware routing all load the model folder's."""
    from kvpush.errors import ConfigError

    if tokenizer is None or tokenizer == model:
        return
    try:
        same = Path(_resolve_model(tokenizer)[0]).resolve() == Path(model_dir).resolve()
    except ConfigError:
        same = False
    if not same:
        raise ConfigError(
            f"--tokenizer {tokenizer}: kvpush serves with the model folder's own tokenizer "
            f"({model_dir}); another one is not supported: put its files in the model "
            "folder, or leave --tokenizer out")


def load_chat_template(value: str) -> str:
    """--chat-template: a file's text, or the template itself (it holds ``{{`` or
    ``{%``); checked for Jinja syntax now rather than on the first chat request."""
    from kvpush.errors import ConfigError

    path = Path(value).expanduser()
    if path.is_file():
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"--chat-template {value}: cannot read it: {e}") from None
    elif "{{" in value or "{%" in value:
        text = value
    else:
        raise ConfigError(f"--chat-template {value}: no such file (nor a Jinja template)")
    import jinja2

    try:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(f"--chat-template {value}: not a valid Jinja template: {e}"
                          ) from None
    return text


def build_config(args: argparse.Namespace) -> Any:
    """The EngineConfig for parsed ``serve`` arguments (raises ConfigError)."""
    from kvpush.config import ConfigError, EngineConfig, KVTransferConfig

    problem = kv_both_problem(args)
    if problem is not None:
        raise ConfigError(problem)
    model_dir, default_name = _resolve_model(args.model)
    _check_tokenizer(getattr(args, "tokenizer", None), args.model, model_dir)
    buffer_device = getattr(args, "kv_buffer_device", None)
    if buffer_device is not None and buffer_device != args.device.split(":")[0]:
        raise ConfigError(f"--kv-transfer-config: kv_buffer_device {buffer_device!r}: "
                          f"kvpush keeps the KV cache on --device ({args.device})")
    secret = getattr(args, "kv_secret", None)
    kv_transfer = KVTransferConfig(
        role=args.role,
        mode=args.kv_transfer,
        engine_id=args.engine_id or "",
        side_channel_host=args.side_channel_host,
        side_channel_port=args.side_channel_port,
        request_plane_port=args.request_plane_port,
        lease_timeout_s=args.lease_timeout,
        heartbeat_interval_s=args.heartbeat_interval,
        fence_timeout_s=args.fence_timeout,
        kv_digest=args.kv_digest,
        load_failure_policy=args.kv_load_failure_policy,
        prefix_hit_tail=args.prefix_hit_tail,
        push_layers_per_write=args.push_layers_per_write,
        side_channel_secret=secret,
        accept_unsigned_params=args.insecure_kv_params,
    )
    kwargs: dict[str, Any] = {}
    if args.block_size is not None:  # else EngineConfig's DEFAULT_BLOCK_SIZE
        kwargs["block_size"] = args.block_size
    return EngineConfig.build(
        model_dir,
        served_model_name=args.served_model_name or default_name,
        max_model_len=args.max_model_len,
        num_blocks=args.num_blocks,
        kv_cache_memory=args.kv_cache_memory,
        decode_cache_memory=args.decode_cache_memory,
        decode_attention=args.decode_attention,
        dtype=args.dtype,
        kv_dtype=args.kv_dtype,
        device=args.device,
        threads=args.threads,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=args.enable_chunked_prefill,
        enable_prefix_caching=args.enable_prefix_caching,
        shuffle_free_blocks=args.shuffle_free_blocks,
        seed=args.seed,
        kv_transfer=kv_transfer,
        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
        **kwargs,
    )


def _registration(args: argparse.Namespace, port: int) -> tuple[Any, str] | None:
    """(etcd target, advertised URL) for --register, or None (raises TargetError)."""
    from kvpush.discovery.cli_args import advertise_url, resolve_target

    target = resolve_target(args.register, args)
    if target is None:
        return None
    return target, advertise_url(args, port)


def run_serve(args: argparse.Namespace) -> int:
    from kvpush.logs import endpoint_list, quiet_access_log, setup_logging

    setup_logging(args.log_level, getattr(args, "log_format", None))
    quiet_access_log(endpoint_list(getattr(args, "disable_access_log_for_endpoints", "")))
    log = logging.getLogger("kvpush.server")
    from kvpush.config import ConfigError, dtype_name
    from kvpush.procs import raise_fd_limit
    from kvpush.server.auth import SecretError, resolve_api_key, resolve_kv_secret

    log.debug("open files: up to %d", raise_fd_limit())  # (the core inherits it)
    problem = kv_both_problem(args)
    if problem is not None:
        return _fail(problem)
    if getattr(args, "vllm_kv_role", None) == "kv_both":
        log.warning("--kv-transfer-config kv_role kv_both: %s", KV_BOTH_ADVICE)
    api_key = resolve_api_key(args.api_key)
    try:
        args.kv_secret, warning = resolve_kv_secret(
            args.kv_secret_file, allow_loose=getattr(args, "allow_loose_secret_file", False))
    except SecretError as e:
        return _fail(str(e))
    if warning:
        log.warning(warning)
    if args.role != "both" and args.kv_secret is None and not args.insecure_kv_params:
        return _fail(
            f"--role {args.role} needs the cluster secret that signs kv_transfer_params "
            "and side-channel messages: write one with `kvpush make-secret PATH` and give "
            "every instance and the router --kv-secret-file PATH (or KVPUSH_KV_SECRET); on "
            "a network where every client and host is trusted, --insecure-kv-params runs "
            "without it")
    try:
        config = build_config(args)
        chat_template = (load_chat_template(args.chat_template)
                         if getattr(args, "chat_template", None) else None)
    except ConfigError as e:
        return _fail(str(e))
    try:
        listener = bind_listener(args.host, args.port)
    except OSError as e:
        return _fail(cannot_listen(args.host, args.port, e))
    port = listener.getsockname()[1]
    try:
        registration = _registration(args, port)
    except ValueError as e:  # TargetError
        listener.close()
        return _fail(str(e))
    kvt = config.kv_transfer
    if kvt.enabled:
        # before NIXL is imported and its UCX agent created (in AsyncEngine)
        import os

        from kvpush.server import ucx_devices

        choice = ucx_devices.apply(kvt.side_channel_host, os.environ)
        log.log(choice.level, "%s", choice.message)
    # torch threads: the core loads the model with one and gives the step loop
    # config.threads (one OpenMP pool per process; see kvpush.engine.core_loop)

    log.info("loading %s (%s, %s: %s; KV %s; max_model_len %d, %d KV blocks of %d "
             "tokens)", config.model.path, config.model.arch, dtype_name(config.dtype),
             config.dtype_reason, dtype_name(config.cache.dtype),
             config.scheduler.max_model_len, config.cache.num_blocks,
             config.cache.block_size)
    engine: AsyncEngine | CoreClient
    try:
        if args.engine_core == "process":
            from kvpush.engine.core_client import CoreClient

            engine = CoreClient.launch(config, log_level=args.log_level)
        else:
            from kvpush.engine.async_engine import AsyncEngine

            engine = AsyncEngine(config)
    except ConfigError as e:
        listener.close()
        return _fail(str(e))
    if chat_template is not None:  # the HTTP process renders chats with this tokenizer
        engine.tokenizer.chat_template = chat_template
        log.info("chat template from --chat-template")
    try:
        return _serve(args, config, engine, listener, api_key, log, registration)
    finally:
        if args.engine_core == "process":  # no-op after a clean shutdown; else the core goes
            cast("CoreClient", engine).close()


def _serve(args: argparse.Namespace, config, engine, listener, api_key, log,
           registration: tuple[Any, str] | None) -> int:
    kvt = config.kv_transfer
    port = listener.getsockname()[1]

    import uvicorn

    from kvpush.server.admin_key import resolve_admin_key
    from kvpush.server.app import build_app
    from kvpush.server.door import uvicorn_options

    app = build_app(engine, api_key=api_key, max_waiting_requests=args.max_waiting_requests,
                    body_timeout_s=args.body_timeout,
                    admin_key=resolve_admin_key(getattr(args, "admin_key", None)),
                    advertise_url=(registration[1] if registration is not None
                                   else getattr(args, "advertise_url", None)),
                    chat_template=(engine.tokenizer.chat_template
                                   if getattr(args, "chat_template", None) else None))
    if api_key is None and not cli_types.is_loopback(args.host):
        log.warning("listening on %s without an API key: anyone who reaches this address "
                    "can use the server (--api-key or KVPUSH_API_KEY)", args.host)
    uv_config = uvicorn.Config(app, host=args.host, port=port, log_level=args.log_level,
                               timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
                               access_log=not getattr(args, "disable_log_requests", False),
                               log_config=None,  # uvicorn's records: our handler
                               **uvicorn_options(args.header_timeout,
                                                 args.max_client_connections))
    if registration is None:
        server = uvicorn.Server(uv_config)
    else:  # card written once started; on SIGTERM withdrawn before the drain
        from kvpush.discovery.card import card_from_info, sign
        from kvpush.discovery.serve_hook import RegisteredServer

        target, url = registration

        async def make_card():  # /kv/info is a call to the engine core
            card = card_from_info(url, await engine.kv_info())
            # signed: routers drop unsigned cards (an instance without the secret
            # cannot join through etcd, only from a router's command line)
            return sign(card, kvt.side_channel_secret) if kvt.side_channel_secret else card

        server = RegisteredServer(uv_config, target, make_card,
                                  ttl_s=args.register_ttl, drain_grace_s=args.drain_grace)
    if kvt.enabled:
        log.info("role %s, %s mode, engine id %s, side channel %s (%s), request plane %s",
                 kvt.role, kvt.mode, kvt.engine_id, engine.side_channel,
                 "messages signed" if kvt.side_channel_secret else "unsigned",
                 getattr(engine, "request_plane", None) or "off")
        if not kvt.params_signed:
            log.warning("acting on unsigned kv_transfer_params (--insecure-kv-params or no "
                        "secret): any client that reaches this instance can name blocks "
                        "and peers; use it on a trusted network only")
    log.info("serving %r on http://%s:%d/v1%s", config.served_model_name, args.host,
             port, " (API key required)" if api_key else "")
    core_died: list[str] = []

    def on_core_death(why: str) -> None:
        if server.should_exit and getattr(engine, "proc", None) is not None \
                and engine.proc.returncode == 0:
            # a stop signal sent to the whole process group (`kvpush up`, systemd)
            # reached the core too, and it stopped cleanly: not a failure
            log.info("the engine core stopped with the server")
            return
        core_died.append(why)
        server.should_exit = True  # uvicorn drains and runs the lifespan's shutdown

    engine.on_death = on_core_death
    server.run(sockets=[listener])
    if core_died:
        print(f"kvpush serve: error: {core_died[0]}; the server stopped", file=sys.stderr)
        return 1
    # uvicorn returns normally on Ctrl-C; a failed bind or startup leaves started False.
    return 0 if server.started else 1
