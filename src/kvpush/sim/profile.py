"""Hardware profiles: what one step, one transfer and one hand-off message cost.

A profile is a JSON file (see ``profiles/`` and docs/SIMULATOR.md). It names the model's
shape, one or more *step models* (:mod:`kvpush.sim.step_models`: the time of one engine
step as a function of the chunks it runs), which step model each role uses, the
transfer link, the hand-off latencies, the instance limits and what sharing a host
costs. Everything is validated on load; a bad file raises :class:`ProfileError` naming
the file and the field.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from kvpush.sim.noise import NOISE_KINDS
from kvpush.sim.step_models import (
    LinearStepModel,
    ModelShape,
    RooflineStepModel,
    RowTable,
    ScaledStepModel,
    StepModel,
)

ROLES: tuple[str, ...] = ("prefill", "decode", "colocated")


class ProfileError(ValueError):
    """A profile that cannot be used: missing file, bad JSON, missing or bad field."""


@dataclass(frozen=True)
class TransferModel:
    """One KV transfer: the posting thread is busy ``post_base_s + descs * post_per_desc_s``;
    the bytes then cross the link at ``bandwidth_Bps`` (serial per link), plus
    ``per_desc_s`` per descriptor on the wire and ``latency_s`` once."""

    bandwidth_Bps: float
    latency_s: float
    post_base_s: float
    post_per_desc_s: float
    per_desc_s: float = 0.0
    setup_s: float = 0.0  # D's per-request transfer set-up in pull (metadata, handles)

    def post_time(self, descs: int) -> float:
        return self.post_base_s + descs * self.post_per_desc_s

    def wire_time(self, nbytes: float, descs: int) -> float:
        return nbytes / self.bandwidth_Bps + descs * self.per_desc_s


@dataclass(frozen=True)
class HandoffModel:
    """One-way latencies of the messages of a hand-off, in seconds."""

    http_hop_s: float        # router -> instance (one leg), or instance -> router answer
    client_hop_s: float      # client <-> router, each way (first token back to the client)
    relay_s: float           # router: turn P's answer into D's leg (pull)
    side_channel_s: float    # P <-> D one message (PushRegister, PushDone, PullDone)
    handshake_s: float = 0.0  # first contact of a P/D pair (ignored after warm-up)
    #: the front end (client, router, instance HTTP server) passes requests on one at a
    #: time, this long each: a burst reaches the engines spread out (0: all at once)
    front_end_s: float = 0.0
    #: measured: how far apart the first two requests of a burst sent all at once
    #: reached the engine, one figure per burst the served probe sent; the simulator draws
    #: one per burst for its first gap (the rest keep ``front_end_s``). Empty: the first
    #: gap is ``front_end_s`` too. The measured first gap is either a fraction of a
    #: millisecond or 3-20 ms, and an engine whose first step starts after the second
    #: request arrived prefills both in it (SIMULATION.md 1-v27).
    burst_first_gaps_s: tuple[float, ...] = ()
    #: measured: from a request reaching an idle engine's inbox to the start of the step
    #: that takes it (the step loop waking and scheduling); what arrives meanwhile joins
    #: that step
    engine_wake_s: float = 0.0
    #: measured: a lone request from the client to its engine's inbox (None:
    #: client_hop_s + http_hop_s)
    request_path_s: float | None = None
    #: measured: an output token from its engine's step end to the client (post to the
    #: HTTP loop, SSE, router, client; None: http_hop_s + client_hop_s)
    token_return_s: float | None = None
    pull_post_on_step_loop: bool = True  # vLLM: D posts the READ on its step path
    #: measured: how much longer a prefill instance's step is in push than in pull when
    #: it carries a push request's chunk (the per-layer WRITE hand-off on the step loop
    #: and the transfer thread's posts beside it, sharing the interpreter and the cores;
    #: kvpush.sim.push_step.probe_push_step); added to each such step that starts while the
    #: other instances of its host are idle
    push_prefill_step_s: float = 0.0
    #: the same for a step that starts while another instance of its host is mid-step
    #: (the transfer thread's posts then compete with that step for the cores too)
    push_prefill_corun_step_s: float = 0.0
    #: measured: what each KV block such a step WRITEs to decode adds to it on top of
    #: the per-step figures, with the host's other instances idle / mid-step (likely the
    #: transfer thread's copies during the forward pass; beside a decoding instance three
    #: busy threads share the cores). kvpush.sim.push_step.probe_push_step measures both
    #: at two loads, mostly one prompt per step and several.
    push_prefill_block_s: float = 0.0
    push_prefill_corun_block_s: float = 0.0
    #: push: layers per WRITE while P's forward pass runs (kvpush's
    #: --push-layers-per-write: one on CUDA, a third of the layers on CPU by default);
    #: each group goes as the pass completes its last layer
    push_layers_per_write: int = 1


@dataclass(frozen=True)
class InstanceLimits:
    block_size: int
    num_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    model: ModelShape
    step_models: Mapping[str, StepModel]
    roles: Mapping[str, str]
    transfer: TransferModel
    handoff: HandoffModel
    instance: InstanceLimits
    sources: Mapping[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    path: str = ""
    #: instances share one host (CPU profiles): a step that starts while another
    #: instance is mid-step takes this many times longer (measured by calibrate)
    corun_slowdown: float = 1.0
    #: the same per kind of step ("prefill": any chunk over one token, "decode"), as
    #: calibrate's served 1P1D pair measures it; where given, it replaces corun_slowdown
    corun_by_kind: Mapping[str, float] | None = None
    #: step model name -> {"prefill": sigma, "decode": sigma}: how far served steps
    #: scatter around the model (kvpush.sim.noise); none: steps last their modelled time
    step_noise: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    #: step model name -> {"prefill": (log factor, ...), "decode": ...}: the same scatter
    #: as a table of even quantiles, tail included; where given it is drawn from instead
    #: of the log-normal (kvpush.sim.noise)
    step_noise_quantiles: Mapping[str, Mapping[str, tuple[float, ...]]] = field(
        default_factory=dict)
    #: step model name -> seconds that each request arriving at the host (client, router
    #: and HTTP front end taking it in, on the cores the steps run on) adds to a step of
    #: that model in flight (host.arrival_step_s; none: arrivals cost steps nothing)
    arrival_step_s: Mapping[str, float] = field(default_factory=dict)

    def arrival_cost(self, role: str, override: str | None = None) -> float:
        """Seconds an arrival at the host adds to a step in flight of the step model
        ``role`` (or ``override``) runs."""
        return self.arrival_step_s.get(override or self.roles[role], 0.0)

    def noise_sigmas(self, role: str, override: str | None = None) -> Mapping[str, float]:
        """The step noise of the step model ``role`` (or ``override``) runs ({}: none)."""
        return self.step_noise.get(override or self.roles[role], {})

    def noise_quantiles(self, role: str, override: str | None = None
                        ) -> Mapping[str, tuple[float, ...]]:
        """The step noise's quantile tables of the step model ``role`` (or ``override``)
        runs ({}: none)."""
        return self.step_noise_quantiles.get(override or self.roles[role], {})

    @property
    def has_noise(self) -> bool:
        """Whether any step model's steps scatter (so noise seeds differ)."""
        return bool(self.step_noise or self.step_noise_quantiles)

    @property
    def has_corun(self) -> bool:
        """Whether a step beside a busy neighbour costs more at all."""
        return self.corun_by_kind is not None or self.corun_slowdown != 1.0

    def corun_factor(self, decode: bool) -> float:
        """The slowdown of a step (a decode-only one or not) beside a busy neighbour."""
        if self.corun_by_kind is not None:
            return self.corun_by_kind["decode" if decode else "prefill"]
        return self.corun_slowdown

    def scaled(self, factor: float, model: str | None = None) -> Profile:
        """This profile with every step model's times (or only ``model``'s) multiplied by
        ``factor``, and what an arrival adds to those models' steps with them (the
        front end takes a request in on the same cores, at the same speed)."""
        if not factor > 0:
            raise ProfileError(f"step-time scale must be > 0, got {factor}")
        if model is not None and model not in self.step_models:
            raise ProfileError(f"{self.name}: no step model {model!r} (have "
                               f"{', '.join(sorted(self.step_models))})")
        models = {k: ScaledStepModel(m, factor) if model in (None, k) else m
                  for k, m in self.step_models.items()}
        arrival = {k: v * factor if model in (None, k) else v
                   for k, v in self.arrival_step_s.items()}
        which = "step times" if model is None else f"{model} step times"
        return dataclasses.replace(self, step_models=models, arrival_step_s=arrival,
                                   notes=self.notes + (f"{which} scaled by {factor:g}",))

    def step_model(self, role: str, override: str | None = None) -> StepModel:
        name = override or self.roles[role]
        try:
            return self.step_models[name]
        except KeyError:
            raise ProfileError(f"{self.name}: no step model {name!r} (have "
                               f"{', '.join(sorted(self.step_models))})") from None


