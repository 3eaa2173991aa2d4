"""kvpush's GPU check: one script that proves the CUDA path on one GPU in 8 minutes.

    python3 benchmarks/gpu/check.py            # on a CUDA machine (make gpu-check)
    python3 benchmarks/gpu/check.py --dry      # anywhere: plan, wheels, size (gpu-check-dry)
    python3 benchmarks/gpu/check.py --device cpu --quick   # the steps on CPU, small shapes

Each step runs in its own process under its own time budget (:data:`STEPS`); a step
that fails or runs out of time is recorded and the next one runs. The summary (JSON and
markdown, with ``nvidia-smi``'s GPU line) goes to ``--out``, else ``$OUT``, else
``benchmarks/results/gpu/`` (``.cache/gpu-check-dry/`` and ``.cache/gpu-check-cpu/`` for
the dry and CPU runs). docs/GPU.md says what each step proves.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

import wheels  # noqa: E402

#: the whole check's bound on a GPU machine (the device tool allows 10 minutes a run)
TOTAL_BUDGET_S = 480.0
#: past a step's budget it gets SIGTERM, then SIGKILL this much later
KILL_GRACE_S = 8.0


@dataclass(frozen=True)
class Step:
    name: str
    budget_s: float
    proves: str
    where: str = "device"  # "device": its own process; "host": inside this one


STEPS: tuple[Step, ...] = (
    Step("env", 10, "the GPU (nvidia-smi), driver, Python, torch and its CUDA, the "
         "packages already there and their versions", "host"),
    Step("install", 30, "the carried wheels install offline into a temporary folder "
         "(pip --no-index --no-deps --target)", "host"),
    Step("nixl", 15, "fastapi, uvicorn, msgspec, pyzmq and NIXL import from it; a NIXL "
         "UCX agent registers GPU memory (VRAM) and WRITEs it to a second agent"),
    Step("hf_parity", 45, "kvpush's greedy tokens equal HF transformers' on random Qwen3 "
         "and Llama in fp32 (four prompts batched, paged decode attention, the CUDA "
         "default), logits within 1e-3; bf16 logits within the bf16 bound of "
         "tests/test_engine_bf16.py; every block free after"),
    Step("paged_decode", 20, "model/paged_decode.py on the GPU against the dense path "
         "(one chunk and the online-softmax chunks, fp32 and bf16), and an engine with "
         "paged decode gives the same tokens as one with the dense decode cache"),
    Step("pd", 65, "a prefill and a decode process on the one GPU, NIXL over UCX on GPU "
         "memory, push and pull, answers equal to a colocated instance's, every "
         "instance's free blocks back to their start"),
    Step("bench_model", 20, "the bench model (Qwen3-32B's KV per layer: 8 KV heads x "
         "128, 64 layers) and the time of a 2,048-token bf16 prefill on the GPU"),
    Step("compare", 200, "kvpush bench compare colocated / pull / push, 2,048 in / 128 "
         "out, rates 1, 2, 4 (vllm bench serve's shape in the announcement)"),
    Step("handoff", 60, "kvpush bench handoff: time to the first chunk, one request at "
         "a time, colocated / push / pull, 128 and 2,048 prompt tokens"),
)


@dataclass
class StepResult:
    name: str
    budget_s: float
    status: str  # passed, failed, timeout, skipped (by plan), not_run (no time left)
    seconds: float = 0.0
    proves: str = ""
    error: str = ""
    figures: dict[str, Any] = field(default_factory=dict)
    log_tail: str = ""


# -- host steps ---------------------------------------------------------------------------

def _run(cmd: list[str], timeout: float = 10) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def gpu_line() -> str:
    """nvidia-smi's line for each GPU: name, memory, driver (empty without one)."""
    if shutil.which("nvidia-smi") is None:
        return ""
    q = _run(["nvidia-smi", "--query-gpu=index,name,memory.total,driver_version,pstate",
              "--format=csv,noheader"])
    return q or _run(["nvidia-smi", "-L"])


