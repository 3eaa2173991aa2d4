"""One frozen configuration tree, built once from CLI flags (or code) and validated once.

Everything downstream reads these dataclasses and never mutates them. Validation
errors raise :class:`ConfigError` with a message meant for a human at the command line.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from kvpush.cli_types import parse_size
from kvpush.dtypes import NAMES, Dtype
from kvpush.errors import ConfigError
from kvpush.kv_budget import KVMemorySplit, split_kv_memory

#: Default tokens per KV block. With the layer-major layout one layer of a run of
#: consecutive blocks is one memory range, so the descriptor count of a transfer grows
#: with fragmentation, not with block count; 32 tokens keeps one layer of one block at
#: 48 KiB for SmolLM2 (fp32) and 128 KiB for a Qwen3-32B shape (bf16), big enough for
#: RDMA to run at line rate even when every block is a descriptor of its own, while
#: still small enough that the prefix cache matches at useful granularity.
DEFAULT_BLOCK_SIZE = 32

SUPPORTED_ARCHS = {
    "LlamaForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
}

__all__ = ["ConfigError", "EngineConfig", "KVTransferConfig", "ModelConfig", "parse_size"]

def parse_dtype(name: str) -> Dtype:
    """A concrete dtype by name (``auto`` is resolved by ``resolve_dtype``)."""
    try:
        return NAMES[name.lower()]
    except KeyError:
        raise ConfigError(
            f"unknown dtype {name!r}; choose one of: auto, float32 (float, fp32), "
            "bfloat16 (bf16), float16 (half, fp16)"
        ) from None


def resolve_dtype(name: str, device: str) -> tuple[Dtype, str]:
    """(dtype, why): ``auto`` picks by hardware (``kvpush.auto_dtype``: bfloat16 on a CPU
    with AVX512-BF16 or AMX and on a CUDA device that supports it, else float32); any
    other name is taken as given."""
    if name.lower() == "auto":
        from kvpush import auto_dtype

        choice = auto_dtype.choose(device)
        return choice.dtype, choice.reason
    return parse_dtype(name), "asked for"


def dtype_name(dtype: Any) -> str:
    """The name of a Dtype or a ``torch.dtype``."""
    return Dtype.of(dtype).value


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder-only transformer, read from a Hugging Face config.json."""

    path: str
    arch: Literal["llama", "qwen3"]
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    attention_bias: bool
    mlp_bias: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    hf_config: dict[str, Any] = field(repr=False, compare=False, hash=False)

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> ModelConfig:
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ConfigError(f"{path} is not a model folder: no config.json in it")
        try:
            raw = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{cfg_file} is not valid JSON: {e}") from None
        archs = raw.get("architectures") or []
        arch = next((SUPPORTED_ARCHS[a] for a in archs if a in SUPPORTED_ARCHS), None)
        if arch is None:
            mt = raw.get("model_type")
            arch = {"llama": "llama", "qwen3": "qwen3"}.get(mt)
        if arch is None:
            raise ConfigError(
                f"unsupported model in {path}: architectures={archs}, "
                f"model_type={raw.get('model_type')!r}; kvpush runs Llama and Qwen3"
            )
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        head_dim = raw.get("head_dim") or hidden // num_heads
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        # Generation config may name extra EOS ids (chat models often do).
        gen_file = path / "generation_config.json"
        if gen_file.is_file():
            try:
                gen_eos = json.loads(gen_file.read_text()).get("eos_token_id")
            except json.JSONDecodeError:
                gen_eos = None
            if isinstance(gen_eos, int):
                gen_eos = [gen_eos]
            for t in gen_eos or []:
                if t not in eos_ids:
                    eos_ids = (*eos_ids, t)
        return cls(
            path=str(path),
            arch=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            attention_bias=bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            hf_config=raw,
        )

    def fingerprint(self) -> str:
        """Identity of the weights' shape and files, compared at the P/D handshake."""
        h = hashlib.blake2b(digest_size=8)
        h.update(json.dumps(self.hf_config, sort_keys=True).encode())
        for f in sorted(Path(self.path).glob("*.safetensors")):
            h.update(f"{f.name}:{f.stat().st_size}".encode())
        return f"{self.arch}-{self.num_layers}x{self.hidden_size}-{h.hexdigest()}"

    def kv_bytes_per_token(self, dtype: Any, tensor_parallel_size: int = 1) -> int:
        """K and V of one token, all layers, in ``dtype`` (a Dtype, its name or a
        ``torch.dtype``); at tensor parallelism, one rank's share (its KV heads:
        ``tp_kv_heads``)."""
        elem = Dtype.of(dtype).itemsize
        heads = len(tp_kv_heads(self, tensor_parallel_size, 0))
        return 2 * self.num_layers * heads * self.head_dim * elem