# ---------------------------------------------------------------------------- loading
def require_field(d: Mapping[str, Any], key: str, where: str,
                  kind: type | tuple = (int, float)) -> Any:
    if key not in d:
        raise ProfileError(f"{where}: missing field {key!r}")
    v = d[key]
    if kind in ((int, float), float) and isinstance(v, bool):
        raise ProfileError(f"{where}.{key}: expected a number, got {v!r}")
    if not isinstance(v, kind):
        raise ProfileError(f"{where}.{key}: expected {getattr(kind, '__name__', 'a number')},"
                           f" got {v!r}")
    if kind in ((int, float), float, int) and v < 0:
        raise ProfileError(f"{where}.{key}: must be >= 0, got {v!r}")
    return v


def _numbers(d: Mapping[str, Any], where: str, required: Sequence[str],
             optional: Sequence[str] = ()) -> dict[str, float]:
    if not isinstance(d, Mapping):
        raise ProfileError(f"{where}: expected an object, got {type(d).__name__}")
    out = {k: float(require_field(d, k, where)) for k in required}
    out.update({k: float(require_field(d, k, where)) for k in optional if k in d})
    return out


def _shape(d: Any, where: str) -> ModelShape:
    if not isinstance(d, Mapping):
        raise ProfileError(f"{where}: expected an object")
    ints = ("num_layers", "num_kv_heads", "head_dim", "hidden_size", "num_heads",
            "intermediate_size", "vocab_size")
    kw: dict[str, Any] = {k: require_field(d, k, where, int) for k in ints}
    for k in ("kv_bytes_per_elem", "weight_bytes_per_elem"):
        if k in d:
            kw[k] = require_field(d, k, where, int)
    return ModelShape(name=str(d.get("name", "model")),
                      tied_embeddings=bool(d.get("tied_embeddings", False)), **kw)


