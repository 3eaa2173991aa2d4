"""The GPU check's plumbing (benchmarks/gpu/, docs/GPU.md) on a CPU: its dry run, the
wheel completeness check, the nixl-cu13 slimming, the travelling size, and the
``--device`` that reaches every instance. Nothing is downloaded: the wheels the check
resolves here are metadata-only stand-ins built by the test."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPU = ROOT / "benchmarks" / "gpu"
sys.path.insert(0, str(GPU))

import model_steps  # noqa: E402
import wheels  # noqa: E402

# under its own name: "check" is too common a module name to claim in sys.modules
_spec = importlib.util.spec_from_file_location("kvpush_gpu_check", GPU / "check.py")
check = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = check  # dataclasses look their module up there
_spec.loader.exec_module(check)


#: the carried packages' own needs (their wheels' Requires-Dist, versions left out)
NEEDS = {"fastapi": ["starlette", "pydantic", "anyio", "typing-extensions",
                     "typing-inspection", "annotated-doc", "opentelemetry-api"],
         "starlette": ["anyio"], "anyio": ["idna"], "uvicorn": ["click", "h11"],
         "pydantic": ["annotated-types", "pydantic-core", "typing-inspection"],
         "nixl": ["nixl-cu12", "nixl-cu13"], "nixl-cu13": ["torch", "numpy"]}


def _stub_carried(folder: Path) -> None:
    pins = wheels.pinned_versions()
    for name in wheels.CARRIED:
        wheels.stub_wheel(folder, name, pins[wheels._norm(name)], NEEDS.get(name, ()))


def test_dry_run_plans_every_step_and_prints_the_travelling_size(tmp_path):
    empty = tmp_path / "wheels"
    empty.mkdir()
    run = subprocess.run([sys.executable, str(GPU / "check.py"), "--dry", "--wheels",
                          str(empty), "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=120)
    # no wheels here: the dry run says so and fails, after planning every step
    assert run.returncode == 1, run.stdout + run.stderr
    assert "INCOMPLETE: no wheels" in run.stdout
    assert "travelling: " in run.stdout and "of 64 MiB" in run.stdout
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    steps = {s["name"]: s for s in summary["steps"]}
    assert list(steps) == [s.name for s in check.STEPS]
    assert steps["env"]["status"] == "passed"
    assert {s["status"] for n, s in steps.items() if n != "env"} == {"skipped"}
    travel = summary["travel"]
    assert 0 < travel["tree_bytes"] < travel["limit_bytes"] == 64 << 20
    assert travel["carried_bytes"] == 0
    md = (tmp_path / "out" / "summary.md").read_text()
    assert "| compare | skipped |" in md and "travelling:" in md


def test_budgets_fit_the_eight_minutes():
    assert sum(s.budget_s for s in check.STEPS) <= check.TOTAL_BUDGET_S == 480


def test_bf16_bound_is_the_documented_one():
    import test_engine_bf16 as t

    assert (model_steps.BF16_ERR_FACTOR, model_steps.BF16_ERR_SLACK) == \
        (t.BF16_ERR_FACTOR, t.BF16_ERR_SLACK)


def test_wheel_check_resolves_offline_and_names_what_is_missing(tmp_path):
    folder = tmp_path / "wheels"
    folder.mkdir()
    _stub_carried(folder)
    comp = wheels.check_complete(folder)
    assert comp.ok, comp.error
    assert any(c.startswith("fastapi==") for c in comp.carried)
    assert "torch==2.11.0" in comp.provided  # the GPU machine's torch, not this one's
    assert comp.unused == []
    wheels.stub_wheel(folder, "sniffio", "1.3.1")  # nothing needs it: reported
    assert wheels.check_complete(folder).unused == ["sniffio-1.3.1-py3-none-any.whl"]
    for gone in ("pyzmq", "h11"):  # a direct need, a need of a need
        kept = next(folder.glob(f"{gone}-*.whl"))
        kept.rename(tmp_path / kept.name)
        comp = wheels.check_complete(folder)
        assert not comp.ok and gone in comp.error, comp.error
        (tmp_path / kept.name).rename(kept)


def test_travel_size_counts_the_tree_and_the_carried_folder(tmp_path):
    repo = tmp_path / "repo"
    (repo / "src").mkdir(parents=True)
    (repo / "src" / "a.py").write_bytes(b"x" * 1000)
    (repo / ".gitignore").write_text("/.cache/\n")
    (repo / ".cache" / "w").mkdir(parents=True)
    (repo / ".cache" / "w" / "a.whl").write_bytes(b"y" * 5000)
    (repo / ".cache" / "other").write_bytes(b"z" * 7000)  # ignored and not carried
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    size = wheels.travel_size(repo, [Path(".cache/w")])
    assert size.tree == 1000 + len("/.cache/\n")
    assert size.carried == 5000 and size.ok
    assert "travelling: 0.0 MiB of 64 MiB" in size.describe()


def _nixl_cu12_files() -> dict[str, Path]:
    import nixl_cu12

    pkg = Path(nixl_cu12.__file__).parent
    libs = pkg.parent / ".nixl_cu12.mesonpy.libs"
    binding = next(pkg.glob("_bindings*.so"))
    return {"binding": binding, "libnixl": libs / "libnixl.so",
            "libserdes": libs / "libserdes.so"}


def test_slimmed_nixl_wheel_keeps_what_is_linked_and_has_a_valid_record(tmp_path):
    real = _nixl_cu12_files()
    needed = wheels.elf_needed(real["binding"].read_bytes())
    assert "libnixl.so" in needed and "libserdes.so" in needed  # as readelf -d shows
    members = {
        "nixl_cu13/__init__.py": b"",
        "nixl_cu13/_bindings.cpython-312-x86_64-linux-gnu.so": real["binding"].read_bytes(),
        ".nixl_cu13.mesonpy.libs/libnixl.so": real["libnixl"].read_bytes(),
        ".nixl_cu13.mesonpy.libs/libserdes.so": real["libserdes"].read_bytes(),
        ".nixl_cu13.mesonpy.libs/libunused.so": real["libserdes"].read_bytes(),
        ".nixl_cu13.mesonpy.libs/plugins/libplugin_UCX.so": b"\x7fELF-not-parsed",
        ".nixl_cu13.mesonpy.libs/plugins/libplugin_GDS.so": b"gds",
        "nixl_cu13.libs/ucx/libuct_cuda.so.0.0.0": b"cuda",
        "nixl_cu13.libs/ucx/libuct_ib.so.0.0.0": b"ib",
        "nixl_ep_cu13/big.so": b"ep" * 1000,
        "nixl_cu13-1.5.1.data/headers/x.hpp": b"h",
        "nixl_cu13-1.5.1.dist-info/METADATA": b"Name: nixl-cu13\nVersion: 1.5.1\n",
        "nixl_cu13-1.5.1.dist-info/RECORD": b"",
    }
    wheel = tmp_path / "nixl_cu13-1.5.1-cp312-cp312-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    before, after = wheels.slim_nixl(wheel)
    assert after < before
    with zipfile.ZipFile(wheel) as z:
        kept = set(z.namelist())
    assert kept == {"nixl_cu13/__init__.py",
                    "nixl_cu13/_bindings.cpython-312-x86_64-linux-gnu.so",
                    ".nixl_cu13.mesonpy.libs/libnixl.so", ".nixl_cu13.mesonpy.libs/libserdes.so",
                    ".nixl_cu13.mesonpy.libs/plugins/libplugin_UCX.so",
                    "nixl_cu13.libs/ucx/libuct_cuda.so.0.0.0",
                    "nixl_cu13-1.5.1.dist-info/METADATA", "nixl_cu13-1.5.1.dist-info/RECORD"}
    assert wheels.verify_wheel(wheel) == []
    assert wheels.slim_nixl(wheel) == (after, after)  # once slimmed, left alone
    # a member changed behind RECORD's back is caught
    bad = tmp_path / "bad.whl"
    with zipfile.ZipFile(wheel) as zin, zipfile.ZipFile(bad, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info)
            zout.writestr(info, b"changed" if info.filename.endswith("__init__.py") else data)
    assert wheels.verify_wheel(bad) == ["nixl_cu13/__init__.py: hash or size differs from RECORD"]


def test_device_reaches_every_instance_of_up_compare_and_handoff():
    from kvpush.bench.compare import CompareConfig, ModeSpec, _up_args
    from kvpush.bench.handoff import HandoffConfig
    from kvpush.cluster.cli import serve_argv

    cfg = CompareConfig(modes=[ModeSpec("push")], rates=[1.0], out_dir=Path("x"),
                        device="cuda")
    args = _up_args(cfg, ModeSpec("push"))
    for role in ("prefill", "decode"):
        argv = serve_argv(args, "m", role, 1234, 1)
        assert argv[argv.index("--device") + 1] == "cuda"
    args.device = None
    assert "--device" not in serve_argv(args, "m", "both", 1234, 1)
    ns = argparse.Namespace(**{**vars(args)})
    del ns.device  # a Namespace built without it (older callers) still works
    assert "--device" not in serve_argv(ns, "m", "both", 1234, 1)
    assert HandoffConfig(device="cuda").device == "cuda"


def test_summary_markdown_records_failures_with_their_log(tmp_path):
    summary = {"mode": "cpu", "date": "d", "gpu": "", "elapsed_s": 1.0,
               "total_budget_s": 480.0, "steps": [
                   {"name": "pd", "budget_s": 75.0, "status": "failed", "seconds": 3.0,
                    "proves": "", "error": "push: answers differ", "figures": {"x": 1},
                    "log_tail": "Traceback ..."}],
               "failure_logs": {"pd": "==== pd.log\nTraceback ..."}}
    check.write_summary(summary, tmp_path)
    assert (tmp_path / "FAILED-pd.log").read_text() == "==== pd.log\nTraceback ..."
    assert "failure_logs" not in json.loads((tmp_path / "summary.json").read_text())
    md = (tmp_path / "summary.md").read_text()
    assert "NOT all passed" in md and "| pd | failed | 3.0 | 75 | push: answers differ |" in md
    assert "Traceback ..." in md
    assert not check.ok(summary)


# -- CUDA code paths, read for the check: what a CPU can test of them -------------------------

def test_every_sdpa_mask_is_in_the_query_dtype(model_factory, monkeypatch):
    """A bf16 engine through every attention path that passes a mask (prefill after
    cached or earlier-chunk tokens, decode through the dense cache with uneven lengths,
    the gather path, the paged decode attention in one chunk and in several): each mask
    reaches SDPA in the query's dtype. CUDA's fused kernels misread (cuDNN, preferred on
    H100/H200) or refuse (memory-efficient) a float32 mask beside bf16 queries; the CPU
    kernels accept it, so only this contract shows it here."""
    import torch
    import torch.nn.functional as F

    from engine_helpers import (
        assert_all_blocks_free,
        make_engine,
        random_prompts,
        run_to_completion,
    )
    from kvpush.model import paged_decode
    from kvpush.sampling_params import SamplingParams

    seen: list[tuple[torch.dtype, torch.dtype]] = []
    sdpa = F.scaled_dot_product_attention

    def checked(q, k, v, attn_mask=None, **kw):
        if attn_mask is not None:
            seen.append((q.dtype, attn_mask.dtype))
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", checked)
    model = model_factory("qwen3")
    long, short = random_prompts([150, 40], seed=9)
    prompts = {"a": long, "b": long[:100] + short, "c": short[:9]}  # b: a prefix hit
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for kw in ({"decode_attention": "dense"}, {"decode_attention": "dense",
                                               "decode_cache_memory": 0},
               {"decode_attention": "paged"}):
        engine = make_engine(model, dtype="bfloat16", max_num_batched_tokens=64, **kw)
        run_to_completion(engine, {"a": prompts["a"]}, params)  # cached for b's prefix
        run_to_completion(engine, {k: prompts[k] for k in ("b", "c")}, params)
        assert_all_blocks_free(engine)
    monkeypatch.setattr(paged_decode, "CHUNK_BYTES", 4096)  # several chunks: fp32 math
    engine = make_engine(model, dtype="bfloat16", decode_attention="paged")
    run_to_completion(engine, {"c": prompts["c"], "a": prompts["a"]}, params)
    assert seen, "no masked SDPA call was made"
    assert {m for q, m in seen if m != q and m != torch.bool} == set(), set(seen)


def test_nixl_calls_on_a_vram_region_make_its_device_current_once_per_thread(monkeypatch):
    """UCX's CUDA transports need a CUDA context current on the calling thread, and the
    transfer thread is a new thread (vllm-project/vllm#36475): with a VRAM region every
    agent call first makes the device current there, once per thread; with host memory
    torch.cuda is never touched."""
    import threading

    import torch

    from kvpush.kv_transfer.transports.nixl_transport import NixlTransport

    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda d: calls.append((threading.current_thread().name, d)))
    host = NixlTransport("gpu-check-host")
    gpu = NixlTransport("gpu-check-vram")
    try:
        host.progress()
        assert calls == []
        gpu._mem = ("VRAM", 3)  # what register_region(..., "cuda:3") sets (no GPU here)
        gpu.progress()
        gpu.progress()
        worker = threading.Thread(target=gpu.progress, name="kvpush-transfer")
        worker.start()
        worker.join(10)
        assert calls == [("MainThread", 3), ("kvpush-transfer", 3)]
    finally:
        gpu._mem = ("DRAM", 0)
        host.close()
        gpu.close()


def test_travel_size_without_git_leaves_out_the_usual_ignored_folders(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_bytes(b"x" * 300)
    for junk in (".venv", ".cache", ".git"):
        (tmp_path / junk).mkdir()
        (tmp_path / junk / "big").write_bytes(b"y" * 9000)
    assert wheels.travel_size(tmp_path, []).tree == 300  # not a git repository