LAYER_MAJOR = "layer-major:L,B,2,T,H,D"
HEAD_MAJOR = "head-major:L,B,2,H,T,D"


def tp_problem(model: ModelConfig, n: int) -> str | None:
    """Why ``model`` cannot be split over ``n`` tensor-parallel ranks (None: it can).

    Every rank takes an equal share of the attention heads and of the MLP's columns; the
    KV heads are split too when ``n`` divides them, and replicated when ``n`` is a
    multiple of them (each rank then holds the one KV head its query heads use)."""
    if n < 1:
        return f"--tensor-parallel-size must be 1 or more, got {n}"
    if n == 1:
        return None
    if model.num_heads % n:
        return (f"--tensor-parallel-size {n}: the model's {model.num_heads} attention "
                f"heads do not divide by {n} (each rank takes an equal share of them)")
    if model.num_kv_heads % n and n % model.num_kv_heads:
        return (f"--tensor-parallel-size {n}: the model's {model.num_kv_heads} KV heads "
                f"neither divide by {n} nor divide {n} (each rank holds an equal share "
                "of them, or one KV head shared by an equal number of ranks)")
    if model.intermediate_size % n:
        return (f"--tensor-parallel-size {n}: the model's MLP width "
                f"{model.intermediate_size} does not divide by {n}")
    return None