def env_step(device: str) -> dict[str, Any]:
    from importlib import metadata

    figs: dict[str, Any] = {"python": sys.version.split()[0], "gpu": gpu_line(),
                            "nvidia_smi_L": _run(["nvidia-smi", "-L"]) if gpu_line() else ""}
    versions = {}
    for name in [*wheels.PROVIDED, "uvloop", "msgpack", "pytest"]:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    figs["versions"] = versions
    probe = ("import json, torch; print(json.dumps({'torch': torch.__version__, "
             "'cuda': torch.version.cuda, 'available': torch.cuda.is_available(), "
             "'device': torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, "
             "'bf16': torch.cuda.is_available() and torch.cuda.is_bf16_supported()}))")
    out = _run([sys.executable, "-c", probe], timeout=60)
    figs["torch"] = json.loads(out) if out.startswith("{") else out
    if device.startswith("cuda") and not (isinstance(figs["torch"], dict)
                                          and figs["torch"].get("available")):
        raise RuntimeError("torch sees no CUDA device")
    return figs


def install_step(wheel_dir: Path, site: Path, timeout: float) -> dict[str, Any]:
    found = sorted(wheel_dir.glob("*.whl"))
    if not found:
        raise RuntimeError(f"no wheels in {wheel_dir}: carry it (make gpu-wheels first)")
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
           "--no-index", "--no-deps", "--no-compile", "--no-cache-dir", "--upgrade",
           "--target", str(site), *map(str, found)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if run.returncode != 0:
        raise RuntimeError(f"pip install failed: {run.stderr.strip()[-800:]}")
    return {"wheels": [w.name for w in found], "site": str(site)}


# -- device steps (each in its own process) ----------------------------------------------------

def nixl_step(device: str) -> dict[str, Any]:
    """Imports of the carried packages, then NIXL: two agents in this process, one
    region each on the device, a WRITE from one to the other, bytes compared."""
    from importlib import metadata

    import numpy as np
    import torch

    figs: dict[str, Any] = {}
    for mod in ("fastapi", "uvicorn", "starlette", "pydantic", "msgspec", "zmq", "nixl"):
        __import__(mod)
    figs["versions"] = {n: metadata.version(n) for n in
                        ("fastapi", "uvicorn", "pydantic", "msgspec", "pyzmq", "nixl")}
    from nixl._api import nixl_agent, nixl_agent_config

    from kvpush.kv_transfer.transports.nixl_transport import nixl_mem

    mem, dev_id = nixl_mem(device)
    cfg = nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
    a, b = nixl_agent("gpu-check-a", cfg), nixl_agent("gpu-check-b", cfg)
    figs["plugins"] = a.get_plugin_list()
    figs["mem_type"] = mem
    n = 64 << 20
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=device)
    dst = torch.zeros(n, dtype=torch.uint8, device=device)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    a.register_memory([(src.data_ptr(), n, dev_id, "")], mem)
    b.register_memory([(dst.data_ptr(), n, dev_id, "")], mem)
    peer = a.add_remote_agent(b.get_agent_metadata())
    local = a.get_xfer_descs(np.array([[src.data_ptr(), n, dev_id]], dtype=np.uint64), mem)
    remote = a.get_xfer_descs(np.array([[dst.data_ptr(), n, dev_id]], dtype=np.uint64), mem)
    t0 = time.perf_counter()
    xfer = a.initialize_xfer("WRITE", local, remote, peer, b"")
    state = a.transfer(xfer)
    for _ in range(20_000):  # at most ~10 s
        if state != "PROC":
            break
        b.get_new_notifs()
        state = a.check_xfer_state(xfer)
        time.sleep(0.0005)
    figs["write_state"] = state
    figs["write_ms_64MiB"] = round(1000 * (time.perf_counter() - t0), 2)
    figs["bytes_equal"] = bool(torch.equal(src, dst))
    if state != "DONE" or not figs["bytes_equal"]:
        raise AssertionError(f"NIXL {mem} WRITE: state {state}, equal {figs['bytes_equal']}")
    return figs


