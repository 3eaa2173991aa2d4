"""Refit a calibrated profile's step models from the samples it recorded.

`kvpush simulate calibrate` stores every step it timed (``measured.step_samples``) and,
from the served probe, every step the serving instance ran (``measured.served[...]
.trace``). When the step model changes (a new feature, a new fit), ``kvpush simulate
refit OLD.json --out NEW.json`` fits it again from those samples and prices the probe's
steps with the new fit for new ``host.served_factors``, ``host.step_noise`` and
``host.step_noise_quantiles``: no engine runs, so the new profile describes the same
host at the same moment as the old one, and the two can be compared on the same
benchmark runs. (A profile calibrated before the quantile tables existed gains them in
a refit, so its steps then scatter as the tables say, not log-normally: two changes at
once.) Given several profiles of one host, ``kvpush simulate refit A.json B.json --out
POOLED.json`` fits them as one (:func:`pool_calibrations`).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable
from typing import Any

from kvpush.sim.matmul_tables import TABLE_SPREAD_WARN, table_spread, thread_warnings
from kvpush.sim.step_fit import fit_linear, pass_levels, pass_warning


def _mean_numbers(dicts: list[dict[str, Any]]) -> dict[str, Any]:
    """The first dict with each number that every dict has replaced by their mean (an
    integer that all have alike, a setting such as handoff.push_layers_per_write, stays
    as it is)."""
    out = dict(dicts[0])
    for k, v in out.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and all(
                isinstance(d.get(k), (int, float)) for d in dicts):
            if isinstance(v, int) and all(d[k] == v for d in dicts):
                continue
            out[k] = sum(float(d[k]) for d in dicts) / len(dicts)
    return out


def pool_calibrations(datas: list[dict[str, Any]], log: Callable[[str], None] = print
                      ) -> dict[str, Any]:
    """One calibrated profile from several of the same host and model (e.g. the ones
    `benchmarks/sim_runs.sh` makes just before and just after its runs), ready for
    :func:`refit_profile`: the step samples and served probe traces of all, matmul
    tables (each calibration's own already the lower median of its timings, which are
    all kept in ``measured.matmul_timings``), co-run factors, hand-off and transfer
    figures averaged. Two calibrations 25 minutes apart differed by up to 11% on
    one-thread steps (SIMULATION.md 1-v12); runs between them see the host somewhere in
    between. Each calibration's tables are checked as calibrate checks them now
    (:func:`kvpush.sim.matmul_tables.thread_warnings`)."""
    if not datas:
        raise ValueError("no profiles to pool")
    for d in datas:
        if not isinstance(d, dict) or not isinstance(d.get("measured"), dict):
            raise ValueError("not a calibrated profile (a JSON object with a measured object)")
        if d.get("model") != datas[0].get("model"):
            raise ValueError("the profiles describe different models; pool calibrations of "
                             "one model only")
        if set(d.get("step_models", {})) != set(datas[0].get("step_models", {})):
            raise ValueError("the profiles have different step models")
    for i, d in enumerate(datas):
        for warning in thread_warnings(d.get("step_models", {})):
            log(f"[refit] calibration {i + 1} of {len(datas)} "
                f"({d['measured'].get('started_utc', '?')}): {warning}")
    out = copy.deepcopy(datas[0])
    if len(datas) == 1:
        return out
    measured = out["measured"]
    measured["pooled_from"] = [d["measured"].get("started_utc", "?") for d in datas]
    measured["step_samples"] = {name: [row for d in datas
                                       for row in d["measured"].get("step_samples", {})
                                       .get(name, [])]
                                for name in out["step_models"]}
    timings = [d["measured"].get("matmul_timings") for d in datas]
    if all(timings):  # every calibration's per-pass table timings, kept as a record
        measured["matmul_timings"] = {name: [t for m in timings for t in m.get(name, [])]
                                      for name in out["step_models"]}
    else:
        measured.pop("matmul_timings", None)
    # the host probe's figures of every calibration (kvpush.sim.host_level): the pooled
    # fit's speed level is theirs together; without them in every profile, none
    probes = [d["measured"].get("host_probe_ms") for d in datas]
    if all(probes):
        measured["host_probe_ms"] = {name: [v for p in probes for v in p.get(name, [])]
                                     for name in out["step_models"]}
    else:
        measured.pop("host_probe_ms", None)
    # each calibration's pull / push pair figure (handoff.push_prefill_step_s: their mean)
    if any(d["measured"].get("push_step") for d in datas):
        measured["push_step"] = [d["measured"].get("push_step") or {} for d in datas]
    served = measured.get("served") or {}
    for name in served:
        served[name]["trace"] = [st for d in datas for st in
                                 (d["measured"].get("served") or {}).get(name, {})
                                 .get("trace", [])]
    for name, sm in out["step_models"].items():
        for key in ("token_rows_s", "sample_rows_s"):
            tables = [d["step_models"][name].get(key) for d in datas]
            if not tables[0]:
                continue
            if any(not t or [r for r, _ in t] != [r for r, _ in tables[0]] for t in tables):
                raise ValueError(f"step_models.{name}.{key}: the profiles timed different "
                                 "rows; pool calibrations of one plan only")
            sm[key] = [[r, sum(t[i][1] for t in tables) / len(tables)]
                       for i, (r, _) in enumerate(tables[0])]
            if (spread := table_spread(tables)) > TABLE_SPREAD_WARN:
                # v24: one calibration timed its 2-thread table at 1-thread speed
                log(f"[refit] warning: {name}: the calibrations' {key} tables differ by up "
                    f"to {spread:.0%}: one was timed while the host ran slower, and the "
                    "pooled table carries it" + (" (refit --fit-table-scale fits its level "
                                                 "to the steps)" if key == "token_rows_s"
                                                 else ""))
    host = out.setdefault("host", {"corun_slowdown": 1.0})
    hosts = [d.get("host", {}) for d in datas]
    host["corun_slowdown"] = sum(float(h.get("corun_slowdown", 1.0)) for h in hosts) / len(hosts)
    if all("corun_by_kind" in h for h in hosts):
        host["corun_by_kind"] = _mean_numbers([h["corun_by_kind"] for h in hosts])
    costs = [h.get("arrival_step_s") or {} for h in hosts]  # per step model, where all have it
    host.pop("arrival_step_s", None)
    if common := [k for k in sorted(costs[0]) if all(k in c for c in costs)]:
        host["arrival_step_s"] = {k: sum(c[k] for c in costs) / len(costs) for k in common}
    for key in ("handoff", "transfer"):
        if all(isinstance(d.get(key), dict) for d in datas):
            out[key] = _mean_numbers([d[key] for d in datas])
    # every calibration's bursts: their first gaps together, where all measured them
    gaps = [d.get("handoff", {}).get("burst_first_gaps_s") for d in datas]
    if isinstance(out.get("handoff"), dict):
        out["handoff"].pop("burst_first_gaps_s", None)
        if all(gaps):
            out["handoff"]["burst_first_gaps_s"] = [g for gs in gaps for g in gs]
    out.setdefault("notes", []).append(
        f"Pooled from {len(datas)} calibrations ({', '.join(measured['pooled_from'])}): "
        "their step samples and served probe traces refitted together; matmul tables, "
        "co-run factors, arrival costs, hand-off and transfer figures averaged (the bursts' "
        "first gaps, handoff.burst_first_gaps_s, put together).")
    return out


def refit_profile(data: dict[str, Any], log: Callable[[str], None] = print,
                  fit_table_scale: bool = False) -> dict[str, Any]:
    """A copy of the profile ``data`` with its linear step models fitted again and, where
    the probe's trace was kept, its served factors re-measured against the new fits
    (``fit_table_scale``: the projections' table level fitted too, see
    :func:`kvpush.sim.step_fit.fit_linear`)."""
    from kvpush.sim.served import curves_json, describe, fit_served

    if not isinstance(data, dict) or not isinstance(data.get("measured", {}), dict):
        raise ValueError("not a calibrated profile (a JSON object with a measured object)")
    out = copy.deepcopy(data)
    measured = out.get("measured", {})
    samples = measured.get("step_samples") or {}
    if not isinstance(samples, dict) or not samples:
        raise ValueError("the profile has no measured.step_samples to refit from "
                         "(only profiles written by `kvpush simulate calibrate` have)")
    served = measured.get("served") or {}
    host = out.setdefault("host", {"corun_slowdown": 1.0})
    factors = host.setdefault("served_factors", {})
    # the samples hold every pass over the plan of every calibration pooled, in order
    passes = (int((measured.get("plan") or {}).get("repeats") or 1)
              * len(measured.get("pooled_from") or [None]))
    for name, rows in samples.items():
        old = out["step_models"].get(name, {})
        tables = {k: old[k] for k in ("token_rows_s", "sample_rows_s") if k in old}
        pairs = [([tuple(c) for c in ch], dt) for ch, dt in rows]
        leveled = fit_table_scale and bool(tables.get("token_rows_s"))
        model, quality = fit_linear(pairs, tables, leveled)
        out["step_models"][name] = {"kind": "linear", **{
            k: v for k, v in dataclasses.asdict(model).items() if v is not None}}
        levels = pass_levels(pairs, model, passes)
        measured.setdefault("fits", {})[name] = {**quality, "pass_levels": levels}
        log(f"[refit] {name}: median rel. err {quality['median_rel_err']:.1%}, max "
            f"{quality['max_rel_err']:.1%} over {len(rows)} samples"
            + (f"; projections' table level {model.token_rows_scale:.2f}" if leveled else ""))
        if leveled and model.token_rows_scale == 0:
            log(f"[refit] warning: {name}: the fit dropped the projections' table (level 0): "
                "the model keeps no 1-row / 2-row matmul shape")
        if warning := pass_warning(name, levels):
            log(f"[refit] {warning}")
        trace = (served.get(name) or {}).get("trace")
        if trace:
            fit = fit_served([{"chunks": ch, "dur": dt} for ch, dt in trace], model)
            factors[name] = fit.factors
            curves = curves_json(fit.curves)
            quantiles = {k: list(v) for k, v in fit.noise_quantiles.items()}
            for key, value in (("served_factor_curves", curves), ("step_noise", fit.noise),
                               ("step_noise_quantiles", quantiles)):
                # the new fit's figure, or none: an old one was measured against the old fit
                table = host.setdefault(key, {})
                table.pop(name, None)
                if value:
                    table[name] = value
            served[name].update(factors=fit.factors, curves=curves, noise=fit.noise,
                                noise_quantiles=quantiles, steps=fit.steps)
            log(f"[refit] {name}: served factors " + ", ".join(
                f"{k} {describe(v, fit.curves.get(k))}" for k, v in fit.factors.items()))
        elif name in factors:
            log(f"[refit] {name}: no probe trace kept; served factors and step noise left "
                "as they were (measured against the old fit)")
    out.setdefault("notes", []).append(
        f"Step models refitted from the recorded samples by `kvpush simulate refit` on "
        f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}.")
    return out