def row_table(v: Any, where: str) -> RowTable:
    """``[[rows, seconds], ...]`` with rows > 0 strictly ascending and seconds >= 0."""
    if not isinstance(v, Sequence) or isinstance(v, str):
        raise ProfileError(f"{where}: expected a list of [rows, seconds] pairs")
    out: list[tuple[float, float]] = []
    for p in v:
        ok = (isinstance(p, Sequence) and not isinstance(p, str) and len(p) == 2
              and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in p))
        if not ok or p[0] <= 0 or p[1] < 0 or (out and p[0] <= out[-1][0]):
            raise ProfileError(f"{where}: bad point {p!r} (need [rows > 0, seconds >= 0], "
                               "rows ascending)")
        out.append((float(p[0]), float(p[1])))
    return tuple(out)


def _step_model(d: Any, where: str, shape: ModelShape) -> StepModel:
    if not isinstance(d, Mapping):
        raise ProfileError(f"{where}: expected an object")
    kind = d.get("kind")
    if kind == "linear":
        c = _numbers(d, where, ("base_s", "per_token_s"),
                     ("per_attn_s", "per_seq_s", "per_ctx_s", "per_sample_s", "per_fill_s",
                      "token_rows_scale"))
        tables = {k: row_table(d[k], f"{where}.{k}") for k in ("token_rows_s",
                                                                 "sample_rows_s") if k in d}
        return LinearStepModel(**c, **tables)
    if kind == "roofline":
        c = _numbers(d, where, ("peak_flops", "mem_bandwidth", "mfu", "bw_efficiency",
                                "overhead_s"), ("per_layer_overhead_s",))
        for k in ("mfu", "bw_efficiency"):
            if not 0 < c[k] <= 1:
                raise ProfileError(f"{where}.{k}: must be in (0, 1], got {c[k]}")
        for k in ("peak_flops", "mem_bandwidth"):
            if c[k] <= 0:
                raise ProfileError(f"{where}.{k}: must be > 0")
        return RooflineStepModel(shape=shape, **c)
    raise ProfileError(f"{where}.kind: expected 'linear' or 'roofline', got {kind!r}")


def engine_step_model(data: Mapping[str, Any], name: str) -> StepModel:
    """Step model ``name`` of a profile's data as the engine alone runs it (without the
    served factors a loaded profile wraps it in)."""
    models = data.get("step_models")
    if not isinstance(models, Mapping) or name not in models:
        raise ProfileError(f"no step model {name!r}")
    return _step_model(models[name], f"step_models.{name}", _shape(data.get("model"), "model"))