def run_device_step(name: str, ctx: Any, budget: float) -> dict:
    import model_steps as ms

    if name == "nixl":
        ctx.figures.update(nixl_step(ctx.device))
        return ctx.figures
    if name in ("hf_parity", "paged_decode", "bench_model"):
        return getattr(ms, name)(ctx)
    import serving_steps as ss

    if name == "pd":
        return ss.pd(ctx)
    return getattr(ss, name)(ctx, budget)


def step_main(args: argparse.Namespace) -> int:
    """One device step in this process; its result goes to ``--result`` as JSON (with
    the figures gathered before a failure)."""
    import model_steps as ms

    ctx = ms.StepContext(device=args.device, work=args.work, quick=args.quick)
    out: dict[str, Any] = {"status": "passed", "figures": ctx.figures, "error": ""}
    try:
        run_device_step(args.step, ctx, args.budget)
    except ms.CheckFailed as e:
        out.update(status="failed", error=str(e))
    except BaseException as e:  # noqa: BLE001 - recorded, the check goes on
        traceback.print_exc()
        out.update(status="failed", error=f"{type(e).__name__}: {e}")
    args.result.write_text(json.dumps(out, default=str, indent=1))
    return 0 if out["status"] == "passed" else 1


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def spawn_step(step: Step, budget: float, device: str, work: Path, quick: bool,
               env: dict[str, str]) -> StepResult:
    res = StepResult(step.name, budget, "failed", proves=step.proves)
    result_file = work / f"{step.name}.result.json"
    log = work / f"{step.name}.log"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--step", step.name,
           "--device", device, "--work", str(work), "--result", str(result_file),
           "--budget", str(budget), *(["--quick"] if quick else [])]
    t0 = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            proc.wait(budget)
        except subprocess.TimeoutExpired:
            res.status = "timeout"
            _stop_group(proc)
    res.seconds = round(time.perf_counter() - t0, 1)
    if result_file.exists():
        data = json.loads(result_file.read_text())
        res.figures, res.error = data["figures"], data["error"]
        if res.status != "timeout":
            res.status = data["status"]
    elif res.status != "timeout":
        res.error = f"exited {proc.returncode} without a result"
    if res.status == "timeout":
        res.error = res.error or f"over its {budget:.0f} s budget"
    if res.status != "passed":
        res.log_tail = _tail(log)
    return res


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the step's process group (clusters stop through their supervisor),
    SIGKILL after KILL_GRACE_S."""
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


# -- the run --------------------------------------------------------------------------------

def default_out(mode: str) -> Path:
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"])
    return {"cuda": ROOT / "benchmarks/results/gpu", "dry": ROOT / ".cache/gpu-check-dry",
            "cpu": ROOT / ".cache/gpu-check-cpu"}[mode]


def dry_checks(wheel_dir: Path) -> dict[str, Any]:
    comp = wheels.check_complete(wheel_dir)
    size = wheels.travel_size(ROOT, [wheel_dir])
    return {"wheels": asdict(comp), "travel": {"tree_bytes": size.tree,
                                               "carried_bytes": size.carried,
                                               "total_bytes": size.total,
                                               "limit_bytes": size.limit, "ok": size.ok,
                                               "text": size.describe()}}


def run_check(args: argparse.Namespace) -> dict[str, Any]:
    mode = "dry" if args.dry else ("cuda" if args.device.startswith("cuda") else "cpu")
    started = time.perf_counter()
    scale = args.budget_scale
    deadline = started + args.total_budget * scale
    summary: dict[str, Any] = {
        "mode": mode, "device": args.device, "quick": args.quick,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "total_budget_s": args.total_budget * scale, "gpu": gpu_line(), "steps": []}
    wheel_dir = args.wheels
    if mode == "dry":
        summary.update(dry_checks(wheel_dir))
    work = Path(tempfile.mkdtemp(prefix="kvpush-gpu-check-"))
    site = work / "site"
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    env.setdefault("UCX_NET_DEVICES", "lo")
    env.setdefault("NIXL_LOG_LEVEL", "WARN")
    path = [str(ROOT / "src")] + ([str(site)] if mode == "cuda" else [])
    env["PYTHONPATH"] = os.pathsep.join(path + [p for p in [os.environ.get("PYTHONPATH")] if p])
    for step in STEPS:
        left = deadline - time.perf_counter()
        budget = min(step.budget_s * scale, left)
        if mode == "dry" and step.name == "env":  # what this host has, no GPU needed
            res = StepResult(step.name, step.budget_s, "passed", proves=step.proves)
            t0 = time.perf_counter()
            res.figures = env_step("cpu")
            res.seconds = round(time.perf_counter() - t0, 1)
        elif mode == "dry" or (step.name == "install" and mode != "cuda"):
            why = "dry run" if mode == "dry" else "not on CUDA: this Python's packages are used"
            res = StepResult(step.name, step.budget_s, "skipped", proves=step.proves, error=why)
        elif budget < 5:
            res = StepResult(step.name, step.budget_s, "not_run", proves=step.proves,
                             error="no time left in the total budget")
        elif step.where == "host":
            res = StepResult(step.name, budget, "passed", proves=step.proves)
            t0 = time.perf_counter()
            try:
                res.figures = (env_step(args.device) if step.name == "env"
                               else install_step(wheel_dir, site, budget))
            except Exception as e:  # noqa: BLE001 - recorded, the check goes on
                res.status, res.error = "failed", f"{type(e).__name__}: {e}"
            res.seconds = round(time.perf_counter() - t0, 1)
        else:
            res = spawn_step(step, budget, args.device, work, args.quick, env)
        print(f"[gpu-check] {step.name:<13} {res.status:<8} {res.seconds:6.1f} s "
              f"(budget {res.budget_s:.0f} s){'  ' + res.error if res.error else ''}",
              flush=True)
        summary["steps"].append(asdict(res))
    summary["elapsed_s"] = round(time.perf_counter() - started, 1)
    summary["work"] = str(work)
    # the device tool brings back at most 8 files: the summary's two and six logs
    summary["failure_logs"] = {s["name"]: failure_log(work, s["name"])
                               for s in summary["steps"]
                               if s["status"] in ("failed", "timeout")
                               and (work / f"{s['name']}.log").exists()}
    if not args.keep_work:
        shutil.rmtree(work, ignore_errors=True)
    return summary


#: the cluster logs each serving step leaves in the work folder
STEP_LOGS = {"pd": ["pd-logs"], "compare": ["compare/logs", "compare.log"],
             "handoff": ["handoff-logs", "handoff.log"]}
#: the most bytes of one failed step's logs copied next to the summary
FAILURE_LOG_BYTES = 2 << 20


def failure_log(work: Path, name: str, tail: int = 60) -> str:
    """A failed step's own log, then the tail of every log its clusters wrote."""
    parts = [f"==== {name}.log\n{_tail(work / f'{name}.log', 400)}"]
    for rel in STEP_LOGS.get(name, []):
        path = work / rel
        files = sorted(path.rglob("*.log")) if path.is_dir() else [path]
        parts += [f"==== {f.relative_to(work)}\n{_tail(f, tail)}" for f in files if f.is_file()]
    return "\n".join(parts)[-FAILURE_LOG_BYTES:]


