"""Hardware profiles: what one step, one transfer and one hand-off message cost.

A profile is a JSON file (``profiles/`` holds the built-in ones; docs/SIMULATOR.md has
the table of its fields). It names the model's shape, one or more *step models*
(:mod:`kvpush.sim.step_models`), which step model each role runs, the transfer link, the
hand-off latencies and the instance limits. Everything is validated on load; a bad file
raises :class:`ProfileError` naming the file and the field.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from kvpush.sim.step_models import (
    LINEAR_FIELDS,
    LinearStepModel,
    ModelShape,
    RooflineStepModel,
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
    client_hop_s: float      # client <-> router, each way
    relay_s: float           # router: turn P's answer into D's leg (pull)
    side_channel_s: float    # P <-> D one message (PushRegister, PushDone, PullDone)
    pull_post_on_step_loop: bool = True  # vLLM: D posts the READ on its step path
    #: push: layers per WRITE while P's forward pass runs (kvpush's
    #: --push-layers-per-write: one on CUDA, a third of the layers on CPU by default;
    #: all layers = one WRITE after the pass, as vLLM's NixlPushConnector)
    push_layers_per_write: int = 1
    #: push: token #1 travels with PushDone (kvpush); False: D recomputes the last prompt
    #: token once the KV has landed, as vLLM's decode does in pull and push alike
    push_token_with_kv: bool = True


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

    def step_model(self, role: str) -> StepModel:
        return self.step_models[self.roles[role]]


# ---------------------------------------------------------------------------- loading
def _number(d: Mapping[str, Any], key: str, where: str, kind: type | tuple = (int, float)
            ) -> Any:
    if key not in d:
        raise ProfileError(f"{where}: missing field {key!r}")
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, kind):
        what = "an integer" if kind is int else "a number"
        raise ProfileError(f"{where}.{key}: expected {what}, got {v!r}")
    if v < 0:
        raise ProfileError(f"{where}.{key}: must be >= 0, got {v!r}")
    return v


def _numbers(d: Any, where: str, required: Sequence[str],
             optional: Sequence[str] = ()) -> dict[str, float]:
    if not isinstance(d, Mapping):
        raise ProfileError(f"{where}: expected an object, got {type(d).__name__}")
    keys = [*required, *(k for k in optional if k in d)]
    return {k: float(_number(d, k, where)) for k in keys}


def _shape(d: Any, where: str) -> ModelShape:
    if not isinstance(d, Mapping):
        raise ProfileError(f"{where}: expected an object")
    ints = ("num_layers", "num_kv_heads", "head_dim", "hidden_size", "num_heads",
            "intermediate_size", "vocab_size")
    kw: dict[str, Any] = {k: _number(d, k, where, int) for k in ints}
    for k in ("kv_bytes_per_elem", "weight_bytes_per_elem"):
        if k in d:
            kw[k] = _number(d, k, where, int)
    return ModelShape(name=str(d.get("name", "model")),
                      tied_embeddings=bool(d.get("tied_embeddings", False)), **kw)


ROOFLINE_FIELDS = ("peak_flops", "mem_bandwidth", "mfu", "bw_efficiency", "overhead_s")


def _step_model(d: Any, where: str, shape: ModelShape) -> StepModel:
    if not isinstance(d, Mapping):
        raise ProfileError(f"{where}: expected an object")
    kind = d.get("kind")
    if kind == "linear":
        fields, c = LINEAR_FIELDS, _numbers(d, where, LINEAR_FIELDS[:2], LINEAR_FIELDS[2:])
    elif kind == "roofline":
        fields = ROOFLINE_FIELDS + ("per_layer_overhead_s",)
        c = _numbers(d, where, ROOFLINE_FIELDS, fields[-1:])
        for k in ("peak_flops", "mem_bandwidth", "mfu", "bw_efficiency"):
            if c[k] <= 0 or (k in ("mfu", "bw_efficiency") and c[k] > 1):
                raise ProfileError(f"{where}.{k}: must be > 0 (mfu, bw_efficiency: at most "
                                   f"1), got {c[k]}")
    else:
        raise ProfileError(f"{where}.kind: expected 'linear' or 'roofline', got {kind!r}")
    unknown = sorted(set(d) - set(fields) - {"kind"})
    if unknown:  # e.g. a profile written by an older calibrate: refuse, not misprice
        raise ProfileError(f"{where}: unknown fields {', '.join(unknown)} for a {kind} "
                           f"step model ({', '.join(fields)})")
    if kind == "linear":
        return LinearStepModel(**c)
    return RooflineStepModel(shape=shape, **c)


def profile_from_dict(data: Any, path: str = "<dict>") -> Profile:
    if not isinstance(data, Mapping):
        raise ProfileError(f"{path}: a profile is a JSON object")
    if "model" not in data:
        raise ProfileError(f"{path}: missing field 'model'")
    shape = _shape(data["model"], f"{path}: model")
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
                  ("http_hop_s", "client_hop_s", "relay_s", "side_channel_s"))
    group = ho.get("push_layers_per_write", 1)
    if isinstance(group, bool) or not isinstance(group, int) or group < 1:
        raise ProfileError(f"{path}: handoff.push_layers_per_write must be an integer >= 1, "
                           f"got {group!r}")
    inst = data.get("instance")
    if not isinstance(inst, Mapping):
        raise ProfileError(f"{path}: missing field 'instance'")
    limits = InstanceLimits(**{k: _number(inst, k, f"{path}: instance", int) for k in
                               ("block_size", "num_blocks", "max_num_batched_tokens",
                                "max_num_seqs")})
    if min(dataclasses.astuple(limits)) < 1:
        raise ProfileError(f"{path}: instance limits must all be >= 1")
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
            push_token_with_kv=bool(ho.get("push_token_with_kv", True))),
        instance=limits, sources={str(k): str(v) for k, v in sources.items()},
        notes=tuple(str(n) for n in data.get("notes", ())), path=path)


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