def tp_kv_heads(model: ModelConfig, n: int, rank: int) -> range:
    """The KV heads rank ``rank`` of ``n`` holds (the model checked by ``tp_problem``):
    ``num_kv_heads / n`` of them, or the one its query heads use when ``n`` exceeds
    them (replicated on ``n / num_kv_heads`` ranks)."""
    hkv = model.num_kv_heads
    first = rank * hkv // n
    return range(first, first + max(1, hkv // n))


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    num_blocks: int
    #: a Dtype (a name or a ``torch.dtype`` given here is taken as its Dtype)
    dtype: Dtype
    enable_prefix_caching: bool = True
    #: permute the free-block queue at start-up with this seed, so consecutive
    #: allocations get scattered block ids (fragmented-KV benchmarks); None: in order
    shuffle_free_blocks: int | None = None
    #: cap of the dense decode cache (DecodeKVCache) in bytes, resolved by
    #: EngineConfig.build (kv_budget.py: inside --kv-cache-memory); None (a
    #: CacheConfig built by hand): the KV region's size; 0: no dense cache (decode
    #: gathers from the paged region, or reads it with the paged decode attention)
    decode_cache_bytes: int | None = None
    #: how decode attention reads the KV: "dense" (the DecodeKVCache copy, gathering
    #: from the region when it does not fit) or "paged" (model/paged_decode.py: over
    #: the block tables, no dense copy; the default on CUDA)
    decode_attention: Literal["dense", "paged"] = "dense"
    #: how the KV memory budget was split (None: a CacheConfig built by hand)
    memory: KVMemorySplit | None = None
    #: the KV region's byte order (kv_cache/kv_region.py): head-major on P/D instances,
    #: so that instances of different tensor parallelism move head slices of blocks
    kv_layout: str = LAYER_MAJOR

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", Dtype.of(self.dtype))


@dataclass(frozen=True)
class SchedulerConfig:
    max_model_len: int
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    enable_chunked_prefill: bool = True


@dataclass(frozen=True)
class KVTransferConfig:
    """How this instance takes part in disaggregated serving.

    ``role``: ``both`` is a plain single instance; ``prefill`` computes prompts and sends
    (push) or lends (pull) their KV; ``decode`` receives KV and generates.
    """

    role: Literal["both", "prefill", "decode"] = "both"
    mode: Literal["push", "pull"] = "push"
    engine_id: str = ""
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 0  # 0: pick a free port at start-up
    #: the engine core's request plane (other fronts' requests, CURVE with the cluster
    #: secret), bound on side_channel_host; 0: a free port at start-up
    request_plane_port: int = 0
    lease_timeout_s: float = 15.0
    heartbeat_interval_s: float = 1.0
    load_failure_policy: Literal["fail", "recompute"] = "fail"
    #: push, decode side: how long the blocks of a transfer whose request ended while
    #: prefill's WRITEs may still land (lease expired, client gone) stay fenced when
    #: prefill neither answers nor drops its connection (a prefill frozen for good);
    #: then they are freed anyway and the timeout is counted
    fence_timeout_s: float = 300.0
    #: prefill sends a digest of each block it writes or lends; decode checks the KV it
    #: got against it before the request runs (kv_transfer/digest.py)
    kv_digest: bool = False
    #: push, decode side: who computes the uncached tail of a prompt whose every full
    #: block decode already holds. "prefill" (default): prefill computes it (its own
    #: prefix cache usually holds the rest) and writes only the tail block, so decode's
    #: step loop stays pure decode; "decode": decode computes it itself and prefill's leg
    #: is dropped (faster first token when prefill lacks the prefix; slower decode steps)
    prefix_hit_tail: Literal["prefill", "decode"] = "prefill"
    #: push, prefill side: how many layers' new blocks go in one WRITE while the forward
    #: pass runs (the step loop hands each group to the transfer thread as the pass
    #: completes its last layer). 0: per layer on CUDA, where the WRITEs overlap the
    #: kernels still to run; a third of the layers per WRITE on CPU, where each hand-off
    #: wakes the transfer thread on the cores the forward pass runs on (per layer, the
    #: hand-offs made push's prefill steps longer than pull's; in thirds, much less:
    #: docs/MEASURED.md)
    push_layers_per_write: int = 0
    #: shared secret that signs every side-channel message (None: unsigned, for trusted
    #: networks only); never shown in reprs or logs
    side_channel_secret: bytes | None = field(default=None, repr=False)
    #: act on kv_transfer_params that the router did not sign (with a secret they must
    #: be signed by default): only where every client is trusted, or behind a proxy
    #: that does not sign (vLLM's). ``kvpush serve --insecure-kv-params``
    accept_unsigned_params: bool = False

    @property
    def enabled(self) -> bool:
        return self.role != "both"

    @property
    def params_signed(self) -> bool:
        """Whether requests' kv_transfer_params must carry the router's signature."""
        return self.enabled and self.side_channel_secret is not None \
            and not self.accept_unsigned_params

    def validate(self) -> None:
        if self.role not in ("both", "prefill", "decode"):
            raise ConfigError(f"--role must be both, prefill or decode, got {self.role!r}")
        if self.mode not in ("push", "pull"):
            raise ConfigError(f"--kv-transfer must be push or pull, got {self.mode!r}")
        if self.load_failure_policy not in ("fail", "recompute"):
            raise ConfigError(
                "--kv-load-failure-policy must be fail or recompute, "
                f"got {self.load_failure_policy!r}"
            )
        if self.prefix_hit_tail not in ("prefill", "decode"):
            raise ConfigError("--prefix-hit-tail must be prefill or decode, "
                              f"got {self.prefix_hit_tail!r}")
        if self.push_layers_per_write < 0:
            raise ConfigError("--push-layers-per-write must be 0 (auto) or more, "
                              f"got {self.push_layers_per_write}")
        if self.side_channel_secret is not None and len(self.side_channel_secret) < 16:
            raise ConfigError("the side-channel secret must be at least 16 bytes "
                              "(--kv-secret-file / KVPUSH_KV_SECRET)")
        if not 0 <= self.side_channel_port < 65536:
            raise ConfigError(f"--side-channel-port out of range: {self.side_channel_port}")
        if not 0 <= self.request_plane_port < 65536:
            raise ConfigError(f"--request-plane-port out of range: {self.request_plane_port}")
        if not self.fence_timeout_s > 0:
            raise ConfigError(f"--fence-timeout must be positive, got {self.fence_timeout_s}")
        if self.heartbeat_interval_s <= 0 or self.lease_timeout_s <= self.heartbeat_interval_s:
            raise ConfigError(
                "--lease-timeout must be longer than the heartbeat interval "
                f"({self.lease_timeout_s} <= {self.heartbeat_interval_s})"
            )


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: str = "cpu"
    #: weights' and activations' dtype (a name or a ``torch.dtype`` is taken as its Dtype)
    dtype: Dtype = Dtype.FLOAT32
    #: how ``dtype`` was chosen: "asked for", or what ``--dtype auto`` saw
    dtype_reason: str = "asked for"
    threads: int | None = None
    seed: int = 0
    served_model_name: str = ""
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    #: ranks the model is split over (one process each: kvpush.engine.tp); with more
    #: than one, ``threads`` is each rank's and the KV cache figures are each rank's
    tensor_parallel_size: int = 1
    #: the longest one tensor-parallel collective may wait for a peer: the ranks run the
    #: same chunks, so they reach each collective within one layer's work of each other;
    #: a peer that missed its plan or stopped (not exited: a dead peer's closed
    #: connection fails the collective at once) fails the step after this. Ranks never
    #: wait inside a collective while idle.
    tp_collective_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", Dtype.of(self.dtype))

    @classmethod
    def build(
        cls,
        model_dir: str | os.PathLike,
        *,
        served_model_name: str | None = None,
        max_model_len: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        num_blocks: int | None = None,
        kv_cache_memory: int | None = None,
        decode_cache_memory: int | None = None,
        decode_attention: str = "auto",
        dtype: str = "float32",
        kv_dtype: str | None = None,
        device: str = "cpu",
        threads: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 1024,
        enable_chunked_prefill: bool = True,
        enable_prefix_caching: bool = True,
        shuffle_free_blocks: int | None = None,
        seed: int = 0,
        kv_transfer: KVTransferConfig | None = None,
        tensor_parallel_size: int = 1,
        tp_collective_timeout_s: float = 10.0,
    ) -> EngineConfig:
        """Validate every knob once and return the frozen tree.

        ``dtype``: float32, bfloat16, float16 or ``auto`` (``resolve_dtype``). ``kvpush
        serve`` defaults to ``auto``; this API stays at float32, so code that compares
        the engine with an fp32 reference (tests, benchmarks) gets fp32 on every host.

        ``tensor_parallel_size`` > 1: the model is split over that many ranks; ``threads``
        is then each rank's (default: torch's count divided among the ranks) and
        ``kv_cache_memory`` each rank's (its slice of every block)."""
        model = ModelConfig.from_dir(model_dir)
        kv_transfer = kv_transfer or KVTransferConfig()
        kv_transfer.validate()
        tp = tensor_parallel_size
        problem = tp_problem(model, tp)
        if problem is not None:
            raise ConfigError(problem)
        if tp > 1 and kv_transfer.enabled and device != "cpu":
            raise ConfigError(
                f"--tensor-parallel-size {tp} with --role {kv_transfer.role} on {device}: "
                "prefill/decode disaggregation with tensor parallelism runs on the CPU "
                "only so far; run P/D instances on CUDA at --tensor-parallel-size 1")
        if not tp_collective_timeout_s > 0:
            raise ConfigError("the tensor-parallel collective timeout must be positive, "
                              f"got {tp_collective_timeout_s}")
        if tp > 1 and kv_transfer.kv_digest:
            raise ConfigError(f"--kv-digest with --tensor-parallel-size {tp}: KV digests "
                              "are checked at tensor parallelism 1 only so far")
        if tp > 1 and threads is None:
            import torch  # its thread count; the API process of a TP instance pays the import

            threads = max(1, torch.get_num_threads() // tp)
        if kv_transfer.enabled and not kv_transfer.engine_id:
            import uuid

            kv_transfer = dataclasses.replace(
                kv_transfer, engine_id=f"{kv_transfer.role}-{uuid.uuid4().hex[:8]}"
            )
        if device != "cpu" and not device.startswith("cuda"):
            raise ConfigError(f"unknown device {device!r}; use cpu or cuda[:N]")
        if device.startswith("cuda"):
            cuda_problem = _cuda_problem(device, tp)
            if cuda_problem is not None:
                raise ConfigError(cuda_problem)
        model_dtype, dtype_reason = resolve_dtype(dtype, device)
        cache_dtype = resolve_dtype(kv_dtype, device)[0] if kv_dtype else model_dtype
        if block_size <= 0 or block_size & (block_size - 1):
            raise ConfigError(f"--block-size must be a power of two > 0, got {block_size}")
        if threads is not None and threads <= 0:
            raise ConfigError(f"--threads must be > 0, got {threads}")
        if max_num_seqs <= 0:
            raise ConfigError(f"--max-num-seqs must be > 0, got {max_num_seqs}")
        if max_model_len is None:
            max_model_len = model.max_position_embeddings
        if max_model_len <= 1:
            raise ConfigError(f"--max-model-len must be > 1, got {max_model_len}")
        if max_model_len > model.max_position_embeddings:
            raise ConfigError(
                f"--max-model-len {max_model_len} is longer than the model's "
                f"max_position_embeddings {model.max_position_embeddings}"
            )
        if max_num_batched_tokens < block_size:
            raise ConfigError(
                f"--max-num-batched-tokens ({max_num_batched_tokens}) must be at least "
                f"the block size ({block_size})"
            )
        if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
            raise ConfigError(
                "without chunked prefill --max-num-batched-tokens must be at least "
                f"--max-model-len ({max_model_len}) so every prompt fits in one step"
            )
        per_block = model.kv_bytes_per_token(cache_dtype, tp) * block_size
        if num_blocks is not None and kv_cache_memory is not None:
            raise ConfigError("give either --num-blocks or --kv-cache-memory, not both")
        if num_blocks is None:
            if kv_cache_memory is None:
                kv_cache_memory = 1 << 30
            if kv_cache_memory <= 0:
                raise ConfigError(f"--kv-cache-memory must be > 0, got {kv_cache_memory}")
        if decode_cache_memory is not None and decode_cache_memory < 0:
            raise ConfigError(
                f"--decode-cache-memory must be >= 0 (0: no dense decode cache), got "
                f"{decode_cache_memory}")
        attention = resolve_decode_attention(decode_attention, device, decode_cache_memory)
        min_blocks = -(-max_model_len // block_size)
        memory = split_kv_memory(
            budget=kv_cache_memory,
            num_blocks=num_blocks,
            block_bytes=per_block,
            min_blocks=min_blocks,
            # DecodeKVCache holds at most max_num_seqs x max_model_len positions, in
            # the model's dtype
            dense_usable_bytes=max_num_seqs * max_model_len * model.kv_bytes_per_token(
                model_dtype, tp),
            dense=attention == "dense" and kv_transfer.role != "prefill",
            decode_cache_memory=decode_cache_memory,
        )
        num_blocks = memory.num_blocks
        if num_blocks < min_blocks:
            raise ConfigError(
                f"KV cache of {num_blocks} blocks cannot hold one request of "
                f"--max-model-len {max_model_len} ({min_blocks} blocks of {block_size} "
                f"tokens, {per_block} bytes each); raise --kv-cache-memory/--num-blocks "
                "or lower --max-model-len"
            )
        return cls(
            model=model,
            cache=CacheConfig(
                block_size=block_size,
                num_blocks=int(num_blocks),
                dtype=cache_dtype,
                enable_prefix_caching=enable_prefix_caching,
                shuffle_free_blocks=shuffle_free_blocks,
                decode_cache_bytes=memory.decode_cache_bytes,
                decode_attention=attention,
                memory=memory,
                kv_layout=HEAD_MAJOR if kv_transfer.enabled else LAYER_MAJOR,
            ),
            scheduler=SchedulerConfig(
                max_model_len=max_model_len,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                enable_chunked_prefill=enable_chunked_prefill,
            ),
            device=device,
            dtype=model_dtype,
            dtype_reason=dtype_reason,
            threads=threads,
            seed=seed,
            served_model_name=served_model_name or Path(model_dir).name,
            kv_transfer=kv_transfer,
            tensor_parallel_size=tp,
            tp_collective_timeout_s=tp_collective_timeout_s,
        )


def _cuda_problem(device: str, tp: int) -> str | None:
    """Why ``device`` (cuda[:N]) cannot hold ``tp`` ranks (None: it can); asks torch."""
    import torch

    if not torch.cuda.is_available():
        return f"device {device!r} asked for, but torch sees no CUDA device"
    first = int(device.partition(":")[2] or 0)
    if tp > 1 and first + tp > torch.cuda.device_count():
        return (f"--tensor-parallel-size {tp} on {device} needs CUDA devices {first} to "
                f"{first + tp - 1} (one per rank); torch sees {torch.cuda.device_count()}")
    return None


def resolve_decode_attention(
    name: str, device: str, decode_cache_memory: int | None
) -> Literal["dense", "paged"]:
    """``--decode-attention``: ``auto`` is ``paged`` on CUDA (no dense copy of the KV in
    GPU memory) unless ``--decode-cache-memory`` asks for a dense cache, and ``dense`` on
    CPU (the dense copy's in-place reads are faster there: docs/MEASURED.md)."""
    if name not in ("auto", "dense", "paged"):
        raise ConfigError(f"--decode-attention must be auto, dense or paged, got {name!r}")
    if name == "paged" and decode_cache_memory:
        raise ConfigError("--decode-attention paged reads the paged KV directly and has "
                          "no dense decode cache; drop --decode-cache-memory")
    if name == "auto":
        cuda = device.startswith("cuda")
        return "paged" if cuda and not decode_cache_memory else "dense"
    return name  # type: ignore[return-value]