def ok(summary: dict[str, Any]) -> bool:
    if summary["mode"] == "dry":
        return summary["wheels"]["ok"] and summary["travel"]["ok"]
    # "skipped" is by plan (install off CUDA, --only); "not_run": out of time
    return all(s["status"] in ("passed", "skipped") for s in summary["steps"])


def markdown(summary: dict[str, Any]) -> str:
    lines = [f"# kvpush GPU check ({summary['mode']}, {summary['date']})", "",
             f"GPU: `{summary['gpu'] or 'none'}`", "",
             f"Elapsed {summary['elapsed_s']} s of {summary['total_budget_s']:.0f} s; "
             f"{'all steps passed' if ok(summary) else 'NOT all passed'}.", "",
             "| step | status | seconds | budget | error |", "|---|---|---|---|---|"]
    for s in summary["steps"]:
        lines.append(f"| {s['name']} | {s['status']} | {s['seconds']} | {s['budget_s']:.0f} "
                     f"| {s['error'].replace('|', '/')[:160]} |")
    if summary["mode"] == "dry":
        w = summary["wheels"]
        lines += ["", f"Wheels: {'complete' if w['ok'] else 'INCOMPLETE: ' + w['error']}"
                  + (f"; carried: {', '.join(w['carried'])}" if w["ok"] else ""),
                  "", summary["travel"]["text"]]
    for s in summary["steps"]:
        figs = s["figures"]
        if figs.get("markdown"):  # a bench's own tables (its figures: summary.json)
            lines += ["", f"## {s['name']}", "", f"`{figs.get('command', '')}`", "",
                      figs["markdown"]]
        elif figs:
            lines += ["", f"## {s['name']}", "", "```", json.dumps(figs, indent=1,
                                                                   default=str)[:4000], "```"]
        if s["log_tail"]:
            lines += ["", f"Log tail of {s['name']}:", "", "```", s["log_tail"], "```"]
    return "\n".join(lines) + "\n"