def profile_from_dict(data: Any, path: str = "<dict>") -> Profile:
    if not isinstance(data, Mapping):
        raise ProfileError(f"{path}: a profile is a JSON object")
    shape = _shape(data.get("model"), f"{path}: model") if "model" in data else None
    if shape is None:
        raise ProfileError(f"{path}: missing field 'model'")
    sm = data.get("step_models")
    if not isinstance(sm, Mapping) or not sm:
        raise ProfileError(f"{path}: missing field 'step_models' (an object of step models)")
    models = {str(k): _step_model(v, f"{path}: step_models.{k}", shape) for k, v in sm.items()}
    roles = data.get("roles")
    if not isinstance(roles, Mapping):
        raise ProfileError(f"{path}: missing field 'roles' (role -> step model name)")
    for r in ROLES:
        if roles.get(r) not in models:
            raise ProfileError(f"{path}: roles.{r} must name one of the step models "
                               f"({', '.join(sorted(models))}), got {roles.get(r)!r}")
    tr = _numbers(data.get("transfer"), f"{path}: transfer",
                  ("bandwidth_Bps", "latency_s", "post_base_s", "post_per_desc_s"),
                  ("per_desc_s", "setup_s"))
    if tr["bandwidth_Bps"] <= 0:
        raise ProfileError(f"{path}: transfer.bandwidth_Bps must be > 0")
    ho = data.get("handoff")
    hn = _numbers(ho, f"{path}: handoff",
                  ("http_hop_s", "client_hop_s", "relay_s", "side_channel_s"),
                  ("handshake_s", "front_end_s", "engine_wake_s", "request_path_s",
                   "token_return_s",
                   "push_prefill_step_s", "push_prefill_corun_step_s",
                   "push_prefill_block_s", "push_prefill_corun_block_s"))
    gaps = ho.get("burst_first_gaps_s", [])
    if not isinstance(gaps, Sequence) or isinstance(gaps, str) or any(
            isinstance(g, bool) or not isinstance(g, (int, float)) or g < 0 for g in gaps):
        raise ProfileError(f"{path}: handoff.burst_first_gaps_s must be a list of seconds "
                           f">= 0, got {gaps!r}")
    group = ho.get("push_layers_per_write", 1)
    if isinstance(group, bool) or not isinstance(group, int) or group < 1:
        raise ProfileError(f"{path}: handoff.push_layers_per_write must be an integer >= 1, "
                           f"got {group!r}")
    inst = data.get("instance")
    if not isinstance(inst, Mapping):
        raise ProfileError(f"{path}: missing field 'instance'")
    limits = InstanceLimits(**{k: require_field(inst, k, f"{path}: instance", int) for k in
                               ("block_size", "num_blocks", "max_num_batched_tokens",
                                "max_num_seqs")})
    if min(limits.block_size, limits.num_blocks, limits.max_num_batched_tokens,
           limits.max_num_seqs) < 1:
        raise ProfileError(f"{path}: instance limits must all be >= 1")
    host = data.get("host", {})
    if not isinstance(host, Mapping):
        raise ProfileError(f"{path}: host must be an object")
    corun = float(require_field(host, "corun_slowdown", f"{path}: host")) if host else 1.0
    if corun < 1.0:
        raise ProfileError(f"{path}: host.corun_slowdown must be >= 1, got {corun}")
    by_kind = None
    if "corun_by_kind" in host:
        by_kind = _numbers(host["corun_by_kind"], f"{path}: host.corun_by_kind",
                           ("prefill", "decode"))
        if min(by_kind.values()) < 1.0:
            raise ProfileError(f"{path}: host.corun_by_kind factors must be >= 1, got "
                               f"{by_kind}")
    from kvpush.sim.served import served_step_models

    models = served_step_models(models, host, path)
    noise = _step_noise(host.get("step_noise", {}), models, f"{path}: host.step_noise")
    quantiles = _step_noise_quantiles(host.get("step_noise_quantiles", {}), models,
                                      f"{path}: host.step_noise_quantiles")
    arrival = host.get("arrival_step_s", {})
    if not isinstance(arrival, Mapping) or set(arrival) - set(models):
        raise ProfileError(f"{path}: host.arrival_step_s must map step model names to "
                           f"seconds, got {arrival!r}")
    arrival = {str(k): float(require_field(arrival, k, f"{path}: host.arrival_step_s"))
               for k in arrival}
    if any(v < 0 for v in arrival.values()):
        raise ProfileError(f"{path}: host.arrival_step_s must be >= 0, got {arrival}")
    sources = data.get("sources", {})
    if not isinstance(sources, Mapping):
        raise ProfileError(f"{path}: sources must be an object (figure -> source)")
    return Profile(
        name=str(data.get("name", Path(path).stem)),
        description=str(data.get("description", "")),
        model=shape, step_models=models, roles={r: str(roles[r]) for r in ROLES},
        transfer=TransferModel(**tr),
        handoff=HandoffModel(**hn, pull_post_on_step_loop=bool(
            ho.get("pull_post_on_step_loop", True)), push_layers_per_write=group,
            burst_first_gaps_s=tuple(float(g) for g in gaps)),
        instance=limits, sources={str(k): str(v) for k, v in sources.items()},
        notes=tuple(str(n) for n in data.get("notes", ())), path=path,
        corun_slowdown=corun, corun_by_kind=by_kind, step_noise=noise,
        step_noise_quantiles=quantiles, arrival_step_s=arrival)