def write_summary(summary: dict[str, Any], out: Path) -> None:
    """summary.json (without the logs), summary.md, and FAILED-<step>.log for up to six
    failed steps."""
    out.mkdir(parents=True, exist_ok=True)
    logs = summary.pop("failure_logs", {})
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    (out / "summary.md").write_text(markdown(summary))
    for name, text in list(logs.items())[:6]:
        (out / f"FAILED-{name}.log").write_text(text)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry", action="store_true",
                   help="no device step: the step plan, the wheels' completeness and the "
                        "travelling size")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (debugging)")
    p.add_argument("--quick", action="store_true", help="smaller shapes (CPU debugging)")
    p.add_argument("--wheels", type=Path, default=ROOT / wheels.WHEEL_DIR)
    p.add_argument("--out", type=Path, help="summary folder (default: $OUT, else see above)")
    p.add_argument("--total-budget", type=float, default=TOTAL_BUDGET_S)
    p.add_argument("--budget-scale", type=float, default=1.0,
                   help="multiply every budget (a CPU run's steps take longer)")
    p.add_argument("--only", help="comma-separated step names to run (others skipped)")
    p.add_argument("--keep-work", action="store_true", help="keep the work folder")
    p.add_argument("--step", help=argparse.SUPPRESS)
    p.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--budget", type=float, default=60.0, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.step:
        return step_main(args)
    global STEPS
    if args.only:
        names = set(args.only.split(","))
        unknown = names - {s.name for s in STEPS}
        if unknown:
            print(f"unknown steps: {', '.join(sorted(unknown))}", file=sys.stderr)
            return 2
        STEPS = tuple(s for s in STEPS if s.name in names or s.where == "host")
    summary = run_check(args)
    out = args.out or default_out(summary["mode"])
    write_summary(summary, out)
    if summary["mode"] == "dry":
        w = summary["wheels"]
        print("[gpu-check] wheels: " + ("complete for cp312 + the GPU machine's packages "
                                        f"({len(w['carried'])} carried)" if w["ok"]
                                        else f"INCOMPLETE: {w['error']}"))
        print(f"[gpu-check] {summary['travel']['text']}")
    print(f"[gpu-check] summary: {out / 'summary.md'}")
    return 0 if ok(summary) else 1


if __name__ == "__main__":
    sys.exit(main())