def _per_model_kinds(table: Any, models: Mapping[str, StepModel], where: str, shape: str
                     ) -> list[tuple[str, Mapping[str, Any]]]:
    """The (step model, {noise kind: value}) pairs of ``host.step_noise`` or
    ``host.step_noise_quantiles``, the outer shape checked: an object of known step models,
    each an object keyed by noise kinds (``shape``: what a value is, for the error)."""
    if not isinstance(table, Mapping):
        raise ProfileError(f"{where} must be an object (step model -> {{kind: {shape}}})")
    for name, kinds in table.items():
        if name not in models:
            raise ProfileError(f"{where}.{name}: no such step model")
        if not isinstance(kinds, Mapping) or set(kinds) - set(NOISE_KINDS):
            raise ProfileError(f"{where}.{name}: expected an object with keys among "
                               f"{', '.join(NOISE_KINDS)}")
    return [(str(name), kinds) for name, kinds in table.items()]


def _step_noise(table: Any, models: Mapping[str, StepModel], where: str
                ) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for name, sigmas in _per_model_kinds(table, models, where, "sigma"):
        out[name] = {str(k): float(require_field(sigmas, k, f"{where}.{name}"))
                     for k in sigmas}
        if any(not 0.0 <= v < 1.0 for v in out[name].values()):
            raise ProfileError(f"{where}.{name}: sigmas must be in [0, 1), got {out[name]}")
    return out


def _step_noise_quantiles(table: Any, models: Mapping[str, StepModel], where: str
                          ) -> dict[str, dict[str, tuple[float, ...]]]:
    out: dict[str, dict[str, tuple[float, ...]]] = {}
    for name, kinds in _per_model_kinds(table, models, where, "[log factor, ...]"):
        out[name] = {}
        for kind, values in kinds.items():
            at = f"{where}.{name}.{kind}"
            if (isinstance(values, str) or not isinstance(values, Sequence)
                    or len(values) < 2 or any(
                    isinstance(v, bool) or not isinstance(v, (int, float)) for v in values)):
                raise ProfileError(f"{at}: expected a list of at least two numbers (log "
                                   "factors at even probabilities)")
            qs = tuple(float(v) for v in values)
            if any(b < a for a, b in zip(qs, qs[1:])) or not all(abs(v) < 3 for v in qs):
                raise ProfileError(f"{at}: the quantiles must be non-decreasing log "
                                   "factors within (-3, 3)")
            out[name][str(kind)] = qs
    return out


def builtin_profiles() -> list[str]:
    """Names of the profiles shipped with kvpush (``kvpush/sim/profiles/*.json``)."""
    folder = resources.files("kvpush.sim") / "profiles"
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".json"))


def load_profile(name_or_path: str | Path) -> Profile:
    """A profile from a JSON file, or a built-in one by name (``h200-tp8-qwen3-32b``)."""
    p = Path(name_or_path).expanduser()
    if not p.is_file():
        builtin = resources.files("kvpush.sim") / "profiles" / f"{name_or_path}.json"
        if not builtin.is_file():
            raise ProfileError(f"no profile {str(name_or_path)!r}: not a file, and not a "
                               f"built-in profile ({', '.join(builtin_profiles())})")
        text, where = builtin.read_text(encoding="utf-8"), f"built-in profile {name_or_path}"
    else:
        try:
            text, where = p.read_text(encoding="utf-8"), str(p)
        except OSError as e:
            raise ProfileError(f"cannot read profile {p}: {e}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ProfileError(f"{where}: not valid JSON: {e}") from None
    return profile_from_dict(data, where)
